"""Linear layers on the CPU through oneDNN with the weight packed once at load (vLLM's CPU build does the same
with its own oneDNN matmul): MKL's sgemm on the row-major weight re-packs it inside every call, which at decode
batch sizes costs more than the product itself.

`pack(weight)` returns the packed copy, or None where the plain `F.linear` is to run (not a CPU tensor, a dtype
oneDNN does not take here, oneDNN missing, or PAGEDKV_CPU_LINEAR=torch); `linear(x, weight, bias, packed)` uses
whichever it is given. The plain weight stays: tied embeddings, tensor-parallel loading and the fallback read it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

CHOICE_ENV = "PAGEDKV_CPU_LINEAR"
CHOICES = ("auto", "onednn", "torch")
_DTYPES = (torch.float32, torch.bfloat16)


def choice() -> str:
    value = os.environ.get(CHOICE_ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{CHOICE_ENV}={value!r} is not one of {CHOICES}")
    return value


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed form of `weight` [out, in], or None where `linear` is to run the plain product."""
    wanted = choice()
    if wanted == "torch" or weight.device.type != "cpu" or weight.dtype not in _DTYPES or weight.dim() != 2:
        return None
    if not available():
        if wanted == "onednn":
            raise RuntimeError(f"{CHOICE_ENV}=onednn, but this torch build has no oneDNN (mkldnn) linear ops")
        return None
    with torch.inference_mode():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias, through `packed` when `pack` made one (x in weight's dtype, as F.linear needs)."""
    if packed is None or x.dtype != weight.dtype or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
