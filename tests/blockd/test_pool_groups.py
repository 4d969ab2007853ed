"""Layer groups (Gemma 2/3, gpt-oss: sliding and global layers mixed): a sequence's tables, one per group, in one
pool. Every op applies to all of them, all or nothing; admission finds the one cached length every group has (a
sliding group needs only the blocks its window reads); one group's blocks are never a hit for another's; I7 and
every other invariant hold per table (`check()`)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockd import protocol as p
from blockd.block_rule import dead_blocks
from blockd.client import PoolClient
from blockd.errors import BlockdError, ErrorCode
from blockd.inprocess import InProcessBlockd
from blockd.pool import HOLE, MAX_GROUPS, BlockPool, PoolSpec
from tests.blockd.pool_state import pool_state
from tests.blockd.test_pool import expect_error

BS, WINDOW = 4, 6


def grouped_pool(num_blocks: int = 32, groups: tuple[bool, ...] = (False, True)) -> BlockPool:
    return BlockPool(PoolSpec("p", num_blocks, BS, "m", 1, WINDOW, groups))


def test_a_sequence_has_a_table_per_group_and_only_sliding_ones_slide() -> None:
    pool = grouped_pool()
    result = pool.admit("a", list(range(14)))
    assert len(result.blocks) == 4 and [len(g.blocks) for g in result.groups] == [4]
    assert set(pool.seqs) == {"a", "a@g1"} and pool.stats().live_sequences == 1
    assert pool.stats().blocks_in_use == 8
    pool.commit("a", 14)
    assert len(pool.index) == 6  # three full blocks per group, hashed apart
    assert pool.slide("a", 14) == 2  # the query at 14 reads 9..14: the sliding group's blocks 0 and 1 go back
    assert pool.seqs["a"].holes == 0 and pool.seqs["a@g1"].table[:2] == [HOLE, HOLE]
    assert pool.check() == []
    grown = pool.append("a", [1, 2, 3])  # 17 tokens: a fifth block in each group
    assert len(grown.blocks) == 1 and len(grown.of_group(1).blocks) == 1
    assert pool.free("a") == 5 + 3
    assert pool.check() == [] and pool.stats().blocks_in_use == 0


def test_one_groups_blocks_are_never_a_hit_for_anothers() -> None:
    pool = grouped_pool()
    pool.admit("a", list(range(13)))
    pool.commit("a", 12)
    hashes = {pool.block_hash[b] for b in pool.seqs["a"].table[:3]}
    assert hashes.isdisjoint(pool.block_hash[b] for b in pool.seqs["a@g1"].table[:3])
    pool.free("a")
    again = pool.admit("b", [*range(12), 9])
    assert again.num_cached_tokens == 12
    assert set(again.blocks[:3]).isdisjoint(again.groups[0].blocks)  # each group took its own chain back


def test_the_cached_length_is_the_longest_every_group_has() -> None:
    pool = grouped_pool(num_blocks=12)
    prompt = list(range(20))
    pool.admit("a", prompt)
    pool.commit("a", 20)
    pool.free("a")  # 5 blocks per group cached; tail first: each chain's head is freed last
    r = pool.admit("b", [*prompt, 1])
    assert r.num_cached_tokens == 20
    assert r.groups[0].blocks[:3] == [HOLE] * dead_blocks(BS, WINDOW, 20)
    assert pool.check() == []
    pool.free("b")
    # Evict the global group's first block: no group has a prefix the other lacks, so nothing is a hit.
    g0_head = pool.index[next(iter(pool.index))]  # (insertion order: group 0's first block was indexed first)
    while g0_head in pool.free_queue:
        pool.admit(f"x{len(pool.seqs)}", [7])
    assert pool.lookup([*prompt, 1]) == 0
    assert pool.check() == []


def test_a_sliding_groups_evicted_head_still_hits() -> None:
    pool = grouped_pool(num_blocks=15)
    prompt = list(range(20))
    pool.admit("a", prompt)
    pool.commit("a", 20)
    head = pool.seqs["a@g1"].table[0]
    pool.slide("a", 20)  # the sliding group's blocks 0-2 go back while the sequence lives
    while pool.block_hash[head] is not None:  # evict the sliding group's first block
        pool.admit(f"x{len(pool.seqs)}", [7])
    assert pool.lookup([*prompt, 1]) == 20  # the window of the query at 20 reads blocks 3 and 4 only
    assert pool.check() == []


def test_admission_is_all_or_nothing() -> None:
    pool = grouped_pool(num_blocks=7)
    before = pool_state(pool)
    err = expect_error(ErrorCode.OUT_OF_BLOCKS, pool.admit, "a", list(range(14)))  # 4 blocks in each of 2 groups
    assert err.missing_blocks == 1
    assert pool_state(pool) == before and pool.check() == []
    pool.admit("a", list(range(12)))  # 3 + 3
    before = pool_state(pool)
    expect_error(ErrorCode.OUT_OF_BLOCKS, pool.append, "a", [1, 2, 3, 4, 5])  # a block each: 2, one is free
    assert pool_state(pool) == before and pool.check() == []


def test_clients_name_sequences_never_group_tables() -> None:
    pool = grouped_pool()
    expect_error(ErrorCode.INVALID_REQUEST, pool.admit, "a@g1", [1, 2])
    pool.admit("a", [1, 2])
    before = pool_state(pool)
    for op in (pool.free, lambda s: pool.commit(s, 1), lambda s: pool.append(s, [3])):
        expect_error(ErrorCode.INVALID_REQUEST, op, "a@g1")
    assert pool_state(pool) == before


def test_bad_group_specs_are_refused() -> None:
    expect_error(ErrorCode.INVALID_REQUEST, BlockPool, PoolSpec("p", 8, BS, "m", 1, None, (False, True)))
    expect_error(ErrorCode.INVALID_REQUEST, BlockPool, PoolSpec("p", 8, BS, "m", 1, 4, (True,) * (MAX_GROUPS + 1)))
    with pytest.raises(p.RequestError, match="groups"):  # bounded on the wire, before any work
        register = p.Register(
            v=p.PROTOCOL_VERSION, id=1, pool_id="p", num_blocks=8, block_size=4, model_id="m", epoch=1,
            groups=[True] * (MAX_GROUPS + 1),
        )  # fmt: skip
        p.decode_request(p.encode(register))


def test_check_reports_a_missing_or_diverging_group_table() -> None:
    pool = grouped_pool()
    pool.admit("a", list(range(6)))
    pool.admit("b", list(range(6)))
    pool.seqs["a@g1"].tokens += b"\0\0\0\0"
    del pool.seqs["b@g1"]
    problems = pool.check()
    assert any("I7" in line and "'a@g1'" in line for line in problems)
    assert any("I7" in line and "'b'" in line for line in problems)


def test_the_client_mirrors_every_groups_table_and_resyncs_them() -> None:
    blockd = InProcessBlockd()
    pool = PoolClient(blockd, pool_id="g", num_blocks=32, block_size=BS, model_id="m", epoch=3, retry_for_s=1.0,
                      sliding_window=WINDOW, groups=(False, True, True))  # fmt: skip
    pool.register()
    pool.admit("a", list(range(14)))
    pool.commit("a", 14)
    pool.slide("a", 14)
    pool.append("a", [1, 2, 3, 4])
    pool.fork("a", "b")
    pool.append("b", [5])  # copy-on-write of the shared open block, in every group
    server = blockd.manager.pools["g"]
    for table_id, mirrored in pool.seqs.items():
        assert mirrored.blocks == server.seqs[table_id].table, table_id
    assert pool.free_blocks == server.num_blocks - server.stats().blocks_in_use
    # The gateway's lookup: the sliding group's first blocks went back but stay cached, so 12 tokens hit.
    assert blockd.manager.lookup(p_tokens([*range(14), 0]), None).cached_tokens["g"] == 12
    blockd.manager.pools.clear()  # blockd lost the pool: the executor's tables are the truth
    pool.resync()
    server = blockd.manager.pools["g"]
    assert {t: s.table for t, s in server.seqs.items()} == {t: s.blocks for t, s in pool.seqs.items()}
    assert server.check() == []


def p_tokens(ids: list[int]) -> bytes:
    from common.tokens import pack_tokens

    return bytes(pack_tokens(ids))


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "append", "commit", "slide", "fork", "free"]),
        st.integers(0, 3),  # which sequence
        st.lists(st.integers(0, 2), min_size=1, max_size=9),  # tokens (few ids: prefixes repeat)
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, num_blocks=st.integers(4, 24), groups=st.sampled_from([(False, True), (False, True, True, True)]))
def test_any_op_sequence_keeps_every_invariant(ops, num_blocks: int, groups: tuple[bool, ...]) -> None:
    pool = grouped_pool(num_blocks, groups)
    computed: dict[str, int] = {}
    for name, which, tokens in ops:
        sid = f"s{which}"
        before = pool_state(pool)
        try:
            if name == "admit":
                r = pool.admit(sid, tokens)
                computed[sid] = r.num_cached_tokens
                assert len({len(r.blocks), *(len(g.blocks) for g in r.groups)}) == 1
            elif name == "append":
                pool.append(sid, tokens)
            elif name == "commit":
                computed[sid] = pool.num_tokens(sid)
                pool.commit(sid, computed[sid])
            elif name == "slide":
                pool.slide(sid, computed.get(sid, 0))
            elif name == "fork":
                pool.fork(sid, f"s{(which + 1) % 4}")
                computed[f"s{(which + 1) % 4}"] = computed.get(sid, 0)
            else:
                pool.free(sid)
        except BlockdError:
            after = pool_state(pool)
            assert after == before, name  # I6
        assert pool.check() == [], (name, pool.check())
        for table_id, seq in pool.seqs.items():  # a sliding table holds at most its window's blocks and the rest
            if seq.group and computed.get(table_id.partition("@")[0]) is not None:
                assert seq.holes <= dead_blocks(BS, WINDOW, pool.num_tokens(table_id))
