"""A pool with a sliding window: `slide` hands a live sequence's dead leading blocks back, leaving holes."""

from __future__ import annotations

import msgspec
import pytest

from blockd import protocol as p
from blockd.client import PoolClient
from blockd.errors import BlockdError, ErrorCode
from blockd.inprocess import InProcessBlockd
from blockd.manager import BlockManager
from blockd.pool import HOLE, BlockPool, PoolSpec
from tests.blockd.pool_state import pool_state
from tests.blockd.test_pool import expect_error


def window_pool(num_blocks: int = 16, block_size: int = 4, window: int | None = 6) -> BlockPool:
    return BlockPool(PoolSpec("p", num_blocks, block_size, "m", 1, window))


def test_slide_hands_back_the_blocks_past_every_querys_window() -> None:
    pool = window_pool()  # blocks of 4, window 6
    pool.admit("a", list(range(14)))  # blocks 0-3
    pool.commit("a", 14)
    assert pool.slide("a", 6) == 0  # the query at 6 reads 1..6: block 0 is still read
    assert pool.slide("a", 9) == 1  # the query at 9 reads 4..9
    assert pool.seqs["a"].table == [HOLE, 1, 2, 3]
    assert pool.slide("a", 9) == 0  # idempotent
    assert pool.slide("a", 14) == 1  # reads 9..14
    assert pool.seqs["a"].table == [HOLE, HOLE, 2, 3]
    assert pool.refcount[:4] == [0, 0, 1, 1]
    assert pool.stats().blocks_in_use == 2
    assert pool.check() == []
    # Handed back with their hashes, they stay prefix hits until evicted.
    assert pool.lookup([*range(14), 99]) == 12
    assert pool.free("a") == 2  # the holes are not freed again
    assert pool.check() == []


def test_slid_blocks_are_freed_like_a_free_and_stay_hits_until_evicted() -> None:
    pool = window_pool(num_blocks=6)
    pool.admit("a", list(range(16)))  # blocks 0-3
    pool.commit("a", 16)
    pool.slide("a", 16)  # the query at 16 reads 11..16: blocks 0 and 1 are dead
    assert list(pool.free_queue) == [4, 5, 1, 0]  # uncached first, then tail first (as a free releases)
    r = pool.admit("b", [*range(16), 7])  # a hit on the whole prompt: its first query (at 16) reads blocks 2-3
    assert r.num_cached_tokens == 16 and r.blocks[:4] == [HOLE, HOLE, 2, 3]
    assert pool.seqs["b"].holes == 2 and pool.check() == []


def test_a_prefix_is_a_hit_while_the_blocks_its_next_query_reads_are_cached() -> None:
    pool = window_pool(num_blocks=8)  # blocks of 4, window 6
    prompt = list(range(20))
    pool.admit("a", prompt)
    pool.commit("a", 20)
    pool.free("a")  # all five blocks cached, tail first: block 0 is the most recently freed
    pool.admit("x", [99] * 13)  # four blocks: the three uncached, then the least recently freed (block 4)
    assert pool.lookup([*prompt, 1]) == 16  # without block 4 the prompt's first 16 tokens still hit
    r = pool.admit("b", [*prompt[:16], 5, 6])  # its first query after them reads keys 11..16: blocks 2 and 3
    assert r.num_cached_tokens == 16 and r.blocks[:4] == [HOLE, HOLE, 2, 3]
    assert pool.check() == []
    plain = window_pool(window=None)
    plain.admit("a", prompt)
    plain.commit("a", 20)
    plain.free("a")
    assert plain.lookup([*prompt, 1]) == 20  # without a window every block of the chain must be there


def test_commit_skips_holes_and_still_hashes_from_tokens() -> None:
    pool = window_pool(window=2)
    pool.admit("a", list(range(12)))
    pool.slide("a", 9)  # never committed: the released blocks hold no prefix
    assert pool.seqs["a"].table[:2] == [HOLE, HOLE]
    assert pool.commit("a", 12) == 1  # only block 2 enters the index, hashed from the tokens
    assert pool.lookup([*range(12), 5]) == 12  # the query at 12 reads keys 11-12 only: block 2 is the hit
    assert pool.check() == []


def test_fork_copies_holes_as_holes() -> None:
    pool = window_pool()
    pool.admit("a", list(range(14)))
    pool.commit("a", 14)
    pool.slide("a", 14)
    pool.fork("a", "b")
    assert pool.seqs["b"].table == [HOLE, HOLE, 2, 3]
    assert pool.refcount[2:4] == [2, 2]
    pool.append("b", [1])  # a write into the shared open block copies it
    assert pool.check() == []
    assert pool.free("a") == 2 and pool.free("b") == 2
    assert pool.check() == [] and pool.stats().blocks_in_use == 0


def test_restore_sequence_takes_leading_holes_a_query_no_longer_reads() -> None:
    pool = window_pool()
    pool.restore_sequence("a", list(range(14)), [HOLE, HOLE, 5, 6], 14)
    assert pool.seqs["a"].holes == 2 and pool.refcount[5:7] == [1, 1]
    assert pool.check() == []
    assert pool.free("a") == 2


@pytest.mark.parametrize(
    ("table", "computed"),
    [
        ([HOLE, HOLE, HOLE, 6], 14),  # block 2 is still read by the query at 14
        ([HOLE, HOLE, 5, 6], 10),  # block 1 is still read by the query at 10
        ([5, HOLE, 6, 7], 14),  # a hole that is not leading
        ([HOLE, HOLE, 5, 5], 14),  # a block named twice
    ],
)
def test_restore_sequence_refuses_holes_where_a_token_is_still_read(table: list[int], computed: int) -> None:
    pool = window_pool()
    pool.admit("x", [1, 2])
    before = pool_state(pool)
    expect_error(ErrorCode.INVALID_REQUEST, pool.restore_sequence, "a", list(range(14)), table, computed)
    assert pool_state(pool) == before


def test_restore_sequence_refuses_holes_in_a_pool_without_a_window() -> None:
    pool = window_pool(window=None)
    expect_error(ErrorCode.INVALID_REQUEST, pool.restore_sequence, "a", list(range(14)), [HOLE, 1, 2, 3], 14)
    assert pool.seqs == {}


def test_bad_slides_are_refused_and_change_nothing() -> None:
    pool = window_pool()
    pool.admit("a", list(range(10)))
    before = pool_state(pool)
    expect_error(ErrorCode.INVALID_REQUEST, pool.slide, "a", 11)  # tokens blockd has not heard of
    expect_error(ErrorCode.INVALID_REQUEST, pool.slide, "a", -1)
    expect_error(ErrorCode.UNKNOWN_SEQUENCE, pool.slide, "nobody", 4)
    assert pool_state(pool) == before
    plain = window_pool(window=None)
    plain.admit("a", list(range(10)))
    before = pool_state(plain)
    expect_error(ErrorCode.INVALID_REQUEST, plain.slide, "a", 10)  # no window: every block is read
    assert pool_state(plain) == before


def test_check_names_holes_where_a_query_still_reads() -> None:
    pool = window_pool()
    pool.admit("a", list(range(10)))
    seq = pool.seqs["a"]
    pool.refcount[seq.table[1]] = 0  # tampered: block 1 made a hole, as no slide could
    pool.free_queue[seq.table[1]] = None
    seq.table[0] = seq.table[1] = HOLE
    pool.refcount[0] = 0
    pool.free_queue[0] = None
    seq.holes = 2
    assert any("I4" in line and "leading holes" in line for line in pool.check())


def test_a_pool_client_mirrors_slides_and_resyncs_the_holes() -> None:
    client = InProcessBlockd()
    pool = PoolClient(
        client, pool_id="w", num_blocks=8, block_size=4, model_id="m", epoch=3, retry_for_s=1.0, sliding_window=6
    )
    pool.register()
    pool.admit("a", list(range(14)))
    pool.commit("a", 14)
    (outcome,) = pool.step([p.Slide("a", 14)])
    assert outcome == p.SlideResult(released=2)
    mirrored = pool.seqs["a"]
    assert mirrored.blocks[:2] == [HOLE, HOLE] and mirrored.holes == 2 and pool.free_blocks == 6
    assert client.manager.pool("w").seqs["a"].table == mirrored.blocks
    pool.fork("a", "b")
    assert pool.seqs["b"].holes == 2 and pool.refcount[mirrored.blocks[2]] == 2
    client.manager.unregister("w", pool.epoch)  # as after an expired lease
    pool.heartbeat()  # re-registers the window and both tables, holes and all
    restored = client.manager.pool("w")
    assert restored.spec.sliding_window == 6 and restored.check() == []
    assert restored.seqs["b"].table == pool.seqs["b"].blocks
    assert client.manager.sequence("a", "w").refcounts[:2] == [0, 0]
    assert pool.free("a") == 2 and pool.free("b") == 2 and pool.free_blocks == 8  # references dropped, holes skipped
    assert restored.check() == [] and restored.stats().blocks_in_use == 0


def test_a_window_changes_the_pool_a_resync_finds() -> None:
    manager = BlockManager()
    register = p.Register(
        v=p.PROTOCOL_VERSION, id=1, pool_id="w", num_blocks=8, block_size=4, model_id="m", epoch=3, sliding_window=6
    )
    manager.register(register)
    with pytest.raises(BlockdError) as raised:
        manager.register(msgspec.structs.replace(register, sliding_window=None))
    assert raised.value.code == ErrorCode.POOL_MISMATCH and "sliding window 6" in raised.value.message
