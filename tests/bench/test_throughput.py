"""`pagedkv bench throughput --quick` end to end on a tiny model: a real blockd, the engine, transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pagedkv.bench.throughput import bench_throughput, make_workload


def _invoke(*args: str):
    return CliRunner().invoke(bench_throughput, list(args), catch_exceptions=False)


def test_quick_run_compares_the_same_work(tiny_models: dict[str, Path]) -> None:
    result = _invoke("--quick", "--model", str(tiny_models["llama"]), "--device", "cpu")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["quick"] is True and figures["device"] == "cpu" and figures["dtype"] == "float32"
    # Both systems delivered exactly the workload's output tokens.
    expected = sum(o for o in _output_lens(figures))
    assert figures["pagedkv_output_tokens"] == figures["hf_output_tokens"] == expected
    # Static batching computes past shorter requests' ends; the engine computes exactly what it delivers.
    assert figures["hf_computed_tokens"] >= figures["hf_output_tokens"]
    # Same memory: paging holds more sequences than max-length reservation.
    assert figures["hf_max_active"] == figures["hf_batch_size"] >= 1
    assert figures["pagedkv_max_active"] > figures["hf_max_active"]
    assert figures["hf_batch_size"] == figures["kv_cache_bytes"] // (figures["kv_bytes_per_token"] * figures["max_len"])
    assert figures["num_blocks"] == figures["kv_cache_bytes"] // (figures["kv_bytes_per_token"] * figures["block_size"])
    assert figures["pagedkv_tok_s"] > 0 and figures["hf_tok_s"] > 0
    assert figures["ratio"] == pytest.approx(figures["pagedkv_tok_s"] / figures["hf_tok_s"], rel=1e-3)
    # float32, greedy: the first request's tokens are the same from both.
    assert figures["first_request_match"] is True
    assert "pagedkv (" in result.stdout and "transformers (" in result.stdout  # the table
    assert "pagedkv:" in result.stderr and "hf:" in result.stderr  # progress on stderr, not stdout


def _output_lens(figures: dict) -> list[int]:
    """The workload's output lengths, rebuilt from the settings the JSON reports."""
    requests = make_workload(
        figures["requests"],
        tuple(figures["prompt_range"]),
        tuple(figures["output_range"]),
        vocab_size=512,
        special_ids=set(),
        seed=figures["seed"],
    )
    return [r.output_len for r in requests]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kv-cache-memory", "4k"], "--kv-cache-memory"),  # holds no max-length sequence
        (["--requests", "0"], "--requests"),
        (["--prompt-range", "64", "8"], "--prompt-range"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    ],
)
def test_bad_options_are_usage_errors(tiny_models: dict[str, Path], args: list[str], needle: str) -> None:
    result = _invoke("--quick", "--model", str(tiny_models["llama"]), "--device", "cpu", *args)
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_inprocess_blockd_runs_the_same_work(tiny_models: dict[str, Path]) -> None:
    result = _invoke("--quick", "--model", str(tiny_models["llama"]), "--device", "cpu", "--blockd", "inprocess")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["blockd"] == "inprocess"
    assert figures["pagedkv_output_tokens"] == figures["hf_output_tokens"] == sum(_output_lens(figures))
    assert figures["first_request_match"] is True


def test_compare_blockd_gives_the_split_as_a_ratio(tiny_models: dict[str, Path]) -> None:
    result = _invoke(
        "--quick", "--model", str(tiny_models["llama"]), "--device", "cpu", "--blockd", "compare", "--repeat", "2"
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(figures["ratios"]) == 2 and figures["ratio"] > 0
    assert figures["daemon_tok_s"] > 0 and figures["inprocess_tok_s"] > 0
    assert figures["output_tokens"] == sum(_output_lens(figures))
    assert figures["first_request_match"] is True  # the same greedy tokens whichever blockd
