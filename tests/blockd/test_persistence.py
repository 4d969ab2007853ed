"""The write-behind store against a real redis-server: what Redis holds always rebuilds blockd's index.

Redis holds what each block holds (block -> hash, generation); an evicted block's record stays until the block
is committed again, and re-sync drops it because its executor reports a newer generation. So the property
tested is: what Redis holds, validated by the executor's generations, is exactly the live index.
"""

from __future__ import annotations

import random

import pytest

from blockd import persistence
from blockd import protocol as p
from blockd.manager import BlockManager
from blockd.persistence import RedisPersistence, load, log_key, snapshot_key
from tests.blockd.pool_state import index_view
from tests.support.persistence import blocks_and_generations, churn, validated
from tests.support.waiting import wait_for


@pytest.fixture
def store(redis_process):
    store = RedisPersistence(redis_process.url, flush_interval_s=0.01)
    yield store
    store.close()


def register(manager: BlockManager, num_blocks: int = 48) -> None:
    manager.register(p.Register(v=1, id=1, pool_id="p", num_blocks=num_blocks, block_size=2, model_id="m", epoch=3))


def test_log_and_compaction_rebuild_the_exact_index(store, redis_process, monkeypatch):
    monkeypatch.setattr(persistence, "_COMPACT_MIN", 40)  # compact often
    manager = BlockManager(events=store)
    specs, entries = store.load()
    assert specs == [] and entries == {}
    store.start()
    register(manager)
    rng = random.Random(7)
    redis = redis_process.client()
    compacted = False
    for _ in range(30):
        churn(manager, rng, 20)
        assert store.flush_now(manager)
        persisted = load(redis).records
        pool = manager.pools["p"]
        assert validated(persisted["p"], pool) == blocks_and_generations(index_view(pool))
        compacted |= redis.llen(log_key("p")) == 0 and redis.llen(snapshot_key("p")) > 0
    assert compacted, "the log was never compacted into a snapshot"
    assert store.stats(0).state == "ok" and store.stats(0).entries_written > 0


def test_a_restarted_store_continues_the_log_it_found(store, redis_process):
    manager = BlockManager(events=store)
    store.load()
    store.start()
    register(manager)
    rng = random.Random(11)
    churn(manager, rng, 60)
    assert store.flush_now(manager)
    expected = index_view(manager.pools["p"])

    second = RedisPersistence(redis_process.url, flush_interval_s=0.01)
    try:
        specs, entries = second.load()
        assert [s.pool_id for s in specs] == ["p"]
        assert validated(entries["p"], manager.pools["p"]) == blocks_and_generations(expected)
        restarted = BlockManager(events=second)
        restarted.restore(specs, entries)
        second.start()
        generations = manager.pools["p"].generation
        restarted.register(
            p.Register(
                v=1, id=2, pool_id="p", num_blocks=48, block_size=2, model_id="m", epoch=3, generations=generations
            )
        )
        assert index_view(restarted.pools["p"]).keys() == expected.keys()
        churn(restarted, rng, 60)
        assert second.flush_now(restarted)
        pool = restarted.pools["p"]
        assert validated(load(redis_process.client()).records["p"], pool) == blocks_and_generations(index_view(pool))
    finally:
        second.close()


def test_dropping_a_pool_removes_its_keys(store, redis_process):
    manager = BlockManager(events=store)
    store.load()
    store.start()
    register(manager)
    churn(manager, random.Random(3), 30)
    assert store.flush_now(manager)
    assert wait_for(lambda: load(redis_process.client()).records.get("p"), what="index persisted")
    manager.unregister("p", 3)
    assert store.flush_now(manager)
    redis = redis_process.client()
    loaded = load(redis)
    assert (loaded.specs, loaded.records, loaded.logged, loaded.skipped) == ([], {}, {}, [])
    assert not redis.exists(snapshot_key("p"), log_key("p"))
