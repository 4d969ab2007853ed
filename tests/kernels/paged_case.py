"""Builds paged batches for the kernel tests: per-sequence contiguous K/V, scattered into NaN-poisoned caches.

The caches are filled by plain indexing (not by the kernels under test), through physical block ids
drawn in random order, optionally shared between sequences. Table entries past a sequence's blocks
point at a spare block that stays NaN, so a kernel reading beyond its sequence produces NaN.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

from pagedkv_kernels import reference

DEVICE = torch.device(os.environ.get("PAGEDKV_TEST_DEVICE", "cpu"))
ON_GPU = DEVICE.type == "cuda"
# The interpreter computes bfloat16 wrongly (numpy has no bf16), so bf16 attention runs on a GPU only.
TEST_DTYPES = (torch.float16, torch.float32, torch.bfloat16) if ON_GPU else (torch.float16, torch.float32)
# For tests that run Triton on CPU tensors: impossible once the kernels are compiled for the GPU.
needs_interpreter = pytest.mark.skipif(ON_GPU, reason="runs Triton on CPU tensors (interpreter only)")

# Triton vs a float64 oracle fed the *same* rounded inputs. What remains is the kernel's own rounding:
# float16 - P is rounded to fp16 for the tensor-core P@V (rel. 2^-11 per weight) and the output is
#           rounded to fp16 (half an ulp, rel. 2^-11 ~ 4.9e-4; outputs are |o| < ~4): 2e-3 both ways.
# bfloat16 - same with 8 mantissa bits: rel. 2^-8 ~ 3.9e-3 per rounding, so 1.6e-2.
# float32 - IEEE dots, float32 accumulation over a few hundred terms and exp2 vs exp: ~1e-6; 1e-5.
# A real bug (wrong mask, wrong block, lost split) moves outputs by O(0.1).
TOLERANCES = {
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    keys: list[torch.Tensor]  # per sequence, contiguous [kv_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    q_lens: list[int]
    kv_lens: list[int]
    scale: float

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.key_cache, self.value_cache, self.block_tables, self.query_start_loc, self.seq_lens)


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    shared_prefix_blocks: int = 0,
    spare_blocks: int = 3,
    strided_q: bool = False,
    sliding_window: int | None = None,
    device: torch.device = DEVICE,
) -> PagedBatch:
    """A batch of sequences given as (q_len, kv_len) pairs; the last q_len of each kv_len tokens are new.

    With `shared_prefix_blocks=n`, every sequence's first n blocks are sequence 0's physical blocks
    (and hold the same K/V), as after a fork or a prefix-cache hit. With `sliding_window`, the blocks wholly
    before the window of every query of their sequence are given back, as a serving engine does: their table
    entries name the NaN spare block, and a block no sequence still sees is NaN too (`keys`/`values` keep the
    true contiguous K/V).
    """
    gen = torch.Generator().manual_seed(seed)
    n_blocks = [math.ceil(kv / block_size) for _, kv in seqs]
    shared = shared_prefix_blocks
    assert all(shared * block_size <= kv for _, kv in seqs), "shared blocks must be full blocks of every sequence"
    total = n_blocks[0] + sum(n - shared for n in n_blocks[1:]) + spare_blocks
    physical = torch.randperm(total, generator=gen)  # ids in random order: never contiguous by accident
    poison_block = int(physical[-1])  # a spare block: stays NaN, fills unused table entries
    tables = torch.full((len(seqs), max(n_blocks) + 1), poison_block, dtype=torch.int32)
    keys, values, used = [], [], 0
    for s, (_, kv_len) in enumerate(seqs):
        first_own = shared if s > 0 else 0
        tables[s, :first_own] = tables[0, :first_own]
        own = n_blocks[s] - first_own
        tables[s, first_own : n_blocks[s]] = physical[used : used + own].to(torch.int32)
        used += own
        k = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(kv_len, num_kv_heads, head_dim, generator=gen)
        if s > 0 and shared:
            k[: shared * block_size] = keys[0][: shared * block_size].float()
            v[: shared * block_size] = values[0][: shared * block_size].float()
        keys.append(k.to(dtype))
        values.append(v.to(dtype))

    shape = (total, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    for s, (_, kv_len) in enumerate(seqs):
        slots = slots_of(tables[s], kv_len, block_size)
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = keys[s]
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = values[s]

    if sliding_window is not None:
        _give_back_blocks(tables, seqs, block_size, sliding_window, poison_block, key_cache, value_cache)
    q_lens = [q for q, _ in seqs]
    num_tokens = sum(q_lens)
    if strided_q:  # q as a slice of a fused qkv projection: rows are not dense
        q = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)[:, :num_heads]
    else:
        q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda x: x.to(device)  # noqa: E731
    return PagedBatch(
        q=to(q),
        key_cache=to(key_cache),
        value_cache=to(value_cache),
        block_tables=to(tables),
        query_start_loc=to(starts),
        seq_lens=to(torch.tensor([kv for _, kv in seqs], dtype=torch.int32)),
        keys=[to(k) for k in keys],
        values=[to(v) for v in values],
        q_lens=q_lens,
        kv_lens=[kv for _, kv in seqs],
        scale=head_dim**-0.5,
    )


def _give_back_blocks(tables, seqs, block_size, window, poison_block, key_cache, value_cache) -> None:
    """Table entries before each sequence's first visible block name `poison_block`; blocks left unnamed, NaN."""
    named_before = {int(b) for b in tables.flatten().tolist()}
    for s, (q_len, kv_len) in enumerate(seqs):
        tables[s, : reference.first_visible(kv_len, q_len, window) // block_size] = poison_block
    for block in named_before - {int(b) for b in tables.flatten().tolist()}:
        key_cache[block] = float("nan")
        value_cache[block] = float("nan")


def slots_of(table_row: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    """Flat slot ids of a sequence's first kv_len tokens."""
    n = math.ceil(kv_len / block_size)
    blocks = table_row[:n].to(torch.int64).cpu()
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:kv_len]


def float64_oracle(batch: PagedBatch, **options) -> torch.Tensor:
    """The paged reference evaluated in float64 on the batch's (already rounded) inputs; `options` are
    paged_attention's (sliding_window, softcap, sinks)."""
    out = torch.empty(batch.q.shape, dtype=torch.float64, device=batch.q.device)
    if options.get("sinks") is not None:
        options = {**options, "sinks": options["sinks"].double()}
    return reference.paged_attention(
        batch.q.double(),
        batch.key_cache.double(),
        batch.value_cache.double(),
        batch.block_tables,
        batch.query_start_loc,
        batch.seq_lens,
        batch.scale,
        out,
        **options,
    )


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    """A contiguous output buffer full of NaN, so any element the kernel fails to write fails the test."""
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
