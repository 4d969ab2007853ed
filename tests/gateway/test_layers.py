"""The gateway is a thin, torch-free process: importing any of its modules must not load torch."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import gateway

# Every module of the gateway package, each imported in a fresh interpreter (an earlier import in this test
# process could hide the one that pulls torch in).
ROOT = Path(__file__).resolve().parents[2]  # the repository: "-c" imports from the working directory
PROGRAM = """
import importlib, pkgutil, sys
import gateway
names = [f"gateway.{m.name}" for m in pkgutil.iter_modules(gateway.__path__)]
for name in names:
    importlib.import_module(name)
    heavy = sorted(m for m in ("torch", "transformers", "pagedkv_kernels", "triton") if m in sys.modules)
    assert not heavy, f"importing {name} loaded {heavy}"
print(len(names))
"""


def test_no_gateway_module_imports_torch() -> None:
    result = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) == len(list(pkgutil.iter_modules(gateway.__path__))) > 5
