"""The native CPU prefill-attention kernel (`pagedkv_kernels.cpu_native.prefill_attention`): chunks of several query
tokens over their cached prefix, against the float64 reference on fresh random paged batches swept over head
sizes, GQA ratios, block sizes, cache dtypes and chunk shapes (tiles of 16, 8 and 4 tokens, partial last blocks,
shared prefixes); and its refusals of bad metadata, before anything is written."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv_kernels import cpu_native, dispatch
from tests.kernels.attention_options import fresh_seed
from tests.kernels.paged_case import float64_oracle, make_batch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# (new tokens, cached prefix): 2-4, 5-8 and 9+ tokens take tiles of 4, 8 and 16 (heads packed into the lanes
# where the GQA ratio allows); lengths just off the block and tile edges; a prompt with no prefix.
CHUNKS = [(2, 0), (3, 5), (4, 16), (5, 31), (8, 1), (9, 40), (16, 0), (17, 15), (33, 100), (70, 0), (40, 129)]


def chunk_rows(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """seqs, begins and q_lens of the batch's sequences of more than one query token."""
    starts = batch.query_start_loc.tolist()
    chunks = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] > 1]
    begins = [starts[i] for i in chunks]
    q_lens = [starts[i + 1] - starts[i] for i in chunks]
    return tuple(torch.tensor(x, dtype=torch.int64) for x in (chunks, begins, q_lens))


def native_prefill(native, batch, *, tables=None, chunks=None, out=None, **options) -> torch.Tensor:
    """The native prefill kernel over the batch's chunks, into a NaN-filled output (rows it must not write stay
    NaN)."""
    out = torch.full(batch.q.shape, float("nan")) if out is None else out
    cpu_native.prefill_attention(
        native,
        batch.q.float().contiguous(),
        batch.key_cache,
        batch.value_cache,
        batch.block_tables if tables is None else tables,
        batch.seq_lens,
        *(chunk_rows(batch) if chunks is None else chunks),
        batch.scale,
        out,
        **options,
    )
    return out


def assert_chunks_match(out: torch.Tensor, batch, tolerance: float, msg: str = "", **options) -> None:
    """Every chunk token's output is the reference's; every other row (decode tokens) is left as it was (NaN)."""
    _, begins, q_lens = chunk_rows(batch)
    written = torch.zeros(batch.q.shape[0], dtype=torch.bool)
    for begin, q_len in zip(begins.tolist(), q_lens.tolist(), strict=True):
        written[begin : begin + q_len] = True
    assert out[~written].isnan().all(), f"the kernel wrote a row that is not a chunk's {msg}"
    assert not out[written].isnan().any(), msg
    expected = float64_oracle(batch, **options)[written]
    torch.testing.assert_close(out[written].double(), expected, atol=tolerance, rtol=tolerance, msg=msg or None)


@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (16, 1), (6, 2), (32, 2)])  # (32, 2): 16 a KV head
@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_prefill_matches_the_float64_reference(native, head_dim, heads, kv_heads, block_size):
    seed = fresh_seed()
    rng = random.Random(seed)
    seqs = [(q, prefix + q) for q, prefix in rng.sample(CHUNKS, 5)]
    seqs += [(1, rng.randint(1, 200))]  # a decode row in the same step: the prefill call leaves it alone
    batch = make_batch(
        seqs,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        seed=seed,
    )
    assert_chunks_match(native_prefill(native, batch), batch, TOLERANCE[torch.float32], f"seed {seed}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_upcasts_half_caches(native, dtype, block_size):
    seed = fresh_seed()
    batch = make_batch(
        [(q, prefix + q) for q, prefix in CHUNKS],
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    assert_chunks_match(native_prefill(native, batch), batch, TOLERANCE[dtype], f"seed {seed}")


@pytest.mark.parametrize("shared", [1, 4])
def test_chunks_over_a_shared_prefix(native, shared):
    """Forked or prefix-cached sequences: every chunk's table starts with the same physical blocks."""
    block_size = 16
    prefix = shared * block_size
    seqs = [(q, prefix + extra + q) for q, extra in [(2, 0), (9, 3), (16, 16), (37, 1)]]
    batch = make_batch(
        seqs,
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        block_size=block_size,
        dtype=torch.float32,
        seed=shared,
        shared_prefix_blocks=shared,
    )
    assert_chunks_match(native_prefill(native, batch), batch, TOLERANCE[torch.float32])


def test_random_mixed_steps_through_the_cpu_backend(native):
    """Steps of decode rows and chunks, fresh each run, through `dispatch.paged_attention` (one native call each
    for the decode rows and the chunks), a float16 query and output among them (the kernel's float32 result copied
    back)."""
    for _ in range(6):
        seed = fresh_seed()
        rng = random.Random(seed)
        dtype = rng.choice([torch.float32, torch.float16])
        kv_heads, group = rng.choice([(1, 1), (2, 4), (1, 8), (2, 3), (4, 2)])
        seqs = [(1, rng.randint(1, 300)) for _ in range(rng.randint(0, 4))]
        for _ in range(rng.randint(1, 4)):
            q_len = rng.randint(2, 90)
            seqs.append((q_len, q_len + rng.choice([0, rng.randint(1, 300)])))
        rng.shuffle(seqs)
        batch = make_batch(
            seqs,
            num_heads=kv_heads * group,
            num_kv_heads=kv_heads,
            head_dim=rng.choice([64, 128]),
            block_size=rng.choice([8, 16, 32]),
            dtype=dtype,
            seed=seed,
        )
        got = dispatch.paged_attention(*batch.args(), batch.scale, backend="torch")
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(got.double(), float64_oracle(batch), atol=tol, rtol=tol, msg=f"seed {seed}")


def _one_chunk(q_len: int = 20, kv_len: int = 50):
    return make_batch([(q_len, kv_len)], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda b: b.block_tables.__setitem__((0, 3), b.key_cache.shape[0]), "outside the cache"),  # the last
        (lambda b: b.block_tables.__setitem__((0, 0), -1), "outside the cache"),
        (lambda b: b.seq_lens.__setitem__(0, b.block_tables.shape[1] * 16 + 1), "beyond its block table"),
        (lambda b: b.seq_lens.__setitem__(0, 19), "below 1 or beyond"),  # fewer cached positions than queries
    ],
)
def test_bad_metadata_is_refused_and_nothing_is_written(native, spoil, message):
    batch = _one_chunk()
    spoil(batch)
    out = torch.zeros(batch.q.shape)
    with pytest.raises(cpu_native.NativeKernelError, match=message):
        native_prefill(native, batch, out=out)
    assert not out.any()


def test_a_bad_chunk_anywhere_refuses_the_whole_call_before_any_write(native):
    """Twelve good chunks and a last one whose block is outside the cache: nothing is written for any of them."""
    batch = make_batch([(20, 60)] * 13, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    batch.block_tables[12, 2] = batch.key_cache.shape[0]
    out = torch.zeros(batch.q.shape)
    with pytest.raises(cpu_native.NativeKernelError, match="outside the cache"):
        native_prefill(native, batch, out=out)
    assert not out.any()


@pytest.mark.parametrize(
    "seqs, begins, q_lens",
    [
        ([1], [0], [20]),  # no such sequence
        ([-1], [0], [20]),
        ([0], [1], [20]),  # past the last query token
        ([0], [-1], [20]),
        ([0], [0], [0]),  # an empty chunk
    ],
)
def test_chunks_naming_tokens_or_sequences_out_of_range_are_refused(native, seqs, begins, q_lens):
    batch = _one_chunk()
    out = torch.zeros(batch.q.shape)
    chunks = tuple(torch.tensor(x, dtype=torch.int64) for x in (seqs, begins, q_lens))
    with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
        native_prefill(native, batch, chunks=chunks, out=out)
    assert not out.any()


def test_a_window_before_the_chunk_leaves_its_blocks_unread(native):
    """With a window, the table entries before the chunk's first visible block may name anything (given back)."""
    batch = make_batch(
        [(12, 100)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32, sliding_window=10
    )
    tables = batch.block_tables.clone()
    tables[0, :8] = -7  # positions 0-63: before every query's window (the first query is at 88)
    out = native_prefill(native, batch, tables=tables, sliding_window=10)
    assert_chunks_match(out, batch, TOLERANCE[torch.float32], sliding_window=10)


def test_wrong_dtypes_are_refused_before_the_call(native):
    batch = _one_chunk()
    seqs, begins, q_lens = chunk_rows(batch)
    with pytest.raises(cpu_native.NativeKernelError, match="chunks"):
        native_prefill(native, batch, chunks=(seqs.int(), begins, q_lens))
    with pytest.raises(cpu_native.NativeKernelError, match="chunks shape"):
        native_prefill(native, batch, chunks=(seqs, begins, q_lens.repeat(2)))
