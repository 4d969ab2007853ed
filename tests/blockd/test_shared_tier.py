"""The deployment's shared KV tier in blockd (blockd.tiers.SharedTier) through the manager: writes at commit,
loads only once written, one pool's blocks served to another, LRU discards within capacity, lost writes and bad
files forgotten, a dead pool's owed writes released, bad registrations refused; T3 under random operations."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockd import protocol as p
from blockd.errors import BlockdError, ErrorCode
from blockd.manager import BlockManager
from blockd.tiers import MEDIUM_SHARED, TierHeld, TierSpec
from common.tokens import pack_tokens

BS = 4


def _register(
    manager: BlockManager,
    pool_id: str,
    *,
    shared_id: str = "vol-1",
    capacity: int = 64,
    held: list[bytes] = (),  # type: ignore[assignment]
    epoch: int = 1,
    host: int = 0,
    num_blocks: int = 8,
) -> None:
    tiers = TierSpec(host_blocks=host, shared_id=shared_id, shared_blocks=capacity, shared=[TierHeld(h) for h in held])
    manager.register(
        p.Register(
            v=p.PROTOCOL_VERSION,
            id=1,
            pool_id=pool_id,
            num_blocks=num_blocks,
            block_size=BS,
            model_id="m",
            epoch=epoch,
            tiers=tiers,
        )
    )


def _prompt(first: int, blocks: int = 3) -> list[int]:
    return list(range(first, first + blocks * BS + 1))  # `blocks` full blocks and one token


def _compute(manager: BlockManager, pool_id: str, seq: str, tokens: list[int]) -> tuple[p.AdmitResult, list]:
    """Admit, commit every full block, free; returns the admit and the commit's tier ops."""
    (admitted,) = manager.step(pool_id, 1, [p.Admit(seq, pack_tokens(tokens))]).results
    assert type(admitted) is p.AdmitResult, admitted
    committed, _ = manager.step(pool_id, 1, [p.Commit(seq, len(tokens)), p.Free(seq)]).results
    assert type(committed) is p.CommitResult
    return admitted, list(committed.tier_ops)


def test_a_block_committed_on_one_pool_loads_on_another_once_its_write_is_reported():
    manager = BlockManager()
    _register(manager, "a")
    _register(manager, "b")
    _, ops = _compute(manager, "a", "s", _prompt(0))
    assert [(op.kind, op.medium) for op in ops] == [("save", MEDIUM_SHARED)] * 3
    written = [op.block_hash for op in ops]
    # Not written yet: b must compute (a pending write is never loaded), and the lookup says so.
    assert manager.lookup(pack_tokens(_prompt(0)), None).tier_tokens == {}
    (early,) = manager.step("b", 1, [p.Admit("early", pack_tokens(_prompt(0)))]).results
    assert early.num_cached_tokens == 0 and early.tier_ops == ()
    manager.step("b", 1, [p.Free("early")])
    assert manager.check() == []

    manager.step("a", 1, [], shared_written=written)
    lookup = manager.lookup(pack_tokens(_prompt(0)), None)
    # a holds them on its device still; b would load them from the shared tier.
    assert lookup.cached_tokens["a"] == 3 * BS and lookup.tier_tokens == {"b": {MEDIUM_SHARED: 3 * BS}}
    (hit,) = manager.step("b", 1, [p.Admit("hit", pack_tokens(_prompt(0)))]).results
    assert hit.num_cached_tokens == 3 * BS and hit.loaded_tokens == 3 * BS
    loads = [op for op in hit.tier_ops if op.kind == "load"]
    assert [op.medium for op in loads] == [MEDIUM_SHARED] * 3
    assert [op.block for op in loads] == list(hit.blocks[:3])
    assert [op.block_hash for op in loads] == written
    # The loaded blocks are committed as computed ones: already on the volume, so not written again.
    (commit,) = manager.step("b", 1, [p.Commit("hit", len(_prompt(0)))]).results
    assert commit.added == 3 and commit.tier_ops == ()
    shared_b = next(t for t in manager.pools["b"].stats().tiers if t.medium == MEDIUM_SHARED)
    assert shared_b.counters.hits == 3 and shared_b.counters.loads == 3 and shared_b.blocks == 3
    shared_a = next(t for t in manager.pools["a"].stats().tiers if t.medium == MEDIUM_SHARED)
    assert shared_a.counters.demotions == 3
    assert manager.check() == []


def test_a_full_shared_tier_discards_its_least_recently_used_block_first():
    manager = BlockManager()
    _register(manager, "a", capacity=4)
    _, first = _compute(manager, "a", "s1", _prompt(0, blocks=2))
    manager.step("a", 1, [], shared_written=[op.block_hash for op in first])
    _, second = _compute(manager, "a", "s2", _prompt(100, blocks=3))
    discards = [op for op in second if op.kind == "discard"]
    saves = [op for op in second if op.kind == "save"]
    assert len(saves) == 3 and [op.block_hash for op in discards] == [first[0].block_hash]
    # The discard comes before the write it makes room for.
    assert second.index(discards[0]) < second.index(saves[-1])
    shared = manager.shared_tiers["vol-1"]
    assert len(shared.entries) + len(shared.pending) == 4
    assert manager.check() == []


def test_a_lost_write_or_a_bad_file_is_forgotten_and_never_loaded():
    manager = BlockManager()
    _register(manager, "a")
    _register(manager, "b")  # (a holds the blocks on its device: b's lookup shows the shared tier)
    _, ops = _compute(manager, "a", "s", _prompt(0))
    hashes = [op.block_hash for op in ops]
    manager.step("a", 1, [], shared_written=hashes[:2], shared_drops=hashes[2:])  # the third's write failed
    assert manager.lookup(pack_tokens(_prompt(0)), None).tier_tokens == {"b": {MEDIUM_SHARED: 2 * BS}}
    manager.step("b", 1, [], shared_drops=hashes[1:2])  # b's load found the second's file corrupt
    assert manager.lookup(pack_tokens(_prompt(0)), None).tier_tokens == {"b": {MEDIUM_SHARED: BS}}
    shared = next(t for t in manager.pools["b"].stats().tiers if t.medium == MEDIUM_SHARED)
    assert shared.counters.drops == 1 and shared.blocks == 1
    assert manager.check() == []


def test_a_restarted_pool_releases_its_owed_writes_and_its_report_refills_the_tier():
    manager = BlockManager(lease_timeout_s=0.0)
    _register(manager, "a")
    _, ops = _compute(manager, "a", "s", _prompt(0))
    shared = manager.shared_tiers["vol-1"]
    assert len(shared.pending) == 3
    # The executor restarts (a new epoch): what it owed is not coming; its scan of the volume is the report.
    found = [op.block_hash for op in ops[:2]]
    _register(manager, "a", epoch=2, held=found)
    assert shared.pending == {} and list(shared.entries) == found
    assert manager.check() == []
    # Its old self's write, reported late under the new epoch, is taken (the file is whole) where room is.
    manager.step("a", 2, [], shared_written=[ops[2].block_hash])
    assert list(shared.entries) == [*found, ops[2].block_hash]
    # A pool dropped (its lease ran out) owes nothing either.
    _compute_epoch2 = manager.step("a", 2, [p.Admit("t", pack_tokens(_prompt(500)))]).results
    manager.step("a", 2, [p.Commit("t", len(_prompt(500)))])
    assert shared.pending
    manager.expire()
    assert shared.pending == {} and manager.check() == []
    assert _compute_epoch2


def test_pools_of_another_shared_id_never_see_the_blocks():
    manager = BlockManager()
    _register(manager, "a", shared_id="vol-1")
    _register(manager, "b", shared_id="vol-1")
    _register(manager, "c", shared_id="vol-2")
    _, ops = _compute(manager, "a", "s", _prompt(0))
    manager.step("a", 1, [], shared_written=[op.block_hash for op in ops])
    assert manager.lookup(pack_tokens(_prompt(0)), None).tier_tokens == {"b": {MEDIUM_SHARED: 3 * BS}}
    (miss,) = manager.step("c", 1, [p.Admit("m", pack_tokens(_prompt(0)))]).results
    assert miss.num_cached_tokens == 0


@pytest.mark.parametrize(
    ("shared_id", "blocks", "code"),
    [
        ("vol", 0, ErrorCode.INVALID_REQUEST),  # an id without a capacity
        ("", 8, ErrorCode.INVALID_REQUEST),  # a capacity without an id
        ("x" * 129, 8, ErrorCode.INVALID_REQUEST),
        ("vol", 1 << 40, ErrorCode.POOL_TOO_LARGE),
    ],
)
def test_a_bad_shared_tier_registration_is_refused_and_changes_nothing(shared_id, blocks, code):
    manager = BlockManager()
    _register(manager, "a")
    with pytest.raises(BlockdError) as refused:
        _register(manager, "z", shared_id=shared_id, capacity=blocks)
    assert refused.value.code == code
    assert set(manager.pools) == {"a"} and set(manager.shared_tiers) == {"vol-1"}


def test_a_step_reporting_writes_is_bounded_by_the_protocol():
    too_many = [b"\0" * 16] * (p.MAX_STEP_OPS + 1)
    data = msgspec.msgpack.encode(
        {
            "op": "step",
            "v": p.PROTOCOL_VERSION,
            "id": 1,
            "pool_id": "a",
            "epoch": 1,
            "ops": [],
            "shared_written": too_many,
        }
    )
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(data, type=p.Step)


_ops = st.lists(
    st.tuples(
        st.sampled_from(["compute", "compute", "written", "lost", "restart"]),
        st.sampled_from(["a", "b"]),
        st.integers(0, 5),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_ops)
def test_t3_holds_under_random_commits_reports_and_restarts(ops):
    manager = BlockManager(lease_timeout_s=0.0)  # (a restart takes its pool over at once)
    epochs = {"a": 1, "b": 1}
    for pool_id in epochs:
        _register(manager, pool_id, capacity=5, num_blocks=12)
    owed: dict[str, list[bytes]] = {"a": [], "b": []}
    n = 0
    for kind, pool_id, arg in ops:
        epoch = epochs[pool_id]
        if kind == "compute":
            n += 1
            tokens = _prompt(arg * 1000, blocks=1 + arg % 3)
            (admitted,) = manager.step(pool_id, epoch, [p.Admit(f"s{n}", pack_tokens(tokens))]).results
            if type(admitted) is p.OpError:
                continue
            committed, _ = manager.step(pool_id, epoch, [p.Commit(f"s{n}", len(tokens)), p.Free(f"s{n}")]).results
            owed[pool_id] += [op.block_hash for op in committed.tier_ops if op.kind == "save"]
        elif kind == "written":
            manager.step(pool_id, epoch, [], shared_written=owed[pool_id][: arg + 1])
            del owed[pool_id][: arg + 1]
        elif kind == "lost":
            manager.step(pool_id, epoch, [], shared_drops=owed[pool_id][:arg])
            del owed[pool_id][:arg]
        else:
            epochs[pool_id] += 1
            owed[pool_id] = []
            _register(manager, pool_id, capacity=5, num_blocks=12, epoch=epochs[pool_id])
        assert manager.check() == []
