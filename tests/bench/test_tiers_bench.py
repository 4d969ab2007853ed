"""`pagedkv bench tiers`: its infinite-cache reference, percentiles and workload, then quick runs on real processes
(blockd and executors; vLLM's side a fake `vllm serve`, `fake_vllm_cli.py`, standard library only)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pagedkv.bench.peer_rounds import schedule
from pagedkv.bench.tiers import bench_tiers
from pagedkv.bench.tiers_workload import BLOCK_SIZE, InfiniteCache, Workload, percentile
from pagedkv.tools.model_gen import write_model
from tests.support.models import TINY

FAKE_CLI = Path(__file__).with_name("fake_vllm_cli.py")
ROW_FIELDS = {
    "prefix_hit_rate",
    "infinite_cache_hit_rate",
    "hit_rate_of_infinite",
    "revisited_ttft_p50_s",
    "revisited_ttft_p99_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "output_tokens_per_s",
    "wall_s",
}


def test_the_infinite_cache_hits_every_computed_full_block_but_the_prompts_last():
    cache = InfiniteCache()
    history = list(range(3 * BLOCK_SIZE + 5))
    assert cache.hit(history) == 0
    cache.computed(history)
    assert cache.hit(history + [7] * BLOCK_SIZE) == 3 * BLOCK_SIZE
    assert cache.hit(history[: 3 * BLOCK_SIZE]) == 2 * BLOCK_SIZE  # the last token is always computed
    assert cache.hit([99, *history[1:]]) == 0  # a block names its whole prefix


def test_percentiles_are_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile([], 50) == 0.0


def test_the_history_holds_every_turn_or_the_command_says_how_long_it_must_be():
    workload = Workload(64, 8, 2048, 48, 16, 4, 0.125, 0)
    assert workload.first_tokens == 2048 - 7 * 64 and workload.working_set_blocks() == 64 * 65
    messages = workload.user_messages()
    assert [len(m) for m in messages[0]] == [workload.first_tokens] + [48] * 7
    result = CliRunner().invoke(bench_tiers, ["--turns", "8", "--history-tokens", "400", "--configs", "off"])
    assert result.exit_code == 2 and "--history-tokens 400 cannot hold 7 more turns" in result.output
    assert "give at least 449" in result.output
    result = CliRunner().invoke(bench_tiers, ["--configs", "off,vllm,lru"])
    assert result.exit_code == 2 and "lru: choose from off, host, host+disk, fp8, vllm, vllm+offload" in result.output


def _consistent(row: dict[str, Any]) -> None:
    """What any row's figures must satisfy whatever the timings."""
    assert row.keys() >= ROW_FIELDS
    assert 0 <= row["cached_tokens"] <= row["infinite_cache_tokens"] <= row["prompt_tokens"]
    assert 0 <= row["prefix_hit_rate"] <= row["infinite_cache_hit_rate"] <= 1
    assert row["hit_rate_of_infinite"] == round(row["cached_tokens"] / row["infinite_cache_tokens"], 4)
    assert 0 < row["revisited_ttft_p50_s"] <= row["revisited_ttft_p99_s"] and 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]
    assert row["output_tokens_per_s"] > 0 and row["requests"] == 6 * 3


@pytest.mark.timeout(240)
def test_a_quick_run_prints_its_table_and_json(tmp_path: Path):
    model = write_model(tmp_path / "model", arch="llama", quiet=True, **TINY)
    out = tmp_path / "tiers.json"
    args = ["--model", str(model), "--quick", "--configs", "off,host+disk,vllm,vllm+offload", "--json", str(out)]
    args += ["--vllm-python", sys.executable, "--vllm-cli", str(FAKE_CLI)]
    result = CliRunner().invoke(bench_tiers, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["outputs_equal"] is True and summary["skipped"] == {}
    rows = {row["config"]: row for row in summary["configs"]}
    assert list(rows) == ["off", "host+disk", "vllm", "vllm+offload"]
    for row in rows.values():
        _consistent(row)
    off, tiers = rows["off"], rows["host+disk"]
    # Every system and configuration ran the same conversations: the same infinite cache where the tokens agree.
    assert (
        off["infinite_cache_tokens"] == tiers["infinite_cache_tokens"]
        and off["prompt_tokens"] == tiers["prompt_tokens"]
    )
    assert off["prefix_hit_rate"] < tiers["prefix_hit_rate"]  # the device alone cannot hold the histories
    assert tiers["hit_rate_of_infinite"] >= 0.9
    assert tiers["executor_tiers"]["loads_disk"] > 0 and tiers["executor_tiers"]["spills"] > 0
    assert tiers["turns_equal_to_reference"] == 18
    # The fake vLLM caches without bound, so it hits what the infinite cache does; its own tokens, not the model's.
    assert rows["vllm"]["hit_rate_of_infinite"] == 1.0 and rows["vllm"]["turns_equal_to_reference"] < 18
    assert (
        "--kv-offloading-size" in rows["vllm+offload"]["flags"] and "--kv-offloading-size" not in rows["vllm"]["flags"]
    )
    pairs = {(p["pagedkv"], p["vllm"]) for p in summary["pagedkv_over_vllm"]}
    assert pairs == {("off", "vllm")}  # vllm+offload's peer (host) did not run
    assert set(summary["aims"]) == {"revisited_ttft_speedup_ge_3", "hit_rate_ge_90pct_of_infinite", "ahead_of_vllm"}
    assert summary["aims"]["hit_rate_ge_90pct_of_infinite"] is True
    for needle in ("revisit p50", "revisit p99", "of infinite", "host+disk: DISK", "pagedkv off / vllm:", "aims:"):
        assert needle in result.output


def test_a_vllm_that_fails_or_is_missing_is_reported_not_measured(tmp_path: Path):
    args = ["--quick", "--configs", "vllm", "--vllm-cli", str(FAKE_CLI)]
    result = CliRunner().invoke(bench_tiers, [*args, "--vllm-python", str(tmp_path / "nowhere" / "python")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["configs"] == [] and "no vLLM environment" in summary["skipped"]["vllm"]
    result = CliRunner(env={"FAKE_VLLM_FAIL": "serve"}).invoke(bench_tiers, [*args, "--vllm-python", sys.executable])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["configs"] == [] and "fake vLLM asked to fail in serve" in summary["skipped"]["vllm"]
    assert "vllm: failed:" in result.output


def test_rounds_alternate_the_configurations_order():
    configs = ["off", "host", "vllm"]
    assert schedule(configs, 3, alternate=True) == [
        *[(1, c) for c in configs],
        *[(2, c) for c in reversed(configs)],
        *[(3, c) for c in configs],
    ]
    result = CliRunner().invoke(bench_tiers, ["--quick", "--configs", "off", "--rounds", "0"])
    assert result.exit_code == 2 and "--rounds" in result.output


@pytest.mark.timeout(240)
def test_rounds_report_medians_and_each_rounds_speedup_against_its_own_off(tmp_path: Path):
    model = write_model(tmp_path / "model", arch="llama", quiet=True, **TINY)
    args = ["--model", str(model), "--quick", "--configs", "off,host,vllm", "--rounds", "2"]
    args += ["--vllm-python", sys.executable, "--vllm-cli", str(FAKE_CLI)]
    result = CliRunner().invoke(bench_tiers, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["rounds"] == 2 and summary["outputs_equal"] is True and summary["skipped"] == {}
    runs = summary["runs"]
    # Every configuration once per round, vLLM too, the second round in the reverse order.
    assert [(r["round"], r["config"]) for r in runs] == schedule(["off", "host", "vllm"], 2, alternate=True)
    for run in runs:
        _consistent(run)
        assert len(run["load_before"]) == 3 and run["machine_cpu_share"] > 0 and run["others_cpu_share"] >= 0
    by = {(r["round"], r["config"]): r for r in runs}
    for round_ in (1, 2):
        off, host = by[round_, "off"], by[round_, "host"]
        assert host["revisited_ttft_speedup"] == round(off["revisited_ttft_p50_s"] / host["revisited_ttft_p50_s"], 2)
        assert off["revisited_ttft_speedup"] == 1.0 and by[round_, "vllm"]["revisited_ttft_speedup"] is None
        assert host["turns_equal_to_reference"] == 18  # every round answers as the first round's off
    rows = {row["config"]: row for row in summary["configs"]}
    assert list(rows) == ["off", "host", "vllm"] and all(row["rounds"] == 2 for row in rows.values())
    speedups = [by[r, "host"]["revisited_ttft_speedup"] for r in (1, 2)]
    host = rows["host"]
    assert host["revisited_ttft_speedup"] == round(sum(speedups) / 2, 2)  # the median of two: their mean
    assert host["revisited_ttft_speedup_range"] == [min(speedups), max(speedups)]
    p50s = [by[r, "host"]["revisited_ttft_p50_s"] for r in (1, 2)]
    assert host["revisited_ttft_p50_s"] == pytest.approx(sum(p50s) / 2, abs=1e-4)
    assert host["requests"] == 18 and host["hit_rate_of_infinite"] == 1.0
    assert not host.keys() & {"round", "load_before", "machine_cpu_share", "others_cpu_share"}
    assert {(p["pagedkv"], p["vllm"]) for p in summary["pagedkv_over_vllm"]} == {("off", "vllm"), ("host", "vllm")}
    text = result.output
    assert "each run, 2 rounds alternated" in text and "median (min..max) of the rounds: host" in text
    low, high = host["revisited_ttft_speedup_range"]
    if low != high:
        assert f"{host['revisited_ttft_speedup']}x ({low}..{high})" in text
