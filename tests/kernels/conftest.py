"""Kernel tests run the Triton kernels under the Triton interpreter on CPU tensors.

`@triton.jit` decides between compiling and interpreting when it decorates, from TRITON_INTERPRET,
so the variable is set here, at conftest import, before any test module imports a Triton kernel.
pytest imports every collected conftest before running tests, so this holds for the whole pytest
process. That suits the other tests that touch Triton: the engine test that forces the Triton backend
(tests/executor/test_engine.py) runs it on CPU tensors too, and tests/tools/test_compile_check.py compiles in a
child process without the variable.

On a machine with a GPU, `PAGEDKV_TEST_DEVICE=cuda pytest tests/kernels` instead runs the same tests
on CUDA tensors with compiled kernels (and adds bfloat16, which the interpreter computes wrongly).
"""

import os

import pytest

if os.environ.get("PAGEDKV_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def native(monkeypatch):
    """The native CPU kernels' library, chosen for the test (a build failure fails it)."""
    from pagedkv_kernels import cpu_native

    monkeypatch.setenv(cpu_native.CHOICE_ENV, "native")
    lib = cpu_native.library()
    assert lib is not None
    return lib
