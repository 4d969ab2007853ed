"""gateway.routing: which executor a request goes to, on real (unstarted) ExecutorLinks with set health and load."""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from collections.abc import Mapping, Sequence

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from blockd import protocol as p
from blockd.errors import BlockdError, ErrorCode
from executor import protocol as ep
from gateway import routing
from gateway.executors import ExecutorLink
from gateway.routing import POLICIES, Extents, PrefixLookup, Route, Router, load_of, pick

SLACK = 8


def make_link(
    name: str, *, running: int = 0, waiting: int = 0, kv: float = 0.0, in_flight: int = 0, healthy: bool = True
) -> ExecutorLink:
    """An ExecutorLink as its task would leave it after hearing from executor `name` (pool `pool-<name>`)."""
    link = ExecutorLink(f"tcp://{name}:5600", zmq.asyncio.Context.instance())
    pool = f"pool-{name}"
    link.healthy = healthy
    link.info = ep.Info(
        pool_id=pool,
        model_id="m",
        model_dir="/m",
        max_model_len=512,
        vocab_size=512,
        block_size=16,
        num_blocks=100,
        device="cpu",
        eos_token_ids=[1],
    )
    link.load = ep.LoadReport(
        pool_id=pool,
        running=running,
        waiting=waiting,
        free_blocks=round(100 * (1 - kv)),
        num_blocks=100,
        kv_utilization=kv,
        preemptions=0,
        steps=0,
    )
    for i in range(in_flight):
        link.streams[f"req-{i}"] = asyncio.Queue()
    return link


def on_device(cached: Mapping[str, int]) -> Extents:
    """Device hits only, as blockd answers for pools without lower tiers."""
    return {pool: {"GPU": n} for pool, n in cached.items()}


class FakeLookup:
    """Stands in for PrefixLookup at its boundary: an async `cached_tokens(tokens)` giving, per pool, the tokens on
    each medium (a plain number: on the device)."""

    def __init__(self, cached: Mapping[str, int | dict[str, int]], on_call: object = None) -> None:
        self.cached = {pool: {"GPU": n} if isinstance(n, int) else n for pool, n in cached.items()}
        self.calls: list[list[int]] = []
        self.on_call = on_call

    async def cached_tokens(self, tokens: Sequence[int], cache_salt: str | None = None) -> Extents:
        self.calls.append(list(tokens))
        if callable(self.on_call):
            self.on_call()
        await asyncio.sleep(0)
        return {pool: dict(extent) for pool, extent in self.cached.items()}


def choose(router: Router, prompt: Sequence[int] = (1, 2, 3), exclude: set[str] = frozenset()) -> Route | None:
    return asyncio.run(router.choose(prompt, exclude))


def name_of(route: Route | None) -> str | None:
    return None if route is None else route.link.endpoint.removeprefix("tcp://").removesuffix(":5600")


# ------------------------------------------------------------------------------------------------ load


def test_queue_depth_is_the_others_part_of_the_report_plus_our_requests_now() -> None:
    assert make_link("a", running=2, waiting=3).queue_depth() == 5
    assert make_link("a", running=1, in_flight=4).queue_depth() == 5, "requests we sent count before it reports"
    # A report asked for while one of ours ran: once ours is done, the executor is idle, whatever it said then.
    link = make_link("a", running=1)
    link._in_flight_at_report = 1
    assert link.queue_depth() == 0
    link.streams.update({"r1": asyncio.Queue(), "r2": asyncio.Queue()})  # two of ours now, one counted in the report
    assert link.queue_depth() == 2
    link.load = make_link("a", running=3, waiting=1).load  # another gateway's three besides ours
    assert link.queue_depth() == 3 + 2
    bare = ExecutorLink("tcp://x:1", zmq.asyncio.Context.instance())
    assert bare.queue_depth() == 0 and load_of(bare, SLACK) == 0.0 and bare.pool_id is None


def test_load_counts_full_kv_cache_as_load_slack_requests() -> None:
    assert load_of(make_link("a", running=2), SLACK) == 2.0
    assert load_of(make_link("a", running=2, kv=1.0), SLACK) == 2.0 + SLACK
    assert load_of(make_link("a", running=2, kv=0.5), SLACK) == 2.0 + SLACK / 2


# ------------------------------------------------------------------------------------------------ prefix


def test_prefix_holder_wins_within_load_slack() -> None:
    a, b, c = make_link("a", running=SLACK), make_link("b"), make_link("c", running=1)
    lookup = FakeLookup({"pool-a": 64, "pool-c": 16})
    router = Router([a, b, c], "prefix", lookup, load_slack=SLACK)
    for _ in range(6):  # whatever the rotation
        route = choose(router, [5] * 70)
        assert name_of(route) == "a", "A holds the longest prefix and is exactly load_slack above the lightest"
        assert route is not None and route.expected_cached_tokens == 64
    assert lookup.calls[0] == [5] * 70, "the prompt's tokens are what blockd is asked about"


def test_a_lone_executor_is_chosen_without_asking_blockd() -> None:
    lookup = FakeLookup({"pool-a": 64})
    router = Router([make_link("a"), make_link("b", healthy=False)], "prefix", lookup, load_slack=SLACK)
    route = choose(router, [5] * 70)
    assert name_of(route) == "a" and route is not None and route.expected_cached_tokens == 0
    assert lookup.calls == [], "one candidate: the lookup would only add a blockd round trip to the request"


def test_prefix_holder_beyond_the_slack_loses_to_the_least_loaded() -> None:
    a, b, c = make_link("a", running=SLACK + 1), make_link("b"), make_link("c", running=2)
    router = Router([a, b, c], "prefix", FakeLookup({"pool-a": 64}), load_slack=SLACK)
    for _ in range(6):
        route = choose(router)
        assert name_of(route) == "b", "A is more than load_slack above the lightest: the least loaded gets it"
        assert route is not None and route.expected_cached_tokens == 0


def test_second_best_holder_wins_when_the_best_is_overloaded() -> None:
    a, b, c = make_link("a", running=20), make_link("b", running=5), make_link("c")
    router = Router([a, b, c], "prefix", FakeLookup({"pool-a": 64, "pool-b": 32}), load_slack=SLACK)
    route = choose(router)
    assert name_of(route) == "b" and route is not None and route.expected_cached_tokens == 32


def test_kv_pressure_counts_against_a_prefix_holder() -> None:
    # A's cache is full of live sequences: with 1 request in flight its load is 1 + SLACK, beyond the slack.
    a, b = make_link("a", running=1, kv=1.0), make_link("b")
    router = Router([a, b], "prefix", FakeLookup({"pool-a": 64}), load_slack=SLACK)
    assert [name_of(choose(router)) for _ in range(4)] == ["b"] * 4
    # With nothing to work through its sequences are gone (the report was taken while they ran): the warm cache wins.
    a.load = make_link("a", running=0, kv=1.0).load
    assert [name_of(choose(router)) for _ in range(4)] == ["a"] * 4


def test_cold_prompts_spread_evenly_over_equal_executors() -> None:
    links = [make_link(n, running=2) for n in "abc"]
    router = Router(links, "prefix", FakeLookup({}), load_slack=SLACK)
    chosen = [name_of(choose(router)) for _ in range(30)]
    assert collections.Counter(chosen) == {"a": 10, "b": 10, "c": 10}, chosen
    assert all(x != y for x, y in itertools.pairwise(chosen)), f"rotation: no executor twice in a row: {chosen}"


def test_cold_prompts_go_to_the_least_loaded() -> None:
    links = [make_link("a", running=3), make_link("b", running=1), make_link("c", running=2)]
    router = Router(links, "prefix", FakeLookup({"pool-zzz": 99}), load_slack=SLACK)  # cached in an unknown pool
    assert {name_of(choose(router)) for _ in range(6)} == {"b"}


def test_prefix_without_lookup_routes_as_least_loaded() -> None:
    links = [make_link("a", running=3), make_link("b", running=1)]
    router = Router(links, "prefix", None, load_slack=SLACK)
    assert {name_of(choose(router)) for _ in range(4)} == {"b"}


def test_link_lost_while_blockd_answers_is_not_chosen() -> None:
    a, b = make_link("a"), make_link("b", running=5)

    def lose_a() -> None:
        a.healthy = False

    router = Router([a, b], "prefix", FakeLookup({"pool-a": 64}, on_call=lose_a), load_slack=SLACK)
    assert name_of(choose(router)) == "b"


# ------------------------------------------------------------------------------------------------ other policies


def test_least_loaded_picks_fewest_requests() -> None:
    links = [
        make_link("a", running=4),
        make_link("b", running=2, waiting=1),
        make_link("c", running=1, waiting=1),
        make_link("d", in_flight=3),
    ]
    lookup = FakeLookup({"pool-a": 100})
    router = Router(links, "least-loaded", lookup, load_slack=SLACK)
    for _ in range(8):
        route = choose(router)
        assert name_of(route) == "c" and route is not None and route.expected_cached_tokens == 0
    assert lookup.calls == [], "least-loaded never asks blockd"


def test_least_loaded_counts_requests_sent_but_not_yet_reported() -> None:
    a, b = make_link("a", running=1), make_link("b", running=0, in_flight=3)
    router = Router([a, b], "least-loaded", None, load_slack=SLACK)
    assert {name_of(choose(router)) for _ in range(4)} == {"a"}


def test_least_loaded_counts_kv_pressure() -> None:
    """A cache full of live sequences is as busy as load_slack more requests: one request elsewhere is lighter."""
    a, b = make_link("a", running=1, kv=1.0), make_link("b", running=2, kv=0.0)
    router = Router([a, b], "least-loaded", None, load_slack=SLACK)
    assert [name_of(choose(router)) for _ in range(4)] == ["b"] * 4


def test_a_report_taken_while_our_request_ran_does_not_make_an_idle_executor_busy() -> None:
    """Reports come every half second; requests of a few tens of milliseconds finish in between. A report that
    counted one of ours, its sequence's blocks live, must not send every request meanwhile elsewhere."""
    a, b = make_link("a", running=1, kv=0.4), make_link("b")
    a._in_flight_at_report = 1  # the report was asked for while our request ran there; it has finished since
    assert load_of(a, SLACK) == 0.0
    router = Router([a, b], "least-loaded", None, load_slack=SLACK)
    assert sorted(name_of(choose(router)) for _ in range(4)) == ["a", "a", "b", "b"], "idle equals idle: rotation"


def test_round_robin_cycles() -> None:
    links = [make_link("a", running=10), make_link("b"), make_link("c", kv=1.0)]
    router = Router(links, "round-robin", FakeLookup({"pool-b": 50}), load_slack=SLACK)
    chosen = [name_of(choose(router)) for _ in range(7)]
    assert chosen == ["a", "b", "c", "a", "b", "c", "a"], "round-robin ignores load and cache"
    route = choose(router)
    assert route is not None and route.expected_cached_tokens == 0, "round-robin does not ask blockd"


@pytest.mark.parametrize("policy", POLICIES)
def test_unhealthy_and_excluded_links_are_never_chosen(policy: str) -> None:
    a = make_link("a", healthy=False)  # the lightest and the prefix holder, but out of rotation
    b, c, d = make_link("b", running=2), make_link("c", running=2), make_link("d", running=2)
    router = Router([a, b, c, d], policy, FakeLookup({"pool-a": 64, "pool-c": 64}), load_slack=SLACK)
    chosen = {name_of(choose(router, exclude={c.endpoint})) for _ in range(12)}
    assert chosen == {"b", "d"}, f"{policy}: chose {chosen}"


@pytest.mark.parametrize("policy", POLICIES)
def test_none_when_no_executor_is_healthy(policy: str) -> None:
    links = [make_link("a", healthy=False), make_link("b", healthy=False)]
    lookup = FakeLookup({"pool-a": 10})
    router = Router(links, policy, lookup, load_slack=SLACK)
    assert choose(router) is None
    assert Router([], policy, lookup).healthy() == []
    assert choose(Router([], policy, lookup)) is None
    ok = make_link("c")
    assert choose(Router([ok, *links], policy, lookup, load_slack=SLACK), exclude={ok.endpoint}) is None
    assert lookup.calls == [], "with nothing to choose from blockd is not asked"


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        Router([make_link("a")], "random", None)


def test_pick_keeps_rotation_order_for_ties() -> None:
    a, b, c = make_link("a"), make_link("b"), make_link("c")
    assert pick([b, c, a], {}, SLACK).link is b
    assert pick([c, a, b], on_device({"pool-a": 0}), SLACK).link is c
    assert pick([c, a, b], on_device({"pool-a": 16, "pool-b": 16}), SLACK).link is a


# ------------------------------------------------------------------------------------------------ blockd lookup


class FakeClock:
    """A clock that moves only when the test moves it: back-off is checked by what happens, not by timing."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counted_lookup(retry_after_s: float) -> tuple[PrefixLookup, FakeClock, list[tuple[int, ...]]]:
    """A lookup against an absent blockd, its clock, and the lookups that reached the (real) blockd client."""
    clock = FakeClock()
    lookup = PrefixLookup("tcp://127.0.0.1:1", timeout_s=0.05, retry_after_s=retry_after_s, clock=clock)
    calls: list[tuple[int, ...]] = []
    original = lookup._client.lookup_tiers

    def counted(tokens, cache_salt=None):
        calls.append(tuple(tokens))
        return original(tokens, cache_salt)

    lookup._client.lookup_tiers = counted  # type: ignore[method-assign]
    return lookup, clock, calls


def test_prefix_lookup_against_unreachable_blockd_returns_nothing() -> None:
    lookup, clock, calls = counted_lookup(retry_after_s=2.0)
    try:
        assert asyncio.run(lookup.cached_tokens([1, 2, 3])) == {}
        assert lookup.reachable is False and calls == [(1, 2, 3)]
        clock.now += 2.0
        assert asyncio.run(lookup.cached_tokens([4, 5])) == {}, "and again, without raising"
        assert lookup.reachable is False and calls == [(1, 2, 3), (4, 5)]
    finally:
        lookup.close()


def test_prefix_lookup_does_not_ask_an_absent_blockd_again_until_its_retry_time() -> None:
    lookup, clock, calls = counted_lookup(retry_after_s=0.5)
    try:
        assert asyncio.run(lookup.cached_tokens([1])) == {} and len(calls) == 1
        for _ in range(5):  # within the back-off: answered at once, blockd not asked (so nothing waits on it)
            clock.now += 0.09
            assert asyncio.run(lookup.cached_tokens([1])) == {}
        assert len(calls) == 1, "no attempt while blockd is known to be away"
        clock.now += 0.06  # 0.51 s after the failure
        assert asyncio.run(lookup.cached_tokens([1])) == {} and len(calls) == 2, "a new probe after retry_after_s"
        assert asyncio.run(lookup.cached_tokens([1])) == {} and len(calls) == 2, "and the back-off starts over"
    finally:
        lookup.close()


def test_router_falls_back_to_least_loaded_when_blockd_is_away() -> None:
    lookup = PrefixLookup("tcp://127.0.0.1:1", timeout_s=0.05)
    try:
        router = Router([make_link("a", running=3), make_link("b", running=1)], "prefix", lookup, load_slack=SLACK)
        route = choose(router)
        assert name_of(route) == "b" and route is not None and route.expected_cached_tokens == 0
    finally:
        lookup.close()


# ------------------------------------------------------------------------------------------------ lower tiers

MEDIA = ("GPU", "CPU", "DISK", "SHARED", "NVME-OF")  # NVME-OF: a medium this gateway has no cost for


def test_a_prefix_in_a_lower_tier_is_routed_to_the_executor_that_holds_it() -> None:
    a, b = make_link("a", running=1), make_link("b")
    router = Router([a, b], "prefix", FakeLookup({"pool-a": {"GPU": 0, "CPU": 64}, "pool-b": 0}), load_slack=SLACK)
    for _ in range(4):  # whatever the rotation: loading 64 tokens beats computing them, within the slack
        route = choose(router, [5] * 70)
        assert name_of(route) == "a" and route is not None
        assert route.expected_cached_tokens == 64, "loaded tokens count as cached"
        assert route.tier == "host"


def test_device_beats_host_beats_disk_beats_recompute_for_the_same_tokens() -> None:
    links = {n: make_link(n) for n in "abcd"}
    extents = {
        "pool-a": {"GPU": 0},
        "pool-b": {"GPU": 0, "DISK": 32},
        "pool-c": {"GPU": 0, "CPU": 32},
        "pool-d": {"GPU": 32},
    }
    for name, tier in [("d", "device"), ("c", "host"), ("b", "disk"), ("a", "recompute")]:
        for order in itertools.permutations(links.values()):  # whatever the rotation
            route = pick(list(order), extents, SLACK)
            assert (name_of(route), route.tier) == (name, tier)
        del links[name], extents[f"pool-{name}"]  # the winner gone, the next best wins


def test_a_longer_prefix_on_disk_beats_a_shorter_one_on_the_device_by_what_it_saves() -> None:
    a, b = make_link("a"), make_link("b")
    # Saved against recomputing: A 64 x (1 - DISK's 0.25) = 48 tokens; B 32 on the device, 32.
    assert name_of(pick([b, a], {"pool-a": {"GPU": 0, "DISK": 64}, "pool-b": {"GPU": 32}}, SLACK)) == "a"
    # B 56 on the device saves more than A's 48: B, though A would compute fewer tokens.
    route = pick([a, b], {"pool-a": {"GPU": 0, "DISK": 64}, "pool-b": {"GPU": 56}}, SLACK)
    assert name_of(route) == "b" and route.expected_cached_tokens == 56 and route.tier == "device"
    # A device prefix and host loads after it: the chain's dearest medium names the decision.
    route = pick([a, b], {"pool-a": {"GPU": 16, "CPU": 48}, "pool-b": {"GPU": 56}}, SLACK)
    assert name_of(route) == "a" and route.expected_cached_tokens == 64 and route.tier == "host"


def test_a_prefix_in_a_lower_tier_is_not_worth_more_than_the_load_slack() -> None:
    a, b = make_link("a", running=SLACK + 1), make_link("b")
    router = Router([a, b], "prefix", FakeLookup({"pool-a": {"GPU": 0, "CPU": 4096}, "pool-b": 0}), load_slack=SLACK)
    route = choose(router, [5] * 5000)
    assert name_of(route) == "b" and route is not None and route.tier == "recompute"


def test_an_unknown_medium_costs_as_the_dearest_known_load() -> None:
    a, b, c = make_link("a"), make_link("b"), make_link("c")
    extents = {"pool-a": {"GPU": 0, "NVME-OF": 32}, "pool-b": {"GPU": 0, "CPU": 32}, "pool-c": {"GPU": 0}}
    assert name_of(pick([a, c, b], extents, SLACK)) == "b", "a known host load is cheaper"
    route = pick([c, a], extents, SLACK)
    assert name_of(route) == "a" and route.tier == "other", "any load beats recomputing; its label stays bounded"


def test_the_shared_tier_costs_as_the_disk_and_counts_as_shared() -> None:
    a, b, c = make_link("a"), make_link("b"), make_link("c")
    extents = {"pool-a": {"GPU": 0, "SHARED": 32}, "pool-b": {"GPU": 0, "CPU": 32}, "pool-c": {"GPU": 0}}
    assert name_of(pick([a, c, b], extents, SLACK)) == "b", "the host is nearer than the shared volume"
    route = pick([c, a], extents, SLACK)
    assert name_of(route) == "a" and route.tier == "shared", "loading from the volume beats recomputing"
    assert routing.cost_of("SHARED") == routing.cost_of("DISK")


def test_not_asking_blockd_counts_no_tier() -> None:
    a, b = make_link("a"), make_link("b")
    assert choose(Router([a, b], "least-loaded", FakeLookup({"pool-a": 64}))).tier is None
    assert choose(Router([a, b], "prefix", None)).tier is None
    assert choose(Router([a, b], "prefix", FakeLookup({}))).tier is None, "no answer: no reason to count"


def extents_strategy() -> st.SearchStrategy[dict[str, int]]:
    return st.dictionaries(st.sampled_from(MEDIA), st.integers(0, 64).map(lambda n: n * 16), max_size=len(MEDIA))


def cumulative(extent: Mapping[str, int]) -> list[int]:
    """Tokens available at each cost or cheaper, over every cost a medium has: a dominates b where a's list is
    element-wise at least b's (as near, or nearer, for every token)."""
    costs = sorted({routing.cost_of(m) for m in MEDIA})
    return [sum(n for m, n in extent.items() if routing.cost_of(m) <= c) for c in costs]


@settings(max_examples=300, deadline=None)
@given(a=extents_strategy(), b=extents_strategy(), flip=st.booleans())
def test_at_equal_load_a_dominated_executor_is_never_preferred(a: dict[str, int], b: dict[str, int], flip: bool):
    """Never more recompute, or a dearer load, for nothing: if A's K/V of the prompt is as near as B's for every
    token (and nearer for some), B is not chosen at equal load, whatever the rotation."""
    if not all(x >= y for x, y in zip(cumulative(a), cumulative(b), strict=True)) or cumulative(a) == cumulative(b):
        return
    la, lb = make_link("a", running=2), make_link("b", running=2)
    route = pick([lb, la] if flip else [la, lb], {"pool-a": a, "pool-b": b}, SLACK)
    assert name_of(route) == "a"
    assert route.expected_cached_tokens == sum(a.values())


@settings(max_examples=300, deadline=None)
@given(
    extents=st.lists(extents_strategy(), min_size=2, max_size=4),
    loads=st.lists(st.integers(0, 3 * SLACK), min_size=4, max_size=4),
    moved=st.integers(0, 3),
)
def test_moving_tokens_nearer_never_loses_the_route_and_the_slack_always_holds(
    extents: list[dict[str, int]], loads: list[int], moved: int
):
    links = [make_link(str(i), running=loads[i]) for i in range(len(extents))]
    cached = {f"pool-{i}": e for i, e in enumerate(extents)}
    route = pick(links, cached, SLACK)
    lightest = min(load_of(link, SLACK) for link in links)
    assert load_of(route.link, SLACK) <= lightest + SLACK, "a warm cache never outweighs the load slack"
    chosen = cached[route.link.pool_id or ""]
    assert route.expected_cached_tokens == sum(chosen.values())
    # The chosen executor's K/V moves nearer (16 tokens of its dearest medium onto the device, or 16 recomputed
    # tokens found in a tier): it is still chosen.
    nearer = dict(chosen)
    dearest = max((m for m, n in nearer.items() if n > 0 and m != "GPU"), key=routing.cost_of, default=None)
    if dearest is not None:
        nearer[dearest] -= 16
        nearer["GPU"] = nearer.get("GPU", 0) + 16
    else:
        nearer[MEDIA[moved]] = nearer.get(MEDIA[moved], 0) + 16
    assert pick(links, {**cached, route.link.pool_id or "": nearer}, SLACK).link is route.link


def test_blockds_answer_becomes_one_map_per_pool_and_a_wrong_one_is_not_believed() -> None:
    result = p.LookupResult(
        cached_tokens={"a": 16, "b": 0, "c": 32, "d": 0},
        tier_tokens={"a": {"CPU": 32}, "c": {"DISK": 48}, "d": {"GPU": 64, "CPU": 16}, "ghost": {"CPU": 16}},
    )
    extents = routing.extents_of(result, prompt_tokens=70)
    assert extents["a"] == {"GPU": 16, "CPU": 32} and extents["b"] == {"GPU": 0}
    assert "c" not in extents, "32 + 48 tokens of a 70-token prompt: a wrong answer, none of it believed"
    assert extents["d"] == {"GPU": 0, "CPU": 16}, "the device's count is cached_tokens', never a tier's"
    assert "ghost" not in extents, "a pool that is not in the answer's device counts is not one"


class HostileBlockd:
    """A ROUTER on loopback answering every lookup with one given reply body (real sockets): the answers of a
    broken or foreign blockd, for the gateway's side of the boundary."""

    def __init__(self, result: object) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.result = result
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:  # (the socket is this thread's from here on: ZeroMQ sockets are not thread-safe)
        while not self._stop.is_set():
            if not self.socket.poll(20):
                continue
            peer, frame = self.socket.recv_multipart()
            request = msgspec.msgpack.decode(frame)
            reply = {"v": p.PROTOCOL_VERSION, "id": request["id"], "ok": True, "result": self.result}
            self.socket.send_multipart([peer, msgspec.msgpack.encode(reply)])
        self.socket.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.context.term()


@pytest.mark.parametrize(
    "result",
    [
        {"cached_tokens": {"pool-a": 16}, "tier_tokens": {"pool-a": {"CPU": -16}}},  # a negative count
        {"cached_tokens": {"pool-a": 16}, "tier_tokens": {"pool-a": {"C" * 33: 16}}},  # a medium name too long
        {"cached_tokens": {"pool-a": 16}, "tier_tokens": {"pool-a": {f"M{i}": 16 for i in range(9)}}},  # too many
        {"cached_tokens": {"pool-a": 16}, "tier_tokens": {"pool-a": [16]}},  # not a map
        {"cached_tokens": {f"p{i}": 0 for i in range(p.MAX_LOOKUP_POOLS + 1)}},  # more pools than any blockd has
        {"cached_tokens": "all of them"},
    ],
    ids=["negative", "long-medium", "many-media", "not-a-map", "many-pools", "not-counts"],
)
def test_a_lookup_reply_that_breaks_the_schema_routes_as_least_loaded(result: object) -> None:
    blockd = HostileBlockd(result)
    lookup = PrefixLookup(blockd.endpoint, timeout_s=2.0)
    try:
        with pytest.raises(BlockdError) as refused:
            lookup._client.lookup_tiers([5] * 40)
        assert refused.value.code == ErrorCode.BAD_MESSAGE and "does not decode" in refused.value.message
        router = Router([make_link("a", running=3), make_link("b", running=1)], "prefix", lookup, load_slack=SLACK)
        route = choose(router, [5] * 40)
        assert name_of(route) == "b" and route is not None and route.tier is None, "no answer believed"
        assert lookup.reachable is False
    finally:
        lookup.close()
        blockd.close()


def test_a_lookup_of_a_blockd_with_lower_tiers_reaches_the_router_whole() -> None:
    blockd = HostileBlockd({"cached_tokens": {"pool-a": 0, "pool-b": 16}, "tier_tokens": {"pool-a": {"CPU": 32}}})
    lookup = PrefixLookup(blockd.endpoint, timeout_s=2.0)
    try:
        assert asyncio.run(lookup.cached_tokens([5] * 40)) == {"pool-a": {"GPU": 0, "CPU": 32}, "pool-b": {"GPU": 16}}
        router = Router([make_link("a"), make_link("b")], "prefix", lookup, load_slack=SLACK)
        route = choose(router, [5] * 40)
        assert (
            name_of(route) == "a" and route is not None and (route.expected_cached_tokens, route.tier) == (32, "host")
        )
    finally:
        lookup.close()
        blockd.close()
