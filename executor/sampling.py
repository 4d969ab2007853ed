"""The sampler: logits of one step in, one token (and its logprobs) per row out, as batched tensor ops.

Its order (structured output's mask, vLLM's logits processing, then greedy or temperature, min_p, top-k, top-p
and a seeded draw) and what its logprobs mean are told in docs/architecture.md ("Sampling").
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from executor.params import SamplingParams
from pagedkv_kernels.pointwise import argmax_rows

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
    """One row of logits to sample from, whose generator draws, and (read only when its params process logits:
    penalties, bad words, min_tokens) the sequence's token ids so far, the prompt's first."""

    params: SamplingParams
    generator: torch.Generator | None
    tokens: Sequence[int] = ()
    prompt_len: int = 0
    matcher: Any = None  # the sequence's xgrammar GrammarMatcher, when its output is constrained


@dataclass
class Sampled:
    token_ids: list[int]
    #: per row: None, or (logprob of the chosen token, [(token, logprob) of the top alternatives])
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        self.shared = torch.Generator(device=device)
        if seed is None:
            self.shared.seed()
        else:
            self.shared.manual_seed(seed)
        self.eos_token_ids = tuple(eos_token_ids)  # banned (unless ignore_eos) while a row is short of min_tokens
        self._bitmask: Any = None  # executor.structured.BitmaskApplier, made for the first constrained row

    def _constrain(self, logits: torch.Tensor, rows: list[SampleRow], constrained: list[int]) -> None:
        if self._bitmask is None:
            from executor.structured import BitmaskApplier

            self._bitmask = BitmaskApplier()
        self._bitmask(logits, constrained, [rows[i].matcher for i in constrained])

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> Sampled:
        """logits: float32 `[len(rows), vocab]` (not modified)."""
        processed = logits
        constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
        if constrained:
            processed = logits.clone()
            self._constrain(processed, rows, constrained)
        if any(row.params.processes_logits for row in rows):
            processed = process_logits(processed if constrained else logits.clone(), rows, self.eos_token_ids)
        tokens = argmax_rows(processed)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if random:
            params = [rows[i].params for i in random]
            generators = [rows[i].generator or self.shared for i in random]
            scaled = _scale(processed, params, random)
            vocab = scaled.shape[-1]
            truncated, whole = [], []
            for j, q in enumerate(params):
                (truncated if 0 < q.top_k < vocab or q.top_p < 1.0 else whole).append(j)
            if whole:  # one batched draw for the rows that sample from the whole distribution
                drawn = _invert(torch.softmax(scaled[whole], dim=-1), [generators[j] for j in whole])
                tokens[torch.tensor([random[j] for j in whole], device=tokens.device)] = drawn
            for j in truncated:
                tokens[random[j]] = self._draw(scaled[j], params[j], generators[j])
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
    def _draw(scaled: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        """One draw from a row's logits (already divided by its temperature) after its top-k and top-p."""
        if params.top_k and params.top_k < scaled.shape[-1]:
            threshold = torch.topk(scaled, params.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # the top token always stays
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return _invert(probs[None], [generator])[0]


def _invert(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` ([rows, vocab]), drawn with one uniform from that row's generator.

    The exponential race (argmax of p / E, E ~ Exp(1)) is as exact, but draws and takes a logarithm per vocabulary
    entry: 1.9 ms a step for 16 rows of a 4,096-token vocabulary on the CPU, ten times this.
    """
    cdf = probs.to(torch.float64).cumsum(-1)
    cdf = cdf / cdf[:, -1:]  # each row's last is 1 exactly: a uniform below 1 always lands on a token
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g, device=probs.device) for g in generators])
    # The first token whose cumulative probability exceeds u: token i with probability p_i, never one of p = 0.
    return torch.searchsorted(cdf, u[:, None], right=True).view(-1)


_NEG_INF = float("-inf")


def process_logits(logits: torch.Tensor, rows: Sequence[SampleRow], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """Apply every row's logits processing to `logits` `[len(rows), vocab]`, in place, as batched tensor ops;
    each kind is skipped when no row uses it. Returns `logits`."""
    device = logits.device
    params = [row.params for row in rows]

    allowed = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if allowed:  # keep the allowed logits aside, fill the rows with -inf, put them back
        row_ids = torch.tensor([i for i in allowed for _ in params[i].allowed_token_ids or ()], device=device)
        token_ids = torch.tensor([t for i in allowed for t in params[i].allowed_token_ids or ()], device=device)
        kept = logits[row_ids, token_ids]
        logits[torch.tensor(allowed, device=device)] = _NEG_INF
        logits[row_ids, token_ids] = kept

    # Bad words, logit_bias and min_tokens only add to single logits (-inf bans them), so they commute and go in
    # one accumulating scatter: duplicate (row, token) pairs add up instead of overwriting each other.
    add_rows: list[int] = []
    add_ids: list[int] = []
    add_values: list[float] = []
    banned = _bad_words(logits, rows, params)
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            add_rows.append(i)
            add_ids.append(token)
            add_values.append(bias)
        if p.min_tokens and len(rows[i].tokens) - rows[i].prompt_len < p.min_tokens:
            stops = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
            add_rows += [i] * len(stops)
            add_ids += stops
            add_values += [_NEG_INF] * len(stops)
    if add_rows or banned is not None:
        index_rows = torch.tensor(add_rows, dtype=torch.long, device=device)
        index_ids = torch.tensor(add_ids, dtype=torch.long, device=device)
        values = torch.tensor(add_values, dtype=logits.dtype, device=device)
        if banned is not None:
            index_rows = torch.cat([index_rows, banned[0]])
            index_ids = torch.cat([index_ids, banned[1]])
            values = torch.cat([values, banned[2]])
        logits.index_put_((index_rows, index_ids), values, accumulate=True)

    penalized = [i for i, p in enumerate(params) if p.penalized]
    if penalized:
        _penalize(logits, rows, penalized)
    return logits


def _bad_words(
    logits: torch.Tensor, rows: Sequence[SampleRow], params: list[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, tokens, values) to add: -inf to the last token of each banned sequence whose other tokens end the
    row's output, 0 where they do not. The match runs on the device for every (row, sequence) pair at once."""
    pairs = [(i, word) for i, p in enumerate(params) for word in p.bad_words_token_ids]
    if not pairs:
        return None
    device = logits.device
    width = max(len(word) for _, word in pairs) - 1  # the longest prefix
    pair_rows = torch.tensor([i for i, _ in pairs], device=device)
    last = torch.tensor([word[-1] for _, word in pairs], device=device)
    if width == 0:
        return pair_rows, last, torch.full((len(pairs),), _NEG_INF, dtype=logits.dtype, device=device)
    # Prefixes right-aligned, -2 (matches anything) on the left; the tails of the outputs right-aligned, -1 (no
    # token: matches no prefix token) where the output is shorter.
    prefixes = torch.tensor([[-2] * (width - len(word) + 1) + list(word[:-1]) for _, word in pairs], device=device)
    tails = []
    for row in rows:
        tail = (
            list(row.tokens[max(row.prompt_len, len(row.tokens) - width) :]) if row.params.bad_words_token_ids else []
        )
        tails.append([-1] * (width - len(tail)) + tail)
    ends = torch.tensor(tails, device=device)[pair_rows]
    match = ((prefixes == ends) | (prefixes == -2)).all(dim=1)
    zero = torch.zeros((), dtype=logits.dtype, device=device)
    return pair_rows, last, torch.where(match, torch.full_like(zero, _NEG_INF), zero)


def _penalize(logits: torch.Tensor, rows: Sequence[SampleRow], penalized: list[int]) -> None:
    """Repetition (prompt and output), frequency and presence (output) penalties of the `penalized` rows, in
    vLLM's order. Only the logits of tokens a row has seen change, so the ops are gathers and scatters over the
    rows' token ids: their cost follows the number of tokens, not rows x vocabulary."""
    device, dtype, vocab = logits.device, logits.dtype, logits.shape[1]

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(row.params, name) for row in rows], dtype=dtype, device=device)

    repeating = [i for i in penalized if rows[i].params.repetition_penalty != 1.0]
    if repeating:
        row_ids, token_ids = _flat_tokens(rows, repeating, output_only=False, device=device)
        factor = per_row("repetition_penalty")[row_ids]
        values = logits[row_ids, token_ids]  # a token seen twice is gathered twice and written twice, alike
        logits[row_ids, token_ids] = torch.where(values > 0, values / factor, values * factor)
    counting = [i for i in penalized if rows[i].params.frequency_penalty != 0.0 or rows[i].params.presence_penalty]
    if counting:
        row_ids, token_ids = _flat_tokens(rows, counting, output_only=True, device=device)
        if any(rows[i].params.frequency_penalty != 0.0 for i in counting):  # once per occurrence
            logits.index_put_((row_ids, token_ids), -per_row("frequency_penalty")[row_ids], accumulate=True)
        if any(rows[i].params.presence_penalty != 0.0 for i in counting):  # once per distinct token
            seen = torch.unique(row_ids * vocab + token_ids)
            row_ids, token_ids = seen // vocab, seen % vocab
            logits.index_put_((row_ids, token_ids), -per_row("presence_penalty")[row_ids], accumulate=True)


def _flat_tokens(
    rows: Sequence[SampleRow], which: list[int], *, output_only: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of the rows `which` (their output only, or prompt and output)."""
    tokens = [rows[i].tokens[rows[i].prompt_len :] if output_only else rows[i].tokens for i in which]
    lengths = torch.tensor([len(t) for t in tokens], device=device)
    row_ids = torch.repeat_interleave(torch.tensor(which, device=device), lengths)
    token_ids = torch.tensor(list(itertools.chain.from_iterable(tokens)), dtype=torch.long, device=device)
    return row_ids, token_ids


def _scale(logits: torch.Tensor, params: list[SamplingParams], random: list[int]) -> torch.Tensor:
    """The random rows' logits divided by their temperatures, then min_p where any row asks for it."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    scaled = logits[torch.tensor(random, device=device)] / temperature[:, None]
    return scaled if all(p.min_p == 0.0 for p in params) else _apply_min_p(scaled, params)


def _apply_min_p(scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Tokens whose probability is below min_p times the top one's set to -inf, as in vLLM: after temperature,
    before top-k and top-p."""
    min_p = torch.tensor([p.min_p for p in params], dtype=scaled.dtype, device=scaled.device)
    probs = torch.softmax(scaled, dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return scaled.masked_fill(probs < threshold, _NEG_INF)
