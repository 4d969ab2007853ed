"""`pagedkv chaos --quick --only faults` in a subprocess (the load phase is test_chaos_load.py's): a stack of real
processes (redis-server, blockd, two executors, a gateway), authenticated (CURVE keys for every service, an API key
for the gateway), under greedy load through kills, pauses, a duplicated pool id, cross-pool steps, peers without
keys, malformed frames and the gateway battery; its last line is one JSON object, which must show every aim met."""

from __future__ import annotations

from pathlib import Path

from tests.tools.chaos_run import run_chaos


def test_chaos_quick_keeps_every_output_right(tmp_path: Path) -> None:
    result, context, returncode = run_chaos(tmp_path, "--quick", "--only", "faults", timeout_s=900)
    assert result["requests"] > 50, context
    assert result["wrong_outputs"] == 0, context
    assert result["leaked_blocks"] == 0, context
    assert result["check"] == "ok", context
    assert result["problems"] == [], context
    assert result["unclear_errors"] == 0, context
    # An executor killed under a stream it serves (and under the load's streams) cuts none: they go on elsewhere.
    cuts = result["cut_after_text_by_scenario"]
    assert cuts["kill -9 executor-0"] == 0 and cuts["kill -9 executor-1"] == 0, context
    assert result["blockd_frames"] >= 2_000 and result["executor_frames"] >= 4_000, context
    assert result["slowest_blockd_reply_s"] < 1.0, context
    # The authenticated stack: peers without keys got no answer; keys of the wrong role and missing or wrong API
    # keys were refused with a clear error.
    battery = result["battery"]
    assert result["attacks_unanswered"] >= 3 * 200, context
    assert battery.get("HTTP no API key -> 401") == 2 and battery.get("HTTP a wrong API key -> 401") == 2, context
    assert battery.get("gateway key Step at blockd: forbidden") == 1, context
    assert battery.get("cross-pool pool-executor-1 forbidden", 0) >= 5, context
    assert any(note.startswith("peers without keys:") and note.endswith(", 0 answered") for note in result["notes"])
    assert returncode == 0, context
