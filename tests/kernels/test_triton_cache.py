"""Triton write_kv and copy_blocks against the torch reference, on NaN-poisoned caches.

These move bits without arithmetic, so results must match exactly, bfloat16 included (the
interpreter's bf16 trouble is in arithmetic, not in loads and stores).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv_kernels import copy_blocks, write_kv
from tests.kernels.paged_case import DEVICE

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def nan_caches(shape, dtype, count=2):
    return [torch.full(shape, float("nan"), dtype=dtype, device=DEVICE) for _ in range(count)]


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_kv_heads, head_dim, block_size", [(2, 64, 16), (1, 80, 8), (3, 256, 64)])
def test_write_kv_matches_reference(dtype, slot_dtype, num_kv_heads, head_dim, block_size):
    num_blocks, num_tokens = 6, 11
    gen = torch.Generator().manual_seed(0)
    # Slots in random order across non-contiguous blocks, with -1 padding in the middle and at the end.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 10]] = -1
    slots = slots.to(slot_dtype).to(DEVICE)
    # K/V sliced out of a fused tensor: rows are strided, head_dim dense.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    got_k, got_v, want_k, want_v = nan_caches(shape, dtype, 4)

    write_kv(key, value, got_k, got_v, slots, backend="triton")
    write_kv(key, value, want_k, want_v, slots, backend="reference")

    assert_same(got_k, want_k)
    assert_same(got_v, want_v)
    written = slots[slots >= 0].long().cpu()
    assert not got_k.view(-1, num_kv_heads, head_dim)[written].isnan().any()
    # Padding tokens and every unaddressed slot leave the cache untouched (still NaN).
    untouched = sorted(set(range(num_blocks * block_size)) - set(written.tolist()))
    assert got_k.view(-1, num_kv_heads, head_dim)[untouched].isnan().all()
    assert got_v.view(-1, num_kv_heads, head_dim)[untouched].isnan().all()


def test_write_kv_all_padding_is_a_no_op():
    key_cache, value_cache = nan_caches((2, 8, 1, 64), torch.float32)
    kv = torch.randn(3, 1, 64, device=DEVICE)
    write_kv(kv, kv, key_cache, value_cache, torch.full((3,), -1, device=DEVICE), backend="triton")
    assert key_cache.isnan().all() and value_cache.isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("as_lists", [False, True])
def test_copy_blocks_every_layer(dtype, as_lists):
    num_layers, shape = 3, (7, 16, 2, 64)
    gen = torch.Generator().manual_seed(1)
    keys = [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(num_layers)]
    values = [torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(num_layers)]
    for cache in keys + values:
        cache[[2, 5, 6]] = float("nan")  # destinations start poisoned
    src, dst = [4, 0, 1], [6, 2, 5]
    want_k, want_v = [c.clone() for c in keys], [c.clone() for c in values]
    mapping = (
        (src, dst) if as_lists else torch.tensor(list(zip(src, dst, strict=False)), dtype=torch.int64, device=DEVICE)
    )

    copy_blocks(keys, values, mapping, backend="triton")
    copy_blocks(want_k, want_v, torch.tensor(list(zip(src, dst, strict=False)), device=DEVICE), backend="reference")

    for got, want in zip(keys + values, want_k + want_v, strict=False):
        assert_same(got, want)
        assert not got.isnan().any()


def test_copy_blocks_empty_mapping_is_a_no_op():
    keys, values = nan_caches((2, 8, 1, 64), torch.float16)
    copy_blocks([keys], [values], ([], []), backend="triton")
    assert keys.isnan().all() and values.isnan().all()


def test_copy_blocks_with_block_larger_than_one_program_chunk():
    # 64 x 4 x 128 = 32k elements per block: several programs per block copy.
    shape = (3, 64, 4, 128)
    keys = [torch.randn(shape, device=DEVICE)]
    values = [torch.randn(shape, device=DEVICE)]
    copy_blocks(keys, values, ([0], [2]), backend="triton")
    assert torch.equal(keys[0][2], keys[0][0]) and torch.equal(values[0][2], values[0][0])
