"""Triton paged attention against a float64 oracle (the paged reference, itself checked against SDPA).

On CPU these run under the Triton interpreter (see conftest.py); shapes are kept small for speed.
Every output starts as NaN, and cache slots nobody wrote are NaN, so a missed write or a read past
a sequence's tokens fails loudly. Tolerances and their reasons: paged_case.TOLERANCES.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv_kernels import paged_attention
from tests.kernels.paged_case import TEST_DTYPES, TOLERANCES, float64_oracle, make_batch, poisoned_like

# A mixed scheduler step: a fresh prefill, a decode token, a chunk starting mid-block (22 cached
# tokens with block 16) that crosses a block boundary, and a first token (length 1).
MIXED = [(6, 6), (1, 37), (7, 29), (1, 1)]


def check(batch, num_splits=None):
    out = poisoned_like(batch.q)
    got = paged_attention(*batch.args(), batch.scale, out=out, num_splits=num_splits, backend="triton")
    assert got is out
    assert not got.isnan().any(), "some output element was never written"
    torch.testing.assert_close(got.double(), float64_oracle(batch), **TOLERANCES[batch.q.dtype])


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
def test_head_dims_gqa(head_dim):
    # 80 and 96 pad to 128 with masks; 256 uses the narrower KV tile.
    check(make_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=torch.float16))


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_block_sizes(block_size, dtype):
    # KV tiles of 64 tokens span 8 blocks of 8 or part of one block of 64; chunk starts mid-block.
    seqs = [(9, 75), (1, 130), (3, 3)]
    check(make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=dtype, seed=1))


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads",
    [(4, 4), (8, 2), (8, 1), (6, 2), (32, 1)],
    ids=["mha", "gqa4", "mqa8", "gqa3-padded-group", "mqa32"],
)
def test_head_groupings(num_heads, num_kv_heads, dtype):
    check(make_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64, block_size=16, dtype=dtype))


@pytest.mark.parametrize("dtype", TEST_DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2, 5, None], ids=["off", "2", "5-uneven", "heuristic"])
def test_decode_flash_decoding_splits(num_splits, dtype):
    # Decode-only batch; with 5 splits the 1-token and 20-token sequences leave some splits empty.
    seqs = [(1, 200), (1, 1), (1, 129), (1, 20)]
    check(make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=2), num_splits)


@pytest.mark.parametrize("num_splits", [1, 8], ids=["unsplit", "8-splits"])
def test_long_context_decode(num_splits):
    # Thousands of tokens of context: hundreds of blocks and dozens of KV tiles per sequence.
    seqs = [(1, 4100), (1, 2333)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, seed=9)
    check(batch, num_splits)


def test_long_prefill_chunk_after_a_long_cached_prefix():
    # A 40-token chunk after 3,000 cached tokens: the unmasked tiles span thousands of positions.
    batch = make_batch(
        [(40, 3040)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=32, dtype=torch.float32, seed=10
    )
    check(batch)


def test_split_path_in_a_mixed_batch():
    # Decode tokens are split, prefill tiles in the same launch are not, and both land in `out`.
    seqs = [(1, 150), (12, 90), (1, 17), (5, 5)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=3)
    check(batch, num_splits=4)


@pytest.mark.parametrize("head_dim", [64, 256])  # KV tiles of 64 and 32 tokens
def test_chunks_starting_around_kv_tile_boundaries(head_dim):
    # The first query of each chunk sits just before, at and after a KV-tile edge, where the kernel
    # switches from unmasked whole tiles to the causally masked tail.
    seqs = [(3, cached + 3) for cached in (29, 30, 31, 32, 33, 61, 62, 63, 64, 65)] + [(1, 64)]
    check(make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=torch.float32))


def test_long_prefill_spans_several_query_tiles():
    # 150 query tokens after 20 cached ones: several BLOCK_M tiles, causal mask inside each.
    for heads in ((2, 2), (8, 2)):
        batch = make_batch(
            [(150, 170)],
            num_heads=heads[0],
            num_kv_heads=heads[1],
            head_dim=64,
            block_size=32,
            dtype=torch.float16,
            seed=4,
        )
        check(batch)


def test_shared_physical_blocks_between_sequences():
    seqs = [(1, 50), (4, 40), (1, 33), (9, 48)]
    batch = make_batch(
        seqs,
        num_heads=4,
        num_kv_heads=1,
        head_dim=64,
        block_size=16,
        dtype=torch.float16,
        shared_prefix_blocks=2,
        seed=5,
    )
    shared = batch.block_tables[:, :2]
    assert (shared == shared[0]).all()
    check(batch, num_splits=2)


def test_many_sequences_and_strided_q():
    # 13 sequences exercise the tile -> sequence binary search; q is a slice of a fused qkv tensor.
    seqs = [(1 + (i * 5) % 7, 10 + (i * 37) % 90) for i in range(13)]
    batch = make_batch(
        seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32, seed=6, strided_q=True
    )
    assert not batch.q.is_contiguous()
    check(batch)


def test_single_token_sequence():
    check(make_batch([(1, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, dtype=torch.float32))


def test_default_scale_and_fresh_output():
    batch = make_batch([(3, 10)], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32)
    got = paged_attention(*batch.args(), backend="triton")  # scale defaults to head_dim ** -0.5
    torch.testing.assert_close(got.double(), float64_oracle(batch), **TOLERANCES[torch.float32])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    data=st.data(),
    num_kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2, 3, 4]),
    head_dim=st.sampled_from([32, 64, 80]),
    block_size=st.sampled_from([8, 16, 32, 64]),
    dtype=st.sampled_from([torch.float16, torch.float32]),
    num_splits=st.sampled_from([None, 1, 3]),
)
def test_random_mixed_batches(data, num_kv_heads, group, head_dim, block_size, dtype, num_splits):
    q_lens = data.draw(st.lists(st.integers(1, 20), min_size=1, max_size=6), label="q_lens")
    cached = data.draw(st.lists(st.integers(0, 80), min_size=len(q_lens), max_size=len(q_lens)), label="cached")
    seqs = [(q, q + c) for q, c in zip(q_lens, cached, strict=False)]
    batch = make_batch(
        seqs,
        num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=len(seqs),
    )
    check(batch, num_splits)
