"""Helpers of the persistence tests: what Redis holds, compared with a pool, and random churn to produce it."""

from __future__ import annotations

import random

from blockd.manager import BlockManager
from blockd.pool import BlockPool
from tests.blockd.pool_state import index_view


def blocks_and_generations(index: dict) -> dict:
    """An index without LRU stamps: Redis hears a stamp only at commit or reuse, memory at every free."""
    return {h: entry[:2] for h, entry in index.items()}


def validated(persisted: dict, pool: BlockPool) -> dict:
    """What re-sync keeps of `persisted`, given the pool's current generations (as its executor reports them)."""
    fresh = BlockPool(pool.spec)
    fresh.adopt_generations(pool.generation)
    fresh.restore_index(persisted.items(), pool.generation)
    return blocks_and_generations(index_view(fresh))


def churn(manager: BlockManager, rng: random.Random, rounds: int) -> None:
    """Admit, commit and free sequences over a small vocabulary: hits, evictions and re-commits all happen."""
    pool = manager.pools["p"]
    for i in range(rounds):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
        seq = f"s{i}"
        try:
            pool.admit(seq, tokens)
        except Exception:
            continue
        pool.commit(seq, len(tokens))
        if rng.random() < 0.8:
            pool.free(seq)
