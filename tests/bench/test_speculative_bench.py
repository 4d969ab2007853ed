"""`pagedkv bench speculative --quick` end to end: the repeating tiny model, both engines, greedy equal."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from pagedkv.bench.spec_workload import write_repeating_model
from pagedkv.bench.speculative import bench_speculative
from tests.support.models import TINY


def test_quick_run_speculates_with_equal_output(tmp_path: Path) -> None:
    model = write_repeating_model(tmp_path / "repeating", arch="llama", **TINY)
    result = CliRunner().invoke(bench_speculative, ["--quick", "--model", str(model)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert [run["concurrency"] for run in figures["runs"]] == [1, 2]
    for run in figures["runs"]:
        assert run["greedy_equal"] is True
        assert run["output_tokens"] == 2 * 24
        assert run["acceptance_rate"] > 0.5 and run["plain_tok_s"] > 0 and run["spec_tok_s"] > 0
