"""Backend choice: CPU tensors -> reference, CUDA -> Triton, and the argument/env switch forcing either."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedkv_kernels
from pagedkv_kernels import dispatch, reference, torch_batched
from tests.kernels.paged_case import make_batch, needs_interpreter

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(dispatch.BACKEND_ENV, raising=False)


def test_auto_follows_the_device():
    assert dispatch.resolve_backend("auto", CPU) == "torch"
    assert dispatch.resolve_backend("auto", CUDA) == "triton"


def test_argument_forces_a_backend_and_beats_the_env(monkeypatch):
    assert dispatch.resolve_backend("triton", CPU) == "triton"
    assert dispatch.resolve_backend("reference", CUDA) == "reference"
    monkeypatch.setenv(dispatch.BACKEND_ENV, "reference")
    assert dispatch.resolve_backend("triton", CPU) == "triton"


@pytest.mark.parametrize(
    "env, want_cpu, want_cuda",
    [
        ("triton", "triton", "triton"),
        ("reference", "reference", "reference"),
        ("auto", "torch", "triton"),
        (" Triton ", "triton", "triton"),
        ("", "torch", "triton"),
        ("torch", "torch", "torch"),
    ],
)
def test_env_var_switch(monkeypatch, env, want_cpu, want_cuda):
    monkeypatch.setenv(dispatch.BACKEND_ENV, env)
    assert dispatch.resolve_backend("auto", CPU) == want_cpu
    assert dispatch.resolve_backend("auto", CUDA) == want_cuda


def test_bad_switch_values(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        dispatch.resolve_backend("cuda", CPU)
    monkeypatch.setenv(dispatch.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="PAGEDKV_KERNELS"):
        dispatch.resolve_backend("auto", CPU)
    with pytest.raises(ValueError, match="Triton backend"):
        dispatch.resolve_backend("triton", torch.device("meta"))


def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@needs_interpreter
@pytest.mark.parametrize("how", ["auto", "argument", "env"])
def test_calls_reach_the_chosen_implementation(monkeypatch, how):
    batch = make_batch(
        [(2, 9)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8, dtype=torch.float32, device=CPU
    )
    triton_attention = dispatch.triton_module("triton_attention", CPU)
    torch_calls = _spy(monkeypatch, torch_batched, "paged_attention")
    tri_calls = _spy(monkeypatch, triton_attention, "paged_attention")
    backend = "triton" if how == "argument" else "auto"
    if how == "env":
        monkeypatch.setenv(dispatch.BACKEND_ENV, "triton")
    pagedkv_kernels.paged_attention(*batch.args(), backend=backend)
    assert (torch_calls, tri_calls) == (([], ["paged_attention"]) if how != "auto" else (["paged_attention"], []))


@needs_interpreter
def test_cache_ops_dispatch_too(monkeypatch):
    triton_cache = dispatch.triton_module("triton_cache", CPU)
    ref_calls = _spy(monkeypatch, reference, "write_kv")
    torch_calls = _spy(monkeypatch, torch_batched, "write_kv")
    tri_calls = _spy(monkeypatch, triton_cache, "write_kv")
    cache = torch.zeros(2, 8, 1, 64)
    kv = torch.ones(1, 1, 64)
    pagedkv_kernels.write_kv(kv, kv, cache, cache.clone(), torch.tensor([3]))
    pagedkv_kernels.write_kv(kv, kv, cache, cache.clone(), torch.tensor([3]), backend="reference")
    pagedkv_kernels.write_kv(kv, kv, cache, cache.clone(), torch.tensor([3]), backend="triton")
    assert ref_calls == ["write_kv"] and torch_calls == ["write_kv"] and tri_calls == ["write_kv"]


@needs_interpreter
def test_compiled_triton_module_refuses_cpu_tensors(monkeypatch):
    module = dispatch.triton_module("triton_attention", CPU)
    monkeypatch.setattr(module, "INTERPRETED", False)  # as if a CUDA call had imported it first
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.triton_module("triton_attention", CPU)


def test_importing_the_package_does_not_import_triton():
    # Importing triton would freeze the compile/interpret choice before dispatch can make it.
    code = "import sys, kernels; assert not [m for m in sys.modules if m.split('.')[0] == 'triton']"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
