"""Loading by rank: each rank reads only its slices of the safetensors files (`get_slice`), never a whole tensor
that it shards, so no rank materialises the model. What a slice is follows `executor.parallel.Shard`."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from executor.checkpoint import weight_files
from executor.model_config import CheckpointError, ModelConfig
from executor.parallel import Shard

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)(\d+)(\.(\w+)\.weight)$")
_STACKED = re.compile(r"^.*\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_GATE_UP_NAMES = ("gate_proj", "w1", "up_proj", "w3")
Read = Callable[[Any], torch.Tensor]  # a safetensors slice handle -> this rank's tensor


def _rows(start: int, stop: int) -> Read:
    return lambda s: s[start:stop]


def _cols(start: int, stop: int) -> Read:
    return lambda s: s[:, start:stop]


def _reduced_bias(shard: Shard) -> Read:
    """A bias added after an all-reduce: rank 0's whole, zeros elsewhere (the sum adds it once)."""
    if shard.holds_reduced_bias:
        return lambda s: s[:]
    return lambda s: torch.zeros(s.get_shape())


def _vocab(shard: Shard, vocab_size: int) -> Read:
    start, stop = shard.vocab

    def read(s: Any) -> torch.Tensor:
        rows = s[start : min(stop, vocab_size)]
        pad = shard.vocab_per_rank - rows.shape[0]
        return torch.cat((rows, rows.new_zeros(pad, *rows.shape[1:]))) if pad else rows

    return read


def _stacked(projection: str, bias: bool, arch: str, shard: Shard) -> Read:
    """gpt-oss's stacked experts ([E, H, 2I] gate/up interleaved, [E, I, H]) or ours ([E, 2I, H] halves,
    [E, H, I]): this rank's experts, and of each its intermediate rows."""
    e0, e1 = shard.experts
    a, b = shard.moe_intermediate
    if projection == "down_proj":
        if bias:
            return (lambda s: s[e0:e1]) if shard.expert_parallel else _reduced_bias(shard)
        return (lambda s: s[e0:e1, a:b]) if arch == "gpt_oss" else (lambda s: s[e0:e1, :, a:b])
    if arch == "gpt_oss":  # interleaved g0 u0 g1 u1 ...: rows a..b of both are columns 2a..2b
        return (lambda s: s[e0:e1, 2 * a : 2 * b]) if bias else (lambda s: s[e0:e1, :, 2 * a : 2 * b])

    def halves(s: Any) -> torch.Tensor:  # gate rows a..b, then up rows a..b (dim 1 of the weight and the bias)
        whole = s.get_shape()[1] // 2
        return torch.cat((s[e0:e1, a:b], s[e0:e1, whole + a : whole + b]), dim=1)

    return halves


def plan(name: str, config: ModelConfig, shard: Shard) -> tuple[str, Read] | None:
    """(the name to load it as, how to read this rank's part) for one checkpoint tensor, or None: not this rank's."""
    if "rotary_emb" in name:
        return None
    d = config.head_dim
    normal = name.replace(".block_sparse_moe.", ".mlp.")
    expert = _PER_EXPERT.match(normal)
    if expert:
        index, projection = int(expert.group(2)), expert.group(4)
        if shard.expert_parallel:
            e0, e1 = shard.experts
            if not e0 <= index < e1:
                return None
            return f"{expert.group(1)}{index - e0}{expert.group(3)}", lambda s: s[:]
        a, b = shard.moe_intermediate
        return name, _rows(a, b) if projection in _GATE_UP_NAMES else _cols(a, b)
    stacked = _STACKED.match(normal)
    if stacked:
        return name, _stacked(stacked.group(1), bool(stacked.group(2)), config.architecture, shard)
    if ".q_proj." in name:
        return name, _rows(shard.heads[0] * d, shard.heads[1] * d)
    if ".k_proj." in name or ".v_proj." in name:
        return name, _rows(shard.kv_heads[0] * d, shard.kv_heads[1] * d)
    if ".o_proj." in name:
        bias = name.endswith(".bias")
        return name, _reduced_bias(shard) if bias else _cols(shard.heads[0] * d, shard.heads[1] * d)
    if ".gate_proj." in name or ".up_proj." in name:
        return name, _rows(*shard.intermediate)
    if ".down_proj." in name:
        return name, _cols(*shard.intermediate)
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        return name, _vocab(shard, config.vocab_size)
    if name.endswith(".self_attn.sinks"):
        return name, _rows(*shard.heads)
    return name, lambda s: s[:]  # norms, the router: every rank holds them whole


def iter_shard_weights(model_dir: str | Path, config: ModelConfig, shard: Shard) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's part of every tensor it holds, by the name `PagedCausalLM.load_weights` takes."""
    from safetensors import safe_open

    for path in weight_files(model_dir):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types for a truncated or foreign file
            raise CheckpointError(f"{path} cannot be read as safetensors: {exc}") from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                picked = plan(name, config, shard)
                if picked is not None:
                    target, read = picked
                    yield target, read(f.get_slice(name))
