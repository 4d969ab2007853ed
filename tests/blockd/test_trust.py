"""Trust at blockd's seams, against a real blockd process: fencing by epoch, leases kept by a heartbeat thread,
and inputs bounded before any work. Every refused request gets a stable code and changes nothing."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from blockd import protocol as p
from blockd.client import BlockdClient, PoolClient, PoolFenced
from blockd.errors import BlockdError, ErrorCode
from blockd.manager import Limits
from common.limits import SUPPORTED_BLOCK_SIZES
from common.tokens import pack_tokens
from pagedkv_kernels import validate
from tests.support.waiting import holds_throughout, wait_for

BS = 4


def pool_client(daemon, pool_id: str = "ex0", num_blocks: int = 64, **kwargs) -> PoolClient:
    client = PoolClient(
        daemon.client(timeout_s=2.0), pool_id=pool_id, num_blocks=num_blocks, block_size=BS, model_id="tiny", **kwargs
    )
    client.register()
    return client


def refused(code: ErrorCode, call, *args, **kwargs) -> str:
    with pytest.raises(BlockdError) as info:
        call(*args, **kwargs)
    assert info.value.code == code, info.value
    assert info.value.message
    return info.value.message


def state_of(daemon, pool_id: str = "ex0") -> dict:
    """Everything a refused request must leave as it was."""
    with daemon.client() as operator:
        stats = msgspec.to_builtins(operator.stats(pool_id).pools[0])
        assert operator.check() == []
    stats.pop("counters")
    return stats


def test_requests_with_another_epoch_are_refused_and_change_nothing(start_blockd):
    daemon = start_blockd("--no-persistence", "--lease-timeout", "1.5")
    victim = pool_client(daemon)
    victim.admit("a", list(range(10)))
    victim.commit("a", 8)
    before = state_of(daemon)
    blocks = list(victim.seqs["a"].blocks)

    guess = victim.epoch + 1
    with daemon.client() as attacker:
        # What an attacker can learn: pool ids and shapes, never the epoch.
        listed = attacker.pools()
        stats = attacker.stats()
        (info,) = listed.pools
        assert info.epoch_fingerprint == victim.epoch_fingerprint
        for reply in (listed, stats):
            assert str(victim.epoch) not in str(msgspec.to_builtins(reply))
        for ops in (
            [p.Free("a")],
            [p.Admit("planted", pack_tokens(list(range(10))))],
            [p.Admit("planted", pack_tokens(list(range(10)))), p.Commit("planted", 8)],
            [p.Append("a", pack_tokens([1, 2, 3, 4, 5]))],
            [p.Fork("a", "a2")],
            [],
        ):
            message = refused(ErrorCode.STALE_EPOCH, attacker.call, p.Step, pool_id="ex0", epoch=guess, ops=ops)
            assert str(victim.epoch) not in message
        refused(ErrorCode.STALE_EPOCH, attacker.call, p.Heartbeat, pool_id="ex0", epoch=guess)
        refused(ErrorCode.STALE_EPOCH, attacker.call, p.Unregister, pool_id="ex0", epoch=guess)
        refused(ErrorCode.STALE_EPOCH, attacker.call, p.ResetPrefixCache, pool_id="ex0", epoch=guess)
        held = refused(
            ErrorCode.POOL_HELD,
            attacker.call,
            p.Register,
            pool_id="ex0",
            num_blocks=64,
            block_size=BS,
            model_id="tiny",
            epoch=guess,
            sequences=[p.LiveSequence("planted", pack_tokens(list(range(8))), blocks[:2], 8)],
        )
        assert "pool ex0 is held by a live executor since" in held and str(victim.epoch) not in held
    assert state_of(daemon) == before
    assert victim.step([p.Append("a", pack_tokens([7]))])  # the owner goes on as if nothing happened

    # Heartbeats with the wrong epoch do not keep a silent pool alive: its lease runs out, and then a new epoch
    # may take the pool (clean).
    with daemon.client() as attacker:

        def pool_gone() -> bool:
            with pytest.raises(BlockdError) as info:
                attacker.call(p.Heartbeat, pool_id="ex0", epoch=guess)
            return info.value.code == ErrorCode.UNKNOWN_POOL

        wait_for(pool_gone, timeout_s=3, interval_s=0.1, what="the lease to run out despite the heartbeats")
    successor = pool_client(daemon, epoch=guess)
    assert state_of(daemon)["blocks_in_use"] == 0 and not successor.seqs
    # The old owner comes back: it is fenced (never re-registers over its successor).
    with pytest.raises(PoolFenced) as fenced:
        victim.step([p.Free("a")])
    assert fenced.value.code == ErrorCode.STALE_EPOCH and victim.fenced


def test_mirror_and_blockd_agree_after_any_sequence_of_refused_requests(start_blockd):
    """An owner drives random ops while a stranger fires every kind of refused request in between; after each
    round the owner's mirror (block tables, free blocks) and blockd's state agree exactly."""
    daemon = start_blockd("--no-persistence", "--max-lookup-tokens", "64", "--max-message-bytes", "256KiB")
    rng = random.Random(11)
    owner = pool_client(daemon, num_blocks=48)
    stranger = BlockdClient(daemon.endpoint, timeout_s=2.0, max_message_bytes=256 * 1024)
    operator = daemon.client()
    names = iter(f"s{i}" for i in range(10_000))

    def tokens(n: int) -> bytes:
        return pack_tokens([rng.randrange(6) for _ in range(n)])

    def legit_op() -> p.StepOp:
        live = list(owner.seqs)
        kind = rng.choice(
            ["admit", "admit", "append", "commit", "fork", "free", "huge", "ghost"] if live else ["admit"]
        )
        seq = rng.choice(live) if live else ""
        if kind == "admit":
            return p.Admit(next(names), tokens(rng.randrange(1, 30)))
        if kind == "append":
            return p.Append(seq, tokens(rng.randrange(1, 9)))
        if kind == "commit":
            return p.Commit(seq, rng.randrange(0, 40))
        if kind == "fork":
            return p.Fork(seq, next(names))
        if kind == "free":
            return p.Free(seq)
        if kind == "huge":
            return p.Admit(next(names), tokens(48 * BS + 1))  # too_many_tokens
        return p.Free("ghost")  # unknown_sequence

    def refused_request() -> None:
        live = list(owner.seqs) or ["x"]
        bad_epoch = owner.epoch ^ (1 << rng.randrange(62))
        kind = rng.randrange(8)
        with pytest.raises(BlockdError) as info:
            if kind == 0:
                ops = [p.Free(rng.choice(live)), p.Admit(next(names), tokens(12)), p.Commit(rng.choice(live), 8)]
                stranger.call(p.Step, pool_id="ex0", epoch=bad_epoch, ops=ops)
            elif kind == 1:
                stranger.call(p.Unregister, pool_id="ex0", epoch=bad_epoch)
            elif kind == 2:
                stranger.call(p.ResetPrefixCache, pool_id="ex0", epoch=bad_epoch)
            elif kind == 3:
                stranger.call(p.Heartbeat, pool_id="ex0", epoch=bad_epoch)
            elif kind == 4:
                stranger.call(p.Register, pool_id="ex0", num_blocks=48, block_size=BS, model_id="tiny", epoch=bad_epoch)
            elif kind == 5:
                stranger.call(p.Lookup, tokens=tokens(65))
            elif kind == 6:
                stranger.call(p.Register, pool_id="ex0", num_blocks=48, block_size=3, model_id="tiny", epoch=1)
            else:
                stranger.lookup([1] * 70_000)  # over --max-message-bytes: refused before it is sent
        assert info.value.code in {
            ErrorCode.STALE_EPOCH,
            ErrorCode.POOL_HELD,
            ErrorCode.TOO_MANY_TOKENS,
            ErrorCode.UNSUPPORTED_BLOCK_SIZE,
            ErrorCode.TOO_LARGE,
        }, info.value

    for _ in range(60):
        for _ in range(rng.randrange(0, 3)):
            refused_request()
        owner.step([legit_op() for _ in range(rng.randrange(1, 5))])
        for _ in range(rng.randrange(0, 3)):
            refused_request()
        stats = operator.stats("ex0").pools[0]
        held = {b for seq in owner.seqs.values() for b in seq.blocks}
        assert stats.live_sequences == len(owner.seqs)
        assert stats.blocks_in_use == len(held)  # the executor's free blocks are blockd's
        for seq_id, seq in owner.seqs.items():
            info = operator.sequence(seq_id, "ex0")
            assert info.blocks == seq.blocks and info.num_tokens == len(seq.tokens) // 4
    assert operator.check() == [] and owner.resyncs == 0
    stranger.close()
    operator.close()


def test_heartbeat_thread_keeps_the_lease_through_a_step_longer_than_the_lease(start_blockd):
    daemon = start_blockd("--no-persistence", "--lease-timeout", "0.6")
    ex = pool_client(daemon)
    ex.admit("a", list(range(9)))
    ex.start_heartbeats()
    try:
        # A forward pass four times the lease: this thread says nothing to blockd meanwhile, and the lease must not
        # run out, which only watching for that long can show (blockd's log, not a request that would renew it).
        holds_throughout(lambda: "lease expired" not in daemon.log(), 2.5, what="the lease")
        assert ex.heartbeats_running
        ex.append("a", [1])
        assert ex.resyncs == 0  # the pool was never lost: no re-registration was needed
        with daemon.client() as operator:
            assert operator.sequence("a", "ex0").num_tokens == 10
    finally:
        ex.stop_heartbeats()
    assert "lease expired" not in daemon.log()
    # Without the thread, the same silence loses the pool (and the next call re-syncs).
    wait_for(lambda: "lease expired" in daemon.log(), timeout_s=10, what="the lease to expire")
    ex.append("a", [2])
    assert ex.resyncs == 1


def test_inputs_are_bounded_before_any_work(start_blockd):
    daemon = start_blockd(
        "--no-persistence",
        "--max-pools",
        "2",
        "--max-blocks-per-pool",
        "1000",
        "--block-sizes",
        "4,16",
        "--max-lookup-tokens",
        "100",
    )
    ex = pool_client(daemon)
    ex.admit("a", list(range(10)))
    ex.commit("a", 8)
    before = state_of(daemon)

    def register(pool_id: str, num_blocks: int = 8, block_size: int = BS) -> None:
        with daemon.client() as client:
            client.call(
                p.Register, pool_id=pool_id, num_blocks=num_blocks, block_size=block_size, model_id="m", epoch=5
            )

    started = time.monotonic()
    refused(ErrorCode.POOL_TOO_LARGE, register, "big", 1001)
    refused(ErrorCode.POOL_TOO_LARGE, register, "huge", 2**31 - 1)
    refused(ErrorCode.UNSUPPORTED_BLOCK_SIZE, register, "odd", 8, 1)
    register("second")
    message = refused(ErrorCode.TOO_MANY_POOLS, register, "third")
    assert "--max-pools" in message
    register("second")  # the same pool again: not a new one
    assert time.monotonic() - started < 2.0  # no refused register did any work

    with daemon.client() as client:
        refused(ErrorCode.TOO_MANY_TOKENS, client.call, p.Lookup, tokens=pack_tokens([1] * 101))
        assert client.lookup([*range(10), *([1] * 200)], max_tokens=100) == {"ex0": 8, "second": 0}
        too_many_ops = [p.Free("x")] * (p.MAX_STEP_OPS + 1)
        refused(ErrorCode.INVALID_REQUEST, client.call, p.Step, pool_id="ex0", epoch=ex.epoch, ops=too_many_ops)
        pools = {i.pool_id for i in client.pools().pools}
    assert pools == {"ex0", "second"}
    assert state_of(daemon) == before


def test_a_flooding_peer_does_not_starve_the_others(start_blockd):
    daemon = start_blockd("--no-persistence", "--receive-queue", "100")
    ex = pool_client(daemon)
    flood = zmq.Context.instance().socket(zmq.DEALER)
    flood.setsockopt(zmq.LINGER, 0)
    flood.setsockopt(zmq.SNDHWM, 0)
    flood.connect(daemon.endpoint)
    frame = p.encode(p.Lookup(v=p.PROTOCOL_VERSION, id=1, tokens=pack_tokens([1] * 64)))
    for _ in range(20_000):  # never reads a reply
        flood.send(frame, zmq.NOBLOCK)
    slowest = 0.0
    for i in range(20):
        started = time.perf_counter()
        ex.admit(f"s{i}", [i, 1, 2])
        slowest = max(slowest, time.perf_counter() - started)
    assert slowest < 1.0
    flood.close()
    wait_for(lambda: daemon.alive(), what="blockd alive")


def test_block_sizes_come_from_one_list():
    assert validate.SUPPORTED_BLOCK_SIZES is SUPPORTED_BLOCK_SIZES
    assert tuple(Limits().block_sizes) == SUPPORTED_BLOCK_SIZES  # blockd's default --block-sizes
