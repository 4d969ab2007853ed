"""`pagedkv bench capacity --kv-cache-dtype fp8`: the paged scheduler again with twice the blocks in the same bytes."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pagedkv.bench.capacity import bench_capacity


def test_fp8_row_holds_more_sequences_in_the_same_bytes():
    args = ["--quick", "--requests", "150", "--kv-tokens", "8192", "--max-len", "2048", "--kv-cache-dtype", "fp8"]
    result = CliRunner().invoke(bench_capacity, args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert any(line.startswith("paged_fp8") for line in lines)  # its table row
    assert figures["paged_fp8_completed"] == 150
    assert figures["kv_cache_dtype"] == "fp8"
    # Twice the blocks: about twice the sequences while memory limits the batch (fewer preemptions too).
    assert 1.6 <= figures["fp8_vs_auto_mean_active"] <= 2.2, figures
    assert figures["paged_fp8_preemptions"] <= figures["paged_preemptions"]
    assert "paged fp8 (fp8, 2x the blocks in the same bytes) holds" in result.stdout


def test_without_the_flag_there_is_no_fp8_row():
    result = CliRunner().invoke(
        bench_capacity, ["--quick", "--requests", "40", "--kv-tokens", "8192", "--max-len", "2048"]
    )
    assert result.exit_code == 0, result.output
    assert "fp8_vs_auto_mean_active" not in json.loads(result.stdout.strip().splitlines()[-1])
