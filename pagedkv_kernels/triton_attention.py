"""Varlen paged attention in Triton: one launch for a mixed prefill/decode step, plus a reduce for splits.

Work decomposition
------------------
A program owns one *tile* of rows for one kv head: BLOCK_Q query tokens of one sequence x the GROUP
query heads that share that kv head (padded to GROUP_P), packed into the M dimension. So each K/V
tile is loaded once for the whole GQA/MQA group and fed to a single `tl.dot`.

Tiles are numbered without a host sync: sequence s owns tile ids starting at
`query_start_loc[s] // BLOCK_Q + s`, an upper bound that always leaves room for ceil(q_len / BLOCK_Q)
tiles; a program finds its sequence by binary search and spare programs exit at once. The grid is
(num_tokens // BLOCK_Q + num_seqs, num_kv_heads, num_splits), all known on the host.

Decode tokens (q_len == 1) may additionally be split along the KV range (flash-decoding): split j
handles one BLOCK_N-aligned chunk and writes float32 (max, sum, acc) partials; `_reduce_splits_kernel`
merges them. Prefill tiles ignore the split axis (programs with split > 0 exit).

Softmax runs online in the log2 domain (exp2 with scale * log2(e) folded into the scores), all in
float32; dot operands stay in the cache dtype (fp16/bf16 tensor cores) with float32 accumulation,
and float32 caches use IEEE-precision dots rather than TF32.

Options are compile-time switches, so a call without them runs the kernel it always did. A sliding window
starts each tile's KV range at the lowest position its first row sees (keys before it, and their blocks, are
never loaded nor looked up: they may have been freed), adds a masked head segment for the keys some rows of the
tile no longer see, and masks p - k >= window in masked tiles. A softcap maps the scaled scores through
cap * tanh(. / cap) before the mask. Sinks join the denominator at the end (or in the split reduce).

Import after TRITON_INTERPRET is settled (see pagedkv_kernels.dispatch): `@triton.jit` reads it at decoration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_kernels.heuristics import choose_num_splits, device_num_sms, next_power_of_two
from pagedkv_kernels.triton_offsets import INTERPRETED, paged_token_offsets

if bool(triton.knobs.runtime.interpret) != INTERPRETED:
    # A compiled kernel cannot call interpreted helpers or vice versa; see pagedkv_kernels.dispatch.
    raise ImportError("TRITON_INTERPRET changed between importing pagedkv_kernels.triton_offsets and this module")

LOG2_E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_ptr, tile_id, num_seqs, search_steps, BLOCK_Q: tl.constexpr):
    """Largest s with query_start[s] // BLOCK_Q + s <= tile_id (fixed-trip binary search, no data-dependent loop)."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        right = first_tile <= tile_id
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _softcapped_log2(s, cap_pre, cap_post):
    """cap * tanh(x / cap) * log2(e) of x = s / scale, given cap_pre = scale / cap and cap_post = cap * log2(e):
    tanh(y) = sign(y) (1 - t) / (1 + t) with t = e^(-2|y|) <= 1, which cannot overflow."""
    y = s * cap_pre
    t = tl.exp2(tl.abs(y) * (-2.0 * 1.4426950408889634))
    tanh = (1.0 - t) / (1.0 + t)
    return tl.where(y < 0, -tanh, tanh) * cap_post


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    kv_start,
    kv_stop,
    kv_lo,
    window,
    cap_pre,
    cap_post,
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,
    head_offset,
    stride_block,
    stride_token,
    qk_scale_log2,
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Fold KV positions [kv_start, kv_start + BLOCK_N) into the running (acc, max, sum).

    MASKED=False is the hot path for tiles every row may fully see (no bounds or causal mask on K/V).
    With SLIDING, positions below kv_lo are neither loaded nor looked up in the block table.
    """
    kv = kv_start + tl.arange(0, BLOCK_N)
    kv_valid = kv < kv_stop
    if SLIDING:
        kv_valid = kv_valid & (kv >= kv_lo)
    rows = paged_token_offsets(block_table_row_ptr, kv, kv_valid, BLOCK_SIZE, stride_block, stride_token)
    offsets = (rows + head_offset)[:, None] + offs_d[None, :]  # K and V caches share strides
    if MASKED:
        # Also keeps unwritten (possibly NaN) slots past kv_stop out: p = 0 would not cancel a NaN.
        load_mask = kv_valid[:, None] & d_mask[None, :]
    else:
        load_mask = d_mask[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=load_mask, other=0.0).to(q.dtype)  # fp8: upcast (exact), else no-op
    s = tl.dot(q, tl.trans(k), input_precision="ieee") if IEEE_DOT else tl.dot(q, tl.trans(k))
    if SOFTCAP:
        s = _softcapped_log2(s, cap_pre, cap_post)
    else:
        s = s * qk_scale_log2
    if MASKED:
        visible = kv_valid[None, :] & (kv[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (kv[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps max -inf; subtracting 0 instead avoids inf - inf = NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + offsets, mask=load_mask, other=0.0).to(q.dtype)
    if IEEE_DOT:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    sinks_ptr,
    qk_scale_log2,
    window,
    cap_pre,
    cap_post,
    num_seqs,
    num_heads,
    search_steps,
    num_splits,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_block,
    stride_token,
    stride_head,
    stride_bt_seq,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    tl.static_assert(BLOCK_M == BLOCK_Q * GROUP_P)
    # tl.dot needs every dimension >= 16 on GPUs (the interpreter would not complain).
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(BLOCK_N >= 16)
    tl.static_assert(HEAD_P >= 16)
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_sequence(query_start_ptr, tile_id, num_seqs, search_steps, BLOCK_Q)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    kv_len = tl.load(seq_lens_ptr + seq)
    q_tile_start = (tile_id - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_tile_start >= q_len:
        return  # spare tile id: this sequence has fewer tiles than its reserved range
    use_split = (q_len == 1) & (num_splits > 1)
    if (split > 0) & (q_len != 1):
        return  # only decode tokens are split along KV

    # Rows: (query token, head within the group) packed into M.
    offs_m = tl.arange(0, BLOCK_M)
    row_tok = q_tile_start + offs_m // GROUP_P
    row_in_group = offs_m % GROUP_P
    row_valid = (row_tok < q_len) & (row_in_group < GROUP)
    row_head = kv_head * GROUP + row_in_group
    # Absolute position of each row's query; padding rows borrow the last real one so none is empty.
    q_pos = kv_len - q_len + tl.minimum(row_tok, q_len - 1)
    offs_d = tl.arange(0, HEAD_P)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_begin + row_tok).to(tl.int64) * stride_q_tok + row_head.to(tl.int64) * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_valid[:, None] & d_mask[None, :], other=0.0)

    # KV range: [kv_lo, kv_stop) is what some row of the tile sees (kv_lo = 0 without a window), [0, kv_common)
    # what the first row sees and kv_stop - window on what the last row sees.
    last_tok = tl.minimum(q_tile_start + BLOCK_Q, q_len) - 1
    kv_stop = kv_len - q_len + last_tok + 1
    kv_common = kv_len - q_len + q_tile_start + 1
    kv_lo = 0
    if SLIDING:
        kv_lo = tl.maximum(kv_common - window, 0)
    n_parts = tl.where(use_split, num_splits, 1)
    part = tl.where(use_split, split, 0)
    chunk = tl.cdiv(tl.cdiv(kv_stop - kv_lo, n_parts), BLOCK_N) * BLOCK_N
    lo = kv_lo + part * chunk
    hi = tl.minimum(lo + chunk, kv_stop)
    # With a window, masked tiles first up to where every row sees the keys (kv_stop - window).
    head_end = lo
    if SLIDING:
        head_end = lo + tl.cdiv(tl.maximum(tl.minimum(hi, kv_stop - window) - lo, 0), BLOCK_N) * BLOCK_N
    # Unmasked tiles: whole BLOCK_N tiles below kv_common. Operands kept >= 0 (GPU int division truncates).
    full_span = tl.maximum(tl.minimum(hi, kv_common) - head_end, 0)
    full_hi = head_end + (full_span // BLOCK_N) * BLOCK_N

    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = kv_head.to(tl.int64) * stride_head
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    if SLIDING:
        for kv_start in range(lo, head_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                q,
                q_pos,
                kv_start,
                hi,
                kv_lo,
                window,
                cap_pre,
                cap_post,
                k_cache_ptr,
                v_cache_ptr,
                block_table_row_ptr,
                head_offset,
                stride_block,
                stride_token,
                qk_scale_log2,
                offs_d,
                d_mask,
                BLOCK_SIZE,
                BLOCK_N,
                True,
                IEEE_DOT,
                SLIDING,
                SOFTCAP,
            )
    for kv_start in range(head_end, full_hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            kv_start,
            hi,
            kv_lo,
            window,
            cap_pre,
            cap_post,
            k_cache_ptr,
            v_cache_ptr,
            block_table_row_ptr,
            head_offset,
            stride_block,
            stride_token,
            qk_scale_log2,
            offs_d,
            d_mask,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            IEEE_DOT,
            SLIDING,
            SOFTCAP,
        )
    for kv_start in range(full_hi, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            kv_start,
            hi,
            kv_lo,
            window,
            cap_pre,
            cap_post,
            k_cache_ptr,
            v_cache_ptr,
            block_table_row_ptr,
            head_offset,
            stride_block,
            stride_token,
            qk_scale_log2,
            offs_d,
            d_mask,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            IEEE_DOT,
            SLIDING,
            SOFTCAP,
        )

    if use_split:
        # Partials are indexed by sequence (a split sequence has exactly one query token).
        part_row = (seq.to(tl.int64) * num_heads + row_head) * num_splits + split
        tl.store(part_m_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_l_ptr + part_row, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part_row[:, None] * HEAD_P + offs_d[None, :], acc, mask=row_valid[:, None])
    else:
        if SINKS:  # the sink joins the denominator: sum and accumulator rescaled to the larger max
            sink = tl.load(sinks_ptr + row_head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_all)
            l_i = l_i * alpha + tl.exp2(sink - m_all)
            acc = acc * alpha[:, None]
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_rows = (q_begin + row_tok).to(tl.int64) * stride_o_tok + row_head.to(tl.int64) * stride_o_head
        tl.store(
            out_ptr + o_rows[:, None] + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    query_start_ptr,
    sinks_ptr,
    num_heads,
    num_splits,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_P: tl.constexpr,
    SPLITS_P: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Merge one decode token's per-split (max, sum, acc) for one head into the final output row."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_begin = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) - q_begin != 1:
        return  # not a decode token: the attention kernel already wrote its output
    offs_s = tl.arange(0, SPLITS_P)
    s_valid = offs_s < num_splits
    rows = (seq.to(tl.int64) * num_heads + head) * num_splits + offs_s
    m = tl.load(part_m_ptr + rows, mask=s_valid, other=float("-inf"))
    row_sum = tl.load(part_l_ptr + rows, mask=s_valid, other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 always holds at least one token
    if SINKS:  # the sink joins the denominator, as one more split with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m_max, sink)
        w = tl.exp2(m - m_all)  # empty splits carry max -inf and weigh 0
        denom = tl.sum(w * row_sum, 0) + tl.exp2(sink - m_all)
    else:
        w = tl.exp2(m - m_max)  # empty splits carry max -inf and weigh 0
        denom = tl.sum(w * row_sum, 0)
    offs_d = tl.arange(0, HEAD_P)
    acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_P + offs_d[None, :], mask=s_valid[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / denom
    dst = out_ptr + q_begin.to(tl.int64) * stride_o_tok + head.to(tl.int64) * stride_o_head + offs_d
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape and launch settings for one call (all compile-time constants of the kernel)."""

    group_p: int
    block_q: int
    block_m: int
    block_n: int
    head_p: int
    num_warps: int
    num_stages: int


def attention_config(num_tokens: int, num_seqs: int, group: int, head_dim: int, elem_bytes: int) -> AttentionConfig:
    """Pick tiles from host-known shapes only (no peeking at lengths, which would sync the GPU)."""
    group_p = next_power_of_two(group)
    head_p = next_power_of_two(head_dim)
    q_per_seq = next_power_of_two(math.ceil(num_tokens / max(1, num_seqs)))
    max_m = 128 if head_p <= 128 else 64
    # M holds q_per_seq tokens x the group, at least 16 rows for tl.dot and at most max_m (or one group).
    block_m = max(16, group_p, min(q_per_seq * group_p, max_m))
    block_q = block_m // group_p
    block_n = 64 if head_p <= 128 else 32
    num_warps = 8 if block_m * head_p >= 128 * 128 else 4
    stage_bytes = 2 * block_n * head_p * elem_bytes  # one K and one V tile in shared memory
    num_stages = 3 if 3 * stage_bytes <= 128 * 1024 else 2
    return AttentionConfig(group_p, block_q, block_m, block_n, head_p, num_warps, num_stages)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch paged attention (inputs already validated); writes into and returns `out`."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = key_cache.shape
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    cfg = attention_config(num_tokens, num_seqs, group, head_dim, key_cache.element_size())
    if num_splits is None:
        # The block-table width bounds the longest sequence without reading lengths back from the GPU (and a
        # window what one decode token reads).
        max_kv_len = block_tables.shape[1] * block_size
        if sliding_window is not None:
            max_kv_len = min(max_kv_len, sliding_window)
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_kv_len, num_sms=device_num_sms(q.device))

    if num_splits > 1:
        part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_seqs, num_heads, num_splits, cfg.head_p), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = torch.empty(1, dtype=torch.float32, device=q.device)  # never touched

    sinks_arg = part_m if sinks is None else sinks  # never read without SINKS
    grid = (num_tokens // cfg.block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        part_m,
        part_l,
        part_acc,
        sinks_arg,
        scale * LOG2_E,
        sliding_window or 0,
        scale / softcap if softcap is not None else 0.0,
        softcap * LOG2_E if softcap is not None else 0.0,
        num_seqs,
        num_heads,
        num_seqs.bit_length(),
        num_splits,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_P=cfg.group_p,
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        HEAD_DIM=head_dim,
        HEAD_P=cfg.head_p,
        IEEE_DOT=q.dtype == torch.float32,
        SLIDING=sliding_window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            query_start_loc,
            sinks_arg,
            num_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_P=cfg.head_p,
            SPLITS_P=next_power_of_two(num_splits),
            SINKS=sinks is not None,
            num_warps=4,
        )
    return out
