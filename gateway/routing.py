"""Which executor gets a request: the `prefix`, `least-loaded` and `round-robin` policies, and blockd's prefix
lookup they ask (an optimisation: unanswered in time, a request is routed as least-loaded). How each decides:
docs/architecture.md ("Routing").
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import structlog

from blockd.client import BlockdClient, BlockdUnavailable
from blockd.errors import BlockdError
from common.auth import ClientCurve
from gateway import ROUTING_POLICIES
from gateway.executors import ExecutorLink

log = structlog.get_logger("gateway")

POLICIES = ROUTING_POLICIES


@dataclass(frozen=True)
class Route:
    link: ExecutorLink
    expected_cached_tokens: int  # what blockd said this executor holds of the prompt (0 if not asked)


class PrefixLookup:
    """blockd's prefix lookup, off the event loop (the client is synchronous and not thread-safe: one thread).

    After a lookup fails, requests are routed without one for `retry_after_s`: a blockd that is away must not
    add its timeout to every request (nor queue them behind each other on the lookup thread).
    """

    def __init__(
        self,
        endpoint: str,
        timeout_s: float = 0.25,
        retry_after_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        curve: ClientCurve | None = None,
    ) -> None:
        self._client = BlockdClient(endpoint, timeout_s=timeout_s, curve=curve)
        self._clock = clock
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockd-lookup")
        self.retry_after_s = retry_after_s
        self.reachable = True
        self._next_try = 0.0

    async def cached_tokens(self, tokens: Sequence[int], cache_salt: str | None = None) -> dict[str, int]:
        if not self.reachable and self._clock() < self._next_try:
            return {}
        self._next_try = self._clock() + self.retry_after_s  # one probe at a time while it is away
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._thread, self._client.lookup, tokens, cache_salt
            )
        except (BlockdUnavailable, BlockdError) as exc:
            if self.reachable:
                log.warning(
                    "prefix_lookup_failed", error=str(exc), fallback="least-loaded", retry_after_s=self.retry_after_s
                )
            self.reachable = False
            self._next_try = self._clock() + self.retry_after_s
            return {}
        if not self.reachable:
            log.info("prefix_lookup_recovered")
        self.reachable = True
        return result

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._client.close()


class Router:
    def __init__(
        self, links: Sequence[ExecutorLink], policy: str, lookup: PrefixLookup | None, load_slack: int = 8
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.links = list(links)
        self.policy = policy
        self.lookup = lookup
        self.load_slack = load_slack
        self._turn = itertools.count()

    def healthy(self, exclude: AbstractSet[str] = frozenset()) -> list[ExecutorLink]:
        return [link for link in self.links if link.healthy and link.endpoint not in exclude]

    def _in_turn(self, links: list[ExecutorLink]) -> list[ExecutorLink]:
        """The links rotated by one more each call: the tie-break that spreads equal choices."""
        start = next(self._turn) % len(links)
        return links[start:] + links[:start]

    async def choose(
        self, prompt: Sequence[int], exclude: AbstractSet[str] = frozenset(), cache_salt: str | None = None
    ) -> Route | None:
        """The executor for this prompt (prefixes looked up under its cache salt), or None if no executor is in
        rotation."""
        candidates = self.healthy(exclude)
        if not candidates:
            return None
        ordered = self._in_turn(candidates)
        if self.policy == "round-robin" or len(ordered) == 1:
            return Route(ordered[0], 0)  # nothing to choose between: no blockd lookup on the request's path
        cached: dict[str, int] = {}
        if self.policy == "prefix" and self.lookup is not None:
            cached = await self.lookup.cached_tokens(prompt, cache_salt)
            ordered = [link for link in ordered if link.healthy] or ordered  # the wait may have changed things
        return pick(ordered, cached if self.policy == "prefix" else {}, self.load_slack)


def load_of(link: ExecutorLink, load_slack: int) -> float:
    """Requests to work through, plus KV pressure: a cache full of live sequences counts as `load_slack` more
    requests (a new one there would wait for blocks or preempt)."""
    utilization = link.load.kv_utilization if link.load else 0.0
    return link.queue_depth() + utilization * load_slack


def pick(ordered: list[ExecutorLink], cached: dict[str, int], load_slack: int) -> Route:
    """The decision itself, given the candidates in tie-break order and blockd's cached tokens per pool."""
    loads = {link.endpoint: load_of(link, load_slack) for link in ordered}
    lightest = min(loads.values())
    # a warm cache is worth a little queueing, not an unbounded hot spot
    eligible = [link for link in ordered if loads[link.endpoint] <= lightest + load_slack]
    # max keeps the first of equals: the rotation decides ties
    best = max(eligible, key=lambda link: (cached.get(link.pool_id or "", 0), -loads[link.endpoint]))
    return Route(best, cached.get(best.pool_id or "", 0))
