"""Plain-torch twins of the Triton kernels: the CPU backend and the oracle the kernels are tested against.

Written for clarity, not speed: one Python loop over sequences, math in float32 (float64 when given
float64 inputs, which is how the tests build their high-precision oracle). Inputs are assumed to be
validated already (see `kernels.validate`); these functions do not check them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half types are upcast so the softmax and the sums happen in at least float32, like the kernels.
    return torch.promote_types(dtype, torch.float32)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter token i's K/V into slot `slot_mapping[i]` of the caches; slot -1 is padding and skipped."""
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    flat_k = key_cache.view(-1, *key_cache.shape[2:])  # [num_slots, num_kv_heads, head_dim]
    flat_v = value_cache.view(-1, *value_cache.shape[2:])
    flat_k[slots[keep]] = key[keep]
    flat_v[slots[keep]] = value[keep]


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    """One sequence's first `kv_len` tokens of a paged cache, as a contiguous `[kv_len, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    num_blocks = -(-kv_len // block_size)
    blocks = block_table_row[:num_blocks].to(torch.int64)
    return cache[blocks].reshape(-1, *cache.shape[2:])[:kv_len]


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its paged K/V; writes into and returns `out`.

    Query token i of a sequence with q_len queries and kv_len cached tokens sits at absolute position
    kv_len - q_len + i and sees positions <= that.
    """
    num_kv_heads = key_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    dtype = _compute_dtype(q.dtype)
    starts = query_start_loc.tolist()
    for seq, kv_len in enumerate(seq_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        q_len = end - begin
        if q_len == 0:
            continue
        k = gather_kv(key_cache, block_tables[seq], kv_len).to(dtype)  # [kv, hkv, d]
        v = gather_kv(value_cache, block_tables[seq], kv_len).to(dtype)
        qs = q[begin:end].to(dtype).view(q_len, num_kv_heads, group, -1)  # group heads share one kv head
        scores = torch.einsum("qhgd,khd->hgqk", qs, k) * scale
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device).view(-1, 1)
        visible = torch.arange(kv_len, device=q.device).view(1, -1) <= q_pos  # [q, kv]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
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
