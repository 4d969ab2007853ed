"""Requests and their sequences, as the engine tracks them.

A request with n choices starts as one sequence (choice 0). When its prompt has been computed, the other
n - 1 choices are forked from it in blockd, so they share the prompt's blocks; each then samples on its own.

Per sequence, three counters always satisfy
    num_computed <= num_registered + reserved  and  num_registered <= len(tokens)
`num_computed` tokens have K/V in the cache, `num_registered` tokens are known to blockd (it holds blocks for
them, and `reserved` slots past them: room for tokens computed before they are registered, see
executor.scheduler), and `tokens` ends with the last sampled token, whose K/V the next step computes. `tokens`
only grows; the two counters move forward while the sequence runs, and preemption resets both (and
`committed_tokens`) to 0: its blocks are freed and it is admitted again later, recomputing what the prefix
cache no longer holds.
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

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs are asked and not all scored yet: the prompt must be computed, not taken from cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.sequences) and len(self.sequences) == self.params.n


@dataclass(eq=False)
class Sequence:
    seq_id: str
    request: Request
    index: int  # which of the request's n choices
    tokens: list[int]
    generator: torch.Generator | None
    status: Status = Status.WAITING
    num_computed: int = 0
    num_registered: int = 0
    committed_tokens: int = 0  # num_computed as of the last commit sent to blockd
    admitted_order: int = -1  # when it (last) became RUNNING: preemption takes the newest
    fork_parent: str | None = None  # set until the fork that creates it in blockd has been sent
    finish_reason: str | None = None
    preemptions: int = 0
    matcher: Any = None  # its xgrammar GrammarMatcher (structured output), advanced with each token

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def params(self) -> SamplingParams:
        return self.request.params
