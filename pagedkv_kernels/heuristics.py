"""Launch heuristics: pure functions of shapes (no triton import), so they are easy to unit-test."""

from __future__ import annotations

from functools import cache

import torch

# H100 SXM and H200 both have 132 SMs; used when the device cannot be asked (CPU, interpreter).
DEFAULT_NUM_SMS = 132
# A split shorter than this spends more on its partial write and the reduce than it gains in parallelism.
MIN_TOKENS_PER_SPLIT = 256
# Caps the partial buffers and the reduce kernel's tile ([MAX_SPLITS, head_dim] in registers).
MAX_SPLITS = 64


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_kv_len: int,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
    max_splits: int = MAX_SPLITS,
) -> int:
    """How many programs share one decode sequence's KV range (flash-decoding); 1 means no split.

    Without splitting, decode launches one program per (sequence, kv head). When that is fewer than
    the GPU's SMs, most of the chip idles while a few programs stream a long context, so the KV range
    is cut into splits until the programs roughly fill one wave of `num_sms`. Splits are never
    shorter than `min_tokens_per_split` tokens: below that the extra partial write and reduce cost
    more than the parallelism gains.
    """
    for name, value in (("num_seqs", num_seqs), ("num_kv_heads", num_kv_heads), ("num_sms", num_sms)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if max_kv_len < 0:
        raise ValueError(f"max_kv_len must be >= 0, got {max_kv_len}")
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    by_occupancy = num_sms // programs
    by_length = max_kv_len // max(1, min_tokens_per_split)
    return max(1, min(by_occupancy, by_length, max_splits))


@cache
def _cuda_num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_num_sms(device: torch.device) -> int:
    """SM count of a CUDA device, or the H100/H200 default elsewhere (CPU interpreter)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())
