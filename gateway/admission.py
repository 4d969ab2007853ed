"""Overload decided at the door (--max-queue-delay): a new request is refused at once, 429 with Retry-After,
when the work already queued would keep it waiting past the bound; once accepted, it is served however long
that takes, never failed for being slow (docs/architecture.md, "A request", step 2).
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
        """The shortest estimated wait for a new request (the router picks the least loaded), or None if some
        executor in rotation is unmeasured: that one could take it. Each wait is an upper bound (a choice may stop
        before its max_tokens, a cached prefix is not computed): the door errs towards refusing early, not failing
        late."""
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
