"""The sampler: logits of one step in, one token (and its logprobs) per row out.

Greedy rows are one batched argmax. Random rows apply temperature, top-k and top-p, then draw with their own
`torch.Generator`: a request with a seed owns a generator seeded from it, so its output depends on the seed
alone, never on what else shares the batch. The draw is the exponential race (argmax of p / E with E ~ Exp(1)),
which picks token i with probability p_i and needs one random vector per row.

Logprobs are those of the model's distribution (log-softmax of the raw logits), before temperature and
truncation, so they mean the same thing whatever the sampling settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.params import SamplingParams

_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n choices apart


def choice_generator(params: SamplingParams, index: int, device: torch.device) -> torch.Generator | None:
    """The generator of choice `index` of a seeded request (None when unseeded: the engine's shared one draws)."""
    if params.seed is None or params.greedy:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((params.seed + index * _SEED_STRIDE) % 2**64)
    return generator


@dataclass
class SampleRow:
    """One row of logits to sample from, and whose generator draws."""

    params: SamplingParams
    generator: torch.Generator | None


@dataclass
class Sampled:
    token_ids: list[int]
    #: per row: None, or (logprob of the chosen token, [(token, logprob) of the top alternatives])
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.shared = torch.Generator(device=device)
        if seed is None:
            self.shared.seed()
        else:
            self.shared.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> Sampled:
        """logits: float32 `[len(rows), vocab]`."""
        tokens = torch.argmax(logits, dim=-1)
        for i, row in enumerate(rows):
            if not row.params.greedy:
                tokens[i] = self._draw(logits[i], row.params, row.generator or self.shared)
        token_ids = tokens.tolist()
        want = [row.params.logprobs for row in rows]
        if all(k is None for k in want):
            return Sampled(token_ids, [None] * len(rows))
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
        top_k = max(k or 0 for k in want)
        top_values, top_ids = logprobs.topk(top_k, dim=-1) if top_k else (logprobs[:, :0], logprobs[:, :0])
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        out: list[tuple[float, list[tuple[int, float]]] | None] = []
        for i, k in enumerate(want):
            if k is None:
                out.append(None)
            else:
                out.append((chosen[i], [(int(t), v) for t, v in zip(top_ids[i][:k], top_values[i][:k], strict=False)]))
        return Sampled(token_ids, out)

    @staticmethod
    def _draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        scaled = row / params.temperature
        if params.top_k and params.top_k < scaled.shape[-1]:
            threshold = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # the top token always stays
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        race = torch.empty_like(probs).exponential_(generator=generator)
        return torch.argmax(probs / race)
