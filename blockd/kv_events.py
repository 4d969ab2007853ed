"""KV cache events in vLLM's format (its ZmqEventPublisher's), so indexers that follow vLLM's prefix caches
(llm-d, NVIDIA Dynamo) follow blockd's pools unchanged: a PUB socket of event batches per pool, a ROUTER that
replays them. The wire and when each event is sent: docs/architecture.md ("KV events in vLLM's format").
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec
import structlog
import zmq

from blockd.manager import PoolEvents
from blockd.pool import BlockPool, Journal, PoolSpec
from blockd.tiers import MEDIUM_GPU
from common.tokens import unpack_tokens

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000
DEFAULT_HWM = 100_000
_POLL_MS = 5

log = structlog.get_logger(service="blockd")


# The wire schema, field for field as vLLM's (its optional fields left out: omit_defaults drops them anyway).


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events: tagged by class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def topic(spec: PoolSpec) -> str:
    return f"kv@{spec.pool_id}@{spec.model_id}"


def _binds(endpoint: str) -> bool:
    """As vLLM: a wildcard or local endpoint is bound, any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher(PoolEvents):
    """Collects a BlockManager's index changes per pool and publishes them in vLLM's format.

    Wraps the manager's other PoolEvents listener (persistence), which it forwards every call to. Pools call
    `stored`, `removed` and `cleared` (see BlockPool.kv_events); `flush()` (blockd's tick) hands what was
    collected to the publishing thread as one batch per pool.
    """

    def __init__(
        self,
        inner: PoolEvents,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        context: zmq.Context | None = None,
    ) -> None:
        self.inner = inner
        self._pools: dict[str, BlockPool] = {}  # pool id -> the pool whose changes are published
        self._pending: dict[str, list[KVCacheEvent]] = {}  # topic -> events, in order
        self._queue: queue.SimpleQueue[tuple[bytes, KVEventBatch] | None] = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self._context = context or zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if _binds(endpoint):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                # A whole replay plus its end marker must fit in the queue of a slow subscriber.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------- PoolEvents (the manager's calls)

    def pool_registered(self, pool: BlockPool) -> None:
        self.inner.pool_registered(pool)
        spec = pool.spec
        old = self._pools.get(spec.pool_id)
        self._pools[spec.pool_id] = pool
        pool.kv_events = self
        if old is not None:
            old.kv_events = None  # the manager dropped it: nothing it does is news any more
        if old is not None and old.spec == spec:
            # Re-sync in this process (the executor reconnected): subscribers hold old's index; tell them the
            # difference only. Entries kept are those old had and the executor still backs.
            for h in old.index:
                if h not in pool.index:
                    self.removed(spec, h)
            self._announce_live(pool, skip=old.index)
            return
        if old is not None and topic(old.spec) != topic(spec):
            self.cleared(old.spec)
        self.cleared(spec)
        self._announce_live(pool, skip={})

    def _announce_live(self, pool: BlockPool, skip: dict[bytes, int]) -> None:
        """BlockStored for the indexed blocks of the pool's live sequences (re-registration: known tokens)."""
        for seq in pool.seqs.values():
            for i in range(seq.committed):
                h = seq.hashes[i]
                if h not in skip and pool.index.get(h) == seq.table[i]:
                    self.stored(pool.spec, seq.hashes[i - 1] if i else None, h, seq.tokens, i)

    def pool_dropped(self, pool_id: str) -> None:
        self.inner.pool_dropped(pool_id)
        pool = self._pools.pop(pool_id, None)
        if pool is not None:
            pool.kv_events = None
            self.cleared(pool.spec)

    def new_journal(self) -> Journal | None:
        return self.inner.new_journal()

    # ---------------------------------------------------------------------- the pools' calls

    def _events(self, spec: PoolSpec) -> list[KVCacheEvent]:
        name = topic(spec)
        events = self._pending.get(name)
        if events is None:
            events = self._pending[name] = []
        return events

    def stored(
        self, spec: PoolSpec, parent: bytes | None, block_hash: bytes, tokens: bytes | bytearray, i: int
    ) -> None:
        """Block i of a sequence whose packed tokens are `tokens` entered the index under block_hash."""
        events = self._events(spec)
        bs = spec.block_size
        ids = unpack_tokens(tokens[i * bs * 4 : (i + 1) * bs * 4])
        last = events[-1] if events else None
        if type(last) is BlockStored and parent is not None and last.block_hashes[-1] == parent and last.token_ids:
            last.block_hashes.append(block_hash)  # the chain goes on: one event, as vLLM sends per request
            last.token_ids.extend(ids)
            return
        events.append(BlockStored([block_hash], parent, ids, bs, None, MEDIUM_GPU, None))

    def removed(self, spec: PoolSpec, block_hash: bytes) -> None:
        self.tier_removed(spec, block_hash, MEDIUM_GPU)

    def tier_stored(self, spec: PoolSpec, block_hash: bytes, medium: str) -> None:
        """A lower tier took the block (blockd.tiers): its token ids are not kept there, so none are sent."""
        events = self._events(spec)
        last = events[-1] if events else None
        if type(last) is BlockStored and last.medium == medium and not last.token_ids:
            last.block_hashes.append(block_hash)
            return
        events.append(BlockStored([block_hash], None, [], spec.block_size, None, medium, None))

    def tier_removed(self, spec: PoolSpec, block_hash: bytes, medium: str) -> None:
        events = self._events(spec)
        last = events[-1] if events else None
        if type(last) is BlockRemoved and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved([block_hash], medium))

    def cleared(self, spec: PoolSpec) -> None:
        events = self._events(spec)
        events.clear()  # nothing before it matters to a subscriber any more
        events.append(AllBlocksCleared())

    def flush(self, ts: float | None = None) -> int:
        """Queue one batch per pool with events since the last flush; returns how many batches."""
        if not self._pending:
            return 0
        pending, self._pending = self._pending, {}
        ts = time.time() if ts is None else ts
        for name, events in pending.items():
            self._queue.put((name.encode(), KVEventBatch(ts, events)))
        return len(pending)

    # ---------------------------------------------------------------------- the publishing thread

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._close_sockets()
                    return
                name, batch = item
                seq = next(self._seq)
                payload = encode(batch)
                try:
                    self._pub.send_multipart((name, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                except zmq.Again:  # no subscriber keeps up: PUB drops, as vLLM's does; replay still has it
                    pass
                except zmq.ZMQError as exc:
                    log.warning("kv event not published", error=str(exc))
                self._buffer.append((seq, name, payload))
            if self._replay is None:
                time.sleep(_POLL_MS / 1000)
            elif poller.poll(_POLL_MS):
                with contextlib.suppress(zmq.Again):
                    self._serve_replay()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("invalid kv event replay request", frames=len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, name, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", name, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is pending, then stop the thread and close the sockets."""
        self.flush()
        self._queue.put(None)
        self._thread.join(timeout_s)
