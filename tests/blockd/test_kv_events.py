"""KV events in vLLM's format: decoded with vLLM's own event classes, they rebuild blockd's prefix index.

The classes come from the vllm wheel itself (`pip download --no-deps`, once, cached): the msgspec definitions
of vllm/distributed/kv_events.py and ExternalBlockHash of vllm/v1/core/kv_cache_utils.py are taken from its
source and executed alone (importing vllm would need torch and the rest of its dependencies). Nothing of the
schema is written here. The tests skip, saying why, only where the wheel cannot be downloaded.
"""

from __future__ import annotations

import ast
import os
import random
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from blockd import protocol as p
from blockd.client import BlockdClient, PoolClient
from blockd.hashing import chain_hashes, extra_key, root_hash
from blockd.kv_events import END_SEQ, KvEventPublisher
from blockd.manager import BlockManager, PoolEvents
from common.net import free_port
from tests.support.processes import BlockdProcess
from tests.support.waiting import wait_for

VLLM_VERSION = "0.33.0"
SOURCES = {"kv_events": "vllm/distributed/kv_events.py", "kv_cache_utils": "vllm/v1/core/kv_cache_utils.py"}
EVENT_CLASSES = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")


def _cache_dir() -> Path:
    base = os.environ.get("PAGEDKV_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pagedkv", "test")
    return Path(base) / f"vllm-{VLLM_VERSION}"


def vllm_sources() -> dict[str, str]:
    """The two source files of the vllm wheel, downloaded once (the wheel is deleted, the files are kept)."""
    cache = _cache_dir()
    if all((cache / Path(path).name).is_file() for path in SOURCES.values()):
        return {key: (cache / Path(path).name).read_text() for key, path in SOURCES.items()}
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"]
        result = subprocess.run(
            [*command, f"vllm=={VLLM_VERSION}", "--dest", tmp], capture_output=True, text=True, timeout=1200
        )
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if result.returncode != 0 or not wheels:
            pytest.skip(f"the vllm {VLLM_VERSION} wheel cannot be downloaded here: {result.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            sources = {key: wheel.read(path).decode() for key, path in SOURCES.items()}
    cache.mkdir(parents=True, exist_ok=True)
    for key, path in SOURCES.items():
        (cache / Path(path).name).write_text(sources[key])
    return sources


def _external_block_hash(source: str) -> Any:
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ExternalBlockHash":
            return eval(compile(ast.Expression(node.value), "kv_cache_utils.py", "eval"), {})  # e.g. bytes | int
    raise AssertionError("vllm's kv_cache_utils.py defines no ExternalBlockHash")


@pytest.fixture(scope="module")
def vllm() -> types.ModuleType:
    """vLLM's event classes, executed from its own source in a module of their own."""
    sources = vllm_sources()
    tree = ast.parse(sources["kv_events"])
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in EVENT_CLASSES]
    assert [c.name for c in classes] == list(EVENT_CLASSES), "vllm's kv_events.py changed shape"
    module = types.ModuleType("vllm_kv_events_schema")
    module.__dict__.update(msgspec=msgspec, Any=Any, ExternalBlockHash=_external_block_hash(sources["kv_cache_utils"]))
    sys.modules[module.__name__] = module
    exec(compile(ast.Module(body=classes, type_ignores=[]), SOURCES["kv_events"], "exec"), module.__dict__)
    module.decoder = msgspec.msgpack.Decoder(type=module.KVEventBatch)
    return module


# ------------------------------------------------------------------------------------------------- a subscriber


class Subscriber:
    """What an indexer does: SUB for the stream, a DEALER for replay of what it missed."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.batches: dict[int, tuple[bytes, bytes]] = {}  # seq -> (topic, payload)

    def drain(self, quiet_s: float = 0.5) -> None:
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert len(seq) == 8
            self.batches[int.from_bytes(seq, "big")] = (topic, payload)

    def replay_from(self, start: int) -> int:
        """Ask for every batch from `start` on, as vLLM's subscriber does; returns how many came."""
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        got = 0
        while True:
            assert self.replay.poll(5000), "no answer to the replay request"
            empty, topic, seq, payload = self.replay.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return got
            self.batches.setdefault(int.from_bytes(seq, "big"), (topic, payload))
            got += 1

    def close(self) -> None:
        self.context.destroy(linger=0)


def rebuild(vllm: types.ModuleType, batches: dict[int, tuple[bytes, bytes]], deployment: str = "pagedkv") -> dict:
    """topic -> set of block hashes, from the events alone; checks each BlockStored against its token ids."""
    assert sorted(batches) == list(range(len(batches))), "sequence numbers must run 0, 1, 2, ... without gaps"
    index: dict[str, set[bytes]] = {}
    for seq in sorted(batches):
        topic, payload = batches[seq]
        name = topic.decode()
        model_id = name.split("@", 2)[2]
        batch = vllm.decoder.decode(payload)
        assert isinstance(batch, vllm.KVEventBatch) and batch.ts > 0
        hashes = index.setdefault(name, set())
        for event in batch.events:
            if isinstance(event, vllm.BlockStored):
                assert event.medium == "GPU" and event.lora_id is None
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                parent = event.parent_block_hash if event.parent_block_hash is not None else root_hash(deployment)
                # The hashes follow from the token ids and the parent, as an indexer may check.
                assert (
                    chain_hashes(event.token_ids, event.block_size, parent, extra_key(model_id)) == event.block_hashes
                )
                hashes.update(event.block_hashes)
            elif isinstance(event, vllm.BlockRemoved):
                hashes.difference_update(event.block_hashes)
            else:
                assert isinstance(event, vllm.AllBlocksCleared)
                hashes.clear()
    return index


# ------------------------------------------------------------------------------------------------------- tests


def _register(manager: BlockManager, pool_id: str, model_id: str, epoch: int, **extra: Any) -> None:
    manager.register(
        p.Register(v=1, id=1, pool_id=pool_id, num_blocks=24, block_size=8, model_id=model_id, epoch=epoch, **extra)
    )


def test_events_decoded_by_vllm_rebuild_blockds_index(vllm: types.ModuleType) -> None:
    publisher = KvEventPublisher(PoolEvents(), "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=100_000)
    subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint or "")
    try:
        now = [0.0]  # a clock the test moves: a restarted executor's new epoch waits for the old lease to end
        manager = BlockManager(events=publisher, clock=lambda: now[0])
        models = {"executor-0": "model-a", "executor-1": "model-b"}
        epochs = dict.fromkeys(models, 1)
        for pool_id, model_id in models.items():
            _register(manager, pool_id, model_id, epochs[pool_id])
        rng = random.Random(7)
        prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(4)]
        live: dict[str, list[str]] = {pool_id: [] for pool_id in models}
        counts = {"admit": 0, "evictions": 0, "reset": 0, "new_epoch": 0, "resync": 0}
        for step in range(600):
            pool_id = rng.choice(list(models))
            pool = manager.pools[pool_id]
            roll = rng.random()
            if roll < 0.55:  # a request: shared prefix + own tail, computed, then committed
                seq_id = f"s{step}"
                tokens = rng.choice(prefixes)[: rng.randrange(4, 13)] + [
                    rng.randrange(1000) for _ in range(rng.randrange(1, 9))
                ]
                try:
                    pool.admit(seq_id, tokens)
                except Exception:  # out of blocks: free something first
                    if live[pool_id]:
                        pool.free(live[pool_id].pop(0))
                    continue
                counts["admit"] += 1
                pool.commit(seq_id, len(tokens))
                live[pool_id].append(seq_id)
            elif roll < 0.85 and live[pool_id]:
                pool.free(live[pool_id].pop(rng.randrange(len(live[pool_id]))))
            elif roll < 0.87:
                pool.reset_prefix_cache()
                counts["reset"] += 1
            elif roll < 0.89:  # the executor restarted: a new epoch, a clean pool
                counts["evictions"] += pool.counters.evictions  # the new pool counts from zero
                epochs[pool_id] += 1
                now[0] += manager.lease_timeout_s + 1  # the old process's lease has run out
                _register(manager, pool_id, models[pool_id], epochs[pool_id])
                live[pool_id] = []
                counts["new_epoch"] += 1
            elif roll < 0.92:  # the executor reconnected (same epoch): re-sync keeps what its KV still backs
                _register(manager, pool_id, models[pool_id], epochs[pool_id], generations=list(pool.generation))
                live[pool_id] = []
                counts["resync"] += 1
            if rng.random() < 0.3:
                publisher.flush()  # blockd flushes once per loop iteration, after a burst of requests
        counts["evictions"] += sum(pool.counters.evictions for pool in manager.pools.values())
        for pool_id, pool in manager.pools.items():  # end with something cached in each pool
            for seq_id in live[pool_id]:
                pool.free(seq_id)
            pool.admit("last", prefixes[0])
            pool.commit("last", len(prefixes[0]))
        publisher.flush()

        subscriber.drain()
        expected = {f"kv@{pool_id}@{models[pool_id]}": set(pool.index) for pool_id, pool in manager.pools.items()}
        # A subscriber that connected late (PUB drops what was sent before it joined) asks for the rest.
        subscriber.replay_from(0)
        rebuilt = rebuild(vllm, subscriber.batches)
        assert rebuilt == expected
        assert all(expected.values()), "the workload must leave something cached"
        assert min(counts.values()) > 0, counts  # every kind of change happened
    finally:
        subscriber.close()
        publisher.close()


def test_replay_sends_from_the_asked_sequence_number(vllm: types.ModuleType) -> None:
    publisher = KvEventPublisher(PoolEvents(), "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=3)
    subscriber = Subscriber(publisher.endpoint, publisher.replay_endpoint or "")
    try:
        manager = BlockManager(events=publisher)
        _register(manager, "p", "m", 1)
        for i in range(5):  # five batches: one AllBlocksCleared (registration) + four stores
            if i:
                manager.pools["p"].admit(f"s{i}", [i] * 16)
                manager.pools["p"].commit(f"s{i}", 16)
            publisher.flush()
        # the thread publishes shortly
        wait_for(lambda: subscriber.replay_from(0) >= 3, timeout_s=5, what="three batches to replay")
        assert sorted(subscriber.batches) == [2, 3, 4], "only the last buffer_steps batches are kept"
        subscriber.batches.clear()
        assert subscriber.replay_from(4) == 1 and list(subscriber.batches) == [4]
        assert subscriber.replay_from(9) == 0  # nothing that new: just the end marker
        topic, payload = subscriber.batches[4]
        assert topic == b"kv@p@m"
        (stored,) = vllm.decoder.decode(payload).events
        assert stored.token_ids == [4] * 16 and stored.parent_block_hash is None and len(stored.block_hashes) == 2
    finally:
        subscriber.close()
        publisher.close()


def test_blockd_publishes_with_kv_events_endpoint(tmp_path: Path, vllm: types.ModuleType) -> None:
    pub_port, replay_port = free_port(), free_port()
    blockd = BlockdProcess(
        [
            "--no-persistence",
            "--kv-events-endpoint",
            f"tcp://*:{pub_port}",
            "--kv-events-replay-endpoint",
            f"tcp://*:{replay_port}",
        ],
        tmp_path / "blockd.log",
    )
    blockd.start()
    subscriber = Subscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    try:
        with BlockdClient(blockd.endpoint) as client:
            pool = PoolClient(client, pool_id="executor-0", num_blocks=16, block_size=8, model_id="tiny")
            pool.register()
            tokens = list(range(100, 118))
            pool.admit("a", tokens)
            assert pool.commit("a", len(tokens)) == 2
            pool.free("a")

            def both_blocks_published() -> dict | None:
                # How many batches carry them depends on how blockd's loop met the requests (a loaded machine
                # can hand it register and step in one burst): wait for what the events say, not their count.
                subscriber.replay_from(0)
                rebuilt = rebuild(vllm, subscriber.batches)
                return rebuilt if len(rebuilt.get("kv@executor-0@tiny", ())) == 2 else None

            rebuilt = wait_for(both_blocks_published, what="both committed blocks in the events")
        assert list(rebuilt) == ["kv@executor-0@tiny"] and len(rebuilt["kv@executor-0@tiny"]) == 2
    finally:
        subscriber.close()
        blockd.terminate()
