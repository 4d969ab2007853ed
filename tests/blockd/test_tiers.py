"""blockd's tier directory (blockd.tiers) through the manager: demotion on eviction, loads on admission, spills
from a full host tier to disk, drops from a full disk, the executor's report on registration, check()."""

from __future__ import annotations

import random

import msgspec
import zmq

from blockd import protocol as p
from blockd.kv_events import END_SEQ, AllBlocksCleared, KVEventBatch, KvEventPublisher
from blockd.manager import BlockManager, PoolEvents
from blockd.tiers import TierHeld, TierSpec
from common.tokens import pack_tokens
from tests.support.waiting import wait_for

BS = 4


def _manager(host: int, disk: int, held: list[TierHeld] | None = None, epoch: int = 1) -> BlockManager:
    manager = BlockManager()
    tiers = TierSpec(host_blocks=host, disk_blocks=disk, disk=held or [])
    manager.register(
        p.Register(
            v=p.PROTOCOL_VERSION, id=1, pool_id="x", num_blocks=4, block_size=BS, model_id="m", epoch=epoch, tiers=tiers
        )
    )
    return manager


def _run(manager: BlockManager, seq: str, tokens: list[int]) -> p.StepOpResult:
    """Admit, commit every full block, free: the prompt's blocks stay cached-free."""
    (admitted,) = manager.step("x", 1, [p.Admit(seq, pack_tokens(tokens))]).results
    assert type(admitted) is not p.OpError, admitted
    manager.step("x", 1, [p.Commit(seq, len(tokens)), p.Free(seq)])
    return admitted


def _prompt(first: int) -> list[int]:
    return list(range(first, first + 3 * BS + 1))  # three full blocks and one token


def test_eviction_demotes_and_a_miss_on_the_device_loads_from_the_host():
    manager = _manager(host=8, disk=0)
    pool = manager.pools["x"]
    _run(manager, "a", _prompt(0))
    b = _run(manager, "b", _prompt(100))  # needs all 4 blocks: evicts a's three
    saves = [op for op in b.tier_ops if op.kind == "save"]
    assert [op.medium for op in saves] == ["CPU"] * 3
    again = _run(manager, "a2", _prompt(0))
    loads = [op for op in again.tier_ops if op.kind == "load"]
    assert again.num_cached_tokens == 3 * BS and again.loaded_tokens == 3 * BS
    assert [op.block for op in loads] == again.blocks[:3]
    # Every load comes after the saves of the blocks it writes: a block is copied out before it is reused.
    for load in loads:
        saved_from = [i for i, op in enumerate(again.tier_ops) if op.kind == "save" and op.block == load.block]
        assert all(i < again.tier_ops.index(load) for i in saved_from)
    (cpu,) = pool.stats().tiers
    assert cpu.counters.loads == 3 and cpu.counters.demotions >= 6 and cpu.blocks <= 8
    assert manager.check() == []
    # Loaded blocks were committed like computed ones: the next admit hits them on the device.
    third = _run(manager, "a3", _prompt(0))
    assert third.num_cached_tokens == 3 * BS and third.loaded_tokens == 0


def test_a_full_host_tier_spills_to_disk_and_a_full_disk_drops_its_oldest():
    manager = _manager(host=2, disk=3)
    pool = manager.pools["x"]
    ops = []
    for first in (0, 100, 200, 300):
        ops += _run(manager, f"s{first}", _prompt(first)).tier_ops
    kinds = {op.kind for op in ops}
    assert {"save", "spill", "discard"} <= kinds
    cpu, disk = pool.stats().tiers
    assert cpu.blocks == 2 and disk.blocks == 3
    assert disk.counters.drops > 0
    for i, op in enumerate(ops):  # a spilled slot is copied out before a later save writes it
        if op.kind == "spill":
            later = [o for o in ops[i + 1 :] if o.kind == "save" and o.slot == op.slot]
            assert later
    assert manager.check() == []


def test_a_restarted_executor_reports_its_disk_and_hits_it_again():
    manager = _manager(host=0, disk=16)
    _run(manager, "a", _prompt(0))
    b = _run(manager, "b", _prompt(100))
    saved = [TierHeld(op.block_hash) for op in b.tier_ops if op.kind == "save"]
    assert len(saved) == 3 and all(op.medium == "DISK" for op in b.tier_ops)
    restarted = _manager(host=0, disk=16, held=saved, epoch=2)  # a new process: a new epoch, its disk scanned
    (admitted,) = restarted.step("x", 2, [p.Admit("a", pack_tokens(_prompt(0)))]).results
    assert admitted.loaded_tokens == 3 * BS
    assert [op.kind for op in admitted.tier_ops] == ["load"] * 3
    # The executor found one bad when it loaded it: its next step says so, and the directory forgets it.
    restarted.step("x", 2, [p.Free("a")], tier_drops=[saved[1].block_hash])
    (disk,) = restarted.pools["x"].stats().tiers
    assert disk.blocks == 2 and disk.counters.drops == 1
    (again,) = restarted.step("x", 2, [p.Admit("a2", pack_tokens(_prompt(0)))]).results
    assert again.loaded_tokens == BS  # the chain stops where the lost block was


def test_a_failed_admit_leaves_the_directory_unchanged():
    manager = _manager(host=8, disk=0)
    pool = manager.pools["x"]
    _run(manager, "a", _prompt(0))
    _run(manager, "b", _prompt(100))
    before = [(t.medium, list(t.entries.items())) for t in pool.tiers.tiers]
    (refused,) = manager.step("x", 1, [p.Admit("big", pack_tokens(list(range(1000, 1000 + 4 * BS + 1))))]).results
    assert type(refused) is p.OpError
    assert [(t.medium, list(t.entries.items())) for t in pool.tiers.tiers] == before
    assert manager.check() == []


def test_kv_events_name_the_medium_of_every_tier():
    publisher = KvEventPublisher(PoolEvents(), "tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    context = zmq.Context()
    try:
        manager = BlockManager(events=publisher)
        tiers = TierSpec(host_blocks=2, disk_blocks=8)
        manager.register(
            p.Register(
                v=p.PROTOCOL_VERSION, id=1, pool_id="x", num_blocks=4, block_size=BS, model_id="m", epoch=1, tiers=tiers
            )
        )
        for first in (0, 100, 200):
            _run(manager, f"s{first}", _prompt(first))
        publisher.flush()
        replay = context.socket(zmq.DEALER)
        replay.connect(publisher.replay_endpoint or "")
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        seen: set[tuple[str, str | None]] = set()

        def replayed_all_media() -> bool:
            replay.send_multipart([b"", (0).to_bytes(8, "big")])
            while True:
                assert replay.poll(5000), "no answer to the replay request"
                _, _, seq, payload = replay.recv_multipart()
                if seq == END_SEQ:
                    break
                for event in decoder.decode(payload).events:
                    if type(event) is not AllBlocksCleared:
                        seen.add((type(event).__name__, event.medium))
            return {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU")} <= seen

        wait_for(replayed_all_media, timeout_s=10, what="the tier events replayed")
        assert {("BlockRemoved", "CPU"), ("BlockStored", "DISK")} <= seen
    finally:
        publisher.close()
        context.destroy(linger=0)


def test_a_resync_takes_the_executors_host_slots_and_leaves_out_bad_ones():
    held = [TierHeld(b"a" * 16, 3), TierHeld(b"b" * 16, 3), TierHeld(b"c" * 16, 9), TierHeld(b"d" * 16, 0)]
    manager = BlockManager()
    tiers = TierSpec(host_blocks=4, host=held)
    manager.register(
        p.Register(
            v=p.PROTOCOL_VERSION, id=1, pool_id="x", num_blocks=4, block_size=BS, model_id="m", epoch=1, tiers=tiers
        )
    )
    (cpu,) = manager.pools["x"].tiers.tiers
    assert dict(cpu.entries) == {b"a" * 16: 3, b"d" * 16: 0}  # a slot named twice, or outside the tier: left out
    assert sorted(cpu.free_slots) == [1, 2]
    assert manager.check() == []


def test_random_traffic_never_loads_or_saves_a_block_that_holds_other_content():
    """The executor's side simulated by what each block, host slot and disk file holds: every op run in order
    must read what its hash names (a save reads a device block before its reuse, a spill a slot before a save
    overwrites it, a load reads a copy of its hash), and check() holds after every step."""
    rng = random.Random(11)
    manager = BlockManager()
    tiers = TierSpec(host_blocks=3, disk_blocks=5)
    manager.register(
        p.Register(
            v=p.PROTOCOL_VERSION, id=1, pool_id="x", num_blocks=8, block_size=BS, model_id="m", epoch=1, tiers=tiers
        )
    )
    pool = manager.pools["x"]
    device: dict[int, bytes] = {}
    host: dict[int, bytes] = {}
    disk: set[bytes] = set()
    prefixes = [[rng.randrange(1, 50) for _ in range(3 * BS)] for _ in range(6)]
    loads = 0
    for step in range(400):
        tokens = rng.choice(prefixes)[: rng.randrange(BS, 3 * BS + 1)] + [rng.randrange(1, 50) for _ in range(3)]
        looked = manager.lookup(pack_tokens(tokens), None)
        (result,) = manager.step("x", 1, [p.Admit(f"s{step}", pack_tokens(tokens))]).results
        if type(result) is p.OpError:
            continue
        # The lookup (the gateway's routing) said what the admit did: its device hits, then each tier's loads.
        below = looked.tier_tokens.get("x", {})
        assert looked.cached_tokens["x"] + sum(below.values()) == result.num_cached_tokens
        loaded = [op.medium for op in result.tier_ops if op.kind == "load"]
        assert below == {m: loaded.count(m) * BS for m in set(loaded)} and sum(below.values()) == result.loaded_tokens
        for op in result.tier_ops:
            if op.kind == "save":
                assert device.get(op.block) == op.block_hash
                if op.medium == "CPU":
                    host[op.slot] = op.block_hash
                else:
                    disk.add(op.block_hash)
            elif op.kind == "spill":
                assert host.get(op.slot) == op.block_hash
                disk.add(op.block_hash)
            elif op.kind == "load":
                held = host.get(op.slot) if op.medium == "CPU" else (op.block_hash if op.block_hash in disk else None)
                assert held == op.block_hash
                device[op.block] = op.block_hash
                loads += 1
            else:
                disk.discard(op.block_hash)
        seq = pool.seqs[f"s{step}"]
        manager.step("x", 1, [p.Commit(f"s{step}", len(tokens))])
        for i, h in enumerate(seq.hashes):  # the executor computed (or loaded) every full block
            if pool.index.get(h) == seq.table[i]:
                device[seq.table[i]] = h
        manager.step("x", 1, [p.Free(f"s{step}")])
        assert manager.check() == []
    assert loads > 20


def test_a_lookup_follows_the_chain_through_every_tier_as_an_admit_would():
    manager = _manager(host=2, disk=8)
    _run(manager, "a", _prompt(0))
    # a's three blocks demoted, its last first (a freed sequence's tail is evicted first): that one spilled to
    # disk when the host tier (two blocks) filled
    _run(manager, "b", _prompt(100))
    looked = manager.lookup(pack_tokens(_prompt(0)), None)
    assert looked.cached_tokens == {"x": 0}
    assert looked.tier_tokens == {"x": {"CPU": 2 * BS, "DISK": BS}}
    # Another salt's chain, or a prompt nobody ran, is in no tier; the answer leaves such pools out.
    assert manager.lookup(pack_tokens(_prompt(0)), "tenant").tier_tokens == {}
    assert manager.lookup(pack_tokens(_prompt(500)), None) == p.LookupResult({"x": 0})
    # The prompt's last block is never looked up (an admit computes at least the last token): as admission.
    assert manager.lookup(pack_tokens(_prompt(0)[: 3 * BS]), None).tier_tokens == {"x": {"CPU": 2 * BS}}
    # Nothing changed: the lookup only looked (the admit that follows still loads all three).
    admitted = _run(manager, "a2", _prompt(0))
    assert admitted.loaded_tokens == 3 * BS and manager.check() == []


def test_a_lookup_reply_without_tiers_is_the_version_2_reply_byte_for_byte():
    """Pools without lower tiers: the optional field is not sent, and a client of before it decodes the reply."""

    class OldLookupResult(msgspec.Struct):  # the reply's shape before tier_tokens
        cached_tokens: dict[str, int]

    manager = BlockManager()
    manager.register(
        p.Register(v=p.PROTOCOL_VERSION, id=1, pool_id="x", num_blocks=4, block_size=BS, model_id="m", epoch=1)
    )
    result = manager.lookup(pack_tokens(_prompt(0)), None)
    assert p.encode(result) == p.encode(OldLookupResult({"x": 0}))
    with_tiers = _manager(host=8, disk=0)
    _run(with_tiers, "a", _prompt(0))
    _run(with_tiers, "b", _prompt(100))
    frame = p.encode(with_tiers.lookup(pack_tokens(_prompt(0)), None))
    assert msgspec.msgpack.decode(frame, type=OldLookupResult) == OldLookupResult({"x": 0}), "old clients read on"
    assert p.decode_result(msgspec.Raw(frame), p.LookupResult).tier_tokens == {"x": {"CPU": 3 * BS}}
