"""Overload decided at the door (--max-queue-delay): a new request is refused at once, 429 with Retry-After,
when the work already queued would keep it waiting past the bound; once accepted, it is served however long
that takes (completed, or cancelled by its client), never failed for being slow.

The wait is estimated per executor in rotation: the tokens its requests may still need computed (prompts not
started, choices' max_tokens left; `ExecutorLink.queued_tokens`: the executor's count, for every gateway, or this
gateway's own, if more), over the tokens per second its
steps measured (`ExecutorLink.tokens_per_s`, from its load reports). A request is refused only when every
executor in rotation has a measure and all of them are past the bound (the router picks the least loaded); an
executor not yet measured could take it, so it is admitted. The counts are an upper bound (a choice may stop
before its max_tokens, a cached prefix is not computed): the door errs towards refusing early, not failing late.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.executors import ExecutorLink

DEFAULT_MAX_QUEUE_DELAY_S = 60.0
MAX_RETRY_AFTER_S = 600


@dataclass(frozen=True)
class Refusal:
    wait_s: float  # the shortest estimated wait, over the executors in rotation
    retry_after_s: int  # when the queue should have drained below the bound


class Door:
    def __init__(self, links: Callable[[], Sequence[ExecutorLink]], max_queue_delay_s: float | None) -> None:
        self.links = links  # the executors in rotation now
        self.max_queue_delay_s = max_queue_delay_s or None  # None (or 0): no bound, only --max-queued-sequences

    def estimated_wait_s(self) -> float | None:
        """The shortest estimated wait for a new request, or None if some executor in rotation is unmeasured."""
        waits = [link.drain_s() for link in self.links()]
        if not waits or any(w is None for w in waits):
            return None
        return min(w for w in waits if w is not None)

    def check(self) -> Refusal | None:
        """A refusal if a request arriving now would wait past the bound; None: let it in."""
        bound = self.max_queue_delay_s
        if bound is None:
            return None
        wait = self.estimated_wait_s()
        if wait is None or wait <= bound:
            return None
        return Refusal(wait, max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait - bound))))
