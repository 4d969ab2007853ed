"""Cache offsets are computed in int64: a pool past 2**31 elements must not wrap.

A real >2**31-element cache is too big for CI, so the offset helpers every kernel uses are run on
block ids and slots whose offsets exceed 2**31, next to a control kernel doing the same math in
int32, which does wrap (proving the probe can tell the difference).
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from pagedkv_kernels import triton_attention, triton_cache
from pagedkv_kernels.triton_offsets import paged_token_offsets, slot_offset
from tests.kernels.paged_case import DEVICE

BLOCK_SIZE = 16
STRIDE_BLOCK = 16 * 8 * 128  # a contiguous [*, 16, 8, 128] cache; small enough to be passed as int32
STRIDE_TOKEN = 8 * 128


@triton.jit
def _probe_token_offsets(bt_ptr, pos_ptr, out_ptr, stride_block, stride_token, N: tl.constexpr, BS: tl.constexpr):
    offs = tl.arange(0, N)
    pos = tl.load(pos_ptr + offs)
    tl.store(out_ptr + offs, paged_token_offsets(bt_ptr, pos, offs < N, BS, stride_block, stride_token))


@triton.jit
def _probe_int32_control(bt_ptr, pos_ptr, out_ptr, stride_block, stride_token, N: tl.constexpr, BS: tl.constexpr):
    offs = tl.arange(0, N)
    pos = tl.load(pos_ptr + offs)
    physical = tl.load(bt_ptr + pos // BS)  # int32 block id times int32 stride: wraps
    tl.store(out_ptr + offs, (physical * stride_block + (pos % BS) * stride_token).to(tl.int64))


@triton.jit
def _probe_slot_offsets(slot_ptr, out_ptr, stride_block, stride_token, N: tl.constexpr, BS: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, slot_offset(tl.load(slot_ptr + offs), BS, stride_block, stride_token))


def expected(block_ids: list[int], positions: list[int]) -> list[int]:
    return [block_ids[p // BLOCK_SIZE] * STRIDE_BLOCK + (p % BLOCK_SIZE) * STRIDE_TOKEN for p in positions]


def run_probe(kernel) -> tuple[list[int], list[int]]:
    block_ids = [3, 2_000_000, 131_071, 2**31 - 1]  # the last three put offsets past 2**31
    positions = [0, 17, 31, 40, 63, 5, 16, 48]
    bt = torch.tensor(block_ids, dtype=torch.int32, device=DEVICE)
    pos = torch.tensor(positions, dtype=torch.int32, device=DEVICE)
    out = torch.zeros(len(positions), dtype=torch.int64, device=DEVICE)
    kernel[(1,)](bt, pos, out, STRIDE_BLOCK, STRIDE_TOKEN, N=len(positions), BS=BLOCK_SIZE)
    return out.tolist(), expected(block_ids, positions)


def test_token_offsets_are_int64():
    got, want = run_probe(_probe_token_offsets)
    assert max(want) > 2**31
    assert got == want


def test_int32_control_does_wrap():
    got, want = run_probe(_probe_int32_control)
    assert got != want


def test_slot_offsets_are_int64():
    slots = [0, 17, 2**33 + 5, 3 * 2**31 + 15, 7, 2**40, 1, 2]
    out = torch.zeros(len(slots), dtype=torch.int64, device=DEVICE)
    _probe_slot_offsets[(1,)](
        torch.tensor(slots, device=DEVICE), out, STRIDE_BLOCK, STRIDE_TOKEN, N=len(slots), BS=BLOCK_SIZE
    )
    assert out.tolist() == [(s // BLOCK_SIZE) * STRIDE_BLOCK + (s % BLOCK_SIZE) * STRIDE_TOKEN for s in slots]


def test_kernels_reach_caches_only_through_the_int64_helpers():
    attend = inspect.getsource(triton_attention._attend_tile.fn)
    write = inspect.getsource(triton_cache._write_kv_kernel.fn)
    assert "paged_token_offsets(" in attend
    assert "slot_offset(" in write
