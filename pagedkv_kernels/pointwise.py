"""The per-token steps around attention: residual add + RMSNorm, SiLU x up, rotary embedding + KV-cache write;
and greedy sampling's argmax over each row of logits.

Each has one torch form (any device, any dtype: the reference the model used to inline) and, for float32 CPU
tensors, a fused native one (`cpu_native`: one pass over the rows where torch makes several, and one call
where it makes a dozen dispatches). The native forms compute the same formulas in float32; only the order of the
sums in the norm differs, so results agree to float32 rounding (tests/kernels/test_pointwise.py).
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from pagedkv_kernels import cpu_native, dispatch


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return cpu_native.library()
    return None


def add_rms_norm(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, RMSNorm of it x weight), the norm in float32. The native form adds in place."""
    lib = _native(residual, weight) if residual.is_contiguous() else None
    if lib is not None and (delta is None or (delta.dtype == torch.float32 and delta.is_contiguous())):
        return residual, cpu_native.add_rms_norm(lib, residual, delta, weight, eps)
    if delta is not None:
        residual = residual + delta
    x32 = residual.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return residual, weight * x32.to(residual.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, where gate and up are the two halves of the last dim."""
    lib = _native(gate_up) if gate_up.is_contiguous() else None
    if lib is not None:
        return cpu_native.silu_mul(lib, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [rows] (int64; the first of equal maxima, a NaN counting as largest), as torch.argmax."""
    lib = _native(logits) if logits.is_contiguous() and logits.dim() == 2 and logits.shape[1] > 0 else None
    if lib is not None:
        return cpu_native.argmax(lib, logits)
    return torch.argmax(logits, dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding, rotate-half form: x [T, heads, d], cos and sin [T, 1, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: dispatch.Backend = "auto",
    check: bool = True,
) -> torch.Tensor:
    """Split qkv [T, (heads + 2 kv_heads) d], rotate q and k by each token's position (cos/sin tables
    [max_position, d]), write k and v into the caches at `slot_mapping`; the rotated q [T, heads, d], contiguous.
    An fp8 cache (`quant`) takes the torch form, whose `write_kv` quantizes with `k_scale` / `v_scale`."""
    _, _, kv_heads, head_dim = key_cache.shape
    tokens = qkv.shape[0]
    lib = _native(qkv, key_cache, cos_table) if dispatch.resolve_backend(backend, qkv.device) == "torch" else None
    if lib is not None and qkv.is_contiguous() and (k_scale, v_scale) == (1.0, 1.0):
        return cpu_native.rope_write_kv(
            lib, qkv, positions, cos_table, sin_table, slot_mapping, key_cache, value_cache, num_heads
        )
    q, k, v = qkv.split((num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    cos = cos_table[positions].unsqueeze(1).to(qkv.dtype)
    sin = sin_table[positions].unsqueeze(1).to(qkv.dtype)
    q = rotate(q.view(tokens, num_heads, head_dim), cos, sin)
    k = rotate(k.view(tokens, kv_heads, head_dim), cos, sin)
    v = v.reshape(tokens, kv_heads, head_dim)
    dispatch.write_kv(
        k, v, key_cache, value_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale, backend=backend, check=check
    )
    return q.contiguous()
