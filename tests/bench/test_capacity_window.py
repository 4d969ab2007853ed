"""`pagedkv bench capacity --window`: a Gemma-3-shaped model's KV in layer groups, sliding groups handing back the
blocks behind their window, against every layer allocated in full."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pagedkv.bench.capacity import bench_capacity, make_requests, sample_lengths, simulate_paged


def _requests(count: int = 60):
    return make_requests(sample_lengths(count, max_len=512, seed=1, prompt_median=128, output_median=96), seed=1)


def test_groups_allocated_in_full_hold_what_the_plain_pool_holds() -> None:
    # Six groups of one sixth of the layers each, in six times the blocks: the same bytes, the same schedule.
    plain = simulate_paged(_requests(), num_blocks=128, block_size=8, watermark_blocks=1, check_every=50)
    full = simulate_paged(
        _requests(),
        name="full",
        num_blocks=6 * 128,
        block_size=8,
        watermark_blocks=6,
        windows=[None] * 6,
        check_every=50,
    )
    assert (full.steps, full.preemptions, full.max_active) == (plain.steps, plain.preemptions, plain.max_active)
    assert full.mean_active == plain.mean_active


def test_sliding_groups_hold_more_sequences_in_the_same_bytes() -> None:
    options = dict(num_blocks=6 * 128, block_size=8, watermark_blocks=6, check_every=20)
    full = simulate_paged(_requests(), name="full", windows=[None] * 6, **options)
    window = simulate_paged(_requests(), name="window", windows=[None] + [32] * 5, **options)
    assert window.completed == full.completed == 60
    assert window.mean_active > 2 * full.mean_active
    assert window.preemptions <= full.preemptions


def test_the_command_reports_the_gain() -> None:
    args = ["--requests", "40", "--kv-tokens", "2048", "--max-len", "512", "--block-size", "8", "--window", "32"]
    result = CliRunner().invoke(bench_capacity, [*args, "--prompt-median", "128", "--output-median", "96"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    assert figures["window"] == 32 and figures["sliding_per_global"] == 5
    assert figures["grouped_full_mean_active"] == figures["paged_mean_active"]
    assert figures["grouped_window_vs_full_mean_active"] > 1.5
    assert "holds" in result.output and "every layer allocated in full" in result.output


def test_the_real_executor_holds_more_sequences_in_layer_groups() -> None:
    from pagedkv.bench.capacity_executor import compare

    # The KV bytes of two sequences with every layer in full; the greedy tokens of both runs are compared inside.
    full, grouped = compare(window=16, requests=4, prompt_len=128, output_len=4, block_size=16, full_sequences=2)
    assert full.max_running < grouped.max_running and full.mean_running < grouped.mean_running
    assert grouped.num_blocks == 6 * full.num_blocks  # the same bytes in blocks of one layer, not six
