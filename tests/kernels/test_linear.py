"""`pagedkv_kernels.linear`: the product on oneDNN-packed weights against a float64 reference on random shapes (decode
rows, prefill chunks, sizes off any tile), with and without bias; the choices PAGEDKV_CPU_LINEAR gives; and the
fallback where a weight does not pack."""

from __future__ import annotations

import pytest
import torch

from pagedkv_kernels import linear as cpu_linear


def _random(seed: int, rows: int, inp: int, out: int, dtype: torch.dtype, bias: bool):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inp, generator=gen, dtype=torch.float64)
    w = torch.randn(out, inp, generator=gen, dtype=torch.float64) * inp**-0.5
    b = torch.randn(out, generator=gen, dtype=torch.float64) if bias else None
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)


@pytest.mark.parametrize("rows", [0, 1, 3, 16, 77, 300])
@pytest.mark.parametrize("inp, out", [(64, 96), (100, 37), (256, 1024)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_float64_reference(rows, inp, out, dtype, tol, bias):
    x, w, b = _random(rows * 7 + inp + out, rows, inp, out, dtype, bias)
    packed = cpu_linear.pack(w)
    assert packed is not None
    got = cpu_linear.linear(x, w, b, packed)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert got.dtype == dtype and got.shape == (rows, out)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_strided_input_and_weight():
    x, w, _ = _random(5, 9, 48, 40, torch.float32, False)
    wide = torch.cat([x, x], dim=1)[:, :48]  # rows not contiguous
    strided_w = w.T.contiguous().T
    got = cpu_linear.linear(wide, strided_w, None, cpu_linear.pack(strided_w))
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, atol=2e-5, rtol=2e-5)


def test_choice_torch_and_unpackable_weights_fall_back(monkeypatch):
    x, w, b = _random(1, 4, 32, 16, torch.float32, True)
    monkeypatch.setenv(cpu_linear.CHOICE_ENV, "torch")
    assert cpu_linear.pack(w) is None
    torch.testing.assert_close(cpu_linear.linear(x, w, b, None), torch.nn.functional.linear(x, w, b))
    monkeypatch.setenv(cpu_linear.CHOICE_ENV, "onednn")
    assert cpu_linear.pack(w.double()) is None  # float64: oneDNN takes float32 and bfloat16 here
    assert cpu_linear.pack(w) is not None


def test_bad_choice_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_linear.CHOICE_ENV, "fast")
    with pytest.raises(ValueError, match="PAGEDKV_CPU_LINEAR='fast'"):
        cpu_linear.pack(torch.zeros(4, 4))
