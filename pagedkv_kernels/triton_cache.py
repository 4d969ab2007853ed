"""Triton kernels that move K/V within the paged caches: scatter new tokens in, copy blocks on fork.

Import after TRITON_INTERPRET is settled (see pagedkv_kernels.dispatch): `@triton.jit` reads it at decoration.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from pagedkv_kernels.heuristics import next_power_of_two
from pagedkv_kernels.quant import fp8_max, is_fp8
from pagedkv_kernels.triton_offsets import INTERPRETED, slot_offset

if bool(triton.knobs.runtime.interpret) != INTERPRETED:
    # A compiled kernel cannot call interpreted helpers or vice versa; see pagedkv_kernels.dispatch.
    raise ImportError("TRITON_INTERPRET changed between importing pagedkv_kernels.triton_offsets and this module")

# Elements one program moves per (block, chunk) in copy_blocks; a block is usually 16 x 8 x 128 = 16k.
_COPY_CHUNK = 4096
# Upper bound on a write program's [heads, head_dim] tile, to keep it in registers.
_WRITE_TILE_ELEMS = 4096


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_slots,
    num_kv_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_block,
    stride_token,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    k_scale,
    v_scale,
    HEAD_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Program (token, head block): copy BLOCK_H heads of one token's K and V into its slot; FP8_MAX > 0: an fp8
    cache, each element divided by its scale and saturated to +-FP8_MAX first (`pagedkv_kernels.quant`)."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return  # -1 is padding; out-of-range ids are refused on the host and never written here
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_P)
    mask = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = slot_offset(slot, BLOCK_SIZE, stride_block, stride_token) + (heads * stride_head)[:, None] + offs_d[None, :]
    token = token.to(tl.int64)
    k_src = token * stride_k_tok + (heads * stride_k_head)[:, None] + offs_d[None, :]
    v_src = token * stride_v_tok + (heads * stride_v_head)[:, None] + offs_d[None, :]
    k = tl.load(key_ptr + k_src, mask=mask)
    v = tl.load(value_ptr + v_src, mask=mask)
    if FP8_MAX > 0:
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
        k = k.to(k_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        v = v.to(v_cache_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(cache_addrs_ptr, mapping_ptr, typed_ptr, block_numel, CHUNK: tl.constexpr):
    """Program (pair, cache, chunk): copy CHUNK elements of block src to block dst in one cache.

    Caches are reached through a table of base addresses so all layers go in one launch; `typed_ptr`
    (any of the caches) only supplies the element type to cast those addresses to.
    """
    pair = tl.program_id(0).to(tl.int64)
    base = tl.load(cache_addrs_ptr + tl.program_id(1)).to(typed_ptr.dtype)
    src = tl.load(mapping_ptr + 2 * pair)
    dst = tl.load(mapping_ptr + 2 * pair + 1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    data = tl.load(base + src * block_numel + offs, mask=mask)
    tl.store(base + dst * block_numel + offs, data, mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Launch the K/V scatter (inputs already validated)."""
    num_tokens = key.shape[0]
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if num_tokens == 0:
        return
    head_p = next_power_of_two(head_dim)
    block_h = min(next_power_of_two(num_kv_heads), max(1, _WRITE_TILE_ELEMS // head_p))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_blocks * block_size,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        k_scale=k_scale,
        v_scale=v_scale,
        HEAD_P=head_p,
        BLOCK_H=block_h,
        FP8_MAX=fp8_max(key_cache.dtype) if is_fp8(key_cache.dtype) else 0.0,
        num_warps=4,
    )


# (device, base addresses) -> address table on that device. Caches are allocated once per process,
# so this saves a host-to-device copy (and its implicit sync) on every copy-on-write call.
_ADDRESS_TABLES: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
_MAX_ADDRESS_TABLES = 8


def _address_table(caches: Sequence[torch.Tensor]) -> torch.Tensor:
    device = caches[0].device
    key = (str(device), tuple(c.data_ptr() for c in caches))
    table = _ADDRESS_TABLES.get(key)
    if table is None:
        if len(_ADDRESS_TABLES) >= _MAX_ADDRESS_TABLES:
            _ADDRESS_TABLES.pop(next(iter(_ADDRESS_TABLES)))
        table = torch.tensor(key[1], dtype=torch.int64).to(device)
        _ADDRESS_TABLES[key] = table
    return table


def copy_blocks(
    key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Launch one block copy over every layer's K and V (inputs already validated)."""
    num_pairs = block_mapping.shape[0]
    if num_pairs == 0:
        return
    caches = [*key_caches, *value_caches]
    block_numel = caches[0].stride(0)
    chunk = min(_COPY_CHUNK, next_power_of_two(block_numel))
    grid = (num_pairs, len(caches), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](_address_table(caches), block_mapping, caches[0], block_numel, CHUNK=chunk, num_warps=4)
