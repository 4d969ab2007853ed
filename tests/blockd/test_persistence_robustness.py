"""Persistence that shrugs off bad data, against a real redis-server: corrupt and unknown-version records are
skipped and counted, never fatal; the writer survives errors, is restarted if it dies, and its queue is bounded;
key prefixes keep deployments that share one Redis apart."""

from __future__ import annotations

import random
import threading
import time
import urllib.request

import msgspec
import pytest

from blockd import protocol as p
from blockd.client import PoolClient
from blockd.manager import BlockManager
from blockd.persistence import META_KEY, POOLS_KEY, RedisKeys, RedisPersistence, load, log_key, snapshot_key
from blockd.pool import PoolSpec
from common.net import free_port
from tests.blockd.pool_state import index_view
from tests.support.persistence import blocks_and_generations, churn, validated
from tests.support.waiting import wait_for

BS = 4


def pool_client(daemon, pool_id: str = "ex0", epoch: int = 41) -> PoolClient:
    client = PoolClient(
        daemon.client(timeout_s=2.0), pool_id=pool_id, num_blocks=64, block_size=BS, model_id="tiny", epoch=epoch
    )
    client.register()
    return client


def cache(ex: PoolClient, seq_id: str, tokens: list[int]) -> None:
    ex.admit(seq_id, tokens)
    ex.commit(seq_id, len(tokens))
    ex.free(seq_id)


def persisted(redis_process, pool_id: str = "ex0", keys: RedisKeys | None = None) -> int:
    return len(load(redis_process.client(), keys or RedisKeys()).records.get(pool_id, {}))


def test_corrupt_records_are_skipped_counted_and_replaced(redis_process, start_blockd):
    port = free_port()
    args = ("--redis-url", redis_process.url, "--flush-interval", "0.05", "--lease-timeout", "30")
    daemon = start_blockd(*args, "--metrics-port", str(port))
    ex = pool_client(daemon)
    cache(ex, "kept", list(range(100, 117)))  # 4 full blocks
    wait_for(lambda: persisted(redis_process) == 4, what="index in redis")
    daemon.kill9()

    redis = redis_process.client()
    redis.rpush(log_key("ex0"), b"\xc1 not msgpack")  # a blob that does not decode
    redis.rpush(log_key("ex0"), msgspec.msgpack.encode({3: [b"short hash", 1, 1]}))  # breaks the schema
    redis.hset(POOLS_KEY, "bad", b"\x00garbage")  # a pool spec that does not decode
    redis.hset(POOLS_KEY, "zz", msgspec.msgpack.encode(PoolSpec("zz", 8, BS, "tiny", 3)))
    redis.set(snapshot_key("zz"), "a string, not a list")  # a key of the wrong type
    daemon.start()

    with daemon.client() as operator:
        stats = operator.stats()
        assert stats.persistence.skipped_records == 4 and stats.persistence.state == "ok"
        assert sorted(stats.dormant_pools) == ["ex0", "zz"]
    assert daemon.log().count("bad records in redis skipped") == 1  # one line per load, not one per record
    # The gauges are refreshed once a second, between requests: the count may reach them after stats did.
    wait_for(
        lambda: (
            "blockd_persistence_skipped_records 4.0"
            in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        ),
        what="the skipped-records metric",
    )

    # What was readable is served: the executor re-syncs and finds its prefix.
    ex.heartbeat()
    with daemon.client() as operator:
        assert operator.lookup([*range(100, 117), 1]) == {"ex0": 16}
    # The writer goes on, and the unreadable pool is gone from Redis after the next write.
    cache(ex, "new", list(range(300, 309)))
    wait_for(lambda: persisted(redis_process) == 6, what="new entries in redis")
    wait_for(lambda: not redis.hexists(POOLS_KEY, "bad"), what="unreadable pool deleted")
    daemon.kill9()
    daemon.start()
    with daemon.client() as operator:
        assert operator.stats().persistence.skipped_records <= 2  # at most the log blobs, until compaction


def test_an_unknown_schema_version_is_not_read_and_is_replaced(redis_process, start_blockd):
    redis = redis_process.client()
    redis.hset(META_KEY, "schema", "99")
    redis.hset(POOLS_KEY, "future", b"\x93\x01\x02\x03")  # whatever a future schema writes
    redis.rpush(snapshot_key("future"), b"\x01")
    daemon = start_blockd("--redis-url", redis_process.url, "--flush-interval", "0.05")
    with daemon.client() as operator:
        stats = operator.stats()
        assert stats.persistence.skipped_records == 1 and stats.dormant_pools == []
    assert "schema" in daemon.log()
    ex = pool_client(daemon)
    cache(ex, "a", list(range(9)))
    wait_for(lambda: redis.hget(META_KEY, "schema") == b"1", what="schema re-written")
    wait_for(lambda: persisted(redis_process) == 2, what="index in redis")
    assert not redis.exists(snapshot_key("future")) and not redis.hexists(POOLS_KEY, "future")


def test_redis_prefix_keeps_deployments_sharing_a_redis_apart(redis_process, start_blockd):
    common = ("--redis-url", redis_process.url, "--flush-interval", "0.05", "--lease-timeout", "30")
    blue = start_blockd(*common, "--deployment", "blue")
    green = start_blockd(*common, "--redis-prefix", "green-env")
    ex_blue, ex_green = pool_client(blue), pool_client(green, epoch=42)  # the same pool id in both
    cache(ex_blue, "b", list(range(9)))
    cache(ex_green, "g", list(range(500, 517)))
    blue_keys, green_keys = RedisKeys("blue"), RedisKeys("green-env")
    wait_for(lambda: persisted(redis_process, keys=blue_keys) == 2, what="blue index")
    wait_for(lambda: persisted(redis_process, keys=green_keys) == 4, what="green index")
    with blue.client() as operator:
        assert operator.stats().persistence.key_prefix == "blue:blockd:v1"
    keys = {k.decode() for k in redis_process.client().keys("*")}
    assert keys and all(k.startswith(("blue:blockd:v1:", "green-env:blockd:v1:")) for k in keys), keys
    blue.kill9()
    green.kill9()
    blue.start()
    green.start()
    ex_blue.heartbeat()
    ex_green.heartbeat()
    with blue.client() as operator:
        assert operator.lookup([*range(9), 1])["ex0"] == 8
        assert operator.lookup([*range(500, 517), 1])["ex0"] == 0
    with green.client() as operator:
        assert operator.lookup([*range(500, 517), 1])["ex0"] == 16


def test_a_full_writer_queue_drops_durability_never_a_request(redis_process, start_blockd):
    args = ("--redis-url", redis_process.url, "--flush-interval", "0.01", "--persistence-queue", "2")
    daemon = start_blockd(*args, "--lease-timeout", "60")
    ex = pool_client(daemon)
    cache(ex, "warm", list(range(9)))
    wait_for(lambda: persisted(redis_process) == 2, what="index in redis")
    redis_process.pause()  # the writer hangs in its socket: batches pile up
    try:
        took: list[float] = []
        with daemon.client() as operator:

            def cache_another() -> bool:  # a poll apart: the daemon's writer is handed a batch in between
                started = time.perf_counter()
                cache(ex, f"s{len(took)}", [1000 + len(took), *range(8)])
                took.append(time.perf_counter() - started)
                return len(took) >= 60 and operator.stats().persistence.dropped_batches > 0

            wait_for(cache_another, timeout_s=30, interval_s=0.02, what="60 requests and a dropped batch")
            ps = operator.stats().persistence
        assert max(took) < 1.0  # every request answered at once
        assert ps.dropped_batches > 0 and ps.state == "degraded" and ps.queue_limit == 2
        assert ps.pending_batches <= ps.queue_limit + 1  # queued, and the one the writer is stuck on
    finally:
        redis_process.resume()
    with daemon.client() as operator:
        entries = operator.stats("ex0").pools[0].index_entries
        wait_for(lambda: operator.stats().persistence.state == "ok", timeout_s=30, what="persistence recovers")
    wait_for(lambda: persisted(redis_process) == entries, timeout_s=20, what="everything re-written")
    assert "redis writer queue full" in daemon.log()


@pytest.fixture
def store(redis_process, monkeypatch):
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread this test kills says nothing
    store = RedisPersistence(redis_process.url, flush_interval_s=0.01)
    yield store
    store.close()


def in_redis_matches(redis_process, manager: BlockManager, store: RedisPersistence) -> bool:
    store.tick(manager, time.monotonic())
    pool = manager.pools["p"]
    records = load(redis_process.client()).records.get("p", {})
    return validated(records, pool) == blocks_and_generations(index_view(pool))


def start(store: RedisPersistence) -> BlockManager:
    manager = BlockManager(events=store)
    store.load()
    store.start()
    manager.register(p.Register(v=1, id=1, pool_id="p", num_blocks=48, block_size=2, model_id="m", epoch=3))
    return manager


class _Killed(BaseException):
    """Ends the writer thread (what no ordinary error does)."""


@pytest.mark.parametrize("failure", [ValueError, _Killed])
def test_the_writer_survives_errors_and_is_restarted_if_it_dies(store, redis_process, monkeypatch, failure):
    manager = start(store)
    apply = store._apply
    failed: list[bool] = []

    def fails_once(batch):
        if not failed:
            failed.append(True)
            raise failure("boom")
        apply(batch)

    monkeypatch.setattr(store, "_apply", fails_once)
    churn(manager, random.Random(5), 40)
    wait_for(lambda: store.tick(manager, time.monotonic()) or failed, what="the failure")
    wait_for(lambda: in_redis_matches(redis_process, manager, store), timeout_s=15, what="index re-written")
    ps = store.stats(time.monotonic())
    assert ps.writer_restarts == (1 if failure is _Killed else 0)
    assert ps.full_rewrites >= 1
    churn(manager, random.Random(6), 40)  # and it keeps writing
    wait_for(lambda: in_redis_matches(redis_process, manager, store), timeout_s=15, what="later changes written")
