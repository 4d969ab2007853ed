"""Paged attention and KV write on the CPU: the CPU serving backend.

Where the native kernels build (`cpu_native`, the default), decode rows and prefill chunks alike go to them,
which read K/V blocks where they lie. The rest of this module is the batched-torch path used without them.

The reference (`pagedkv_kernels.reference`) loops over sequences in plain einsum, which is clear and right but spends a
CPU step in Python and temporaries once dozens of sequences decode together. Here the decode rows (one query
token each) go through a gather + `scaled_dot_product_attention` in a few calls, grouped by context length and
padded to each group's longest, masked. The gather copies whole blocks (one `index_select` over the block dim,
a contiguous copy per block: 3-5x faster than indexing every slot); padding table entries read the sequence's
own first block, and every gathered slot past a row's length is zeroed before SDPA (masked out, but 0 x NaN would
still reach the sum), so whatever stale values or NaN unused slots hold never matter. Prefill chunks (several query
tokens) are few per step: one SDPA call each, the causal mask offset by the cached prefix. With a sliding window
each row gathers from its first visible block (the ones before may have been freed); a softcap or sinks, which SDPA
cannot express, take explicit scores instead. Tested against the float64 reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv_kernels import cpu_native, quant, reference


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and int(slots.min()) < 0:  # padding slots: the reference skips them
        reference.write_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    if quant.is_fp8(key_cache.dtype):  # torch has no fp8 index_copy_: the bytes are copied as uint8
        key = quant.quantize(key, key_cache.dtype, k_scale).view(torch.uint8)
        value = quant.quantize(value, value_cache.dtype, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value)


@dataclass(frozen=True)
class Options:
    """paged_attention's optional features (see `pagedkv_kernels.dispatch`); a call without any passes None instead."""

    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None

    def first_block(self, kv_len: int, q_len: int, block_size: int) -> int:
        """The sequence's first block any of its queries sees: the ones before it are never read."""
        return reference.first_visible(kv_len, q_len, self.sliding_window) // block_size


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
    options = None
    if sliding_window is not None or softcap is not None or sinks is not None:
        options = Options(sliding_window, softcap, sinks)
    rows = step_rows(block_tables, query_start_loc, seq_lens)
    starts, lens, decode, prefill = rows.starts, rows.lens, rows.decode, rows.prefill
    lib = cpu_native.library() if lens and cpu_native.supports(key_cache, q.shape[1]) else None
    if lib is not None:
        _native(lib, q, key_cache, value_cache, rows, scale, out, options)
        return out
    block_size = key_cache.shape[1]
    spans = lens if options is None else [n - options.first_block(n, 1, block_size) * block_size for n in lens]
    for group in _length_groups(decode, spans):
        _decode_rows(q, key_cache, value_cache, block_tables, starts, lens, group, scale, out, options)
    for i in prefill:
        q_len = starts[i + 1] - starts[i]
        _prefill_chunk(q, key_cache, value_cache, block_tables[i], starts[i], q_len, lens[i], scale, out, options)
    return out


@dataclass(frozen=True)
class StepRows:
    """A step's sequences as this backend splits them, and the index tensors the native kernels take: the same
    for every layer of the step, so `step_rows` builds them once a step, not once a layer."""

    starts: list[int]
    lens: list[int]
    decode: list[int]  # sequences of one query token
    prefill: list[int]  # sequences of more
    tables: torch.Tensor  # int32
    seq_lens: torch.Tensor  # int32
    decode_seqs: torch.Tensor  # the decode rows in order of their first block (see `_native`), int64
    decode_tokens: torch.Tensor
    chunk_seqs: torch.Tensor  # the prefill chunks: sequence, first token, query tokens, int64
    chunk_begins: torch.Tensor
    chunk_lens: torch.Tensor


#: The last few steps' rows with the metadata they were split from, as copies this module owns: a hit is metadata
#: of equal values, whatever tensors carry it and whatever was written to them since, so a stale entry can never
#: answer (identity and version counters cannot tell: inference-mode tensors have no version counter, and a freed
#: tensor's address is reused). Comparing ~3 small tensors costs a few microseconds a layer, splitting them ~100.
#: A few entries, for models whose layer groups take different tables (sliding-window and global layers).
_STEP_ROWS: list[tuple[tuple[torch.Tensor, ...], StepRows]] = []
_STEP_ROWS_KEPT = 4


def step_rows(block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> StepRows:
    key = (block_tables, query_start_loc, seq_lens)
    for seen, rows in _STEP_ROWS:
        if all(torch.equal(t, s) for t, s in zip(key, seen, strict=True)):
            return rows
    owned = tuple(t.clone() for t in key)
    rows = _split_rows(*owned)
    _STEP_ROWS.insert(0, (owned, rows))
    del _STEP_ROWS[_STEP_ROWS_KEPT:]
    return rows


def _split_rows(block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> StepRows:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode = [i for i in range(len(lens)) if starts[i + 1] - starts[i] == 1]
    prefill = [i for i in range(len(lens)) if starts[i + 1] - starts[i] > 1]
    first_token = torch.tensor(starts, dtype=torch.int64)
    seqs = torch.tensor(decode, dtype=torch.int64)
    if decode:
        # Rows in order of their first block: rows sharing a cached prefix run back to back (work items are taken
        # in order), so its blocks are read from memory once and from cache by the rest.
        seqs = seqs[torch.argsort(block_tables[seqs, 0], stable=True)]
    chunks = torch.tensor(prefill, dtype=torch.int64)
    begins = first_token[chunks]
    return StepRows(
        starts,
        lens,
        decode,
        prefill,
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        seqs,
        first_token[seqs],
        chunks,
        begins,
        first_token[chunks + 1] - begins,
    )


#: Padded positions (rows x longest context) per decode call. Measured on a 2-core CPU: one call over 40 rows of
#: ~450 tokens took 11 ms, the same rows in calls of <= 4096 positions 4 ms in all; small calls cost more calls.
GROUP_POSITIONS = 4096


def _length_groups(rows: list[int], spans: list[int]) -> list[list[int]]:
    """Decode rows sorted by the positions each reads (`spans`) and cut into calls of bounded padded size (and
    little padding)."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(rows, key=spans.__getitem__):
        if current and (len(current) + 1) * spans[i] > GROUP_POSITIONS:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def _native(lib, q, key_cache, value_cache, rows: StepRows, scale, out, options) -> None:
    """Every row by the native kernels, which read blocks in place (`cpu_native`): the decode rows in one
    call, the prefill chunks in another."""
    direct = out.dtype == torch.float32 and out.is_contiguous()
    q32 = q.to(torch.float32).contiguous()
    target = out if direct else torch.empty_like(q32)
    extra = {}
    if options is not None:
        sinks = None if options.sinks is None else options.sinks.to(torch.float32).contiguous()
        extra = dict(sliding_window=options.sliding_window, softcap=options.softcap, sinks=sinks)
    caches = (q32, key_cache, value_cache, rows.tables, rows.seq_lens)
    if rows.decode:
        cpu_native.decode_attention(lib, *caches, rows.decode_tokens, rows.decode_seqs, scale, target, **extra)
    if rows.prefill:
        chunks = (rows.chunk_seqs, rows.chunk_begins, rows.chunk_lens)
        cpu_native.prefill_attention(lib, *caches, *chunks, scale, target, **extra)
    if not direct:  # the tokens of the call's sequences; any past them are not this call's to write
        first, end = rows.starts[0], rows.starts[-1]
        out[first:end] = target[first:end].to(out.dtype)


def _decode_rows(q, key_cache, value_cache, block_tables, starts, lens, rows, scale, out, options) -> None:
    block_size = key_cache.shape[1]
    device, dtype = q.device, torch.promote_types(q.dtype, torch.float32)
    row_lens = torch.tensor([lens[i] for i in rows], device=device)
    # Each row's blocks from its first visible one (0 without a window): those before it are never read.
    first = [0 if options is None else options.first_block(lens[i], 1, block_size) for i in rows]
    span_blocks = max(-(-lens[i] // block_size) - f for i, f in zip(rows, first, strict=True))
    first_t = torch.tensor(first, device=device)[:, None]
    columns = first_t + torch.arange(span_blocks, device=device)[None, :]  # [R, B] block-table columns
    owned = columns * block_size < row_lens[:, None]
    columns = torch.where(owned, columns, first_t)  # padding entries read the row's first visible block
    # Whole blocks, one contiguous copy each (an index_select over the block dim), not one index per slot.
    tables = block_tables[torch.tensor(rows, device=device)[:, None], columns].to(torch.int64)  # [R, B]
    positions = first_t * block_size + torch.arange(span_blocks * block_size, device=device)[None, :]  # [R, L]
    visible = positions < row_lens[:, None]
    if options is not None and options.sliding_window is not None:
        visible &= positions >= row_lens[:, None] - options.sliding_window
    hidden = (~visible).nonzero(as_tuple=True)  # (rows, positions) past each row's length or before its window
    k = _gather_blocks(key_cache, tables, hidden).transpose(1, 2).to(dtype)  # [R, hkv, L, d]
    v = _gather_blocks(value_cache, tables, hidden).transpose(1, 2).to(dtype)
    token_rows = torch.tensor([starts[i] for i in rows], device=device)
    qs = q[token_rows].to(dtype).unsqueeze(2)  # [R, h, 1, d]
    o = _attend(qs, k, v, visible[:, None, :], scale, options)
    out[token_rows] = o.squeeze(2).to(out.dtype)


def _gather_blocks(
    cache: torch.Tensor, tables: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """The blocks of `tables` [R, B] as [R, B * block_size, hkv, d], the `hidden` slots (masked out) zeroed:
    unwritten slots may hold anything (NaN included), and 0 x NaN would reach the sum."""
    rows, span = tables.shape
    gathered = cache.index_select(0, tables.reshape(-1)).view(rows, span * cache.shape[1], *cache.shape[2:])
    return gathered.index_put_(hidden, gathered.new_zeros(()))


def _prefill_chunk(q, key_cache, value_cache, table, begin, q_len, kv_len, scale, out, options) -> None:
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    dtype = torch.promote_types(q.dtype, torch.float32)
    first = 0 if options is None else options.first_block(kv_len, q_len, block_size)
    blocks = table[first : -(-kv_len // block_size)].to(torch.int64)  # whole blocks: one contiguous copy each
    kv_span = kv_len - first * block_size
    k = key_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:kv_span].transpose(0, 1).to(dtype)
    v = value_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:kv_span].transpose(0, 1).to(dtype)
    # With a batch dim of 1 ([1, h, q, d]): the 3-d form takes a slower SDPA path on the CPU (2x here)
    qs, k, v = q[begin : begin + q_len].to(dtype).transpose(0, 1)[None], k[None], v[None]
    if q_len == kv_len and options is None:  # no cached prefix: plain causal, SDPA's own mask (and its flash kernel)
        o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # the causal mask offset by the cached prefix (and the window)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(first * block_size, kv_len, device=q.device)[None, :]
        visible = k_pos <= q_pos  # [q, kv]
        if options is not None and options.sliding_window is not None:
            visible &= q_pos - k_pos < options.sliding_window
        o = _attend(qs, k, v, visible[None], scale, options)
    out[begin : begin + q_len] = o[0].transpose(0, 1).to(out.dtype)


#: Scores one explicit-attention pass holds (float32 elements, ~64 MB): a long prefill chunk goes in query slices.
EXPLICIT_SCORES = 1 << 24


def _attend(qs, k, v, visible, scale, options) -> torch.Tensor:
    """Attention of qs [B, h, q, d] over k, v [B, hkv, L, d] where visible [B or 1, q, L]: SDPA, or with a softcap
    or sinks (which SDPA has no form for) the explicit scores, capped, masked, the sinks a softmax column."""
    if options is None or (options.softcap is None and options.sinks is None):
        return F.scaled_dot_product_attention(qs, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=True)
    batch, heads, q_len, _ = qs.shape
    step = max(1, EXPLICIT_SCORES // (batch * heads * k.shape[2]))
    if q_len <= step:
        return _explicit(qs, k, v, visible, scale, options)
    return torch.cat(
        [
            _explicit(qs[:, :, i : i + step], k, v, visible[:, i : i + step], scale, options)
            for i in range(0, q_len, step)
        ],
        dim=2,
    )


def _explicit(qs, k, v, visible, scale, options) -> torch.Tensor:
    batch, heads, q_len, head_dim = qs.shape
    kv_heads = k.shape[1]
    qg = qs.reshape(batch, kv_heads, heads // kv_heads, q_len, head_dim)  # group heads share one kv head
    scores = reference.softcapped(torch.einsum("bhgqd,bhkd->bhgqk", qg, k) * scale, options.softcap)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    if options.sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = options.sinks.to(scores.dtype).view(1, kv_heads, -1, 1, 1).expand(batch, -1, -1, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhgqk,bhkd->bhgqd", probs, v).reshape(batch, heads, q_len, head_dim)
