"""Which executor gets a request: the `prefix`, `least-loaded` and `round-robin` policies, and blockd's prefix
lookup they ask (an optimisation: unanswered in time, a request is routed as least-loaded). How each decides:
docs/architecture.md ("Routing").
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

import structlog

from blockd.client import BlockdClient, BlockdUnavailable
from blockd.errors import BlockdError
from blockd.protocol import LookupResult
from common.auth import ClientCurve
from gateway import ROUTING_POLICIES
from gateway.executors import ExecutorLink

log = structlog.get_logger("gateway")

POLICIES = ROUTING_POLICIES


#: What getting one prompt token's K/V onto an executor costs, in tokens computed (recompute = 1), by where the
#: K/V is: blockd's medium names (blockd.tiers; "GPU" is the device's cached prefix). Measured with `pagedkv bench
#: tiers --conversations 8 --turns 2 --first-tokens 1024 --user-tokens 16 --output-tokens 4 --clients 1 --configs
#: off,host,host+disk,host,off` (CPU, default model, 2026-12-02): a re-visited turn of ~1,044 tokens, 1,024 of them
#: loaded, took 487/299 ms recomputed (0.38 ms a token), 45/65 ms loaded from host memory and 87 ms with three in
#: four blocks from disk (page cache): a loaded token costs at most 0.12 (host) and 0.24 (disk) of a computed one,
#: the request's fixed costs included. The shared tier ("SHARED") is read as the disk is, from a file (measured on a
#: local directory; a network volume is dearer: every executor pays the same for it, so it rarely decides a route).
#: Only the order device < host < disk, shared < recompute matters much: the router compares executors whose load
#: is within --load-slack by this cost.
LOAD_COST_PER_TOKEN: Final[Mapping[str, float]] = MappingProxyType(
    {"GPU": 0.0, "CPU": 0.1, "DISK": 0.25, "SHARED": 0.25}
)
RECOMPUTE_COST_PER_TOKEN: Final = 1.0
#: A medium this gateway has no figure for (a newer blockd's tier): taken for a load as dear as the dearest known.
UNKNOWN_MEDIUM_COST_PER_TOKEN: Final = max(LOAD_COST_PER_TOKEN.values())
#: The `tier` a routing decision is counted under (pagedkv_gateway_routed_by_tier): the dearest medium the chosen
#: executor loads the prompt's K/V from, "recompute" when it holds none of it, "other" for an unknown medium.
TIER_LABELS: Final[Mapping[str, str]] = MappingProxyType(
    {"GPU": "device", "CPU": "host", "DISK": "disk", "SHARED": "shared"}
)
RECOMPUTE = "recompute"

#: Pool id -> medium -> prompt tokens there, in chain order from the device ("GPU") down (blockd's lookup).
Extents = dict[str, dict[str, int]]


@dataclass(frozen=True)
class Route:
    link: ExecutorLink
    # Prompt tokens blockd said this executor would not compute: its device's cached prefix and what its lower
    # tiers would load (0 if not asked)
    expected_cached_tokens: int
    # why, for the metric: the dearest medium those tokens come from (TIER_LABELS); None when blockd was not asked
    # or did not answer
    tier: str | None = None


def cost_of(medium: str) -> float:
    return LOAD_COST_PER_TOKEN.get(medium, UNKNOWN_MEDIUM_COST_PER_TOKEN)


def saved_cost(extent: Mapping[str, int]) -> float:
    """What the executor's K/V of the prompt saves against computing it all, in tokens computed: each token's
    recompute cost less its load cost. The prompt's length is the same for every executor, so the one with the
    most saved is the one whose prefill costs least."""
    return sum(n * (RECOMPUTE_COST_PER_TOKEN - cost_of(medium)) for medium, n in extent.items())


def tier_label(extent: Mapping[str, int]) -> str:
    media = [medium for medium, n in extent.items() if n > 0]
    if not media:
        return RECOMPUTE
    dearest = max(media, key=cost_of)
    return TIER_LABELS.get(dearest, "other")


def extents_of(result: LookupResult, prompt_tokens: int) -> Extents:
    """blockd's answer as one map per pool (the device's prefix as "GPU", then the lower tiers). A pool whose
    tokens add up to more than the prompt has is left out: the answer is wrong, so nothing of it is believed."""
    extents: Extents = {}
    for pool_id, device in result.cached_tokens.items():
        extent = {"GPU": device}
        extent.update((m, n) for m, n in result.tier_tokens.get(pool_id, {}).items() if m != "GPU")
        if sum(extent.values()) <= prompt_tokens:
            extents[pool_id] = extent
    return extents


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

    async def cached_tokens(self, tokens: Sequence[int], cache_salt: str | None = None) -> Extents:
        """Per pool, where the prompt's K/V is (`Extents`); {} while blockd does not answer."""
        if not self.reachable and self._clock() < self._next_try:
            return {}
        self._next_try = self._clock() + self.retry_after_s  # one probe at a time while it is away
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                self._thread, self._client.lookup_tiers, tokens, cache_salt
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
        return extents_of(result, len(tokens))

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
        cached: Extents = {}
        if self.policy == "prefix" and self.lookup is not None:
            cached = await self.lookup.cached_tokens(prompt, cache_salt)
            ordered = [link for link in ordered if link.healthy] or ordered  # the wait may have changed things
        return pick(ordered, cached if self.policy == "prefix" else {}, self.load_slack)


def load_of(link: ExecutorLink, load_slack: int) -> float:
    """Requests to work through, plus KV pressure: a cache full of live sequences counts as `load_slack` more
    requests (a new one there would wait for blocks or preempt)."""
    depth = link.queue_depth()
    # Live sequences are requests' (an executor with none to work through holds none, whatever a report taken while
    # one ran said).
    utilization = link.load.kv_utilization if link.load and depth else 0.0
    return depth + utilization * load_slack


def pick(ordered: list[ExecutorLink], cached: Extents, load_slack: int) -> Route:
    """The decision itself, given the candidates in tie-break order and, per pool, where blockd says the prompt's
    K/V is: among the executors within `load_slack` of the least loaded, the one whose prefill costs least
    (`saved_cost`), then the least loaded, then the rotation."""
    loads = {link.endpoint: load_of(link, load_slack) for link in ordered}
    lightest = min(loads.values())
    # a warm cache is worth a little queueing, not an unbounded hot spot
    eligible = [link for link in ordered if loads[link.endpoint] <= lightest + load_slack]
    saved = {link.endpoint: saved_cost(cached.get(link.pool_id or "", {})) for link in eligible}
    # max keeps the first of equals: the rotation decides ties
    best = max(eligible, key=lambda link: (saved[link.endpoint], -loads[link.endpoint]))
    extent = cached.get(best.pool_id or "", {})
    return Route(best, sum(extent.values()), tier_label(extent) if cached else None)
