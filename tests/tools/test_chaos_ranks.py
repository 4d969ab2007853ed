"""`pagedkv chaos --quick --only ranks` in a subprocess: the stack of real processes, under greedy load, with
executor-1 restarted as a tensor-parallel group of two (rank 0 and its worker, gloo), whose worker rank is then
killed with SIGKILL and paused with SIGSTOP past the group's timeout. Each time the whole group must stop (exit
70) and come back, the gateway send elsewhere meanwhile, no output differ from the clean stack's (served by
single-device executors) and no block stay held."""

from __future__ import annotations

from pathlib import Path

from executor.parallel_runner import EX_GROUP_FAILED
from tests.tools.chaos_run import run_chaos


def test_chaos_rank_faults_stop_the_group_and_lose_nothing(tmp_path: Path) -> None:
    result, context, returncode = run_chaos(tmp_path, "--quick", "--only", "ranks")
    assert result["requests"] > 20, context
    assert result["wrong_outputs"] == 0, context
    assert result["leaked_blocks"] == 0 and result["check"] == "ok", context
    assert result["problems"] == [], context
    for what in ("killed", "paused"):
        assert f"rank 1 of executor-1 {what}: the group exited with {EX_GROUP_FAILED}" in result["notes"], context
    # Restarted as a group (1), then after each rank fault (2).
    assert result["restarts"]["executor-1"] == 3 and result["restarts"]["gateway"] == 0, context
    assert result["restarts"]["executor-0"] == 0, context
    assert "tensor_parallel_group_failed" in (tmp_path / "executor-1.log").read_text()
    assert returncode == 0, context
