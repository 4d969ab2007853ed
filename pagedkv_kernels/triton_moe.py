"""The fused mixture-of-experts kernel: every token's top-k experts in one launch (`pagedkv_kernels.moe` calls it).

The tile plan, the fused program and its atomic float32 sum are told in docs/kernels.md ("Mixture of experts").
Import after TRITON_INTERPRET is settled (see pagedkv_kernels.dispatch): `@triton.jit` reads it at decoration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_kernels.heuristics import next_power_of_two
from pagedkv_kernels.triton_offsets import INTERPRETED

if bool(triton.knobs.runtime.interpret) != INTERPRETED:
    # A compiled kernel cannot call interpreted helpers or vice versa; see pagedkv_kernels.dispatch.
    raise ImportError("TRITON_INTERPRET changed between importing pagedkv_kernels.triton_offsets and this module")

ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


@dataclass(frozen=True)
class MoeConfig:
    """Tile sizes and launch options of one call, from shapes only."""

    block_m: int
    block_i: int
    block_k: int
    block_n: int
    num_warps: int
    num_stages: int


def moe_config(num_pairs: int, num_experts: int, hidden: int, inter: int, dtype_bytes: int) -> MoeConfig:
    """Rows per tile near the mean rows per expert (16 in decode, where a tile is mostly padding); chunks of 64
    intermediate columns, 32 when tiles are 16 rows: decode reads each chosen expert once, so more programs per
    expert spread that read over more SMs, while a chunk's x rows and atomic adds cost little there."""
    mean_rows = max(1, num_pairs // num_experts)
    block_m = min(64, max(16, next_power_of_two(mean_rows)))
    block_i = min(32 if block_m == 16 else 64, max(16, next_power_of_two(inter)))
    block_k = min(64, max(16, next_power_of_two(hidden)))
    block_n = min(64, max(16, next_power_of_two(hidden)))
    return MoeConfig(block_m, block_i, block_k, block_n, num_warps=4, num_stages=3 if dtype_bytes == 2 else 2)


@triton.jit
def _fused_experts_kernel(
    hidden_ptr,
    w_gate_up_ptr,
    w_down_ptr,
    b_gate_up_ptr,
    b_down_ptr,
    routing_ptr,
    pairs_ptr,
    tile_experts_ptr,
    acc_ptr,
    hidden_size,
    inter_size,
    num_experts,
    top_k,
    alpha,
    limit,
    stride_x_tok,
    stride_gu_e,
    stride_gu_n,
    stride_gu_k,
    stride_d_e,
    stride_d_n,
    stride_d_k,
    stride_bgu_e,
    stride_bd_e,
    HAS_B_GATE_UP: tl.constexpr,
    HAS_B_DOWN: tl.constexpr,
    ACTIVATION: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (tile, chunk): BLOCK_M pairs of one expert x BLOCK_I intermediate columns, into acc [T, H]."""
    expert = tl.load(tile_experts_ptr + tl.program_id(0))
    if expert >= num_experts:
        return  # a spare tile past the last expert's
    expert = expert.to(tl.int64)  # [E, 2I, H] passes 2**31 elements on the largest models
    chunk = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + offs_m)
    row_ok = pair >= 0  # -1: padding of the expert's last tile
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    offs_i = chunk * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = offs_i < inter_size
    offs_k = tl.arange(0, BLOCK_K)

    x_rows = hidden_ptr + token[:, None] * stride_x_tok
    # The gate rows of this chunk, read as [BLOCK_K, BLOCK_I] tiles (H along dim 0); the up rows are I further.
    gate_cols = w_gate_up_ptr + expert * stride_gu_e + offs_i[None, :].to(tl.int64) * stride_gu_n
    up_cols = w_gate_up_ptr + expert * stride_gu_e + (offs_i[None, :] + inter_size).to(tl.int64) * stride_gu_n
    gate = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < hidden_size
        x = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & i_ok[None, :]
        w_gate = tl.load(gate_cols + kk[:, None] * stride_gu_k, mask=w_mask, other=0.0)
        w_up = tl.load(up_cols + kk[:, None] * stride_gu_k, mask=w_mask, other=0.0)
        if IEEE_DOT:
            gate = tl.dot(x, w_gate, gate, input_precision="ieee")
            up = tl.dot(x, w_up, up, input_precision="ieee")
        else:
            gate = tl.dot(x, w_gate, gate)
            up = tl.dot(x, w_up, up)
    if HAS_B_GATE_UP:
        bias_row = b_gate_up_ptr + expert * stride_bgu_e
        gate += tl.load(bias_row + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_row + inter_size + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]

    if ACTIVATION == 0:  # silu
        act = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:  # gelu, tanh form: 0.5 (1 + tanh(z)) = sigmoid(2 z), 2 z = 2 sqrt(2 / pi) (x + 0.044715 x^3)
        act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate)) * up
    else:  # gpt-oss: clamped SwiGLU
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate * tl.sigmoid(alpha * gate))
    act = tl.where(i_ok[None, :], act, 0.0).to(w_down_ptr.dtype.element_ty)

    routing = tl.load(routing_ptr + pair, mask=row_ok, other=0.0)
    down_rows = w_down_ptr + expert * stride_d_e + offs_i[:, None].to(tl.int64) * stride_d_k
    out_rows = acc_ptr + token[:, None] * hidden_size
    first_chunk = tl.where(chunk == 0, 1.0, 0.0)  # the down bias is added once per pair, by chunk 0
    for n0 in range(0, hidden_size, BLOCK_N):
        nn = n0 + tl.arange(0, BLOCK_N)
        n_ok = nn < hidden_size
        w_d = tl.load(down_rows + nn[None, :] * stride_d_n, mask=i_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE_DOT:
            part = tl.dot(act, w_d, input_precision="ieee")
        else:
            part = tl.dot(act, w_d)
        if HAS_B_DOWN:
            bias = tl.load(b_down_ptr + expert * stride_bd_e + nn, mask=n_ok, other=0.0).to(tl.float32)
            part += (bias * first_chunk)[None, :]
        tl.atomic_add(out_rows + nn[None, :], part * routing[:, None], mask=row_ok[:, None] & n_ok[None, :])


def _plan(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [tiles * block_m] int32, tile_experts [tiles] int32), computed on the device without a sync.

    Pair p = token * k + choice. Each expert's pairs sit in a run of whole tiles (padding -1); `tiles` is the
    static bound cdiv(P, block_m) + min(E, P), the spare tiles naming expert E (nothing to do). An expert id
    out of range (possible only on the GPU, where values are not checked) drops its pair.
    """
    flat = expert_ids.reshape(-1).long()
    num_pairs = flat.numel()
    keyed = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(keyed, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, keyed, torch.ones_like(keyed))
    counts = counts[:num_experts]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    run_begin = (tile_end - tiles) * block_m  # where each expert's run starts in `pairs`
    first_pair = torch.cumsum(counts, 0) - counts  # each expert's first position in `order`
    sorted_keys = keyed[order]
    expert_of = sorted_keys.clamp(max=num_experts - 1)
    num_tiles = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    dump = num_tiles * block_m  # one extra slot that takes the dropped pairs
    rank = torch.arange(num_pairs, device=flat.device) - first_pair[expert_of]
    dest = torch.where(sorted_keys < num_experts, run_begin[expert_of] + rank, dump)
    pairs = torch.full((dump + 1,), -1, dtype=torch.int32, device=flat.device)
    pairs.scatter_(0, dest, order.to(torch.int32))
    tile_ids = torch.arange(num_tiles, device=flat.device)
    tile_experts = torch.searchsorted(tile_end, tile_ids, right=True).to(torch.int32)
    return pairs[:dump], tile_experts


def experts(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None,
    b_down: torch.Tensor | None,
    activation: str,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The routed sum `[T, H]` in float32 (inputs checked by `pagedkv_kernels.moe`)."""
    num_tokens, top_k = expert_ids.shape
    num_experts, two_i, hidden_size = w_gate_up.shape
    inter = two_i // 2
    cfg = moe_config(num_tokens * top_k, num_experts, hidden_size, inter, hidden.element_size())
    pairs, tile_experts = _plan(expert_ids, num_experts, cfg.block_m)
    routing = expert_weights.to(torch.float32).contiguous()
    # The kernel steps along the biases' last dim by 1 (they are small: a copy costs nothing).
    b_gate_up = None if b_gate_up is None else b_gate_up.contiguous()
    b_down = None if b_down is None else b_down.contiguous()
    acc = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    grid = (tile_experts.shape[0], triton.cdiv(inter, cfg.block_i))
    _fused_experts_kernel[grid](
        hidden,
        w_gate_up,
        w_down,
        w_gate_up if b_gate_up is None else b_gate_up,  # any pointer of the right type when absent
        w_down if b_down is None else b_down,
        routing,
        pairs,
        tile_experts,
        acc,
        hidden_size,
        inter,
        num_experts,
        top_k,
        float(alpha),
        float(limit),
        hidden.stride(0),
        *w_gate_up.stride(),
        *w_down.stride(),
        0 if b_gate_up is None else b_gate_up.stride(0),
        0 if b_down is None else b_down.stride(0),
        HAS_B_GATE_UP=b_gate_up is not None,
        HAS_B_DOWN=b_down is not None,
        ACTIVATION=ACTIVATION_CODES[activation],
        IEEE_DOT=hidden.dtype == torch.float32,
        BLOCK_M=cfg.block_m,
        BLOCK_I=cfg.block_i,
        BLOCK_K=cfg.block_k,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return acc
