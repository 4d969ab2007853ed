"""The public kernel API: validate once, pick a backend, call it.

Backend choice, first match wins:
1. the call's `backend=` argument when it is not "auto";
2. the environment variable PAGEDKV_KERNELS = triton | reference | auto;
3. auto: Triton for CUDA tensors, the CPU backend (`torch_batched`: its decode rows by the native kernel of
   `cpu_native`, or gathered for SDPA where it does not build) for CPU tensors.

"reference" is the plain per-sequence loop the tests use as their oracle; "torch" differs from it in paged
attention (decode rows batched or native) and, through `pagedkv_kernels.pointwise`, in a KV write fused with the rotary
embedding for float32 CPU tensors (block copy is the same function).

Forcing Triton on CPU tensors runs the kernels under the Triton interpreter. Triton decides between
compiling and interpreting when `@triton.jit` *decorates* a function, i.e. when the kernel module is
imported, from the env var TRITON_INTERPRET. So the Triton modules are imported lazily, on first use:
if the first use is on CPU, TRITON_INTERPRET=1 is set (process-wide) just before the import. Once
imported in compiled mode (a CUDA call came first), CPU tensors cannot be run on Triton in that
process and a RuntimeError says so; set TRITON_INTERPRET=1 before the first call to avoid it.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch

from pagedkv_kernels import quant, reference, torch_batched, validate
from pagedkv_kernels.heuristics import MAX_SPLITS

Backend = Literal["auto", "triton", "torch", "reference"]
BACKEND_ENV = "PAGEDKV_KERNELS"
_BACKENDS = ("auto", "triton", "torch", "reference")


def resolve_backend(backend: str, device: torch.device) -> Literal["triton", "torch", "reference"]:
    """Which implementation runs for tensors on `device`, given the call's `backend` argument and the env."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    choice = backend
    if choice == "auto":
        choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
        if choice not in _BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={choice!r} is not one of {_BACKENDS}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and device.type not in ("cuda", "cpu"):
        raise ValueError(f"the Triton backend runs on CUDA (or CPU via the interpreter), not {device.type}")
    return choice  # type: ignore[return-value]


def triton_module(name: Literal["triton_attention", "triton_cache", "triton_moe"], device: torch.device) -> ModuleType:
    """Import `pagedkv_kernels.<name>`, under the Triton interpreter when the tensors are on the CPU."""
    full_name = f"pagedkv_kernels.{name}"
    if device.type == "cpu" and "pagedkv_kernels.triton_offsets" not in sys.modules:  # imported first by both
        os.environ["TRITON_INTERPRET"] = "1"  # must precede the import: @triton.jit reads it then
    module = importlib.import_module(full_name)
    if device.type == "cpu" and not module.INTERPRETED:
        raise RuntimeError(
            f"{full_name} was imported in compiled (GPU) mode, so its Triton kernels cannot run on CPU tensors "
            "in this process; set TRITON_INTERPRET=1 before the first kernel call to use the interpreter"
        )
    return module


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: Backend = "auto",
    check: bool = True,
) -> None:
    """Scatter new tokens' K and V into one layer's paged caches, in place.

    Args:
        key, value: `[num_tokens, num_kv_heads, head_dim]`, same dtype as the caches, or any model dtype for
            fp8 caches (last dim dense).
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous; float8_e4m3fn or
            float8_e5m2 caches store `key / k_scale` and `value / v_scale` saturated (`quant`).
        slot_mapping: `[num_tokens]` int32/int64; slot = block_id * block_size + offset, -1 = padding
            (that token is skipped and the cache left untouched).
        k_scale, v_scale: the per-tensor scales of fp8 caches (1.0 for any other cache).
        backend: "auto" | "triton" | "torch" | "reference" (see module docstring).
        check: validate the inputs; a caller that already checked this step's metadata (the first of a
            model's layers) may skip it for the rest.
    """
    if check:
        validate.check_write_kv(key, value, key_cache, value_cache, slot_mapping)
    scales = _kv_scales(key_cache.dtype, k_scale, v_scale)
    chosen = resolve_backend(backend, key_cache.device)
    if chosen == "torch":
        torch_batched.write_kv(key, value, key_cache, value_cache, slot_mapping, *scales)
    elif chosen == "reference":
        reference.write_kv(key, value, key_cache, value_cache, slot_mapping, *scales)
    else:
        module = triton_module("triton_cache", key_cache.device)
        module.write_kv(key, value, key_cache, value_cache, slot_mapping, *scales)


def _kv_scales(cache_dtype: torch.dtype, k_scale: float, v_scale: float) -> tuple[float, float]:
    scales = quant.check_scale(k_scale, "k_scale"), quant.check_scale(v_scale, "v_scale")
    if scales != (1.0, 1.0) and not quant.is_fp8(cache_dtype):
        raise ValueError(f"k_scale and v_scale apply to fp8 caches only; this cache is {cache_dtype}")
    return scales


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    backend: Backend = "auto",
    check: bool = True,
) -> torch.Tensor:
    """Attention for a whole scheduler step (prefill chunks and decode tokens mixed) over paged K/V.

    Query token i of a sequence with q_len queries and kv_len total tokens sits at absolute position
    kv_len - q_len + i and attends causally to positions <= that: its cached prefix plus itself and
    earlier new tokens. The new tokens' K/V must already be in the cache (see `write_kv`).

    Args:
        q: `[num_tokens, num_heads, head_dim]`, sequences back to back; num_heads a multiple of num_kv_heads.
        key_cache, value_cache: `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, q's dtype or fp8
            (float8_e4m3fn, float8_e5m2: upcast inside every backend, element * k_scale or * v_scale).
        block_tables: `[num_seqs, max_blocks]` int32 physical block ids per sequence.
        query_start_loc: `[num_seqs + 1]` int32 cumulative query offsets (0, q_len0, q_len0 + q_len1, ...);
            every sequence has at least one query token.
        seq_lens: `[num_seqs]` int32 total KV length per sequence, new tokens included.
        scale: softmax scale; default head_dim ** -0.5.
        out: optional preallocated `[num_tokens, num_heads, head_dim]` output of q's dtype.
        num_splits: Triton only: force the number of KV splits for decode tokens (1 = no
            flash-decoding split); None lets `choose_num_splits` decide. Ignored by the reference.
        sliding_window: a query at position p sees key position k only if p - k < sliding_window (and k <= p),
            as transformers' sliding-window mask. No backend reads a block that lies wholly before the window of
            every query of its sequence, so such blocks may be freed and their table entries reused.
        softcap: logit softcapping (Gemma 2): scores = softcap * tanh(scores * scale / softcap), then the mask.
        sinks: `[num_heads]` float, one learned logit per query head that joins the softmax denominator and
            carries no value (gpt-oss attention sinks).
        k_scale, v_scale: the fp8 caches' per-tensor scales (see `write_kv`); 1.0 for any other cache.
        backend: "auto" | "triton" | "torch" | "reference" (see module docstring).
        check: validate the inputs (see `write_kv`).

    Returns:
        The attention output (`out` if given).
    """
    options = None
    if sliding_window is not None or softcap is not None or sinks is not None:  # kept off the default path
        options = {"sliding_window": sliding_window, "softcap": softcap, "sinks": sinks}
    if check:
        validate.check_paged_attention(
            q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, out, **(options or {})
        )
    elif options is not None:  # per layer: a step's first layer checking its options checks no other's
        validate.check_attention_options(sliding_window, softcap, sinks, q)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    k_scale, v_scale = _kv_scales(key_cache.dtype, k_scale, v_scale)
    # q . (k * k_scale) = (q . k) * k_scale and sum p (v * v_scale) = v_scale * sum p v: the backends see the
    # stored values upcast, the scales folded into the softmax scale and the output.
    scale = scale * k_scale
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS
    ):
        raise ValueError(f"num_splits must be an int in [1, {MAX_SPLITS}] or None, got {num_splits!r}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    chosen = resolve_backend(backend, q.device)
    args = (q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, float(scale), out)
    if chosen == "reference":
        reference.paged_attention(*args, **(options or {}))
    elif chosen == "torch":
        torch_batched.paged_attention(*args, **(options or {}))
    else:
        triton_module("triton_attention", q.device).paged_attention(*args, num_splits, **(options or {}))
    if v_scale != 1.0:
        out.mul_(v_scale)
    return out


def copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor | tuple[Sequence[int], Sequence[int]],
    *,
    backend: Backend = "auto",
) -> None:
    """Copy whole blocks src -> dst in every layer's K and V cache (copy-on-write after a fork), in place.

    Args:
        key_caches, value_caches: one cache per layer, all of one shape, dtype and device.
        block_mapping: `[n, 2]` int64 tensor of (src, dst) rows, or a tuple of two equal-length lists
            (src_ids, dst_ids). Destinations must be distinct and disjoint from the sources.
        backend: "auto" | "triton" | "torch" | "reference" (see module docstring).
    """
    cache, mapping = validate.check_copy_blocks(key_caches, value_caches, block_mapping)
    if resolve_backend(backend, cache.device) != "triton":
        reference.copy_blocks(key_caches, value_caches, mapping)
    else:
        triton_module("triton_cache", cache.device).copy_blocks(key_caches, value_caches, mapping)
