"""How big the KV cache is: a number of blocks (a block: `block_size` tokens of one layer group's layers,
executor.layer_groups), a byte size, or (on CUDA) a fraction of free device memory; and the sliding window its
blocks are handed back by."""

from __future__ import annotations

from dataclasses import dataclass

import click
import torch

from common.units import parse_size
from executor.layer_groups import layer_groups
from executor.model_config import ModelConfig

DEFAULT_CPU_BYTES = 256 * 2**20
DEFAULT_CUDA_FRACTION = 0.9


@dataclass(frozen=True)
class KvBudget:
    bytes: int | None = None
    fraction: float | None = None  # of the device memory free once the model is loaded


def parse_kv_budget(spec: str | None, device: torch.device) -> KvBudget:
    if spec is None:
        return KvBudget(fraction=DEFAULT_CUDA_FRACTION) if device.type == "cuda" else KvBudget(DEFAULT_CPU_BYTES)
    text = spec.strip()
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is not None and 0 < value <= 1:
        if device.type != "cuda":
            raise click.BadParameter(
                "a fraction of free memory applies to CUDA devices; give a size like 1GiB",
                param_hint="--kv-cache-memory",
            )
        return KvBudget(fraction=value)
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-cache-memory") from None
    if size <= 0:
        raise click.BadParameter("must be positive", param_hint="--kv-cache-memory")
    return KvBudget(bytes=size)


def resolve_num_blocks(
    num_blocks: int | None,
    budget: KvBudget,
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    from executor.runner import kv_bytes_per_block

    if num_blocks is not None:
        return num_blocks
    per_block = kv_bytes_per_block(config, block_size, dtype)
    if budget.fraction is not None:
        free, _ = torch.cuda.mem_get_info(device)
        size = int(free * budget.fraction)
    else:
        assert budget.bytes is not None
        size = budget.bytes
    blocks = size // per_block
    if blocks < 1:
        raise click.BadParameter(f"{size} bytes hold no block of {per_block} bytes", param_hint="--kv-cache-memory")
    return blocks


def pool_window(config: ModelConfig) -> int | None:
    """The sliding window blockd hands blocks back by: when every layer slides, the widest window (a block no
    layer's window reaches is read by none); with sliding and global layers mixed, the sliding layer groups'
    (executor.layer_groups); None when no block falls out of a window."""
    return layer_groups(config).window
