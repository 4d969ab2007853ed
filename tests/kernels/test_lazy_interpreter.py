"""Triton forced on CPU tensors in a process where Triton was imported before TRITON_INTERPRET was set.

That is the executor's situation (torch imports Triton at startup), unlike this test session, whose conftest sets
TRITON_INTERPRET first; so it runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import os, torch, triton, triton.language  # Triton first, in compiled mode
assert not os.environ.get("TRITON_INTERPRET")
from pagedkv_kernels import dispatch
torch.manual_seed(0)
blocks, bs, hkv, d = 6, 16, 2, 32
k_cache, v_cache = torch.randn(blocks, bs, hkv, d), torch.randn(blocks, bs, hkv, d)
q = torch.randn(3 + 1, 4, d)
tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
starts = torch.tensor([0, 3, 4], dtype=torch.int32)
lens = torch.tensor([20, 40], dtype=torch.int32)
got = dispatch.paged_attention(q, k_cache, v_cache, tables, starts, lens, backend="triton")
want = dispatch.paged_attention(q, k_cache, v_cache, tables, starts, lens, backend="reference")
assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
print("ok")
"""


def test_triton_on_cpu_after_triton_was_imported_in_compiled_mode():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
