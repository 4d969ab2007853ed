"""FP8 KV caches: the `--kv-cache-dtype` names, and the one quantize / dequantize rule every backend follows.

A block of an fp8 cache holds `x / scale` rounded to nearest-even in float8_e4m3fn or float8_e5m2, saturated to
the format's largest finite value (e4m3fn has no infinity, and an e5m2 infinity would poison every score), so a
stored element reads back as `float(stored) * scale`. One scale per tensor: `k_scale` for every key cache,
`v_scale` for every value cache; 1.0 unless calibrated, as vLLM without calibration data.
"""

from __future__ import annotations

import torch

#: `--kv-cache-dtype` spellings (vLLM's): auto = the model's dtype; fp8 = fp8_e4m3.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES: tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype `--kv-cache-dtype name` gives a model computing in `model_dtype`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 format (448 for e4m3fn, 57344 for e5m2): the saturation bound."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`x / scale` in `dtype`, saturated to its finite range (NaN stays NaN)."""
    bound = fp8_max(dtype)
    return (x.to(torch.float32) / scale).clamp(-bound, bound).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What an fp8 tensor stands for, in `dtype`: `float(x) * scale`."""
    return x.to(dtype) * scale


def check_scale(value: object, name: str) -> float:
    """A KV scale as a float: finite and > 0, else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
    return float(value)
