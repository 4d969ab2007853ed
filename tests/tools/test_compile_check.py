"""The Triton kernels compile for Hopper (sm_90) with the real compiler, no GPU needed.

The interpreter accepts things the GPU compiler rejects (dot shapes, shared-memory limits, types),
so this runs `python -m pagedkv.tools.compile_check` in a fresh process without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv.tools.compile_check", "--arch", "90"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    # Exit 3 would mean no toolchain; the triton wheel this project pins ships ptxas, so that is a failure too.
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") >= 19
