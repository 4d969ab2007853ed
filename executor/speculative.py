"""Speculative decoding: `--speculative-config` (vLLM's JSON), proposals for the decoding chunks of a step, and
the verification of a drafted row's sampled tokens.

A decoding chunk computes its sequence's last token; with a draft of d tokens it computes them too, as d more
query positions of the same forward pass over the paged KV, and the sampler draws a token from each of the d + 1
rows. The draft's accepted prefix is the tokens drawn equal to the draft's, and the token drawn after them (the
correction, or the bonus when all are accepted) ends the step's output. Proposals are point masses (n-gram
lookup; a draft model's greedy choice), for which this is exactly rejection sampling: draft token x is accepted
with probability min(1, p(x) / q(x)) = p(x), and a rejection draws from the residual (p - q)+, which is p without
x, renormalised: the token drawn from p when it is not x. So the output's distribution is the target's, token by
token, and greedy output is the argmax at every position, as without speculation.

The draft's K/V go into slots blockd holds reserved for the sequence past its tokens (never registered, so never
hashed nor committed): a rejected token's slot is the next token's, and the blocks a sequence's reservation
holds past what it needs go back through blockd's `trim` (docs/architecture.md, "Speculative decoding").
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from blockd.client import MirroredSequence
from common.tokens import TOKEN_BYTES
from executor.scheduler import Chunk
from executor.sequence import Sequence

METHODS = ("ngram", "draft_model")
_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


class SpeculativeConfigError(ValueError):
    """A `--speculative-config` that cannot be served (a bad key or value, a draft model that does not fit the
    target): refused at startup."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int  # k: the most draft tokens per sequence and step
    prompt_lookup_max: int = 0  # ngram: the longest suffix of the sequence looked up
    prompt_lookup_min: int = 0  # ngram: the shortest
    model: str | None = None  # draft_model: its checkpoint directory

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """vLLM's JSON: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
        "prompt_lookup_min": m} or {"method": "draft_model", "model": DIR, "num_speculative_tokens": k} (a
        "model" without a method is a draft model, as in vLLM; "model": "ngram" is the n-gram method)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("must be a JSON object")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise SpeculativeConfigError(f"unknown keys {unknown} (known: {sorted(_KEYS)})")
        method, model = raw.get("method"), raw.get("model")
        if method is None and model is not None:
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method not in METHODS:
            raise SpeculativeConfigError(f"method must be one of {list(METHODS)}, got {method!r}")
        k = raw.get("num_speculative_tokens")
        if type(k) is not int or k < 1:
            raise SpeculativeConfigError(f"num_speculative_tokens must be a positive integer, got {k!r}")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise SpeculativeConfigError('method "draft_model" needs "model": a directory')
            if "prompt_lookup_max" in raw or "prompt_lookup_min" in raw:
                raise SpeculativeConfigError("prompt_lookup_* are for the ngram method")
            return cls(method, k, model=model)
        if model not in (None, "ngram", "[ngram]"):
            raise SpeculativeConfigError('the ngram method takes no "model"')
        lo, hi = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's default
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if type(value) is not int or value < 1:
                raise SpeculativeConfigError(f"{name} must be a positive integer, got {value!r}")
        if lo > hi:
            raise SpeculativeConfigError(f"prompt_lookup_min {lo} > prompt_lookup_max {hi}")
        return cls(method, k, prompt_lookup_max=hi, prompt_lookup_min=lo)

    def check_block_size(self, block_size: int) -> None:
        """A draft must fit in the room one append reserves (blockd.block_rule.reservable: a block at least)."""
        if self.num_speculative_tokens >= block_size:
            raise SpeculativeConfigError(
                f"num_speculative_tokens ({self.num_speculative_tokens}) must be below the block size ({block_size})"
            )


class Proposer(Protocol):
    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, most): at most `most` (>= 1) tokens likely to follow the sequence's tokens."""


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens, for
    the longest n in [min, max] that occurs. The search is bytes.rfind over the tokens packed 4 bytes each (kept
    per sequence and extended as it grows), so a long context costs a C-speed scan, not a Python loop."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._packed: weakref.WeakKeyDictionary[Sequence, bytearray] = weakref.WeakKeyDictionary()

    def _bytes(self, seq: Sequence) -> bytearray:
        packed = self._packed.get(seq)
        if packed is None:
            packed = self._packed[seq] = bytearray()
        have = len(packed) // TOKEN_BYTES
        if have > len(seq.tokens):  # (a sequence's tokens only grow; be safe all the same)
            del packed[:]
            have = 0
        for token in seq.tokens[have:]:
            packed += token.to_bytes(TOKEN_BYTES, "little")
        return packed

    def propose_all(self, wanted: list[tuple[Sequence, int]]) -> list[list[int]]:
        return [self.propose(seq, most) for seq, most in wanted]

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        tokens = seq.tokens
        total = len(tokens)
        packed = self._bytes(seq)
        for n in range(min(self.lookup_max, total - 1), self.lookup_min - 1, -1):
            pattern = bytes(packed[(total - n) * TOKEN_BYTES :])
            end = (total - 1) * TOKEN_BYTES  # a match must end before the last token: one token at least follows
            while True:
                at = packed.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % TOKEN_BYTES == 0:
                    follow = at // TOKEN_BYTES + n
                    return tokens[follow : follow + max_tokens]
                end = at + len(pattern) - 1  # misaligned: look again left of it
        return []


@dataclass
class SpecStats:
    """What speculation did since the executor started (the load report carries them)."""

    drafts: int = 0  # drafted rows verified
    proposed_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


def held_slots(mirrored: MirroredSequence) -> int:
    """Token slots blockd holds for a sequence: registered tokens and reserved slots past them."""
    return len(mirrored.tokens) // TOKEN_BYTES + mirrored.reserved


class Speculator:
    """Puts drafts on a step's decoding chunks and counts what verification accepts."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecStats()

    @property
    def lookahead(self) -> int:
        """Slots past a sequence's next token the scheduler keeps held, so that a full draft fits."""
        return self.config.num_speculative_tokens + 1

    def propose(self, chunks: list[Chunk], tables: Mapping[str, MirroredSequence], budget: int) -> None:
        """Set `draft` on the decoding chunks, within the step's token budget left (`budget`) and the room blockd
        holds for each sequence: the draft's positions and the next step's first one (the step after may have
        been planned already, for one sampled token: so every token this step can add must lie in room held now,
        docs/architecture.md, "Speculative decoding")."""
        k = self.config.num_speculative_tokens
        wanted: list[tuple[Chunk, int]] = []
        for chunk in chunks:
            if budget <= 0:
                break
            seq = chunk.seq
            if len(chunk.token_ids) != 1 or not chunk.samples or seq.matcher is not None or seq.params.beam_search:
                continue  # prefill chunks, structured output (its matcher would run ahead), beams (ranked together)
            params = seq.params
            n = len(seq.tokens)
            room = held_slots(tables[seq.seq_id]) - n - 1
            most = min(k, budget, room, params.max_tokens - seq.num_generated - 1, self.max_model_len - n - 1)
            if most <= 0:
                continue
            wanted.append((chunk, most))
            budget -= most
        if not wanted:
            return
        drafts = self.proposer.propose_all([(chunk.seq, most) for chunk, most in wanted])
        for (chunk, most), draft in zip(wanted, drafts, strict=True):
            chunk.draft = draft[:most]

    def verified(self, draft: list[int], sampled: list[int]) -> int:
        """How many of the draft's tokens the sampled ones accept (`sampled`: one per row, len(draft) + 1)."""
        accepted = 0
        while accepted < len(draft) and sampled[accepted] == draft[accepted]:
            accepted += 1
        self.stats.drafts += 1
        self.stats.proposed_tokens += len(draft)
        self.stats.accepted_tokens += accepted
        return accepted
