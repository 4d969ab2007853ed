"""`pagedkv bench tensor-parallel` end to end on a tiny model: TP=1 and TP=2 executors, real processes."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pagedkv.bench.tensor_parallel import bench_tensor_parallel
from pagedkv.tools.model_gen import write_model
from tests.support.models import TINY


def test_reports_tok_s_collectives_and_equal_outputs(tmp_path):
    model = write_model(tmp_path / "tiny", arch="llama", quiet=True, **TINY)
    args = ["--model", str(model), "--sizes", "1,2", "--requests", "3", "--prompt-len", "9", "--max-tokens", "4"]
    result = CliRunner().invoke(bench_tensor_parallel, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    one, two = report["results"]
    assert report["same_outputs"] is True
    assert one["exit_code"] == two["exit_code"] == 0  # SIGTERM stops a group cleanly
    assert one["tensor_parallel_size"] == 1 and "collective_s" not in one
    assert two["output_tokens"] == one["output_tokens"] == 12
    assert two["steps"] > 0 and 0 < two["collective_s"] <= two["step_s"]
