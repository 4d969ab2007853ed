"""Input checks shared by both backends, so a bad call fails the same way on CPU and on GPU.

Shape, dtype, device and layout checks are free and always run. Checks on tensor *values* (slot and
block ids in range, monotone query offsets, ...) need the data on the host; they run only when the
tensors already live on the CPU, because on a GPU they would force a device sync on every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.limits import SUPPORTED_BLOCK_SIZES
from pagedkv_kernels.quant import FP8_DTYPES
from pagedkv_kernels.reference import first_visible

SUPPORTED_HEAD_DIMS: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 192, 256)
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
#: A cache holds the model's dtype, or fp8 (`pagedkv_kernels.quant`): written from and read into the model's dtype.
CACHE_DTYPES: tuple[torch.dtype, ...] = SUPPORTED_DTYPES + FP8_DTYPES


@dataclass(frozen=True)
class CacheGeometry:
    """Shape facts of one layer's K/V cache pair `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class AttentionGeometry:
    """Shape facts of one paged-attention call."""

    cache: CacheGeometry
    num_tokens: int
    num_heads: int
    num_seqs: int
    max_blocks_per_seq: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.cache.num_kv_heads


def _require_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _require_ndim(x: torch.Tensor, ndim: int, name: str, layout: str) -> None:
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def _require_dtype(x: torch.Tensor, allowed: Sequence[torch.dtype], name: str) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {names}")


def _require_device(x: torch.Tensor, device: torch.device, name: str, other: str) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {other} is on {device}; all inputs must share one device")


def _require_contiguous(x: torch.Tensor, name: str) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {tuple(x.stride())} for shape {tuple(x.shape)})")


def _require_unit_last_stride(x: torch.Tensor, name: str) -> None:
    # Rows may be strided (e.g. q sliced out of a fused qkv projection), but head_dim must be dense.
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {x.stride(-1)})")


def _require_model_dtype(x: torch.Tensor, cache_dtype: torch.dtype, name: str) -> None:
    """x is in the cache's dtype, or, for an fp8 cache, in any of the model dtypes (quantized on write)."""
    if cache_dtype in FP8_DTYPES:
        _require_dtype(x, SUPPORTED_DTYPES, name)
    elif x.dtype != cache_dtype:
        raise TypeError(f"{name} dtype {x.dtype} != cache dtype {cache_dtype}")


def check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor, name: str = "") -> CacheGeometry:
    """Validate one layer's K and V caches and return their geometry."""
    k_name, v_name = f"key_cache{name}", f"value_cache{name}"
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    for x, n in ((key_cache, k_name), (value_cache, v_name)):
        _require_tensor(x, n)
        _require_ndim(x, 4, n, layout)
        _require_dtype(x, CACHE_DTYPES, n)
        _require_contiguous(x, n)
    if key_cache.shape != value_cache.shape:
        raise ValueError(f"{k_name} shape {tuple(key_cache.shape)} != {v_name} shape {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype:
        raise TypeError(f"{k_name} dtype {key_cache.dtype} != {v_name} dtype {value_cache.dtype}")
    _require_device(value_cache, key_cache.device, v_name, k_name)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"block_size {block_size} is not supported; supported: {SUPPORTED_BLOCK_SIZES}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if num_kv_heads < 1 or num_blocks < 1:
        raise ValueError(f"{k_name} must have at least one block and one kv head, got {tuple(key_cache.shape)}")
    return CacheGeometry(num_blocks, block_size, num_kv_heads, head_dim, key_cache.dtype, key_cache.device)


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> CacheGeometry:
    """Validate a write of new tokens' K/V `[num_tokens, num_kv_heads, head_dim]` into a cache pair."""
    cache = check_cache_pair(key_cache, value_cache)
    layout = "[num_tokens, num_kv_heads, head_dim]"
    for x, n in ((key, "key"), (value, "value")):
        _require_tensor(x, n)
        _require_ndim(x, 3, n, layout)
        if tuple(x.shape[1:]) != (cache.num_kv_heads, cache.head_dim):
            raise ValueError(
                f"{n} shape {tuple(x.shape)} does not match the cache's "
                f"(num_kv_heads, head_dim) = ({cache.num_kv_heads}, {cache.head_dim})"
            )
        _require_model_dtype(x, cache.dtype, n)
        _require_device(x, cache.device, n, "key_cache")
        _require_unit_last_stride(x, n)
    if key.shape != value.shape:
        raise ValueError(f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}")
    _require_tensor(slot_mapping, "slot_mapping")
    _require_ndim(slot_mapping, 1, "slot_mapping", "[num_tokens]")
    _require_dtype(slot_mapping, INDEX_DTYPES, "slot_mapping")
    _require_device(slot_mapping, cache.device, "slot_mapping", "key_cache")
    _require_contiguous(slot_mapping, "slot_mapping")
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but key has {key.shape[0]} tokens")
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= cache.num_slots:
            raise ValueError(f"slot_mapping values must be -1 (padding) or in [0, {cache.num_slots}); got [{lo}, {hi}]")
    return cache


def check_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> AttentionGeometry:
    """Validate one varlen paged-attention call, its options included, and return its geometry.

    With a sliding window only the block-table entries from each sequence's first visible block on must name
    blocks of the cache: the earlier ones are never read (they may have been freed)."""
    cache = check_cache_pair(key_cache, value_cache)
    _require_tensor(q, "q")
    _require_ndim(q, 3, "q", "[num_tokens, num_heads, head_dim]")
    _require_model_dtype(q, cache.dtype, "q")
    _require_device(q, cache.device, "q", "key_cache")
    _require_unit_last_stride(q, "q")
    num_tokens, num_heads, head_dim = q.shape
    if head_dim != cache.head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache.head_dim}")
    if num_heads < 1 or num_heads % cache.num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {cache.num_kv_heads}")

    for x, n, ndim, layout in (
        (block_tables, "block_tables", 2, "[num_seqs, max_blocks]"),
        (query_start_loc, "query_start_loc", 1, "[num_seqs + 1]"),
        (seq_lens, "seq_lens", 1, "[num_seqs]"),
    ):
        _require_tensor(x, n)
        _require_ndim(x, ndim, n, layout)
        _require_dtype(x, (torch.int32,), n)
        _require_device(x, cache.device, n, "key_cache")
        _require_contiguous(x, n)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has {num_seqs} sequences")
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries; expected num_seqs + 1 = {num_seqs + 1}"
        )

    if out is not None:
        _require_tensor(out, "out")
        if out.shape != q.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
        if out.dtype != q.dtype:
            raise TypeError(f"out dtype {out.dtype} != q dtype {q.dtype}")
        _require_device(out, cache.device, "out", "key_cache")
        _require_unit_last_stride(out, "out")

    check_attention_options(sliding_window, softcap, sinks, q)
    geometry = AttentionGeometry(cache, num_tokens, num_heads, num_seqs, block_tables.shape[1])
    if cache.device.type == "cpu":
        _check_attention_values(geometry, block_tables, query_start_loc, seq_lens, sliding_window)
    return geometry


def check_attention_options(
    sliding_window: int | None, softcap: float | None, sinks: torch.Tensor | None, q: torch.Tensor
) -> None:
    """Validate paged attention's optional features, given a validated q (`sinks`: no value read, no sync)."""
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0
    ):
        raise ValueError(f"softcap must be a finite float > 0 or None, got {softcap!r}")
    if sinks is not None:
        _require_tensor(sinks, "sinks")
        _require_ndim(sinks, 1, "sinks", "[num_heads]")
        if sinks.shape[0] != q.shape[1]:
            raise ValueError(f"sinks has {sinks.shape[0]} entries but q has {q.shape[1]} heads; one per query head")
        _require_dtype(sinks, SUPPORTED_DTYPES, "sinks")
        _require_device(sinks, q.device, "sinks", "q")
        _require_contiguous(sinks, "sinks")


def _check_attention_values(
    g: AttentionGeometry,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
) -> None:
    """Host-side checks of the metadata values (CPU tensors only): whole-tensor tests, so a step of hundreds of
    sequences costs a few tensor ops; the per-sequence loop runs only to name the first bad one."""
    starts = query_start_loc.to(torch.int64)
    first, last = int(starts[0]), int(starts[-1])
    if first != 0 or last != g.num_tokens:
        raise ValueError(f"query_start_loc must start at 0 and end at num_tokens={g.num_tokens}; got {first}..{last}")
    q_lens, kv_lens = starts[1:] - starts[:-1], seq_lens.to(torch.int64)
    capacity = g.max_blocks_per_seq * g.cache.block_size
    used_blocks = (kv_lens + g.cache.block_size - 1) // g.cache.block_size
    columns = torch.arange(g.max_blocks_per_seq)[None, :]
    in_use = columns < used_blocks[:, None]
    if sliding_window is not None:  # entries before the first visible block are never read
        in_use &= columns >= (kv_lens - q_lens - sliding_window + 1).clamp(min=0)[:, None] // g.cache.block_size
    used = block_tables[in_use]
    bad_block = bool(used.numel()) and (int(used.min()) < 0 or int(used.max()) >= g.cache.num_blocks)
    if bad_block or bool((q_lens < 1).any()) or bool((kv_lens < q_lens).any()) or bool((kv_lens > capacity).any()):
        _name_bad_sequence(g, block_tables, q_lens.tolist(), kv_lens.tolist(), capacity, sliding_window)


def _name_bad_sequence(
    g: AttentionGeometry,
    block_tables: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    capacity: int,
    sliding_window: int | None,
) -> None:
    for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if q_len < 1:
            raise ValueError(f"sequence {i} has {q_len} query tokens; every sequence needs at least one")
        if kv_len < q_len:
            raise ValueError(
                f"sequence {i}: seq_lens {kv_len} < its {q_len} query tokens (new K/V must be in the cache)"
            )
        if kv_len > capacity:
            raise ValueError(f"sequence {i}: seq_lens {kv_len} exceeds its block table capacity {capacity}")
        first = first_visible(kv_len, q_len, sliding_window) // g.cache.block_size
        used = block_tables[i, first : math.ceil(kv_len / g.cache.block_size)]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= g.cache.num_blocks):
            raise ValueError(f"sequence {i}: block ids must lie in [0, {g.cache.num_blocks}); got {used.tolist()}")


def check_copy_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    block_mapping: torch.Tensor | tuple[Sequence[int], Sequence[int]],
) -> tuple[CacheGeometry, torch.Tensor]:
    """Validate a copy-on-write block copy over all layers; return the geometry and an `[n, 2]` int64 mapping."""
    if isinstance(key_caches, torch.Tensor) or isinstance(value_caches, torch.Tensor):
        raise TypeError("key_caches and value_caches must be sequences of per-layer cache tensors")
    if len(key_caches) != len(value_caches) or not key_caches:
        raise ValueError(f"need one key and one value cache per layer; got {len(key_caches)} and {len(value_caches)}")
    cache = check_cache_pair(key_caches[0], value_caches[0], "[0]")
    for i, (k, v) in enumerate(zip(key_caches, value_caches, strict=False)):
        other = check_cache_pair(k, v, f"[{i}]")
        if other != cache or k.shape != key_caches[0].shape:
            raise ValueError(f"layer {i} cache {tuple(k.shape)} {k.dtype} differs from layer 0's; layers must match")

    if isinstance(block_mapping, torch.Tensor):
        mapping = block_mapping
        _require_ndim(mapping, 2, "block_mapping", "[n, 2] of (src, dst) pairs")
        if mapping.shape[1] != 2:
            raise ValueError(f"block_mapping must have shape [n, 2], got {tuple(mapping.shape)}")
        _require_dtype(mapping, (torch.int64,), "block_mapping")
        _require_device(mapping, cache.device, "block_mapping", "the caches")
        _require_contiguous(mapping, "block_mapping")
    elif isinstance(block_mapping, tuple) and len(block_mapping) == 2:
        # A tuple only: a list of [src, dst] pairs would read as two id lists when it holds two pairs.
        src, dst = (list(side) for side in block_mapping)
        if len(src) != len(dst):
            raise ValueError(f"block_mapping source list has {len(src)} ids but destination list has {len(dst)}")
        if not all(isinstance(b, int) and not isinstance(b, bool) for b in src + dst):
            raise TypeError("block_mapping lists must hold Python ints")
        _check_mapping_values(src, dst, cache.num_blocks)  # host lists: checking is free
        mapping = torch.tensor(list(zip(src, dst, strict=False)), dtype=torch.int64).reshape(-1, 2).to(cache.device)
    else:
        raise TypeError("block_mapping must be an [n, 2] int64 tensor or a (src_ids, dst_ids) tuple of two lists")
    if isinstance(block_mapping, torch.Tensor) and mapping.device.type == "cpu":
        _check_mapping_values(mapping[:, 0].tolist(), mapping[:, 1].tolist(), cache.num_blocks)
    return cache, mapping


def _check_mapping_values(src: list[int], dst: list[int], num_blocks: int) -> None:
    bad = [b for b in src + dst if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"block ids must lie in [0, {num_blocks}); got {bad[:8]}")
    if len(set(dst)) != len(dst):
        raise ValueError("block_mapping destinations must be distinct (two copies into one block would race)")
    if set(dst) & set(src):
        raise ValueError("a block_mapping destination is also a source; copy order would change the result")
