"""`pagedkv bench capacity`: the workload helpers, the schedulers on hand-checked cases, and the command."""

from __future__ import annotations

import json
import statistics

import pytest
from click.testing import CliRunner

from blockd.pool import BlockPool
from pagedkv.bench import capacity
from pagedkv.bench.capacity import (
    InvariantViolation,
    bench_capacity,
    make_requests,
    sample_lengths,
    simulate_paged,
    simulate_reserved,
)


def test_sample_lengths_respect_max_len_and_are_deterministic():
    for max_len in (2, 64, 4096):
        pairs = sample_lengths(3000, max_len=max_len, seed=7)
        assert len(pairs) == 3000
        assert all(p >= 1 and o >= 1 and p + o <= max_len for p, o in pairs)
    assert sample_lengths(500, max_len=4096, seed=3) == sample_lengths(500, max_len=4096, seed=3)
    assert sample_lengths(500, max_len=4096, seed=3) != sample_lengths(500, max_len=4096, seed=4)
    with pytest.raises(ValueError):
        sample_lengths(1, max_len=1, seed=0)


def test_sample_lengths_follow_the_stated_medians():
    pairs = sample_lengths(20000, max_len=4096, seed=0)
    prompt_median = statistics.median(p for p, _ in pairs)
    output_median = statistics.median(o for _, o in pairs)
    assert abs(prompt_median / capacity.PROMPT_MEDIAN - 1) < 0.05
    assert abs(output_median / capacity.OUTPUT_MEDIAN - 1) < 0.05


def test_make_requests_gives_distinct_deterministic_token_ids():
    lengths = [(5, 3), (5, 3), (40, 2)]
    a, b = make_requests(lengths, seed=1), make_requests(lengths, seed=1)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [len(r.tokens) for r in a] == [(p + o) * 4 for p, o in lengths]
    assert a[0].tokens[:20] != a[1].tokens[:20]  # same lengths, different prompts: no shared prefix
    assert make_requests(lengths, seed=2)[0].tokens != a[0].tokens


def test_paged_preempts_the_newest_and_recomputes_it():
    # 4 blocks of 4 slots; two requests of 4 prompt + 6 output tokens. Both fit at first (1 block each) and grow
    # to 2 blocks each by step 5; at step 6 A needs a third block: B (newest) is preempted with its 8 tokens and
    # readmitted at step 7 with prompt + 5 generated tokens (3 blocks), then samples its last token.
    reqs = make_requests([(4, 6), (4, 6)], seed=0)
    res = simulate_paged(reqs, num_blocks=4, block_size=4, watermark_blocks=0, check_every=1)
    assert (res.steps, res.completed, res.max_active) == (7, 2, 2)
    assert (res.preemptions, res.recomputed_tokens) == (1, 8)
    assert reqs[1].admissions == 2 and reqs[0].admissions == 1


def test_paged_fails_loudly_on_a_broken_invariant(monkeypatch):
    monkeypatch.setattr(BlockPool, "check", lambda self: ["I2 block 0 is broken"])
    with pytest.raises(InvariantViolation, match="I2 block 0"):
        simulate_paged(make_requests([(4, 6)], seed=0), num_blocks=4, block_size=4, watermark_blocks=0)


def test_reserved_schedulers_on_a_hand_checked_case():
    # Budget 20 slots. Max-length reservation (10 each): two at a time. Exact reservation (prompt + output):
    # 6 + 6 + 8 = 20, all three at once.
    reqs = make_requests([(2, 4), (3, 3), (4, 4)], seed=0)
    contiguous = simulate_reserved(reqs, name="contiguous", kv_tokens=20, reserve=lambda r: 10)
    assert (contiguous.max_active, contiguous.completed) == (2, 3)
    # steps: A and B run 4 and 3 steps; C is admitted at step 4 (after B left) and runs steps 4-7.
    assert contiguous.steps == 7
    # saturated steps 1-3 (C waits): live tokens (2+3, 3+4, 4+5) over 20 reserved slots.
    assert contiguous.saturated_steps == 3
    assert contiguous.kv_utilization == pytest.approx(statistics.fmean([5 / 20, 7 / 20, 9 / 20]))
    oracle = simulate_reserved(reqs, name="oracle", kv_tokens=20, reserve=lambda r: r.prompt_len + r.output_len)
    assert (oracle.max_active, oracle.steps, oracle.saturated_steps) == (3, 4, 0)
    with pytest.raises(InvariantViolation):
        simulate_reserved(reqs, name="short", kv_tokens=20, reserve=lambda r: 5)


def _run(*args: str):
    result = CliRunner().invoke(bench_capacity, list(args))
    return result


def test_quick_run_paging_holds_more_at_high_utilization():
    result = _run("--quick")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert any(line.startswith("paged") for line in lines) and any(line.startswith("contiguous") for line in lines)
    assert "requests done" in result.stderr
    assert figures["quick"] is True
    n = figures["requests"]
    assert n == capacity.QUICK_REQUESTS
    for name in ("paged", "contiguous", "oracle"):
        assert figures[f"{name}_completed"] == n
    assert figures["contiguous_max_active"] == figures["kv_tokens"] // figures["max_len"]
    assert figures["paged_max_active"] > figures["oracle_max_active"] > figures["contiguous_max_active"]
    assert figures["paged_mean_active"] > 2 * figures["contiguous_mean_active"]
    assert figures["paged_kv_utilization"] > 0.9
    assert figures["contiguous_kv_utilization"] < 0.5
    for key in ("paged_kv_utilization", "contiguous_kv_utilization", "oracle_kv_utilization"):
        assert 0 < figures[key] <= 1
    assert figures["num_blocks"] == figures["kv_tokens"] // figures["block_size"]
    assert figures["paged_saturated_steps"] > 0 and figures["contiguous_saturated_steps"] > 0


def test_explicit_options_override_quick_and_are_reported():
    result = _run("--quick", "--requests", "50", "--kv-tokens", "8192", "--max-len", "2048", "--seed", "5")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert (figures["requests"], figures["kv_tokens"], figures["max_len"], figures["seed"]) == (50, 8192, 2048, 5)
    assert figures["contiguous_max_active"] == 4
    assert figures["paged_completed"] == 50


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-tokens", "1000"], "--kv-tokens"),
        (["--block-size", "0"], "--block-size"),
        (["--max-len", "1"], "--max-len"),
        (["--requests", "0"], "--requests"),
        (["--kv-tokens", "4096", "--watermark", "0.1"], "watermark"),
        (["--watermark", "0.5"], "--watermark"),
    ],
)
def test_bad_options_are_usage_errors(args, message):
    result = _run("--quick", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
