"""Requests and their sequences (one per choice), as the engine tracks them, and how far each sequence has got.

A request with n choices starts as one sequence (choice 0); the other n - 1 are forked from it in blockd once
its prompt is computed, sharing the prompt's blocks (docs/architecture.md, "A step").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from executor.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not in blockd: new, or preempted
    RUNNING = "running"  # in blockd, holds blocks
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    params: SamplingParams
    prompt: list[int]
    cache_salt: str | None
    arrival_s: float
    sequences: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied at first admission
    grammar: Any = None  # its compiled structured-output grammar (xgrammar), once compiled
    # With params.prompt_logprobs: what the prefill has scored so far (entry i: prompt token i + 1), sent once
    # complete, in the request's first delta.
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
    beam: Any = None  # its executor.beam.BeamSearch, with params.beam_width (its sequences are the beams)

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs are asked and not all scored yet: the prompt must be computed, not taken from cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    @property
    def finished(self) -> bool:
        if self.beam is not None:
            return self.beam.done
        return all(s.status is Status.FINISHED for s in self.sequences) and len(self.sequences) == self.params.n


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request: Request
    index: int  # which of the request's n choices
    tokens: list[int]
    generator: torch.Generator | None
    status: Status = Status.WAITING
    # How far it has got: `tokens` only grows (the prompt, then each sampled token, whose K/V the next step
    # computes). How many tokens blockd holds is not counted here: the pool client's mirror says
    # (`Scheduler.registered`), and the mirror's `reserved` slots past them take tokens computed before they are
    # registered. Preemption resets both counters (its blocks go back; it is admitted again later and recomputes
    # what the prefix cache no longer holds).
    num_computed: int = 0  # tokens whose K/V are in the cache (prefix hits count): a step computes the rest
    committed_tokens: int = 0  # tokens the last planned commit covers: blockd indexes their full blocks
    admitted_order: int = -1  # when it (last) became RUNNING: preemption takes the newest
    fork_parent: str | None = None  # set until the fork that creates it in blockd has been sent
    finish_reason: str | None = None
    preemptions: int = 0
    matcher: Any = None  # its xgrammar GrammarMatcher (structured output), advanced with each token
    # Lower-tier loads still reading (ticket -> device block: executor.tier_store): `num_computed` counts their
    # tokens, but until every one has landed the sequence is not scheduled and nothing past `committed_tokens` is
    # committed, so neither it nor another sequence reads those blocks.
    loading: dict[int, int] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def params(self) -> SamplingParams:
        return self.request.params
