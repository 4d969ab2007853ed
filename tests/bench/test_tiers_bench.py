"""`pagedkv bench tiers`: its infinite-cache reference and percentiles, then one quick run on real processes."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from pagedkv.bench.tiers import BLOCK_SIZE, InfiniteCache, bench_tiers, percentile
from pagedkv.tools.model_gen import write_model
from tests.support.models import TINY


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


def test_a_quick_run_prints_its_table_and_json(tmp_path: Path):
    model = write_model(tmp_path / "model", arch="llama", quiet=True, **TINY)
    out = tmp_path / "tiers.json"
    result = CliRunner().invoke(
        bench_tiers, ["--model", str(model), "--quick", "--configs", "off,host+disk", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert summary["outputs_equal"] is True
    off, tiers = summary["configs"]
    assert off["prefix_hit_rate"] < tiers["prefix_hit_rate"]  # the device alone cannot hold the histories
    assert tiers["hit_rate_of_infinite"] >= 0.9
    assert tiers["executor_tiers"]["loads_disk"] > 0 and tiers["executor_tiers"]["spills"] > 0
    assert "config" in result.output and "host+disk" in result.output
