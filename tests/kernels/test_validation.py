"""Bad inputs raise ValueError/TypeError naming the problem, on every backend, before any kernel runs; the valid
baselines the error cases perturb run and give the right answer, so each error case fails for its own reason."""

from __future__ import annotations

import pytest
import torch

from pagedkv_kernels import copy_blocks, paged_attention, write_kv
from tests.kernels.paged_case import TOLERANCES, float64_oracle, make_batch, needs_interpreter

BACKENDS = ["reference", "torch", "triton"]


def attention_batch():
    return make_batch(
        [(3, 20), (1, 9)],
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        dtype=torch.float16,
        device=torch.device("cpu"),
    )


def attention_kwargs(**overrides):
    b = attention_batch()
    kw = dict(
        q=b.q,
        key_cache=b.key_cache,
        value_cache=b.value_cache,
        block_tables=b.block_tables,
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
    )
    kw.update(overrides)
    return kw


def _cache(shape=(4, 8, 2, 64), dtype=torch.float16):
    return torch.zeros(shape, dtype=dtype)


ATTENTION_ERRORS = {
    "head_dim 48": (
        lambda kw: dict(
            q=torch.zeros(4, 4, 48, dtype=torch.float16),
            key_cache=_cache((4, 8, 2, 48)),
            value_cache=_cache((4, 8, 2, 48)),
        ),
        ValueError,
        "head_dim 48 is not supported",
    ),
    "block size 12": (
        lambda kw: dict(key_cache=_cache((4, 12, 2, 64)), value_cache=_cache((4, 12, 2, 64))),
        ValueError,
        "block_size 12 is not supported",
    ),
    "float64 cache": (
        lambda kw: dict(
            q=torch.zeros(4, 4, 64, dtype=torch.float64),
            key_cache=_cache(dtype=torch.float64),
            value_cache=_cache(dtype=torch.float64),
        ),
        TypeError,
        "key_cache has dtype",
    ),
    "q dtype": (lambda kw: dict(q=torch.zeros(4, 4, 64)), TypeError, "q dtype torch.float32 != cache dtype"),
    "k/v dtype": (lambda kw: dict(value_cache=kw["value_cache"].float()), TypeError, "key_cache dtype"),
    "k/v shape": (lambda kw: dict(value_cache=kw["value_cache"][:-1]), ValueError, "value_cache shape"),
    "heads not multiple": (
        lambda kw: dict(q=torch.zeros(4, 3, 64, dtype=torch.float16)),
        ValueError,
        "multiple of num_kv_heads",
    ),
    "q head_dim": (lambda kw: dict(q=torch.zeros(4, 4, 32, dtype=torch.float16)), ValueError, "q head_dim 32"),
    "q rank": (lambda kw: dict(q=torch.zeros(4, 256, dtype=torch.float16)), ValueError, "q must be 3-D"),
    "non-contiguous cache": (
        lambda kw: dict(key_cache=kw["key_cache"].transpose(1, 2).contiguous().transpose(1, 2)),
        ValueError,
        "key_cache must be contiguous",
    ),
    "strided head_dim": (
        lambda kw: dict(q=torch.zeros(4, 4, 128, dtype=torch.float16)[..., ::2]),
        ValueError,
        "q must be contiguous in its last dimension",
    ),
    "block table dtype": (
        lambda kw: dict(block_tables=torch.zeros(2, 4, dtype=torch.int64)),
        TypeError,
        "block_tables has dtype",
    ),
    "block table rows": (
        lambda kw: dict(block_tables=torch.zeros(3, 4, dtype=torch.int32)),
        ValueError,
        "block_tables has 3 rows",
    ),
    "non-contiguous block table": (
        lambda kw: dict(block_tables=torch.zeros(4, 2, dtype=torch.int32).t()),
        ValueError,
        "block_tables must be contiguous",
    ),
    "query_start_loc length": (
        lambda kw: dict(query_start_loc=torch.tensor([0, 4], dtype=torch.int32)),
        ValueError,
        "num_seqs \\+ 1",
    ),
    "query_start_loc end": (
        lambda kw: dict(query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32)),
        ValueError,
        "end at num_tokens=4",
    ),
    "empty sequence": (
        lambda kw: dict(query_start_loc=torch.tensor([0, 4, 4], dtype=torch.int32)),
        ValueError,
        "at least one",
    ),
    "kv shorter than q": (
        lambda kw: dict(seq_lens=torch.tensor([2, 9], dtype=torch.int32)),
        ValueError,
        "seq_lens 2 < its 3 query tokens",
    ),
    "kv beyond table": (
        lambda kw: dict(seq_lens=torch.tensor([20, 90], dtype=torch.int32)),
        ValueError,
        "exceeds its block table capacity",
    ),
    "block id out of range": (
        lambda kw: dict(block_tables=torch.full((2, 4), 99, dtype=torch.int32)),
        ValueError,
        "block ids must lie in",
    ),
    "out shape": (lambda kw: dict(out=torch.zeros(4, 4, 32, dtype=torch.float16)), ValueError, "out shape"),
    "out dtype": (lambda kw: dict(out=torch.zeros(4, 4, 64)), TypeError, "out dtype"),
    "out device": (
        lambda kw: dict(out=torch.zeros(4, 4, 64, dtype=torch.float16, device="meta")),
        ValueError,
        "out is on meta",
    ),
    "q device": (
        lambda kw: dict(q=torch.zeros(4, 4, 64, dtype=torch.float16, device="meta")),
        ValueError,
        "q is on meta",
    ),
    "not a tensor": (lambda kw: dict(seq_lens=[20, 9]), TypeError, "seq_lens must be a torch.Tensor"),
    "bad scale": (lambda kw: dict(scale="0.1"), TypeError, "scale must be a finite float"),
    "bad num_splits": (lambda kw: dict(num_splits=0), ValueError, "num_splits must be"),
    "window 0": (lambda kw: dict(sliding_window=0), ValueError, "sliding_window must be an int >= 1"),
    "window float": (lambda kw: dict(sliding_window=4.0), ValueError, "sliding_window must be an int >= 1"),
    "window bool": (lambda kw: dict(sliding_window=True), ValueError, "sliding_window must be an int >= 1"),
    "softcap 0": (lambda kw: dict(softcap=0.0), ValueError, "softcap must be a finite float > 0"),
    "softcap negative": (lambda kw: dict(softcap=-30.0), ValueError, "softcap must be a finite float > 0"),
    "softcap inf": (lambda kw: dict(softcap=float("inf")), ValueError, "softcap must be a finite float > 0"),
    "softcap nan": (lambda kw: dict(softcap=float("nan")), ValueError, "softcap must be a finite float > 0"),
    "softcap string": (lambda kw: dict(softcap="50"), ValueError, "softcap must be a finite float > 0"),
    "sinks not a tensor": (lambda kw: dict(sinks=[0.0] * 4), TypeError, "sinks must be a torch.Tensor"),
    "sinks per kv head": (lambda kw: dict(sinks=torch.zeros(2)), ValueError, "sinks has 2 entries but q has 4"),
    "sinks rank": (lambda kw: dict(sinks=torch.zeros(1, 4)), ValueError, "sinks must be 1-D"),
    "sinks dtype": (lambda kw: dict(sinks=torch.zeros(4, dtype=torch.int64)), TypeError, "sinks has dtype"),
    "sinks float64": (lambda kw: dict(sinks=torch.zeros(4, dtype=torch.float64)), TypeError, "sinks has dtype"),
    "sinks device": (lambda kw: dict(sinks=torch.zeros(4, device="meta")), ValueError, "sinks is on meta"),
    "sinks strided": (lambda kw: dict(sinks=torch.zeros(8)[::2]), ValueError, "sinks must be contiguous"),
    "window: a visible block out of range": (
        lambda kw: dict(block_tables=kw["block_tables"].index_fill(1, torch.tensor([2]), 99), sliding_window=5),
        ValueError,
        "sequence 0: block ids must lie in",
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(ATTENTION_ERRORS))
def test_paged_attention_errors(case, backend):
    make_overrides, exc, message = ATTENTION_ERRORS[case]
    kwargs = attention_kwargs()
    kwargs.update(make_overrides(kwargs))
    with pytest.raises(exc, match=message):
        paged_attention(**kwargs, backend=backend)


@needs_interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_attention_baseline_runs_and_is_right(backend):
    out = paged_attention(**attention_kwargs(), backend=backend)
    assert out.shape == (4, 4, 64) and out.dtype == torch.float16
    torch.testing.assert_close(out.double(), float64_oracle(attention_batch()), **TOLERANCES[torch.float16])


@needs_interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_ignores_table_entries_before_it(backend):
    """Entries of blocks before every query's window may name no block at all (given back): not an error."""
    kwargs = attention_kwargs()
    kwargs["block_tables"] = kwargs["block_tables"].clone()
    kwargs["block_tables"][0, :1] = -1  # sequence 0 (3 queries at 17..19, window 8) sees positions 10.. only
    out = paged_attention(**kwargs, sliding_window=8, backend=backend)
    torch.testing.assert_close(
        out.double(), float64_oracle(attention_batch(), sliding_window=8), **TOLERANCES[torch.float16]
    )


def write_kwargs(**overrides):
    kw = dict(
        key=torch.zeros(3, 2, 64, dtype=torch.float16),
        value=torch.zeros(3, 2, 64, dtype=torch.float16),
        key_cache=_cache(),
        value_cache=_cache(),
        slot_mapping=torch.tensor([0, -1, 31]),
    )
    kw.update(overrides)
    return kw


WRITE_ERRORS = {
    "slot out of range": (dict(slot_mapping=torch.tensor([0, 1, 32])), ValueError, "slot_mapping values"),
    "slot below -1": (dict(slot_mapping=torch.tensor([0, -2, 3])), ValueError, "slot_mapping values"),
    "slot dtype": (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), TypeError, "slot_mapping has dtype"),
    "slot count": (dict(slot_mapping=torch.tensor([0, 1])), ValueError, "slot_mapping has 2 entries"),
    "key heads": (dict(key=torch.zeros(3, 1, 64, dtype=torch.float16)), ValueError, "does not match the cache"),
    "key dtype": (dict(value=torch.zeros(3, 2, 64)), TypeError, "value dtype"),
    "key vs value": (dict(value=torch.zeros(4, 2, 64, dtype=torch.float16)), ValueError, "key shape"),
    "bf16 vs fp16 caches": (dict(value_cache=_cache(dtype=torch.bfloat16)), TypeError, "key_cache dtype"),
    "unsupported block size": (
        dict(key_cache=_cache((4, 4, 2, 64)), value_cache=_cache((4, 4, 2, 64))),
        ValueError,
        "block_size 4",
    ),
}


@needs_interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_write_baseline_writes_its_slots_and_skips_padding(backend):
    kw = write_kwargs(key=torch.full((3, 2, 64), 1.0, dtype=torch.float16))
    kw["value"] = torch.full((3, 2, 64), 2.0, dtype=torch.float16)
    write_kv(**kw, backend=backend)
    for cache, filled in ((kw["key_cache"], 1.0), (kw["value_cache"], 2.0)):
        slots = cache.view(-1, 2, 64)
        assert (slots[0] == filled).all() and (slots[31] == filled).all()  # slot_mapping [0, -1, 31]
        assert (slots[1:31] == 0).all()  # the -1 token wrote nothing


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(WRITE_ERRORS))
def test_write_kv_errors(case, backend):
    overrides, exc, message = WRITE_ERRORS[case]
    with pytest.raises(exc, match=message):
        write_kv(**write_kwargs(**overrides), backend=backend)


COPY_ERRORS = {
    "tensor not list": (lambda: (_cache(), _cache(), ([0], [1])), TypeError, "sequences of per-layer"),
    "layer count": (lambda: ([_cache()], [_cache(), _cache()], ([0], [1])), ValueError, "one key and one value"),
    "layers differ": (
        lambda: ([_cache(), _cache((5, 8, 2, 64))], [_cache(), _cache((5, 8, 2, 64))], ([0], [1])),
        ValueError,
        "differs from layer 0",
    ),
    "mapping dtype": (
        lambda: ([_cache()], [_cache()], torch.tensor([[0, 1]], dtype=torch.int32)),
        TypeError,
        "block_mapping has dtype",
    ),
    "mapping shape": (lambda: ([_cache()], [_cache()], torch.tensor([[0, 1, 2]])), ValueError, "shape \\[n, 2\\]"),
    "list lengths": (lambda: ([_cache()], [_cache()], ([0, 1], [2])), ValueError, "source list has 2"),
    "id range": (lambda: ([_cache()], [_cache()], ([0], [4])), ValueError, "block ids must lie in"),
    "tensor id range": (lambda: ([_cache()], [_cache()], torch.tensor([[0, 9]])), ValueError, "block ids must lie"),
    "duplicate dst": (lambda: ([_cache()], [_cache()], ([0, 1], [2, 2])), ValueError, "distinct"),
    "dst is src": (lambda: ([_cache()], [_cache()], ([0, 1], [1, 2])), ValueError, "also a source"),
    "mapping form": (lambda: ([_cache()], [_cache()], "0->1"), TypeError, "block_mapping must be"),
    "list of pairs": (lambda: ([_cache()], [_cache()], [[0, 1], [2, 3]]), TypeError, "tuple of two lists"),
}


@needs_interpreter
@pytest.mark.parametrize("backend", BACKENDS)
def test_valid_copy_baseline_copies_blocks(backend):
    keys = [torch.arange(4 * 8 * 2 * 64, dtype=torch.float16).view(4, 8, 2, 64) for _ in range(2)]
    values = [k.clone() * -1 for k in keys]
    copy_blocks(keys, values, ([0, 1], [2, 3]), backend=backend)
    for cache in (*keys, *values):
        assert torch.equal(cache[2], cache[0]) and torch.equal(cache[3], cache[1])
        assert not torch.equal(cache[0], cache[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(COPY_ERRORS))
def test_copy_blocks_errors(case, backend):
    make_args, exc, message = COPY_ERRORS[case]
    with pytest.raises(exc, match=message):
        copy_blocks(*make_args(), backend=backend)


def test_bad_backend_name():
    with pytest.raises(ValueError, match="backend must be one of"):
        write_kv(**write_kwargs(), backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        paged_attention(**attention_kwargs(), backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        copy_blocks([_cache()], [_cache()], ([0], [1]), backend="cuda")


def test_options_are_checked_even_when_the_call_skips_its_checks():
    # A model's later layers skip the step's metadata checks, but their options are their own.
    with pytest.raises(ValueError, match="softcap must be"):
        paged_attention(**attention_kwargs(), softcap=-1.0, check=False, backend="reference")
    with pytest.raises(ValueError, match="sinks has 3 entries"):
        paged_attention(**attention_kwargs(), sinks=torch.zeros(3), check=False, backend="reference")
