"""Paged attention in batched torch: the CPU serving backend.

The reference (`kernels.reference`) loops over sequences, which is clear and right but spends a CPU step in
Python overhead once dozens of sequences decode together. Here every decode row (one query token) of the step
is handled in one batched gather + matmul over its blocks, padded to the longest context and masked; prefill
chunks (several query tokens) are few per step and go through the reference one sequence at a time. Math in
float32, like the reference; tested against the float64 reference.
"""

from __future__ import annotations

import torch

from kernels import reference


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
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    if len(decode) > 1:
        _decode_rows(q, key_cache, value_cache, block_tables, starts, lens, decode, scale, out)
    else:
        decode = []
    done = set(decode)
    for i in range(len(lens)):
        if i in done or starts[i + 1] == starts[i]:
            continue
        begin, end = starts[i], starts[i + 1]
        reference.paged_attention(
            q[begin:end], key_cache, value_cache, block_tables[i : i + 1],
            torch.tensor([0, end - begin], device=q.device), seq_lens[i : i + 1], scale, out[begin:end],
        )  # fmt: skip
    return out


def _decode_rows(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: list[int],
    lens: list[int],
    rows: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    dtype = torch.promote_types(q.dtype, torch.float32)
    device = q.device
    row_lens = torch.tensor([lens[i] for i in rows], device=device)
    max_blocks = -(-max(lens[i] for i in rows) // block_size)
    index = torch.tensor(rows, device=device)
    tables = block_tables[index, :max_blocks].to(torch.int64)  # [R, B]
    span = max_blocks * block_size
    # [R, B, bs, hkv, d] -> [R, hkv, L, d]
    k = key_cache[tables].reshape(len(rows), span, num_kv_heads, head_dim).transpose(1, 2).to(dtype)
    v = value_cache[tables].reshape(len(rows), span, num_kv_heads, head_dim).transpose(1, 2).to(dtype)
    token_rows = torch.tensor([starts[i] for i in rows], device=device)
    group = q.shape[1] // num_kv_heads
    qs = q[token_rows].to(dtype).view(len(rows), num_kv_heads, group, head_dim)  # [R, hkv, g, d]
    scores = torch.matmul(qs, k.transpose(-1, -2)) * scale  # [R, hkv, g, L]
    hidden = torch.arange(span, device=device).view(1, -1) >= row_lens.view(-1, 1)  # [R, L]: past the context
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    v = v.masked_fill(hidden[:, None, :, None], 0.0)  # padding slots may hold anything, NaN included
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v)  # [R, hkv, g, d]
    out[token_rows] = o.reshape(len(rows), -1, head_dim).to(out.dtype)
