"""A pool's whole state as plain data, to prove that a failed operation changed nothing (invariant I6)."""

from __future__ import annotations

from typing import Any

import msgspec

from blockd.pool import BlockPool


def pool_state(pool: BlockPool) -> dict[str, Any]:
    """Everything an operation may change, failure counters excepted (a failure is allowed to count itself)."""
    counters = msgspec.structs.asdict(pool.counters)
    counters.pop("admit_failures")
    return dict(
        refcount=list(pool.refcount),
        block_hash=list(pool.block_hash),
        generation=list(pool.generation),
        stamp=list(pool.stamp),
        free_queue=list(pool.free_queue),
        index=list(pool.index.items()),  # in insertion order
        seqs={
            sid: (
                pool.token_ids(sid),
                list(s.table),
                list(s.hashes),
                s.committed,
                s.extra,
                s.reserved,
                s.holes,
                s.group,
            )
            for sid, s in pool.seqs.items()
        },
        counters=counters,
        clock=pool._clock,
        journal=None if pool.journal is None else dict(pool.journal),
        recently_freed=list(pool._recently_freed),
    )


def index_view(pool: BlockPool) -> dict[bytes, tuple[int, int, int]]:
    """The prefix index as hash -> (block, generation, lru stamp)."""
    return {h: (b, pool.generation[b], pool.stamp[b]) for h, b in pool.index.items()}
