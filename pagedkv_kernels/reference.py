"""Plain-torch twins of the Triton kernels: the CPU backend and the oracle the kernels are tested against.

Written for clarity, not speed: one Python loop over sequences, math in float32 (float64 when given
float64 inputs, which is how the tests build their high-precision oracle). Inputs are assumed to be
validated already (see `pagedkv_kernels.validate`); these functions do not check them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv_kernels import quant


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half types are upcast so the softmax and the sums happen in at least float32, like the kernels.
    return torch.promote_types(dtype, torch.float32)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Scatter token i's K/V into slot `slot_mapping[i]` of the caches; slot -1 is padding and skipped. An fp8
    cache gets them quantized (`pagedkv_kernels.quant`)."""
    if quant.is_fp8(key_cache.dtype):
        key, value = quant.quantize(key, key_cache.dtype, k_scale), quant.quantize(value, value_cache.dtype, v_scale)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    flat_k = key_cache.view(-1, *key_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k[slots[keep]] = key[keep]
    flat_v[slots[keep]] = value[keep]


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int, first_block: int = 0) -> torch.Tensor:
    """Tokens [first_block * block_size, kv_len) of one sequence's paged cache, as a contiguous
    `[tokens, num_kv_heads, head_dim]`; the table entries before `first_block` are not read."""
    block_size = cache.shape[1]
    num_blocks = -(-kv_len // block_size)
    blocks = block_table_row[first_block:num_blocks].to(torch.int64)
    return cache[blocks].reshape(-1, *cache.shape[2:])[: kv_len - first_block * block_size]


def first_visible(kv_len: int, q_len: int, sliding_window: int | None) -> int:
    """The lowest key position any of a sequence's q_len queries sees (its first query sits at kv_len - q_len);
    blocks wholly before it are never read, so they may have been freed."""
    if sliding_window is None:
        return 0
    return max(0, kv_len - q_len - sliding_window + 1)


def softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's logit softcapping of already scaled scores: softcap * tanh(scores / softcap)."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged K/V; writes into and returns `out`.

    Query token i of a sequence with q_len queries and kv_len cached tokens sits at absolute position
    p = kv_len - q_len + i and sees positions k <= p (and p - k < sliding_window). Scores are
    `softcapped(q . k * scale)`; a head's sink logit joins its softmax denominator (see `pagedkv_kernels.dispatch`).
    """
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    group = q.shape[1] // num_kv_heads
    dtype = _compute_dtype(q.dtype)
    starts = query_start_loc.tolist()
    for seq, kv_len in enumerate(seq_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        q_len = end - begin
        if q_len == 0:
            continue
        first_block = first_visible(kv_len, q_len, sliding_window) // block_size
        k = gather_kv(key_cache, block_tables[seq], kv_len, first_block).to(dtype)  # [kv, hkv, d]
        v = gather_kv(value_cache, block_tables[seq], kv_len, first_block).to(dtype)
        qs = q[begin:end].to(dtype).view(q_len, num_kv_heads, group, -1)  # group heads share one kv head
        scores = softcapped(torch.einsum("qhgd,khd->hgqk", qs, k) * scale, softcap)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device).view(-1, 1)
        k_pos = torch.arange(first_block * block_size, kv_len, device=q.device).view(1, -1)
        visible = k_pos <= q_pos  # [q, kv]
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # the sink as one more column of the softmax, dropped after it
            sink = sinks.to(dtype).view(num_kv_heads, group, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        o = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(q_len, q.shape[1], -1)
        out[begin:end] = o.to(out.dtype)
    return out


def copy_blocks(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copy block `src` to block `dst` for every `[src, dst]` row, in every layer's K and V."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*key_caches, *value_caches):
        cache[dst] = cache[src]  # gathers all sources before writing, so the pairs act simultaneously
