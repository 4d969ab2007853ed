"""`pagedkv bench kernels`: the no-GPU exit, and the benchmark logic on tiny CPU shapes."""

from __future__ import annotations

import json
import time

import pytest
import torch
from click.testing import CliRunner

from pagedkv.bench.kernels import bench_kernels, run_benchmarks
from tests.kernels.paged_case import needs_interpreter


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a CUDA GPU")
def test_without_cuda_exits_2_with_a_json_last_line():
    result = CliRunner().invoke(bench_kernels, ["--quick"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert "needs a CUDA GPU" in lines[0]
    last = json.loads(lines[-1])
    assert last["cuda"] is False and "CUDA GPU" in last["error"]


def test_options_are_validated():
    result = CliRunner().invoke(bench_kernels, ["--block-size", "12"])
    assert result.exit_code == 2 and "12" in result.output


def wall_clock_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


@needs_interpreter
def test_benchmark_logic_on_tiny_cpu_shapes():
    # Same code path as on the GPU (interpreted kernels, a wall-clock timer): catches crashes and
    # checks the outputs the benchmark compares against SDPA agree.
    lines: list[str] = []
    results = run_benchmarks(
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=16,
        decode_grid=[(1, 40), (2, 300)],
        prefill_cases=[(2, 24)],
        timer=wall_clock_ms,
        echo=lines.append,
        copy_bytes=1 << 20,
    )
    json.dumps(results)  # everything must be JSON-serialisable
    assert [r["context"] for r in results["decode"]] == [40, 300]
    for row in results["decode"] + results["prefill"]:
        assert row["max_abs_err"] < 1e-4 and row["ms"] > 0 and row["vs_sdpa"] > 0
    assert any("decode" in line for line in lines) and any("prefill" in line for line in lines)
