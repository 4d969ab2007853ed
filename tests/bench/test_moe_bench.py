"""`pagedkv bench moe`: its rows on tiny CPU shapes (every path agreeing with the grouped one), and its refusals."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from pagedkv.bench.moe import bench_moe, run_benchmarks, wall_timer
from tests.kernels.paged_case import needs_interpreter


def test_cpu_rows_agree_and_the_last_line_is_json():
    args = ["--device", "cpu", "--experts", "6", "--hidden", "32", "--inter", "16", "--top-k", "2"]
    result = CliRunner().invoke(bench_moe, [*args, "--tokens", "1", "--tokens", "9"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert any("torch_vs_dense" in line for line in lines)
    last = json.loads(lines[-1])
    assert (last["num_experts"], last["hidden_size"], last["inter"], last["top_k"]) == (6, 32, 16, 2)
    assert [r["tokens"] for r in last["rows"]] == [1, 9]
    for row in last["rows"]:
        assert 1 <= row["active_experts"] <= 6
        assert row["torch_ms"] > 0 and row["dense_ms"] > 0 and row["torch_vs_dense"] > 0
        assert row["torch_err"] == 0 and row["dense_err"] < 1e-4


def test_refusals_exit_2_with_a_json_last_line():
    result = CliRunner().invoke(bench_moe, ["--device", "cpu", "--experts", "4", "--top-k", "5"])
    assert result.exit_code == 2
    assert "more than --experts" in json.loads(result.output.strip().splitlines()[-1])["error"]
    result = CliRunner().invoke(bench_moe, ["--inter", "0"])
    assert result.exit_code == 2 and "--inter" in result.output


@needs_interpreter
def test_the_triton_rows_under_the_interpreter():
    # The CUDA rows' code on CPU tensors: Triton interpreted, timed by the wall clock.
    lines: list[str] = []
    results = run_benchmarks(
        device=torch.device("cpu"),
        dtype=torch.float32,
        num_experts=5,
        hidden_size=24,
        inter=40,
        top_k=3,
        tokens=[4],
        timer=lambda fn: wall_timer(fn, repeats=1),
        paths=("torch", "triton"),
        echo=lines.append,
    )
    (row,) = results["rows"]
    assert row["triton_ms"] > 0 and row["triton_err"] < 1e-5 and row["triton_vs_dense"] > 0
    assert any("triton_vs_dense" in line for line in lines)
