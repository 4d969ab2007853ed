"""Focused behaviour tests of BlockPool: one scenario each, with the exact blocks worked out by hand."""

from __future__ import annotations

import pytest

from blockd.errors import BlockdError, ErrorCode
from blockd.hashing import chain_hashes
from blockd.pool import AppendResult, BlockPool, PoolSpec
from tests.blockd.pool_state import index_view, pool_state


def make_pool(num_blocks: int, block_size: int, *, journal: dict | None = None, model: str = "m") -> BlockPool:
    return BlockPool(PoolSpec("p", num_blocks, block_size, model, 1), journal=journal)


def block_hash_of(pool: BlockPool, tokens: list[int], cache_salt: str | None = None) -> bytes:
    """The chained hash of the last full block of `tokens`."""
    return chain_hashes(tokens, pool.block_size, pool.root, pool.extra_for(cache_salt))[-1]


def expect_error(code: ErrorCode, fn, *args, **kwargs) -> BlockdError:
    with pytest.raises(BlockdError) as info:
        fn(*args, **kwargs)
    assert info.value.code == code, info.value
    return info.value


# ------------------------------------------------------------------------------------------------ admit


@pytest.mark.parametrize(("n", "cached"), [(1, 0), (4, 0), (5, 4), (8, 4), (9, 8), (12, 8)])
def test_fully_cached_prompt_still_computes_its_last_token(n: int, cached: int) -> None:
    pool = make_pool(16, 4)
    chain = list(range(12))
    pool.admit("a", chain)
    pool.commit("a", 12)  # all three blocks indexed
    pool.free("a")
    assert cached == (n - 1) // 4 * 4
    assert pool.lookup(chain[:n]) == cached
    r = pool.admit("b", chain[:n])
    assert r.num_cached_tokens == cached
    assert len(r.blocks) == -(-n // 4)
    assert pool.check() == []


def test_admit_is_all_or_nothing() -> None:
    pool = make_pool(4, 2)
    pool.admit("a", [1, 2, 3, 4, 5])  # 3 of 4 blocks
    pool.commit("a", 4)
    before = pool_state(pool)
    err = expect_error(ErrorCode.OUT_OF_BLOCKS, pool.admit, "b", [7, 7, 7, 7, 7])  # needs 3, 1 free
    assert err.missing_blocks == 2
    assert pool_state(pool) == before
    assert pool.counters.admit_failures == 1
    assert "b" not in pool.seqs
    # A prompt that fits still goes in afterwards.
    assert pool.admit("b", [7, 7]).blocks == [3]
    assert pool.check() == []


def test_hits_on_cached_free_blocks_are_not_evicted_by_the_same_admit() -> None:
    pool = make_pool(5, 2)
    assert pool.admit("a", [1, 2, 3, 4]).blocks == [0, 1]
    pool.commit("a", 4)
    assert pool.admit("y", [5, 5, 5, 5, 5, 5]).blocks == [2, 3, 4]
    pool.commit("y", 6)
    pool.free("a")
    pool.free("y")
    # Every free block is cached, a's chain least recently freed: its blocks are at the head of the queue.
    assert list(pool.free_queue) == [1, 0, 4, 3, 2]

    # Two hits on blocks 0 and 1 plus one new block: allocating before taking the hits out of the queue
    # would hand out block 1 (a hit) as the new block.
    r = pool.admit("b", [1, 2, 3, 4, 9])
    assert r.num_cached_tokens == 4
    assert r.blocks == [0, 1, 4]  # y's chain loses its tail
    assert pool.refcount == [1, 1, 0, 0, 1]
    assert pool.lookup([1, 2, 3, 4, 0]) == 4
    assert pool.lookup([5] * 7) == 4
    assert pool.check() == []


def test_admit_counts_cached_free_hits_against_the_free_blocks() -> None:
    pool = make_pool(6, 2)
    pool.admit("live", [7])
    pool.admit("a", [1, 2, 3, 4, 5])
    pool.commit("a", 4)
    pool.free("a")
    before = pool_state(pool)
    # 11 tokens: 6 blocks, 2 of them hits, so 4 new ones; 5 blocks are free but 2 of those are the hits.
    err = expect_error(ErrorCode.OUT_OF_BLOCKS, pool.admit, "b", [1, 2, 3, 4, *[9] * 7])
    assert err.missing_blocks == 1
    assert pool_state(pool) == before
    # More tokens than the whole pool holds: refused before any hashing.
    expect_error(ErrorCode.TOO_MANY_TOKENS, pool.admit, "c", [1] * 13)
    assert pool_state(pool) == before
    assert pool.lookup([1, 2, 3, 4, 5]) == 4  # the cached chain survived the failed admit


# ------------------------------------------------------------------------------------------------ LRU


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = make_pool(4, 2)
    assert pool.admit("a", [1, 2, 7]).blocks == [0, 1]
    pool.commit("a", 2)  # block 0 holds [1, 2]
    assert pool.admit("b", [3, 4, 7]).blocks == [2, 3]
    pool.commit("b", 2)  # block 2 holds [3, 4]
    pool.free("a")
    pool.free("b")
    # Uncached blocks (3, then 1) first; cached ones in the order they were freed (0 before 2).
    assert list(pool.free_queue) == [3, 1, 0, 2]
    assert pool.admit("c", [5]).blocks == [3]
    assert pool.admit("d", [6]).blocks == [1]
    evictions = pool.counters.evictions
    assert pool.admit("e", [8]).blocks == [0]  # evicts a's prefix, freed first
    assert pool.counters.evictions == evictions + 1
    assert pool.lookup([1, 2, 7]) == 0
    assert pool.lookup([3, 4, 7]) == 2
    assert pool.check() == []


def test_uncached_freed_blocks_are_reused_before_cached_ones() -> None:
    pool = make_pool(6, 2)
    pool.admit("cached", [1, 2, 3])  # blocks 0, 1
    pool.commit("cached", 2)
    pool.free("cached")  # 1 -> head, 0 -> tail
    pool.admit("plain", [5, 6, 7])  # blocks 1, 2 (1 was at the head)
    pool.free("plain")  # never committed: both to the head
    assert list(pool.free_queue)[-1] == 0
    granted = pool.admit("big", [9] * 10).blocks  # five blocks: every uncached one first
    assert granted == [1, 2, 3, 4, 5]
    assert pool.lookup([1, 2, 3]) == 2  # block 0 is still a hit


def test_a_freed_chains_tail_is_evicted_before_its_head() -> None:
    pool = make_pool(4, 2)
    assert pool.admit("a", [1, 2, 3, 4, 5, 6, 7]).blocks == [0, 1, 2, 3]
    assert pool.commit("a", 6) == 3
    pool.free("a")
    assert list(pool.free_queue) == [3, 2, 1, 0]
    assert pool.admit("x", [9]).blocks == [3]
    assert pool.admit("y", [9]).blocks == [2]  # the chain's last block goes first
    assert pool.lookup([1, 2, 3, 4, 5, 6, 7]) == 4  # its head is still there
    assert pool.check() == []


def test_reusing_a_cached_block_makes_it_most_recently_used() -> None:
    pool = make_pool(4, 2)
    pool.admit("a", [1, 2, 0])
    pool.commit("a", 2)  # block 0
    pool.admit("b", [3, 4, 0])
    pool.commit("b", 2)  # block 2
    pool.free("a")
    pool.free("b")  # cached in LRU order: 0, 2
    r = pool.admit("a2", [1, 2, 5])  # a hit on block 0 ...
    assert r.blocks[0] == 0 and r.num_cached_tokens == 2
    pool.free("a2")  # ... freed again: now more recent than block 2
    cached = [b for b in pool.free_queue if pool.block_hash[b] is not None]
    assert cached == [2, 0]
    assert pool.check() == []


# ------------------------------------------------------------------------------------- copy-on-write


def test_copy_on_write_after_fork_on_a_partial_last_block() -> None:
    pool = make_pool(6, 2)
    pool.admit("tmp", [7] * 6)  # blocks 0-2 get generation 1
    pool.free("tmp")
    assert list(pool.free_queue) == [0, 1, 2, 3, 4, 5]
    assert pool.admit("a", [1, 2, 3]).blocks == [0, 1]
    pool.fork("a", "b")
    assert pool.refcount[:2] == [2, 2]

    r = pool.append("b", [4])
    assert r.copies == ((1, 2),)
    assert r.copy_generations == (2,) == (pool.generation[2],)  # block 2 was used before: a fresh generation
    assert r.blocks == ()
    assert pool.seqs["b"].table == [0, 2]
    assert pool.seqs["a"].table == [0, 1]
    assert pool.refcount[:3] == [2, 1, 1]
    assert pool.counters.copies_on_write == 1

    # The parent now holds its last block alone: no copy.
    assert pool.append("a", [5]) == AppendResult()
    assert pool.token_ids("a") == [1, 2, 3, 5]
    assert pool.token_ids("b") == [1, 2, 3, 4]
    assert pool.check() == []


def test_no_copy_when_the_shared_last_block_is_full() -> None:
    pool = make_pool(6, 2)
    pool.admit("a", [1, 2, 3, 4])
    pool.fork("a", "b")
    r = pool.append("b", [5])
    assert r.copies == () and r.copy_generations == ()
    assert r.blocks == (2,)
    assert pool.refcount[:3] == [2, 2, 1]
    assert pool.counters.copies_on_write == 0


def test_copy_on_write_and_a_new_block_in_one_append() -> None:
    pool = make_pool(6, 2)
    pool.admit("a", [1, 2, 3])
    pool.fork("a", "b")
    r = pool.append("b", [4, 5, 6])  # fills the copied block and needs one more
    assert r.copies == ((1, 2),)  # the copy's destination is granted first
    assert r.blocks == (3,)
    assert r.generations == (1,)
    assert pool.seqs["b"].table == [0, 2, 3]
    assert pool.check() == []


def test_appending_nothing_to_a_shared_partial_block_copies_nothing() -> None:
    pool = make_pool(4, 2)
    pool.admit("a", [1, 2, 3])
    pool.fork("a", "b")
    before = pool_state(pool)
    assert pool.append("b", []) == AppendResult()
    assert pool_state(pool) == before


def test_copy_on_write_out_of_blocks_changes_nothing() -> None:
    pool = make_pool(2, 2)
    pool.admit("a", [1, 2, 3])
    pool.fork("a", "b")
    before = pool_state(pool)
    err = expect_error(ErrorCode.OUT_OF_BLOCKS, pool.append, "b", [4])
    assert err.missing_blocks == 1
    assert pool_state(pool) == before


def test_reserved_slots_hold_tokens_computed_before_they_are_registered() -> None:
    pool = make_pool(8, 4)
    pool.admit("a", [1, 2, 3, 4, 5])  # blocks 0, 1; slots 5-7 of block 1 are empty
    assert pool.append("a", [], reserve=3) == AppendResult()  # room for 3 tokens, in the block it already holds
    assert pool.seqs["a"].reserved == 3 and pool.check() == []
    assert pool.append("a", [6, 7]) == AppendResult()  # computed into reserved slots, registered now
    assert pool.seqs["a"].reserved == 1 and pool.token_ids("a") == [1, 2, 3, 4, 5, 6, 7]
    r = pool.append("a", [8], reserve=4)  # the block is full: the next four go into a fresh one
    assert r.blocks == (2,) and pool.seqs["a"].reserved == 4
    assert pool.seqs["a"].table == [0, 1, 2] and pool.check() == []
    assert pool.commit("a", 8) == 2  # registered tokens are hashed; the reserved slots are not
    pool.free("a")
    assert pool.check() == []


def test_a_reservation_reaches_into_the_next_block_and_no_further() -> None:
    pool = make_pool(8, 4)
    pool.admit("a", [1, 2, 3, 4, 5])  # blocks 0, 1; 3 slots left in block 1
    before = pool_state(pool)
    err = expect_error(ErrorCode.INVALID_REQUEST, pool.append, "a", [], reserve=8)
    assert "at most 7" in err.message
    expect_error(ErrorCode.INVALID_REQUEST, pool.append, "a", [6, 7, 8], reserve=9)  # at most 8: two fresh blocks
    expect_error(ErrorCode.INVALID_REQUEST, pool.append, "a", [6], reserve=-1)
    assert pool_state(pool) == before
    r = pool.append("a", [], reserve=7)  # the rest of block 1 and all of a fresh one
    assert r.blocks == (2,) and pool.seqs["a"].table == [0, 1, 2] and pool.check() == []
    assert pool.append("a", [6, 7, 8, 9, 10]) == AppendResult()  # computed into the room, registered later
    assert pool.seqs["a"].reserved == 2 and pool.check() == []


def test_a_fork_shares_the_blocks_of_the_tokens_and_the_first_to_write_there_copies_the_open_one() -> None:
    pool = make_pool(8, 4)
    pool.admit("a", [1, 2, 3, 4, 5])
    pool.append("a", [], reserve=7)  # blocks 0, 1 and reserved-only 2
    pool.fork("a", "b")
    # The child shares the blocks holding tokens, not the parent's reserved-only block, and reserves nothing.
    assert pool.seqs["b"].table == [0, 1] and pool.seqs["b"].reserved == 0
    assert pool.refcount[:3] == [2, 2, 1] and pool.check() == []
    r = pool.append("a", [6])  # the parent writes first: it takes the copy of the open block, in its place
    assert r.copies == ((1, 3),) and pool.seqs["a"].table == [0, 3, 2] and pool.seqs["b"].table == [0, 1]
    assert pool.append("b", [9], reserve=2) == AppendResult()  # the child holds block 1 alone now
    assert pool.token_ids("a") == [1, 2, 3, 4, 5, 6] and pool.token_ids("b") == [1, 2, 3, 4, 5, 9]
    assert pool.check() == []


def test_only_a_write_into_the_shared_open_block_copies_it() -> None:
    pool = make_pool(8, 4)
    pool.admit("a", [1, 2, 3, 4, 5])
    pool.append("a", [], reserve=3)  # the rest of block 1
    pool.fork("a", "b")
    r = pool.append("a", [], reserve=7)  # the new slots start past block 1: nothing is written there
    assert r.copies == () and r.blocks == (2,) and pool.seqs["a"].table == [0, 1, 2] and pool.check() == []
    r = pool.append("b", [], reserve=3)  # the child's first reserved slot is in block 1: it copies first
    assert r.copies == ((1, 3),) and pool.seqs["b"].table == [0, 3] and pool.check() == []


def test_check_names_a_shared_open_block_written_ahead_by_two() -> None:
    pool = make_pool(8, 4)
    pool.admit("a", [1, 2, 3, 4, 5])
    pool.append("a", [], reserve=3)
    pool.fork("a", "b")
    assert pool.check() == []
    pool.seqs["b"].reserved = 3  # (a state no operation leads to: both would write slots 5-7 of block 1)
    assert any("I4 block 1 holds one sequence's reserved slots" in p for p in pool.check())
    pool.seqs["b"].table = [0]  # a table too short for its tokens is reported, not a crash of the check
    assert any("I4 sequence 'b' holds 1 blocks" in p for p in pool.check())


def test_restore_sequence_refuses_to_share_an_open_block_that_another_writes_ahead() -> None:
    pool = make_pool(8, 4)
    pool.restore_sequence("a", [1, 2, 3, 4, 5], [3, 6], 5, reserved=3)  # writes ahead into block 6
    before = pool_state(pool)
    for tokens, table, reserved in (
        ([1, 2, 3, 4, 5], [3, 6], 3),  # reserving there too
        ([1, 2, 3, 4, 5, 6], [3, 6], 0),  # reading a slot "a" writes
        ([1, 2, 3, 4, 9, 9, 9, 9], [3, 6], 0),  # holding it full
    ):
        err = expect_error(
            ErrorCode.INVALID_REQUEST, pool.restore_sequence, "b", tokens, table, len(tokens), reserved=reserved
        )
        assert "reads or reserves them" in err.message
    assert pool_state(pool) == before
    pool.restore_sequence("b", [1, 2, 3, 4, 5], [3, 6], 5)  # what a fork leaves: the same tokens, no reservation
    assert pool.check() == []


def test_restore_sequence_takes_reserved_slots_up_to_a_block_past_its_next_tokens_block() -> None:
    pool = make_pool(8, 4)
    pool.restore_sequence("a", [1, 2, 3, 4, 5], [3, 6, 7], 5, reserved=7)
    assert pool.seqs["a"].reserved == 7 and pool.check() == []
    before = pool_state(pool)
    for table, r in (([0, 1, 2, 4], 8), ([0, 1], 4), ([0, 1, 1], 4)):
        expect_error(ErrorCode.INVALID_REQUEST, pool.restore_sequence, "b", [1, 2, 3, 4, 5], table, 5, reserved=r)
    # A reserved-only block is its sequence's alone: no other table may name it, nor may it name a held one.
    err = expect_error(ErrorCode.INVALID_REQUEST, pool.restore_sequence, "b", [1, 2, 3, 4, 5], [0, 7], 5)
    assert "reserved slots only" in err.message
    err = expect_error(ErrorCode.INVALID_REQUEST, pool.restore_sequence, "b", [1, 2, 3, 4], [0, 6], 4, reserved=4)
    assert "reserved slots only" in err.message
    assert pool_state(pool) == before
    pool.restore_sequence("b", [1, 2, 3, 4, 5], [3, 6], 5)  # sharing the blocks of tokens is what a fork leaves
    assert pool.check() == []


def test_append_out_of_blocks_reports_what_is_missing_and_changes_nothing() -> None:
    pool = make_pool(3, 2)
    pool.admit("a", [1, 2, 3])  # blocks 0, 1; one free
    before = pool_state(pool)
    err = expect_error(ErrorCode.OUT_OF_BLOCKS, pool.append, "a", [4, 5, 6, 7, 8])  # 8 tokens: 4 blocks
    assert err.missing_blocks == 1
    assert pool_state(pool) == before
    assert pool.append("a", [4, 5]).blocks == (2,)


# ------------------------------------------------------------------------------------------- commit


def test_commit_of_duplicate_content_keeps_the_first_block() -> None:
    pool = make_pool(8, 2)
    assert pool.admit("a", [1, 2, 3, 4, 0]).blocks == [0, 1, 2]
    assert pool.admit("b", [1, 2, 3, 4, 0]).blocks == [3, 4, 5]  # no hit: nothing indexed yet
    assert pool.commit("b", 4) == 2
    assert pool.commit("a", 4) == 0  # the same prefix again: b's copy stays the hit
    assert pool.index == {block_hash_of(pool, [1, 2]): 3, block_hash_of(pool, [1, 2, 3, 4]): 4}
    assert pool.block_hash[0] is None and pool.block_hash[1] is None
    assert pool.admit("c", [1, 2, 3, 4, 9]).blocks[:2] == [3, 4]
    assert pool.check() == []


def test_commit_is_incremental_and_idempotent() -> None:
    pool = make_pool(8, 2)
    pool.admit("a", [1, 2, 3])
    assert pool.commit("a", 1) == 0  # no full block computed yet
    assert pool.commit("a", 2) == 1
    assert pool.commit("a", 3) == 0
    pool.append("a", [4, 5, 6])
    assert pool.commit("a", 6) == 2
    assert pool.commit("a", 6) == 0
    assert pool.commit("a", 4) == 0  # going back commits nothing and drops nothing
    assert len(pool.index) == 3
    assert pool.lookup([1, 2, 3, 4, 5, 6, 0]) == 6


def test_cache_salt_isolates_prefixes() -> None:
    pool = make_pool(16, 2)
    tokens = [1, 2, 3, 4, 5]
    pool.admit("a", tokens, "tenant-1")
    pool.commit("a", 5)
    pool.free("a")
    assert pool.lookup(tokens, "tenant-1") == 4
    assert pool.lookup(tokens) == 0
    assert pool.lookup(tokens, "tenant-2") == 0
    assert pool.lookup(tokens, "") == 0  # an empty salt is a salt
    assert pool.admit("b", tokens, "tenant-2").num_cached_tokens == 0
    assert pool.admit("c", tokens).num_cached_tokens == 0
    assert pool.admit("d", tokens, "tenant-1").num_cached_tokens == 4
    assert pool.check() == []


def test_different_models_never_share_prefixes() -> None:
    a, b = make_pool(8, 2, model="model-a"), make_pool(8, 2, model="model-b")
    for pool in (a, b):
        pool.admit("s", [1, 2, 3])
        pool.commit("s", 2)
    assert len(a.index) == len(b.index) == 1  # each pool indexed the same full block...
    assert a.index.keys().isdisjoint(b.index)  # ...under a hash of its own model
    assert a.lookup([1, 2, 3]) == 2 and b.lookup([1, 2, 3]) == 2


def test_lookup_reports_what_admit_hits() -> None:
    pool = make_pool(128, 2)
    for i, chain in enumerate([[0, 1, 0, 1, 1, 1, 0], [0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1]]):
        pool.admit(f"seed{i}", chain)
        pool.commit(f"seed{i}", len(chain))
    pool.free("seed1")
    hits = 0
    for n in range(1, 9):
        for code in range(2**n):
            prompt = [(code >> i) & 1 for i in range(n)]
            expected = pool.lookup(prompt)
            got = pool.admit("q", prompt).num_cached_tokens
            assert got == expected, prompt
            hits += got > 0
            pool.free("q")
    assert hits > 20
    assert pool.check() == []


# -------------------------------------------------------------------------------------- generations


def test_generations_rise_on_every_fresh_grant() -> None:
    pool = make_pool(1, 2)
    for i in range(1, 6):
        r = pool.admit("s", [i])
        assert r.blocks == [0]
        assert r.generations == [i] == [pool.generation[0]]
        pool.free("s")


def test_a_prefix_hit_keeps_its_generation() -> None:
    pool = make_pool(4, 2)
    pool.admit("a", [1, 2, 3])
    pool.commit("a", 2)
    pool.free("a")
    r = pool.admit("b", [1, 2, 9])
    assert r.num_cached_tokens == 2
    assert r.generations[0] == 1  # the cached block still holds the same KV
    assert r.generations[1] == pool.generation[r.blocks[1]] >= 1
    grown = pool.append("b", [4, 5])
    assert grown.generations == tuple(pool.generation[b] for b in grown.blocks)


# ------------------------------------------------------------------------------- restart and re-sync


def test_write_behind_race_a_rewritten_block_is_never_a_stale_hit() -> None:
    spec = PoolSpec("p", 4, 2, "m", 1)
    pool = BlockPool(spec)
    assert pool.admit("s1", [1, 2, 0]).blocks == [0, 1]
    pool.commit("s1", 2)  # block 0 holds [1, 2]
    assert pool.admit("s2", [3, 4, 0]).blocks == [2, 3]
    pool.commit("s2", 2)  # block 2 holds [3, 4]
    pool.free("s1")
    pool.free("s2")
    persisted = pool.block_records()  # what the write-behind writer flushed to Redis
    assert set(persisted) == {0, 2}

    # Block 0 is evicted and rewritten before the next flush, then blockd dies.
    r = pool.admit("s3", [5, 6, 7, 8, 9])
    assert r.blocks == [3, 1, 0]
    assert pool.generation[0] == 2
    pool.commit("s3", 4)
    executor_generations = list(pool.generation)  # the executor knows what each of its blocks holds

    fresh = BlockPool(spec)
    fresh.adopt_generations(executor_generations)
    fresh.restore_sequence("s3", [5, 6, 7, 8, 9], [3, 1, 0], 4)
    assert fresh.restore_index(persisted.items(), executor_generations) == 1
    assert fresh.lookup([1, 2, 0]) == 0  # block 0 holds [9] now: never a hit for [1, 2]
    assert fresh.lookup([3, 4, 0]) == 2  # block 2 is untouched: still a hit
    assert fresh.lookup([5, 6, 7, 8, 0]) == 4  # s3's committed blocks were re-indexed from its table
    assert fresh.check() == []
    fresh.free("s3")
    r = fresh.admit("s4", [3, 4, 1])
    assert r.num_cached_tokens == 2 and r.blocks == [2, 0]
    fresh.free("s4")
    assert fresh.admit("s5", [1, 2, 0]).num_cached_tokens == 0
    assert fresh.check() == []

    # The generation check is what drops the stale entry: with the old generation it would be restored.
    unaware = BlockPool(spec)
    stale_generations = list(executor_generations)
    stale_generations[0] = persisted[0][1]
    unaware.adopt_generations(stale_generations)
    assert unaware.restore_index(persisted.items(), stale_generations) == 2
    assert unaware.lookup([1, 2, 0]) == 2


def test_restore_index_keeps_the_persisted_lru_order() -> None:
    spec = PoolSpec("p", 6, 2, "m", 1)
    pool = BlockPool(spec)
    for sid, first in (("a", 1), ("b", 2), ("c", 3)):
        pool.admit(sid, [first, first, 0])
        pool.commit(sid, 2)
    for sid in ("b", "c", "a"):
        pool.free(sid)
    order = [b for b in pool.free_queue if pool.block_hash[b] is not None]
    snapshot = pool.block_records()
    fresh = BlockPool(spec)
    fresh.adopt_generations(pool.generation)
    assert fresh.restore_index(reversed(list(snapshot.items())), pool.generation) == 3
    assert [b for b in fresh.free_queue if fresh.block_hash[b] is not None] == order
    assert fresh.check() == []
    # A later free is more recent than every restored stamp.
    fresh.admit("d", [9, 9, 9])
    fresh.commit("d", 2)
    fresh.free("d")
    assert fresh.block_hash[list(fresh.free_queue)[-1]] == block_hash_of(fresh, [9, 9])
    assert fresh.check() == []


def test_restore_index_without_generations_restores_nothing() -> None:
    pool = make_pool(4, 2)
    pool.admit("a", [1, 2, 3])
    pool.commit("a", 2)
    fresh = make_pool(4, 2)
    assert fresh.restore_index(pool.block_records().items(), None) == 0
    assert fresh.index == {}


def test_restore_sequence_rebuilds_refcounts() -> None:
    pool = make_pool(6, 2)
    # A parent and a forked child that copied its last block: they share blocks 0 and 1.
    pool.restore_sequence("parent", [1, 2, 3, 4, 5], [0, 1, 2], 4)
    pool.restore_sequence("child", [1, 2, 3, 4, 6, 7], [0, 1, 3], 6)
    assert pool.refcount == [2, 2, 1, 1, 0, 0]
    assert sum(pool.refcount) == sum(len(s.table) for s in pool.seqs.values())
    assert list(pool.free_queue) == [4, 5]
    assert pool.check() == []
    assert pool.lookup([1, 2, 3, 4, 6, 7, 8]) == 6
    assert pool.seqs["parent"].committed == 2 and pool.seqs["child"].committed == 3
    assert pool.token_ids("child") == [1, 2, 3, 4, 6, 7]
    # The restored sequences go on as if admitted here.
    assert pool.append("parent", [9]) == AppendResult()
    assert pool.append("child", [8]).blocks == (4,)
    pool.free("parent")
    pool.free("child")
    assert pool.refcount == [0] * 6
    assert pool.check() == []


# --------------------------------------------------------------------------------- stats and journal


def test_stats() -> None:
    pool = make_pool(8, 4)
    fresh = pool.stats()
    assert (fresh.blocks_in_use, fresh.blocks_never_used, fresh.blocks_cached_free) == (0, 8, 0)
    assert fresh.prefix_hit_rate_tokens == fresh.prefix_hit_rate_blocks == 0.0

    pool.admit("a", [1, 2, 3, 4, 5, 6])  # blocks 0 (4 tokens) and 1 (2 tokens)
    pool.admit("b", [9])  # block 2 (1 token)
    s = pool.stats()
    assert (s.blocks_in_use, s.tokens_held, s.live_sequences) == (3, 7, 2)
    assert s.kv_utilization == pytest.approx(7 / 12)
    assert s.blocks_never_used == 5

    pool.fork("a", "c")  # shared blocks hold their tokens once
    s = pool.stats()
    assert (s.blocks_in_use, s.tokens_held, s.live_sequences) == (3, 7, 3)

    pool.commit("a", 6)  # block 0
    pool.free("a")
    pool.free("c")
    s = pool.stats()
    assert (s.blocks_in_use, s.blocks_cached_free, s.index_entries, s.blocks_never_used) == (1, 1, 1, 5)
    assert s.kv_utilization == pytest.approx(1 / 4)

    r = pool.admit("d", [1, 2, 3, 4, 5, 6])  # a hit on block 0
    assert r.num_cached_tokens == 4
    s = pool.stats()
    assert s.counters.queried_tokens == 13 and s.counters.hit_tokens == 4
    assert s.counters.queried_blocks == 2 and s.counters.hit_blocks == 1
    assert s.prefix_hit_rate_tokens == pytest.approx(4 / 13)
    assert s.prefix_hit_rate_blocks == pytest.approx(1 / 2)
    assert s.counters.admits == 3 and s.counters.freed_blocks == 4
    assert s.counters.granted_blocks == 4  # 2 + 1 + 1: the hit was not granted
    assert (s.blocks_in_use, s.blocks_cached_free) == (3, 0)
    # stats() hands out a copy of the counters.
    s.counters.admits = 99
    assert pool.counters.admits == 3


def test_reset_prefix_cache() -> None:
    journal: dict = {}
    pool = make_pool(6, 2, journal=journal)
    pool.admit("a", [1, 2, 3, 4, 5])
    pool.commit("a", 4)  # blocks 0, 1
    pool.free("a")
    pool.admit("b", [7, 8, 9])  # blocks 2, 3
    pool.commit("b", 2)  # block 2
    assert list(pool.free_queue) == [4, 5, 1, 0]
    indexed_blocks = set(pool.index.values())
    assert pool.reset_prefix_cache() == 3
    assert pool.index == {}
    assert pool.block_hash == [None] * 6
    assert {b: journal[b] for b in indexed_blocks} == dict.fromkeys(indexed_blocks)  # none holds a prefix
    # The formerly cached free blocks are plain free blocks now, reused first; live blocks stay live.
    assert set(list(pool.free_queue)[:2]) == {0, 1}
    assert pool.seqs["b"].table == [2, 3] and pool.refcount[2] == 1
    assert pool.lookup([1, 2, 3, 4, 5]) == 0
    assert pool.lookup([7, 8, 9]) == 0
    assert pool.reset_prefix_cache() == 0
    assert pool.check() == []


def test_journal_records_commits_and_reuse_per_block() -> None:
    journal: dict = {}
    pool = make_pool(4, 2, journal=journal)
    h = block_hash_of(pool, [1, 2])
    pool.admit("a", [1, 2, 3])
    assert journal == {}
    pool.commit("a", 2)
    assert journal == {0: (h, 1, 0)}  # block 0 holds h, generation 1, at the current LRU clock
    journal.clear()
    pool.free("a")
    assert journal == {}  # a plain free is not journaled
    pool.admit("b", [1, 2, 3])  # reuses the cached-free block: its recency is journaled
    assert journal == {0: (h, 1, 1)}
    journal.clear()
    pool.free("b")
    pool.admit("c", [5] * 8)  # every block: evicts block 0 and grants it again (generation 2)
    assert journal == {}  # the stale record (generation 1) is left for re-sync to drop
    assert pool.block_records() == {} and pool.generation[0] == 2


def test_journal_applied_to_persisted_records_restores_exactly_the_current_index() -> None:
    journal: dict = {}
    pool = make_pool(4, 2, journal=journal)
    pool.admit("a", [1, 2, 3, 4, 5])
    pool.commit("a", 4)
    records = pool.block_records()  # what a flush wrote
    journal.clear()
    pool.free("a")
    pool.admit("b", [6, 6, 6, 6, 6, 6])  # evicts block 1 (the chain's tail) and rewrites it
    pool.commit("b", 6)
    records.update(journal)  # what the next flush appends
    persisted = {b: r for b, r in records.items() if r is not None}
    fresh = make_pool(4, 2)
    fresh.adopt_generations(pool.generation)  # the executor's generations
    fresh.restore_index(persisted.items(), pool.generation)
    # Blocks and generations exactly; LRU stamps as of the last commit or reuse (see pool.Journal).
    assert {h: e[:2] for h, e in index_view(fresh).items()} == {h: e[:2] for h, e in index_view(pool).items()}


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "tokens",
    [
        [],
        [-1],
        [2**32],
        [1, 2, 3, 4, 2**32],  # the bad id sits in the partial last block, which is never hashed
        [1, 2, 3, -5],
        [2**32, 1, 2, 3, 4],
        [1.5, 2],
        ["x"],
    ],
)
def test_admit_rejects_bad_prompts_and_changes_nothing(tokens: list) -> None:
    pool = make_pool(8, 4)
    pool.admit("live", [1, 2, 3, 4, 5])
    pool.commit("live", 4)
    before = pool_state(pool)
    expect_error(ErrorCode.INVALID_REQUEST, pool.admit, "bad", tokens)
    assert pool_state(pool) == before
    assert pool.counters.admit_failures == 0


@pytest.mark.parametrize("tokens", [[-1], [2**32], [1, 2**40]])
def test_append_and_lookup_reject_bad_ids(tokens: list) -> None:
    pool = make_pool(8, 2)
    pool.admit("a", [1, 2, 3])
    before = pool_state(pool)
    expect_error(ErrorCode.INVALID_REQUEST, pool.append, "a", tokens)
    expect_error(ErrorCode.INVALID_REQUEST, pool.lookup, [1, 2, 3, *tokens])
    assert pool_state(pool) == before


def test_commit_outside_the_sequence_is_rejected() -> None:
    pool = make_pool(8, 2)
    pool.admit("a", [1, 2, 3])
    before = pool_state(pool)
    expect_error(ErrorCode.INVALID_REQUEST, pool.commit, "a", 4)
    expect_error(ErrorCode.INVALID_REQUEST, pool.commit, "a", -1)
    assert pool_state(pool) == before


@pytest.mark.parametrize(
    ("tokens", "table"),
    [
        ([1, 2, 3], [0]),  # too short
        ([1, 2, 3], [0, 1, 2]),  # too long
        ([], []),  # no tokens
        ([1, 2, 3], [0, 6]),  # a block outside the pool
        ([1, 2, 3], [-1, 0]),
        ([1, 2, 2**32], [0, 1]),  # a bad token id
    ],
)
def test_restore_sequence_rejects_bad_input_and_changes_nothing(tokens: list, table: list) -> None:
    pool = make_pool(6, 2)
    pool.admit("live", [4, 4, 4])
    before = pool_state(pool)
    expect_error(ErrorCode.INVALID_REQUEST, pool.restore_sequence, "r", tokens, table, len(tokens))
    assert pool_state(pool) == before
    assert pool.check() == []


def test_adopt_generations_rejects_bad_input() -> None:
    pool = make_pool(4, 2)
    expect_error(ErrorCode.INVALID_REQUEST, pool.adopt_generations, [1, 1, 1])
    expect_error(ErrorCode.INVALID_REQUEST, pool.adopt_generations, [1, 1, -1, 1])
    assert pool.generation == [0, 0, 0, 0]


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (-1, 4), (4, 0), (4, -2)])
def test_pool_shape_must_be_positive(num_blocks: int, block_size: int) -> None:
    expect_error(ErrorCode.INVALID_REQUEST, BlockPool, PoolSpec("p", num_blocks, block_size, "m", 1))


def test_sequence_id_errors() -> None:
    pool = make_pool(8, 2)
    pool.admit("a", [1, 2, 3])
    before = pool_state(pool)
    expect_error(ErrorCode.SEQUENCE_EXISTS, pool.admit, "a", [5])
    expect_error(ErrorCode.SEQUENCE_EXISTS, pool.fork, "a", "a")
    expect_error(ErrorCode.SEQUENCE_EXISTS, pool.restore_sequence, "a", [1], [5], 0)
    for op in (pool.free, lambda s: pool.append(s, [1]), lambda s: pool.commit(s, 0), lambda s: pool.fork(s, "z")):
        expect_error(ErrorCode.UNKNOWN_SEQUENCE, op, "never")
    assert pool_state(pool) == before

    assert pool.free("a") == 2
    before = pool_state(pool)
    for op in (pool.free, lambda s: pool.append(s, [1]), lambda s: pool.commit(s, 0), lambda s: pool.fork(s, "z")):
        expect_error(ErrorCode.DOUBLE_FREE, op, "a")
    assert pool_state(pool) == before
    # The id can be used again; freed again, it is a double free again.
    pool.admit("a", [1])
    pool.free("a")
    expect_error(ErrorCode.DOUBLE_FREE, pool.free, "a")
    assert pool.check() == []


def test_free_all() -> None:
    pool = make_pool(8, 2)
    pool.admit("a", [1, 2, 3])
    pool.fork("a", "b")
    pool.admit("c", [4])
    assert pool.free_all() == 5
    assert pool.seqs == {} and pool.refcount == [0] * 8
    assert pool.check() == []
