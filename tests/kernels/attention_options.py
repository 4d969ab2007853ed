"""Random cases for paged attention's options (sliding window, softcap, sinks, scale) and a dense float64 oracle.

The oracle is written the way transformers' eager attention is (test_attention_options.py checks it against
transformers itself): per sequence over contiguous K/V, scores scaled then softcapped, an additive -inf mask,
the sinks concatenated as one more column of the softmax and dropped after it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tests.kernels.paged_case import PagedBatch, make_batch

FEATURES = ("window", "softcap", "sinks", "scale")
COMBINATIONS = [
    ("window",),
    ("softcap",),
    ("sinks",),
    ("scale",),
    ("window", "softcap"),
    ("window", "sinks"),
    ("softcap", "sinks", "scale"),
    FEATURES,
]


@dataclass
class OptionsCase:
    batch: PagedBatch
    options: dict  # sliding_window / softcap / sinks, as paged_attention takes them
    description: str


def dense_attention(batch: PagedBatch, sliding_window=None, softcap=None, sinks=None) -> torch.Tensor:
    """float64 attention per sequence over its contiguous K/V, mask and options as in transformers' eager code."""
    outs, start = [], 0
    group = batch.q.shape[1] // batch.keys[0].shape[1]
    for q_len, kv_len, k, v in zip(batch.q_lens, batch.kv_lens, batch.keys, batch.values, strict=True):
        q = batch.q[start : start + q_len].double().transpose(0, 1)  # [H, q, D]
        k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv, D]
        v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * batch.scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores + torch.zeros_like(scores).masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.double().view(-1, 1, 1).expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outs.append((probs @ v).transpose(0, 1))
        start += q_len
    return torch.cat(outs)


def random_case(
    seed: int,
    features: tuple[str, ...],
    *,
    dtype: torch.dtype,
    head_dims: tuple[int, ...] = (64, 128, 256),
    block_sizes: tuple[int, ...] = (8, 16, 32),
    max_len: int = 300,
    rows: int = 6,
) -> OptionsCase:
    """A mixed step drawn from `seed`: decode rows, a prefill chunk after a cached prefix, a fresh prefill; head
    dim, GQA ratio, block size and the features' values drawn too. A window may be shorter or longer than the
    contexts; blocks wholly outside it are given back (poisoned, see `make_batch`)."""
    rng = random.Random(seed)
    head_dim = rng.choice(head_dims)
    kv_heads, group = rng.choice([(1, 1), (2, 2), (1, 4), (2, 3), (1, 8)])
    block_size = rng.choice(block_sizes)
    seqs = [(1, rng.randint(1, max_len)) for _ in range(max(1, rows - 2))]
    prefix = rng.randint(1, max_len // 2)
    seqs.append((rng.randint(2, 24), prefix + rng.randint(2, 24)))  # a chunk after a cached prefix
    seqs[-1] = (min(seqs[-1][0], seqs[-1][1]), seqs[-1][1])
    fresh = rng.randint(2, 40)
    seqs.append((fresh, fresh))
    rng.shuffle(seqs)
    options: dict = {}
    if "window" in features:
        options["sliding_window"] = rng.choice([1, rng.randint(2, 16), rng.randint(17, max_len), 2 * max_len])
    if "softcap" in features:
        options["softcap"] = rng.choice([0.5, 2.0, rng.uniform(5.0, 50.0)])
    batch = make_batch(
        seqs,
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        sliding_window=options.get("sliding_window"),
    )
    if "scale" in features:  # Gemma's query_pre_attn_scalar: not 1/sqrt(head_dim)
        batch.scale = rng.choice([0.5, 2.0, 4.0]) * head_dim**-0.5
    if "sinks" in features:
        gen = torch.Generator().manual_seed(seed)
        sinks = torch.randn(kv_heads * group, generator=gen) * 2 + rng.choice([-2.0, 0.0, 3.0])
        options["sinks"] = sinks.to(batch.q.device)
    description = (
        f"seed={seed} seqs={seqs} heads={kv_heads * group}/{kv_heads} d={head_dim} bs={block_size} "
        f"scale={batch.scale:.4f} { ({k: v for k, v in options.items() if k != 'sinks'}) }"
    )
    return OptionsCase(batch, options, description)


def fresh_seed() -> int:
    """A new seed every run (printed with any failure), so the cases keep covering new shapes."""
    return random.SystemRandom().randrange(2**31)
