"""Mixture-of-experts feed-forward: each token through its top-k experts, weighted and summed.

`experts()` is the public call; the backends ("torch", "triton", "reference"), the maths and the numerics are in
docs/kernels.md, "Mixture of experts".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F

from pagedkv_kernels import dispatch, pointwise
from pagedkv_kernels import linear as cpu_linear

Activation = Literal["silu", "gelu_tanh", "swiglu_oai"]
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh", "swiglu_oai")
# gpt-oss's clamped SwiGLU: its config's swiglu_alpha and swiglu_limit defaults.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0

MOE_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def experts(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    activation: Activation = "silu",
    alpha: float = SWIGLU_ALPHA,
    limit: float = SWIGLU_LIMIT,
    backend: dispatch.Backend = "auto",
    out: torch.Tensor | None = None,
    packed: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
) -> torch.Tensor:
    """The routed experts' weighted sum for every token: `[T, H]` in hidden's dtype (`out` if given).

    Args:
        hidden: `[T, H]` float16 / bfloat16 / float32 (float64 too off Triton); rows may be strided.
        expert_ids: `[T, k]` int32/int64, each in [0, E). Checked on CPU tensors only (a GPU check would sync);
            on the GPU the Triton kernel skips an out-of-range choice.
        expert_weights: `[T, k]` floating (float32 is what routers give), the routing weight of each choice.
        w_gate_up: `[E, 2I, H]`, hidden's dtype: gate rows [0, I), up rows [I, 2I) (de-interleaved).
        w_down: `[E, H, I]`, hidden's dtype.
        b_gate_up, b_down: optional biases `[E, 2I]` and `[E, H]` (gpt-oss), hidden's dtype.
        activation: "silu": silu(gate) * up (Mixtral, Qwen3-MoE); "gelu_tanh": gelu(gate, tanh form) * up;
            "swiglu_oai" (gpt-oss): gate clamped to <= limit, up to [-limit, limit],
            (up + 1) * gate * sigmoid(alpha * gate).
        alpha, limit: the swiglu_oai constants (ignored by the other activations).
        backend: "auto" | "triton" | "torch" | "reference" (see `pagedkv_kernels.dispatch`).
        out: optional `[T, H]` output of hidden's dtype on its device; may be `hidden` itself.
        packed: per expert, its gate_up and down weights as `pagedkv_kernels.linear.pack` gave them (the CPU path's
            matmuls then run on those); None: the plain weights.
    """
    _check(hidden, expert_ids, expert_weights, w_gate_up, w_down, b_gate_up, b_down, activation, alpha, limit, out)
    if packed is not None and len(packed) != w_gate_up.shape[0]:
        raise ValueError(f"packed holds {len(packed)} experts' weights, w_gate_up {w_gate_up.shape[0]}")
    if out is None:
        out = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    if hidden.shape[0] == 0:
        return out
    chosen = dispatch.resolve_backend(backend, hidden.device)
    args = (hidden, expert_ids, expert_weights, w_gate_up, w_down, b_gate_up, b_down, activation, alpha, limit)
    if chosen == "triton":
        if hidden.dtype == torch.float64:
            raise TypeError("the Triton MoE kernel takes float16, bfloat16 or float32, not float64")
        acc = dispatch.triton_module("triton_moe", hidden.device).experts(*args)
    elif chosen == "torch":
        acc = _grouped(*args, packed)
    else:
        acc = _per_token(*args)
    return out.copy_(acc)


def activate(gate_up: torch.Tensor, activation: Activation, alpha: float, limit: float) -> torch.Tensor:
    """act(gate, up) of `[rows, 2I]` (gate the first half) -> `[rows, I]`, in gate_up's dtype."""
    if activation == "silu":
        return pointwise.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def _accumulator_dtype(hidden: torch.Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def _grouped(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None,
    b_down: torch.Tensor | None,
    activation: Activation,
    alpha: float,
    limit: float,
    packed: Sequence[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
) -> torch.Tensor:
    """Pairs sorted by expert; per chosen expert, its rows gathered, two matmuls, a weighted scatter-add.

    Per expert, not over all T x k pairs at once, so no `[T k, H]` buffer is made (512 MB for a prefill chunk
    of 8k tokens x top-8 x 2048 in float32). Returns float32 (float64 for float64 inputs) `[T, H]`."""
    num_tokens, top_k = expert_ids.shape
    acc_dtype = _accumulator_dtype(hidden)
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    rows = order // top_k  # the token of each sorted pair
    routing = expert_weights.reshape(-1)[order].to(acc_dtype)
    acc = torch.zeros(num_tokens, hidden.shape[1], dtype=acc_dtype, device=hidden.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        seg = slice(start, start + count)
        packed_gate_up, packed_down = (None, None) if packed is None else packed[e]
        x = hidden.index_select(0, rows[seg])
        gate_up = cpu_linear.linear(x, w_gate_up[e], None if b_gate_up is None else b_gate_up[e], packed_gate_up)
        act = activate(gate_up.to(acc_dtype), activation, alpha, limit).to(w_down.dtype)
        y = cpu_linear.linear(act, w_down[e], None if b_down is None else b_down[e], packed_down).to(acc_dtype)
        acc.index_add_(0, rows[seg], y.mul_(routing[seg, None]))
        start += count
    return acc


def _per_token(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None,
    b_down: torch.Tensor | None,
    activation: Activation,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The definition, token by token and choice by choice, every operand upcast first: the oracle."""
    acc_dtype = _accumulator_dtype(hidden)
    acc = torch.zeros(hidden.shape, dtype=acc_dtype, device=hidden.device)
    for t in range(hidden.shape[0]):
        x = hidden[t].to(acc_dtype)
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            gate_up = w_gate_up[e].to(acc_dtype) @ x
            if b_gate_up is not None:
                gate_up = gate_up + b_gate_up[e].to(acc_dtype)
            y = w_down[e].to(acc_dtype) @ activate(gate_up[None], activation, alpha, limit)[0]
            if b_down is not None:
                y = y + b_down[e].to(acc_dtype)
            acc[t] += expert_weights[t, j].to(acc_dtype) * y
    return acc


def _check(
    hidden: object,
    expert_ids: object,
    expert_weights: object,
    w_gate_up: object,
    w_down: object,
    b_gate_up: object,
    b_down: object,
    activation: object,
    alpha: object,
    limit: object,
    out: object,
) -> None:
    """Shapes, dtypes, devices and constants; expert ids in range when they are on the CPU."""
    hidden = _tensor(hidden, "hidden", 2, "[T, H]")
    if hidden.dtype not in MOE_DTYPES:
        raise TypeError(f"hidden must be one of {MOE_DTYPES}, got {hidden.dtype}")
    if hidden.stride(-1) != 1:
        raise ValueError("hidden must be dense along H (stride 1 in its last dim)")
    num_tokens, h = hidden.shape
    expert_ids = _tensor(expert_ids, "expert_ids", 2, "[T, k]")
    if expert_ids.dtype not in _INDEX_DTYPES:
        raise TypeError(f"expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if expert_ids.shape[0] != num_tokens or expert_ids.shape[1] < 1:
        raise ValueError(f"expert_ids must be [T={num_tokens}, k>=1], got {list(expert_ids.shape)}")
    top_k = expert_ids.shape[1]
    expert_weights = _tensor(expert_weights, "expert_weights", 2, "[T, k]")
    if not expert_weights.dtype.is_floating_point:
        raise TypeError(f"expert_weights must be floating point, got {expert_weights.dtype}")
    if tuple(expert_weights.shape) != (num_tokens, top_k):
        raise ValueError(f"expert_weights must be [T={num_tokens}, k={top_k}], got {list(expert_weights.shape)}")
    w_gate_up = _tensor(w_gate_up, "w_gate_up", 3, "[E, 2I, H]")
    num_experts, two_i, w_h = w_gate_up.shape
    if num_experts < 1 or two_i < 2 or two_i % 2 or w_h != h:
        raise ValueError(f"w_gate_up must be [E>=1, 2I (even, >=2), H={h}], got {list(w_gate_up.shape)}")
    inter = two_i // 2
    w_down = _tensor(w_down, "w_down", 3, "[E, H, I]")
    if tuple(w_down.shape) != (num_experts, h, inter):
        raise ValueError(f"w_down must be [E={num_experts}, H={h}, I={inter}], got {list(w_down.shape)}")
    named = {"w_gate_up": w_gate_up, "w_down": w_down}
    for name, bias, shape in (("b_gate_up", b_gate_up, (num_experts, two_i)), ("b_down", b_down, (num_experts, h))):
        if bias is not None:
            bias = _tensor(bias, name, len(shape), f"[{', '.join(map(str, shape))}]")
            if tuple(bias.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)}, got {list(bias.shape)}")
            named[name] = bias
    if out is not None:
        out = _tensor(out, "out", 2, "[T, H]")
        if tuple(out.shape) != (num_tokens, h):
            raise ValueError(f"out must be [T={num_tokens}, H={h}], got {list(out.shape)}")
        named["out"] = out
    for name, t in named.items():
        if t.dtype != hidden.dtype:
            raise TypeError(f"{name} must have hidden's dtype {hidden.dtype}, got {t.dtype}")
    named.update(expert_ids=expert_ids, expert_weights=expert_weights)
    for name, t in named.items():
        if t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device}, hidden on {hidden.device}: all must be on one device")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, value in (("alpha", alpha), ("limit", limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite float, got {value!r}")
    if limit <= 0:  # type: ignore[operator]
        raise ValueError(f"limit must be positive, got {limit!r}")
    if hidden.device.type == "cpu" and num_tokens > 0:
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= num_experts:
            bad = lo if lo < 0 else hi
            raise ValueError(f"expert_ids must lie in [0, {num_experts}), found {bad}")


def _tensor(x: object, name: str, ndim: int, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {list(x.shape)}")
    return x
