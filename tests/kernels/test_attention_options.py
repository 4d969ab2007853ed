"""Paged attention's options (sliding window, logit softcap, sinks, a scale other than 1/sqrt(d)) in every backend.

The dense oracle (`attention_options.dense_attention`) is checked against transformers' own eager attention and
mask functions; the paged reference against the oracle; the CPU backend (native kernel and SDPA fallback) and
Triton (the interpreter here) against the float64 reference. Cases are drawn fresh every run (the seed is in
every failure message). With a window, blocks wholly before every query's window are given back: their table
entries name a NaN block, so a backend that reads them fails.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedkv_kernels import dispatch, reference
from tests.kernels.attention_options import COMBINATIONS, dense_attention, fresh_seed, random_case
from tests.kernels.paged_case import DEVICE, TOLERANCES, float64_oracle, make_batch, poisoned_like


def _transformers_step(seq: tuple[int, int], window: int, seed: int):
    """One sequence (q_len, kv_len) as transformers' eager attention takes it: [1, H, T, D] tensors and the
    additive mask its sliding-window mask function gives for query positions kv_len - q_len + i."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    q_len, kv_len = seq
    cpu = torch.device("cpu")  # transformers' eager code on host tensors, whatever the test device
    batch = make_batch(
        [seq], num_heads=6, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.float64, seed=seed, device=cpu
    )
    q_idx = torch.arange(kv_len - q_len, kv_len)[:, None]
    kv_idx = torch.arange(kv_len)[None, :]
    allowed = sliding_window_causal_mask_function(window)(0, 0, q_idx, kv_idx)
    mask = torch.zeros(q_len, kv_len, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]
    query = batch.q.transpose(0, 1)[None]
    key, value = batch.keys[0].transpose(0, 1)[None], batch.values[0].transpose(0, 1)[None]
    return batch, query, key, value, mask


@pytest.mark.parametrize("seq, window", [((9, 40), 7), ((1, 33), 16), ((12, 12), 100), ((5, 21), 1)])
def test_oracle_matches_transformers_gemma2_eager_attention(seq, window):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    batch, query, key, value, mask = _transformers_step(seq, window, seed=window)
    batch.scale = 0.3  # query_pre_attn_scalar**-0.5 with a scalar other than head_dim
    module = SimpleNamespace(num_key_value_groups=3, head_dim=64, training=False)
    want, _ = eager_attention_forward(module, query, key, value, mask, scaling=batch.scale, softcap=2.5)
    got = dense_attention(batch, sliding_window=window, softcap=2.5)
    # Gemma 2's eager code takes its softmax in float32 whatever the inputs: 1e-6 is that rounding.
    torch.testing.assert_close(got, want[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(float64_oracle(batch, sliding_window=window, softcap=2.5), got)


@pytest.mark.parametrize("seq, window", [((9, 40), 7), ((1, 33), 16), ((12, 12), 100)])
def test_oracle_matches_transformers_gpt_oss_eager_attention(seq, window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    batch, query, key, value, mask = _transformers_step(seq, window, seed=window + 1)
    sinks = torch.tensor([-1.0, 0.0, 0.5, 2.0, 4.0, -3.0], dtype=torch.float64)
    module = SimpleNamespace(num_key_value_groups=3, sinks=sinks, training=False)
    want, _ = eager_attention_forward(module, query, key, value, mask, scaling=batch.scale)
    got = dense_attention(batch, sliding_window=window, sinks=sinks)
    torch.testing.assert_close(got, want[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(float64_oracle(batch, sliding_window=window, sinks=sinks), got)


@pytest.mark.parametrize("features", COMBINATIONS, ids=["+".join(c) for c in COMBINATIONS])
def test_reference_matches_the_dense_oracle(features):
    for _ in range(3):
        case = random_case(fresh_seed(), features, dtype=torch.float32)
        out = poisoned_like(case.batch.q)
        dispatch.paged_attention(*case.batch.args(), case.batch.scale, out=out, backend="reference", **case.options)
        assert not out.isnan().any(), case.description
        want = dense_attention(case.batch, **case.options)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5, msg=case.description)
        torch.testing.assert_close(float64_oracle(case.batch, **case.options), want, atol=1e-10, rtol=1e-10)


def test_a_window_of_one_sees_only_the_query_itself():
    batch = make_batch([(4, 30), (1, 9)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32)
    got = dispatch.paged_attention(*batch.args(), batch.scale, backend="reference", sliding_window=1)
    own = torch.cat([v[-q:] for q, v in zip(batch.q_lens, batch.values, strict=True)])  # [tokens, kv_heads, d]
    torch.testing.assert_close(got, own.repeat_interleave(2, dim=1))


def test_a_window_wider_than_every_context_changes_nothing():
    batch = make_batch([(5, 40), (1, 17)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
    plain = dispatch.paged_attention(*batch.args(), batch.scale, backend="reference")
    torch.testing.assert_close(
        dispatch.paged_attention(*batch.args(), batch.scale, backend="reference", sliding_window=40), plain
    )


@pytest.mark.parametrize(
    "backend, decode_path", [("reference", ""), ("torch", "native"), ("torch", "torch"), ("triton", "")]
)
def test_no_backend_reads_a_table_entry_before_the_window(backend, decode_path, monkeypatch):
    """Entries before the first visible block may name anything once blocks are given back, even no block."""
    monkeypatch.setenv("PAGEDKV_CPU_KERNELS", decode_path or "auto")
    batch = make_batch(
        [(3, 50), (1, 70), (1, 9)],
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        block_size=8,
        dtype=torch.float32,
        sliding_window=10,
    )
    want = float64_oracle(batch, sliding_window=10)
    tables = batch.block_tables.clone()
    for s, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens, strict=True)):
        tables[s, : reference.first_visible(kv_len, q_len, 10) // 8] = -1
    args = (batch.q, batch.key_cache, batch.value_cache, tables, batch.query_start_loc, batch.seq_lens)
    got = dispatch.paged_attention(*args, batch.scale, sliding_window=10, backend=backend)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


CPU_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("decode_path", ["native", "torch"])  # decode rows: the C++ kernel, or gather + SDPA
@pytest.mark.parametrize("features", COMBINATIONS, ids=["+".join(c) for c in COMBINATIONS])
def test_cpu_backend_matches_the_float64_reference(features, decode_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_CPU_KERNELS", decode_path)
    for dtype in CPU_DTYPES:
        case = random_case(fresh_seed(), features, dtype=dtype)
        out = poisoned_like(case.batch.q)
        dispatch.paged_attention(*case.batch.args(), case.batch.scale, out=out, backend="torch", **case.options)
        assert not out.isnan().any(), case.description
        torch.testing.assert_close(
            out.double(), float64_oracle(case.batch, **case.options), **TOLERANCES[dtype], msg=case.description
        )


@pytest.mark.parametrize("window", [None, 20])
def test_native_rows_sharing_a_prefix_with_every_option(window, monkeypatch):
    """Enough decode rows that the native kernel takes whole rows, sharing 3 blocks: without a window they go
    through its grouped pass (softcap and sinks included); with one, blocks before it are given back."""
    monkeypatch.setenv("PAGEDKV_CPU_KERNELS", "native")
    seed = fresh_seed()
    lengths = torch.randint(48, 200, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
    batch = make_batch(
        [(1, n) for n in lengths],
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=seed,
        shared_prefix_blocks=3,
        sliding_window=window,
    )
    options = dict(sliding_window=window, softcap=3.0, sinks=torch.linspace(-2, 3, 8, device=DEVICE))
    got = dispatch.paged_attention(*batch.args(), batch.scale, backend="torch", **options)
    torch.testing.assert_close(got.double(), float64_oracle(batch, **options), atol=1e-5, rtol=1e-5, msg=f"{seed}")


def _triton(batch, options, num_splits=None, description=""):
    out = poisoned_like(batch.q)
    dispatch.paged_attention(*batch.args(), batch.scale, out=out, num_splits=num_splits, backend="triton", **options)
    assert not out.isnan().any(), description
    want = float64_oracle(batch, **options)
    torch.testing.assert_close(out.double(), want, **TOLERANCES[batch.q.dtype], msg=description)


@pytest.mark.parametrize("features", COMBINATIONS, ids=["+".join(c) for c in COMBINATIONS])
def test_triton_matches_the_float64_reference(features):
    # Small: the interpreter is slow. One fresh case per combination, the dtype drawn with it.
    seed = fresh_seed()
    dtype = (torch.float16, torch.float32)[seed % 2]
    case = random_case(seed, features, dtype=dtype, max_len=120, rows=4)
    _triton(case.batch, case.options, description=case.description)


def test_triton_decode_splits_with_a_window_and_sinks():
    """Flash-decoding splits over a window (they start at it, so some are empty) with the sinks in the reduce;
    windows of 1 and wider than the contexts too."""
    seed = fresh_seed()
    seqs = [(1, 90), (1, 41), (1, 3)]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    for window, dtype in ((24, torch.float32), (1, torch.float16), (200, torch.float16)):
        batch = make_batch(
            seqs,
            num_heads=4,
            num_kv_heads=2,
            head_dim=64,
            block_size=16,
            dtype=dtype,
            seed=seed,
            sliding_window=window,
        )
        options = dict(sliding_window=window, sinks=sinks, softcap=4.0 if window == 24 else None)
        _triton(batch, options, num_splits=3, description=f"seed {seed} window {window}")


def test_triton_prefill_chunk_longer_than_its_window():
    """A 40-token chunk after 60 cached tokens, window 6: every tile has keys only some rows see (the masked
    head segment), and blocks before the chunk's first window are given back."""
    batch = make_batch(
        [(40, 100), (1, 50)],
        num_heads=2,
        num_kv_heads=1,
        head_dim=128,
        block_size=8,
        dtype=torch.float32,
        seed=fresh_seed(),
        sliding_window=6,
    )
    _triton(batch, dict(sliding_window=6))


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_a_window_past_any_length_is_no_window(backend):
    batch = make_batch([(4, 37), (1, 20)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32)
    got = dispatch.paged_attention(*batch.args(), batch.scale, sliding_window=2**40, backend=backend)
    torch.testing.assert_close(got.double(), float64_oracle(batch), **TOLERANCES[torch.float32])


def test_a_long_chunk_with_softcap_goes_in_query_slices_and_stays_exact(monkeypatch):
    from pagedkv_kernels import torch_batched

    monkeypatch.setattr(torch_batched, "EXPLICIT_SCORES", 4 * 100 * 7)  # 7 queries a slice over 100 keys, 4 heads
    batch = make_batch(
        [(30, 100), (1, 64)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=fresh_seed(),
        sliding_window=50,
    )
    options = dict(sliding_window=50, softcap=2.0, sinks=torch.tensor([1.0, -1.0, 0.0, 2.0], device=DEVICE))
    got = dispatch.paged_attention(*batch.args(), batch.scale, backend="torch", **options)
    torch.testing.assert_close(got.double(), float64_oracle(batch, **options), atol=1e-5, rtol=1e-5)
