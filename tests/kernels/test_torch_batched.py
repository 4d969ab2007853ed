"""The batched torch backend (CPU serving) against the float64 reference, on fresh random paged batches."""

from __future__ import annotations

import pytest
import torch

from pagedkv_kernels import dispatch, torch_batched
from tests.kernels.paged_case import float64_oracle, make_batch

CASES = [
    # (q_len, kv_len) per sequence: decode rows of many lengths, mixed with prefill chunks and a lone token
    [(1, 1), (1, 17), (1, 64), (1, 300)],
    [(1, 5), (7, 40), (1, 33), (16, 16), (1, 129)],
    [(3, 3), (1, 2)],  # one decode row: the per-sequence path
    [(1, 4100), (1, 9), (5, 100)],
]


@pytest.mark.parametrize("seqs", CASES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("decode_path", ["native", "torch"])
def test_batched_torch_matches_the_float64_reference(
    seqs, heads, kv_heads, dtype, block_size, decode_path, monkeypatch
):
    monkeypatch.setenv("PAGEDKV_CPU_KERNELS", decode_path)  # decode rows: the native kernel, or gather + SDPA
    batch = make_batch(
        seqs,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=32,
        block_size=block_size,
        dtype=dtype,
        seed=hash((tuple(seqs), heads, block_size)) % 1000,
    )
    want = float64_oracle(batch)
    got = dispatch.paged_attention(*batch.args(), batch.scale, backend="torch")
    assert not got.isnan().any()  # NaN-poisoned padding and spare blocks are never mixed in
    tolerance = 1e-5 if dtype is torch.float32 else 2e-3
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def test_shared_blocks_and_padded_tables():
    batch = make_batch(
        [(1, 40), (1, 70), (1, 33)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        shared_prefix_blocks=2,
    )
    torch.testing.assert_close(
        dispatch.paged_attention(*batch.args(), batch.scale, backend="torch").double(),
        float64_oracle(batch),
        atol=1e-5,
        rtol=1e-5,
    )


def test_write_kv_matches_the_reference_with_and_without_padding():
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(5, 2, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
    for slots in (torch.tensor([3, 17, 0, 40, 8]), torch.tensor([3, -1, 0, 40, -1])):
        caches = [torch.full((6, 8, 2, 32), float("nan")) for _ in range(4)]
        dispatch.write_kv(key, value, caches[0], caches[1], slots, backend="torch")
        dispatch.write_kv(key, value, caches[2], caches[3], slots, backend="reference")
        torch.testing.assert_close(caches[0], caches[2], equal_nan=True)
        torch.testing.assert_close(caches[1], caches[3], equal_nan=True)


def test_many_decode_rows_are_split_into_length_groups_and_stay_exact(monkeypatch):
    from pagedkv_kernels import torch_batched

    monkeypatch.setattr(torch_batched, "GROUP_POSITIONS", 200)  # forces several groups of one to a few rows
    seqs = [(1, n) for n in (3, 150, 40, 41, 199, 7, 64, 120)] + [(4, 30)]
    groups = torch_batched._length_groups(list(range(8)), [n for _, n in seqs])
    assert sorted(i for g in groups for i in g) == list(range(8)) and len(groups) > 2
    assert all(len(g) * max(seqs[i][1] for i in g) <= 200 or len(g) == 1 for g in groups)
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)
    torch.testing.assert_close(
        dispatch.paged_attention(*batch.args(), batch.scale, backend="torch").double(),
        float64_oracle(batch),
        atol=1e-5,
        rtol=1e-5,
    )


@pytest.mark.parametrize("block_size", [16, 64])
def test_many_decode_rows_of_random_lengths(block_size):
    """Fresh random inputs every run: dozens of decode rows (some shorter than a block) and a prefill chunk."""
    gen = torch.Generator()
    seed = int(gen.seed()) % 2**31
    lengths = torch.randint(1, 600, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    batch = make_batch(
        [(1, n) for n in lengths] + [(9, 50)],
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        block_size=block_size,
        dtype=torch.float32,
        seed=seed,
    )
    got = dispatch.paged_attention(*batch.args(), batch.scale, backend="torch")
    assert not got.isnan().any(), f"seed {seed}"
    torch.testing.assert_close(got.double(), float64_oracle(batch), atol=1e-5, rtol=1e-5, msg=f"seed {seed}")


@pytest.mark.parametrize("inference_mode", [False, True])
def test_step_rows_are_built_once_a_step_and_never_answer_for_changed_metadata(monkeypatch, inference_mode):
    """Every layer of a step passes the same metadata: its rows are split once. Metadata written in place since
    gets fresh rows, and the attention follows the new tables, also for inference-mode tensors (which keep no
    version counter)."""
    monkeypatch.setenv("PAGEDKV_CPU_KERNELS", "native")
    batch = make_batch(
        [(1, 40), (5, 30), (1, 17)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32
    )
    if inference_mode:
        with torch.inference_mode():
            batch.block_tables, batch.query_start_loc, batch.seq_lens = (
                t.clone() for t in (batch.block_tables, batch.query_start_loc, batch.seq_lens)
            )
    meta = (batch.block_tables, batch.query_start_loc, batch.seq_lens)
    first = torch_batched.step_rows(*meta)
    assert torch_batched.step_rows(*meta) is first
    assert torch_batched.step_rows(*(t.clone() for t in meta)) is first  # equal values in other tensors
    before = dispatch.paged_attention(*batch.args(), batch.scale, backend="torch")
    torch.testing.assert_close(before.double(), float64_oracle(batch), atol=1e-5, rtol=1e-5)
    # The decode rows 0 and 2 swap their tables and lengths in place: each must now read the other's K/V.
    with torch.inference_mode(inference_mode):
        batch.block_tables[[0, 2]] = batch.block_tables[[2, 0]].clone()
        batch.seq_lens[[0, 2]] = batch.seq_lens[[2, 0]].clone()
    rows = torch_batched.step_rows(*meta)
    assert rows is not first and rows.lens == [17, 30, 40]
    after = dispatch.paged_attention(*batch.args(), batch.scale, backend="torch")
    torch.testing.assert_close(after.double(), float64_oracle(batch), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after[0], before[0])
