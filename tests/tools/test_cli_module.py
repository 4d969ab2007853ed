"""`python -m pagedkv.cli` runs the CLI (it used to import the module and exit 0 without doing anything)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_m_pagedkv_cli_runs_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "serve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "Usage:" in result.stdout and "--tool-call-parser" in result.stdout


def test_python_m_pagedkv_cli_fails_on_an_unknown_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "no-such-command"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "No such command" in result.stderr
