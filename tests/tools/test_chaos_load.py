"""`pagedkv chaos --only load` in a subprocess, short: the stack of real processes (redis-server, blockd, two
executors, a gateway with a short --executor-timeout and --max-queue-delay) under arrivals at 3x its measured
capacity, then with executor-0 restarted so that one of its steps stalls for twice the gateway's executor timeout.
No accepted request may fail (a refusal is only a 429 before the request started), no output differ from the clean
stack's, no block stay held, and the stalled executor must stay in rotation."""

from __future__ import annotations

from pathlib import Path

from tests.tools.chaos_run import run_chaos


def test_chaos_load_fails_no_accepted_request(tmp_path: Path) -> None:
    result, context, returncode = run_chaos(tmp_path, "--only", "load", "--overload-seconds", "6")
    scenarios = result["load_scenarios"]
    assert sorted(scenarios) == ["overload 3x for 6 s", "step stalled 4 s (2x timeout)"], context
    for scenario in scenarios.values():
        assert scenario["accepted_failed"] == 0, context
        assert scenario["wrong_outputs"] == 0, context
        assert scenario["leaked_blocks"] == 0, context
        assert scenario["ok"] == scenario["accepted"] > 0, context
    assert any(note.startswith("stalled step: executor-0's step 3 stalled for 4 s") for note in result["notes"])
    assert result["restarts"]["executor-0"] == 1 and result["restarts"]["gateway"] == 0, context
    assert result["problems"] == [] and result["check"] == "ok", context
    assert returncode == 0, context
