"""Rotary embeddings: per-pair inverse frequencies for each scaling, and the cos/sin tables the layers look up.

Each scaling follows transformers' formulas (modeling_rope_utils) in float32. YaRN's and LongRoPE's attention
factor multiplies cos and sin, as there. LongRoPE takes its short factors for positions below the original
context and its long ones from there on: transformers instead switches a whole sequence to the long factors once
it is longer than the original context (recomputing its cache); the two agree for every sequence within the
original context, and for decoding after a prompt within it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from executor.model_config import RopeConfig


def _base_frequencies(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


def _yarn(theta: float, dim: int, s: dict) -> torch.Tensor:
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rotary_angles(rope: RopeConfig, head_dim: int, positions: int) -> tuple[torch.Tensor, float]:
    """Angles [positions, head_dim // 2] of each position's rotation pairs, and the factor on cos and sin."""
    s = rope.scaling or {"rope_type": "default"}
    kind = s["rope_type"]
    pos = torch.arange(positions, dtype=torch.float32)
    if kind == "longrope":
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        short = 1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * rope.theta**shape)
        long = 1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * rope.theta**shape)
        inv = torch.where((pos >= s["original_max_position_embeddings"])[:, None], long[None, :], short[None, :])
        return pos[:, None] * inv, float(s["attention_factor"])
    if kind == "yarn":
        return pos[:, None] * _yarn(rope.theta, head_dim, s)[None, :], float(s["attention_factor"])
    inv_freq = _base_frequencies(rope.theta, head_dim)
    if kind == "linear":
        inv_freq = inv_freq / float(s["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, s)
    return pos[:, None] * inv_freq[None, :], 1.0


class Rotary(nn.Module):
    """cos/sin tables [positions, head_dim] (rotate-half layout, float32) for one RopeConfig.

    With `rotary_dim` < head_dim (partial rotary) the first rotary_dim / 2 pairs turn and the others hold still
    (cos 1, sin 0): rotate-half pairs dim i with i + head_dim / 2, so the q and k rows are permuted at load
    (`partial_rotary_order`) to put transformers' pairs (i, i + rotary_dim / 2) there."""

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        positions: int,
        device: torch.device | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        turned = rotary_dim or head_dim
        freqs, factor = rotary_angles(rope, turned, positions)
        scale = torch.full((head_dim // 2,), 1.0)
        scale[: turned // 2] = factor  # the attention factor scales the turned pairs only
        freqs = torch.cat((freqs, freqs.new_zeros(positions, (head_dim - turned) // 2)), dim=-1)
        angles, scale = torch.cat((freqs, freqs), dim=-1), torch.cat((scale, scale))
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The per-head order of q/k dims that makes transformers' partial rotary (dims [0, rotary_dim) turned in
    pairs (i, i + rotary_dim / 2), the rest passed through) the rotate-half pairs (i, i + head_dim / 2) of
    `Rotary`'s table: new dim j reads old dim order[j]. q and k permuted alike keep every q.k product."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = [*range(half), *range(rotary_dim, rotary_dim + rest)]
    second = [*range(half, rotary_dim), *range(rotary_dim + rest, head_dim)]
    return torch.tensor(first + second)
