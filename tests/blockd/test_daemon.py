"""A real blockd process against a real redis-server, over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import time

import pytest

from blockd import protocol as p
from blockd.client import BlockdClient, PoolClient, PoolFenced, StepFailed
from blockd.errors import BlockdError, ErrorCode
from blockd.persistence import POOLS_KEY, load_pool_records
from common.limits import SUPPORTED_BLOCK_SIZES
from common.tokens import pack_tokens
from tests.support.processes import RedisProcess
from tests.support.waiting import wait_for

TOO_MANY_RESERVED = 2 * max(SUPPORTED_BLOCK_SIZES) + 1

BS = 4


def pool_client(daemon, pool_id: str = "ex0", num_blocks: int = 64, epoch: int | None = None) -> PoolClient:
    client = PoolClient(
        daemon.client(timeout_s=1.0),
        pool_id=pool_id,
        num_blocks=num_blocks,
        block_size=BS,
        model_id="tiny",
        epoch=epoch,
        retry_for_s=20.0,
    )
    client.register()
    return client


def prompt(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def persisted_records(redis_process, pool_id: str) -> dict:
    """What Redis holds for the pool's blocks: block -> (hash, generation, stamp)."""
    return load_pool_records(redis_process.client(), pool_id)[0]


def persisted_entries(redis_process, pool_id: str) -> int:
    return len(persisted_records(redis_process, pool_id))


def test_operations_over_the_wire(redis_process, start_blockd):
    daemon = start_blockd("--redis-url", redis_process.url, "--flush-interval", "0.05")
    ex = pool_client(daemon)
    first = ex.admit("a", prompt(0, 10))
    assert len(first.blocks) == 3 and first.num_cached_tokens == 0
    grown = ex.append("a", [1, 2, 3])  # 13 tokens: a fourth block
    assert len(grown.blocks) == 1 and not grown.copies
    assert ex.commit("a", 12) == 3
    ex.fork("a", "a.1")
    cow = ex.append("a.1", [9])  # the shared last block is partly filled: copy-on-write
    ((src, dst),) = cow.copies
    assert src == grown.blocks[0] and dst not in ex.seqs["a"].blocks

    with daemon.client() as operator:
        info = operator.sequence("a")
        assert info.refcounts == [2, 2, 2, 1]  # the first three blocks are shared with the fork
        assert operator.lookup([*ex.seqs["a"].token_ids()[:12], 99]) == {"ex0": 12}

    # One step mixing every kind of op, one of them failing: the others apply, the failing one changes nothing.
    results = ex.step(
        [
            p.Admit("b", pack_tokens(ex.seqs["a"].token_ids()[:13])),
            p.Append("a", pack_tokens([5])),
            p.Free("nope"),
            p.Commit("a.1", 14),
            p.Free("a"),
        ]
    )
    assert type(results[0]) is p.AdmitResult and results[0].num_cached_tokens == 12
    assert type(results[1]) is p.AppendResult
    assert type(results[2]) is p.OpError and results[2].code == ErrorCode.UNKNOWN_SEQUENCE
    assert type(results[3]) is p.CommitResult
    assert type(results[4]) is p.FreeResult and results[4].freed == 4
    assert set(ex.seqs) == {"b", "a.1"}
    with daemon.client() as operator:
        assert operator.check() == []
        stats = operator.stats("ex0").pools[0]
        assert stats.live_sequences == 2
        assert stats.counters.hit_tokens == 12

    with pytest.raises(StepFailed) as err:
        ex.admit("huge", prompt(0, 63 * BS + 1))  # fits the pool, not its free blocks
    assert err.value.code == ErrorCode.OUT_OF_BLOCKS and err.value.missing_blocks > 0
    with pytest.raises(StepFailed) as err:
        ex.admit("huger", prompt(0, 64 * BS + 1))  # more than the whole pool: refused before any hashing
    assert err.value.code == ErrorCode.TOO_MANY_TOKENS
    for seq_id in list(ex.seqs):
        ex.free(seq_id)
    with daemon.client() as operator:
        assert operator.stats("ex0").pools[0].blocks_in_use == 0
        assert operator.check() == []


def test_kill9_restart_keeps_prefixes_and_resyncs_refcounts(redis_process, start_blockd):
    args = ("--redis-url", redis_process.url, "--flush-interval", "0.05", "--lease-timeout", "30")
    daemon = start_blockd(*args)
    ex = pool_client(daemon, num_blocks=128)
    cached = prompt(1000, 33)  # 8 full blocks that will be cached-free at the crash
    ex.admit("done", cached)
    ex.commit("done", 33)
    ex.free("done")
    ex.admit("live", prompt(0, 21))
    ex.commit("live", 21)
    ex.fork("live", "live.1")
    ex.append("live.1", [7, 7, 7])
    with daemon.client() as operator:
        before = {s: operator.sequence(s) for s in ("live", "live.1")}
        entries = operator.stats("ex0").pools[0].index_entries
    # Committed longer ago than the write-behind lag: in Redis.
    wait_for(lambda: persisted_entries(redis_process, "ex0") == entries, what="index in redis")

    daemon.kill9()
    daemon.start()
    with daemon.client() as operator:
        assert operator.stats().dormant_pools == ["ex0"]
    # The executor carries on; its next request finds its pool unknown and re-syncs by itself.
    ex.append("live", [5])
    assert ex.resyncs == 1
    with daemon.client() as operator:
        for seq_id, old in before.items():
            now = operator.sequence(seq_id)
            assert now.blocks[: len(old.blocks)] == old.blocks
        assert operator.sequence("live").refcounts[:5] == [2, 2, 2, 2, 2]
        assert operator.lookup([*cached, 1]) == {"ex0": 32}  # the cached-free prefix survived the crash
        assert operator.check() == []
    again = ex.admit("again", [*cached, 1])
    assert again.num_cached_tokens == 32


def test_prefix_rewritten_after_persisting_is_never_a_hit_after_restart(redis_process, start_blockd):
    """The write-behind race: Redis still names a block that has since been evicted and rewritten."""
    # A long flush interval: right after one batch lands, the next is seconds away, so the crash below
    # comes before Redis hears of the eviction.
    args = ("--redis-url", redis_process.url, "--flush-interval", "2", "--lease-timeout", "30")
    daemon = start_blockd(*args)
    ex = pool_client(daemon, num_blocks=8)
    stale = prompt(500, 9)  # two full blocks
    ex.admit("old", stale)
    ex.commit("old", 9)
    ex.free("old")
    wait_for(lambda: persisted_entries(redis_process, "ex0") == 2, what="stale prefix in redis", interval_s=0.01)

    ex.admit("new", prompt(900, 8 * BS))  # every block reused for other content
    ex.commit("new", 8 * BS - 1)
    daemon.kill9()
    assert persisted_entries(redis_process, "ex0") == 2, "precondition: redis still holds the stale entries"
    stale_blocks = set(persisted_records(redis_process, "ex0"))
    assert stale_blocks <= set(ex.seqs["new"].blocks), "precondition: those blocks now hold other tokens"

    daemon.start()
    ex.heartbeat()  # blockd lost the pool: re-sync with the executor's sequences and generations
    assert ex.resyncs == 1
    with daemon.client() as operator:
        assert operator.lookup(stale) == {"ex0": 0}
        assert operator.lookup(prompt(900, 8 * BS)) == {"ex0": 28}
        assert operator.check() == []


def test_redis_outage_degrades_then_rewrites_the_index(redis_process, start_blockd, tmp_path):
    daemon = start_blockd("--redis-url", redis_process.url, "--flush-interval", "0.05")
    ex = pool_client(daemon, num_blocks=256)
    ex.admit("s0", prompt(0, 17))
    ex.commit("s0", 17)
    wait_for(lambda: persisted_entries(redis_process, "ex0") == 4, what="first prefix in redis")

    redis_process.kill()
    for i in range(1, 6):  # allocation goes on from memory
        ex.admit(f"s{i}", prompt(100 * i, 17))
        ex.commit(f"s{i}", 17)
    with daemon.client() as operator:
        wait_for(lambda: operator.stats().persistence.state == "degraded", what="degraded state")
        degraded = operator.stats().persistence
        assert degraded.last_error and degraded.lag_s > 0
        ex.append("s1", [3])

        redis_process.start(tmp_path / "fresh-redis")  # back, but empty: it lost everything
        wait_for(lambda: operator.stats().persistence.state == "ok", timeout_s=15, what="recovery")
        entries = operator.stats("ex0").pools[0].index_entries
    assert entries == 24
    wait_for(lambda: persisted_entries(redis_process, "ex0") == entries, what="index re-written")
    assert redis_process.client().hexists(POOLS_KEY, "ex0")


def test_silent_pool_expires_and_resyncs_when_it_returns(redis_process, start_blockd):
    daemon = start_blockd("--redis-url", redis_process.url, "--lease-timeout", "1", "--flush-interval", "0.05")
    ex = pool_client(daemon, num_blocks=32, epoch=7)
    ex.admit("s", prompt(0, 9))
    ex.commit("s", 9)
    wait_for(lambda: persisted_entries(redis_process, "ex0") == 2, what="index in redis")
    with daemon.client() as operator:
        wait_for(lambda: not operator.pools().pools, timeout_s=5, what="lease expiry")
    wait_for(lambda: persisted_entries(redis_process, "ex0") == 0, what="index dropped from redis")
    assert not redis_process.client().hexists(POOLS_KEY, "ex0")

    ex.heartbeat()  # unknown pool → re-register with the same epoch and the live sequence
    assert ex.resyncs == 1
    with daemon.client() as operator:
        assert operator.sequence("s").refcounts == [1, 1, 1]
        assert operator.check() == []

    fresh = PoolClient(daemon.client(), pool_id="ex0", num_blocks=32, block_size=BS, model_id="tiny", epoch=8)
    with pytest.raises(PoolFenced) as held:  # a new epoch while the pool's lease runs: refused
        fresh.register()
    assert held.value.code == ErrorCode.POOL_HELD and "held by a live executor since" in held.value.message
    with daemon.client() as operator:
        wait_for(lambda: not operator.pools().pools, timeout_s=5, what="lease expiry")
    result = fresh.register()  # a restarted executor after the old one's lease ran out: new epoch, clean pool
    assert not result.resynced and result.restored_sequences == 0
    with daemon.client() as operator:
        assert operator.stats("ex0").pools[0].blocks_in_use == 0


def test_bad_input_is_answered_and_changes_nothing(redis_process, start_blockd):
    import msgspec
    import zmq

    daemon = start_blockd("--redis-url", redis_process.url, "--max-message-bytes", "64KiB")
    ex = pool_client(daemon)
    ex.admit("a", prompt(0, 10))
    ex.commit("a", 8)
    with daemon.client() as operator:
        before = msgspec.to_builtins(operator.stats("ex0").pools[0])

    context = zmq.Context.instance()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)

    def ask(*frames: bytes) -> p.RawReply:
        raw.send_multipart(list(frames))
        assert raw.poll(5000), "blockd did not answer"
        return p.decode_reply(raw.recv())

    enc = msgspec.msgpack.encode
    step = {"v": p.PROTOCOL_VERSION, "id": 11, "op": "step", "pool_id": "ex0", "epoch": ex.epoch}
    cases = [
        ((b"\x00\xffgarbage",), ErrorCode.BAD_MESSAGE),
        ((enc([1, 2, 3]),), ErrorCode.BAD_MESSAGE),
        ((enc({"v": 99, "id": 1, "op": "stats"}),), ErrorCode.BAD_VERSION),
        ((enc({"v": p.PROTOCOL_VERSION, "id": 2, "op": "launch_missiles"}),), ErrorCode.UNKNOWN_OP),
        ((enc({**step, "ops": "not a list"}),), ErrorCode.INVALID_REQUEST),
        ((enc({**step, "ops": [{"type": "admit", "seq_id": "x", "tokens": [1, 5]}]}),), ErrorCode.INVALID_REQUEST),
        ((enc({**step, "ops": [{"type": "admit", "seq_id": "", "tokens": b"\0" * 4}]}),), ErrorCode.INVALID_REQUEST),
        ((enc({"v": p.PROTOCOL_VERSION, "id": 3, "op": "register", "pool_id": "ex0"}),), ErrorCode.INVALID_REQUEST),
        ((enc({**step, "pool_id": "ghost", "ops": []}),), ErrorCode.UNKNOWN_POOL),
        # A reservation larger than two of the largest blocks: refused by the schema, before any op is applied.
        (
            (enc({**step, "ops": [{"type": "append", "seq_id": "a", "tokens": b"", "reserve": TOO_MANY_RESERVED}]}),),
            ErrorCode.INVALID_REQUEST,
        ),
        (
            (enc({**step, "ops": [{"type": "append", "seq_id": "a", "tokens": b"", "reserve": -1}]}),),
            ErrorCode.INVALID_REQUEST,
        ),
        ((b"two", b"frames"), ErrorCode.BAD_MESSAGE),
        (
            (
                enc(
                    {
                        "v": p.PROTOCOL_VERSION,
                        "id": 4,
                        "op": "register",
                        "pool_id": "ex0",
                        "num_blocks": 65,
                        "block_size": BS,
                        "model_id": "tiny",
                        "epoch": ex.epoch,
                    }
                ),
            ),
            ErrorCode.POOL_MISMATCH,
        ),
        (
            (enc({"v": p.PROTOCOL_VERSION, "id": 5, "op": "reset_prefix_cache", "pool_id": "ghost"}),),
            ErrorCode.UNKNOWN_POOL,
        ),
        ((enc({"v": p.PROTOCOL_VERSION, "id": 6, "op": "seq", "seq_id": "ghost"}),), ErrorCode.UNKNOWN_SEQUENCE),
        # Lookups (a gateway's): token ids unpacked, not whole uint32s, a salt too long or not a string.
        ((enc({"v": p.PROTOCOL_VERSION, "id": 7, "op": "lookup", "tokens": [1, 2]}),), ErrorCode.INVALID_REQUEST),
        (
            (enc({"v": p.PROTOCOL_VERSION, "id": 8, "op": "lookup", "tokens": b"\x01\x02\x03"}),),
            ErrorCode.INVALID_REQUEST,
        ),
        (
            (enc({"v": p.PROTOCOL_VERSION, "id": 9, "op": "lookup", "tokens": b"", "cache_salt": "s" * 1025}),),
            ErrorCode.INVALID_REQUEST,
        ),
        (
            (enc({"v": p.PROTOCOL_VERSION, "id": 10, "op": "lookup", "tokens": b"", "cache_salt": 5}),),
            ErrorCode.INVALID_REQUEST,
        ),
    ]
    for frames, code in cases:
        reply = ask(*frames)
        assert not reply.ok and reply.error is not None, frames
        assert reply.error.code == code, (frames, reply.error)
        assert reply.error.message
    assert (
        ask(enc({"v": p.PROTOCOL_VERSION, "id": 77, "op": "launch_missiles"})).id == 77
    )  # the id is echoed when readable

    # Over --max-message-bytes: ZeroMQ cuts the sender off before blockd reads a byte of it (MAXMSGSIZE)...
    oversized = context.socket(zmq.DEALER)
    oversized.setsockopt(zmq.LINGER, 0)
    oversized.connect(daemon.endpoint)
    oversized.send(enc({**step, "ops": [{"type": "append", "seq_id": "a", "tokens": bytes(80000)}]}))
    assert not oversized.poll(1000), "an oversized message must not be read"
    oversized.close()
    # ... and blockd's own client refuses to send it, with a clear error.
    with pytest.raises(BlockdError) as too_large, BlockdClient(daemon.endpoint, max_message_bytes=64 * 1024) as client:
        client.lookup(list(range(20000)))
    assert too_large.value.code == ErrorCode.TOO_LARGE

    per_op = ex.step([p.Free("ghost"), p.Append("ghost", pack_tokens([1])), p.Commit("a", 999), p.Fork("ghost", "g2")])
    assert [r.code for r in per_op] == [
        ErrorCode.UNKNOWN_SEQUENCE,
        ErrorCode.UNKNOWN_SEQUENCE,
        ErrorCode.INVALID_REQUEST,
        ErrorCode.UNKNOWN_SEQUENCE,
    ]
    # A reservation reaching more than a block past the block its first slot is in ("a" holds 10 tokens: 2 slots
    # left in its block, then a block of 4).
    (past,) = ex.step([p.Append("a", b"", 7)])
    assert past.code == ErrorCode.INVALID_REQUEST and "at most 6" in past.message
    # Packed token ids that are not whole uint32s: the op fails, the sequence is untouched.
    (odd,) = ex.step([p.Append("a", b"\x01\x02\x03")])
    assert odd.code == ErrorCode.INVALID_REQUEST and "multiple of 4" in odd.message
    ex.admit("b", prompt(50, 5))
    ex.free("b")
    with pytest.raises(StepFailed) as double:
        ex.free("b")
    assert double.value.code == ErrorCode.DOUBLE_FREE
    with pytest.raises(StepFailed) as dup:
        ex.admit("a", prompt(0, 3))
    assert dup.value.code == ErrorCode.SEQUENCE_EXISTS

    raw.close()
    assert daemon.alive()
    with daemon.client() as operator:
        after = msgspec.to_builtins(operator.stats("ex0").pools[0])
        assert operator.check() == []
    # Only the admit/free of "b" happened: everything else is as it was.
    for key in ("blocks_in_use", "live_sequences", "index_entries", "tokens_held"):
        assert after[key] == before[key], key


def test_graceful_sigterm_flushes_and_exits(redis_process, start_blockd):
    daemon = start_blockd("--redis-url", redis_process.url, "--flush-interval", "5")
    ex = pool_client(daemon)
    ex.admit("a", prompt(0, 9))
    ex.commit("a", 9)
    assert daemon.terminate() == 0
    assert persisted_entries(redis_process, "ex0") == 2  # written on the way out, not after 5 s
    assert "blockd stopping" in daemon.log()


def test_embedded_redis_default_survives_kill9(start_blockd, tmp_path):
    daemon = start_blockd("--state-dir", str(tmp_path / "state"), "--flush-interval", "0.05")
    ex = pool_client(daemon, epoch=5)
    ex.admit("a", prompt(0, 9))
    ex.commit("a", 9)
    ex.free("a")
    with daemon.client() as operator:
        assert operator.stats().persistence.redis.startswith("unix://")

        def flushed() -> bool:  # both committed blocks written, and nothing Redis has not acknowledged
            persistence = operator.stats().persistence
            return persistence.entries_written >= 2 and persistence.lag_s == 0

        wait_for(flushed, what="the commit to reach the embedded Redis")
    daemon.kill9()  # the embedded redis-server gets SIGTERM and writes its AOF
    daemon.start()
    ex.heartbeat()
    with daemon.client() as operator:
        assert operator.lookup(prompt(0, 9)) == {"ex0": 8}


def test_client_gives_up_quickly_when_blockd_is_down():
    client = BlockdClient("tcp://127.0.0.1:1", timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        client.stats()
    assert time.monotonic() - started < 3


def test_register_rejects_bad_generations(start_blockd):
    daemon = start_blockd("--no-persistence")
    with daemon.client() as client:
        with pytest.raises(BlockdError) as err:
            client.call(p.Register, pool_id="x", num_blocks=4, block_size=2, model_id="m", epoch=1, generations=[0])
        assert err.value.code == ErrorCode.INVALID_REQUEST
        assert client.pools().pools == []


def test_redis_unreachable_at_start_serves_degraded_then_catches_up(tmp_path, start_blockd):
    redis_process = RedisProcess(tmp_path / "late-redis")  # its port is chosen, nothing listens yet
    try:
        daemon = start_blockd("--redis-url", redis_process.url, "--flush-interval", "0.05")
        ex = pool_client(daemon)
        ex.admit("a", prompt(0, 9))  # allocation does not wait for Redis
        ex.commit("a", 9)
        with daemon.client() as operator:
            assert operator.stats().persistence.state == "degraded"
            redis_process.start()
            wait_for(lambda: operator.stats().persistence.state == "ok", timeout_s=15, what="recovery")
        wait_for(lambda: persisted_entries(redis_process, "ex0") == 2, what="index written")
    finally:
        redis_process.server.stop()


def test_a_step_in_flight_survives_a_blockd_restart(redis_process, start_blockd):
    """The executor sends its step, runs its forward pass meanwhile; blockd dies and comes back in between."""
    args = ("--redis-url", redis_process.url, "--flush-interval", "0.05", "--lease-timeout", "30")
    daemon = start_blockd(*args)
    ex = pool_client(daemon, num_blocks=64)
    ex.admit("a", prompt(0, 8))
    ex.submit_step([p.Append("a", pack_tokens([1])), p.Admit("b", pack_tokens(prompt(100, 9)))])
    assert ex.finish_step()[1].num_cached_tokens == 0  # overlapped round trip: same results as step()

    ex.submit_step([p.Append("a", pack_tokens([2])), p.Admit("c", pack_tokens(prompt(200, 5)))])
    daemon.kill9()  # the step may or may not have been applied: the executor cannot tell
    daemon.start()
    results = ex.finish_step()  # re-syncs from the executor's mirror, then sends the step again
    assert type(results[0]) is p.AppendResult and type(results[1]) is p.AdmitResult
    ex.heartbeat()  # if the answer beat the kill, the restarted blockd lacks the pool: the re-sync happens here
    assert ex.resyncs == 1
    with daemon.client() as operator:
        assert operator.sequence("a").num_tokens == 10  # the append applied exactly once
        assert operator.sequence("c").blocks == ex.seqs["c"].blocks
        assert operator.check() == []
        in_use = operator.stats("ex0").pools[0].blocks_in_use
    assert in_use == len({b for s in ex.seqs.values() for b in s.blocks})


def test_prefixes_kept_by_redis_survive_a_blockd_started_while_redis_was_down(redis_process, start_blockd):
    args = ("--redis-url", redis_process.url, "--flush-interval", "0.05", "--lease-timeout", "30")
    first = start_blockd(*args)
    ex = pool_client(first, epoch=21)
    ex.admit("a", prompt(0, 9))
    ex.commit("a", 9)
    ex.free("a")
    wait_for(lambda: persisted_entries(redis_process, "ex0") == 2, what="index in redis")
    assert first.terminate() == 0
    redis_process.server.stop()  # Redis writes its AOF and goes away

    second = start_blockd(*args)  # finds no Redis: serves from memory, degraded
    with second.client() as operator:
        assert operator.stats().persistence.state == "degraded"
        redis_process.start()  # back, with what it kept
        wait_for(lambda: operator.stats().persistence.state == "ok", timeout_s=15, what="recovery")
        assert operator.stats().dormant_pools == ["ex0"]
    assert persisted_entries(redis_process, "ex0") == 2  # written back, not wiped
    ex.client = second.client(timeout_s=1.0)
    ex.heartbeat()  # the executor re-syncs with its generations: its prefix is a hit again
    with second.client() as operator:
        assert operator.lookup(prompt(0, 9)) == {"ex0": 8}
