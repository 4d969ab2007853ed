"""The native CPU decode-attention kernel (`pagedkv_kernels.cpu_native`): against the float64 reference on fresh random
paged batches, its refusals of bad metadata, and how it is built, cached and chosen."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedkv_kernels import cpu_native, dispatch
from tests.kernels.paged_case import float64_oracle, make_batch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def decode_rows(batch) -> tuple[torch.Tensor, torch.Tensor]:
    starts = batch.query_start_loc.tolist()
    rows = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
    return torch.tensor([starts[i] for i in rows], dtype=torch.int64), torch.tensor(rows, dtype=torch.int64)


def native_decode(native, batch, tables: torch.Tensor | None = None) -> torch.Tensor:
    """The native kernel over the batch's decode rows, into a NaN-filled output."""
    tokens, seqs = decode_rows(batch)
    out = torch.full(batch.q.shape, float("nan"))
    tables = batch.block_tables if tables is None else tables
    cpu_native.decode_attention(
        native,
        batch.q.float(),
        batch.key_cache,
        batch.value_cache,
        tables,
        batch.seq_lens,
        tokens,
        seqs,
        batch.scale,
        out,
    )
    return out


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (16, 1), (6, 2)])  # (6, 2): an odd head left over
@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_matches_the_float64_reference(native, head_dim, heads, kv_heads, block_size, dtype):
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 300]
    gen = torch.Generator().manual_seed(hash((head_dim, heads, block_size, str(dtype))) % 10_000)
    lengths += torch.randint(1, 400, (3,), generator=gen).tolist()
    batch = make_batch(
        [(1, n) for n in lengths],  # NaN-poisoned caches: a slot read past a row's length shows as NaN
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=int(gen.initial_seed()),
    )
    out = native_decode(native, batch)
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), float64_oracle(batch), atol=tol, rtol=tol)


def test_few_rows_split_by_kv_head_and_many_rows_whole_agree(native):
    """Below 4 rows a thread, work items are (row, KV head) pairs; above, whole rows: both exact."""
    for rows in (2, 64):
        batch = make_batch(
            [(1, 17 + 29 * i) for i in range(rows)],
            num_heads=8,
            num_kv_heads=4,
            head_dim=32,
            block_size=16,
            dtype=torch.float32,
            seed=rows,
        )
        got = dispatch.paged_attention(*batch.args(), batch.scale, backend="torch")
        torch.testing.assert_close(got.double(), float64_oracle(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, shared", [(16, 2), (16, 7), (1, 3), (8, 12)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 4, 32), (4, 4, 64), (16, 2, 128), (12, 4, 32)])
@pytest.mark.parametrize("rows", [40, 19, 18])
def test_rows_sharing_a_prefix_read_it_as_a_group_and_match_the_reference(
    native, block_size, shared, heads, kv_heads, head_dim, rows
):
    """Rows whose tables start with the same blocks go through the grouped pass (16 rows a group), then on alone:
    lengths from exactly the shared blocks to far past them. 40, 19 and 18 rows leave a last group of 8, 3 and 2
    rows, which packs 2, 4 or 8 query heads of one KV head into the lanes where the head layout allows."""
    gen = torch.Generator().manual_seed(block_size * 100 + shared + heads + rows)
    prefix = shared * block_size
    lengths = [prefix, prefix + 1, prefix + block_size, 3 * prefix + 5]
    lengths += (prefix + torch.randint(0, 200, (rows - 4,), generator=gen)).tolist()
    batch = make_batch(
        [(1, n) for n in lengths],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float32,
        seed=int(gen.initial_seed()),
        shared_prefix_blocks=shared,
    )
    out = native_decode(native, batch)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), float64_oracle(batch), atol=1e-5, rtol=1e-5)


def test_a_group_with_a_bad_shared_block_is_refused(native):
    batch = make_batch(
        [(1, 70)] * 40,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        block_size=16,
        dtype=torch.float32,
        seed=3,
        shared_prefix_blocks=3,
    )
    tables = batch.block_tables.clone()
    tables[:, 1] = batch.key_cache.shape[0]  # a shared block past the cache, in every row
    with pytest.raises(cpu_native.NativeKernelError):
        native_decode(native, batch, tables)


def _one_row(length: int = 40):
    return make_batch([(1, length)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, dtype=torch.float32)


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda b: b.block_tables.__setitem__((0, 1), b.key_cache.shape[0]), "outside the cache"),
        (lambda b: b.block_tables.__setitem__((0, 0), -1), "outside the cache"),
        (lambda b: b.seq_lens.__setitem__(0, b.block_tables.shape[1] * 16 + 1), "beyond its block table"),
        (lambda b: b.seq_lens.__setitem__(0, 0), "below 1"),
    ],
)
def test_bad_metadata_is_refused_and_nothing_is_written(native, spoil, message):
    batch = _one_row()
    spoil(batch)
    tokens, seqs = decode_rows(batch)
    out = torch.zeros(batch.q.shape)
    with pytest.raises(cpu_native.NativeKernelError, match=message):
        cpu_native.decode_attention(
            native,
            batch.q,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.seq_lens,
            tokens,
            seqs,
            batch.scale,
            out,
        )
    assert not out.any()  # every row is checked before its first write


def test_rows_naming_a_token_or_sequence_out_of_range_are_refused(native):
    batch = _one_row()
    out = torch.zeros(batch.q.shape)
    for tokens, seqs in (([1], [0]), ([0], [1]), ([-1], [0])):
        with pytest.raises(cpu_native.NativeKernelError, match="out of range"):
            cpu_native.decode_attention(
                native,
                batch.q,
                batch.key_cache,
                batch.value_cache,
                batch.block_tables,
                batch.seq_lens,
                torch.tensor(tokens),
                torch.tensor(seqs),
                batch.scale,
                out,
            )


def test_wrong_dtypes_and_shapes_are_refused_before_the_call(native):
    batch = _one_row()
    tokens, seqs = decode_rows(batch)
    args = [batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, tokens, seqs, batch.scale]
    with pytest.raises(cpu_native.NativeKernelError, match="q, out"):
        cpu_native.decode_attention(native, batch.q.double(), *args, torch.zeros(batch.q.shape, dtype=torch.float64))
    with pytest.raises(cpu_native.NativeKernelError, match="tables"):
        bad = [*args]
        bad[2] = batch.block_tables.long()
        cpu_native.decode_attention(native, batch.q, *bad, torch.zeros(batch.q.shape))
    with pytest.raises(cpu_native.NativeKernelError, match="caches differ"):
        bad = [*args]
        bad[1] = batch.value_cache.half()
        cpu_native.decode_attention(native, batch.q, *bad, torch.zeros(batch.q.shape))


def test_the_library_is_built_once_and_reused(native, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_HOME", str(tmp_path))
    first = cpu_native._build()
    built = first.stat().st_mtime_ns
    assert cpu_native._build() == first and first.stat().st_mtime_ns == built
    assert [p.name for p in (tmp_path / "native").iterdir()] == [first.name]  # no temporary file left behind


def test_choice_env(monkeypatch):
    monkeypatch.setenv(cpu_native.CHOICE_ENV, "torch")
    assert cpu_native.library() is None
    monkeypatch.setenv(cpu_native.CHOICE_ENV, "fast")
    with pytest.raises(ValueError, match="PAGEDKV_CPU_KERNELS='fast'"):
        cpu_native.choice()


def test_without_a_compiler_auto_falls_back_with_a_warning_and_native_fails(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PAGEDKV_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_native._load.cache_clear()
    cpu_native._warn_once.cache_clear()
    try:
        monkeypatch.setenv(cpu_native.CHOICE_ENV, "auto")
        with caplog.at_level(logging.WARNING, logger="pagedkv_kernels.cpu_native"):
            assert cpu_native.library() is None
        assert "fall back to torch" in caplog.text and "no-such-compiler" in caplog.text
        batch = _one_row()  # and the torch backend still answers, by gathering
        got = dispatch.paged_attention(*batch.args(), batch.scale, backend="torch")
        torch.testing.assert_close(got.double(), float64_oracle(batch), atol=1e-5, rtol=1e-5)
        monkeypatch.setenv(cpu_native.CHOICE_ENV, "native")
        with pytest.raises(cpu_native.NativeKernelError, match="no-such-compiler"):
            cpu_native.library()
    finally:
        cpu_native._load.cache_clear()
        cpu_native._warn_once.cache_clear()


def test_pinning_puts_each_worker_on_one_cpu_and_leaves_the_caller_free(native):
    import os
    from pathlib import Path

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        assert cpu_native.pin_workers(native, 2) is None  # nothing to spread over: left alone
        return
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cpu_native.pin_workers(native, 2) == allowed[:2]
        masks = [
            line.split(":", 1)[1].strip()
            for status in Path("/proc/self/task").glob("*/status")
            for line in status.read_text().splitlines()
            if line.startswith("Cpus_allowed_list")
        ]
        assert str(allowed[1]) in masks, "the team's second thread runs on the second CPU only"
        assert sorted(os.sched_getaffinity(0)) == allowed, "the calling thread keeps every CPU"
        assert cpu_native.pin_workers(native, 1) is None  # one thread: no worker to pin
    finally:
        torch.set_num_threads(before)
