"""Write-behind persistence of the prefix index and the pools' epochs to Redis.

Redis is never waited on inside a request. Pools record index changes in a plain dict (their journal, newest
value per hash). Every `flush_interval_s` the daemon's loop collects the journals into a batch and hands it to a
writer thread, which applies it to Redis in one pipelined MULTI/EXEC. So a committed prefix reaches Redis within
flush_interval_s plus one write (the `lag_s` in stats says how far behind Redis is right now); a `kill -9` of
blockd loses at most that much.

When Redis fails, persistence turns "degraded": journals are discarded (memory stays bounded), the writer
reconnects with backoff, and once Redis answers again the loop sends a full snapshot of every pool that
replaces what Redis holds: whatever Redis missed, or lost itself, is re-written.

Key schema (all keys under the prefix `pagedkv:blockd:v1`):
  pagedkv:blockd:v1:meta             hash   schema -> "1"
  pagedkv:blockd:v1:pools            hash   pool id -> msgpack [pool_id, num_blocks, block_size, model_id, epoch]
  pagedkv:blockd:v1:index:<pool id>  hash   block hash (32 hex digits) -> msgpack [block, generation, lru stamp]
An entry is valid only while its pool's executor still reports that generation for that block (see pool.py).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import redis
import structlog

from blockd import protocol as p
from blockd.manager import PoolEvents
from blockd.pool import BlockPool, IndexEntry, Journal, PoolSpec

if TYPE_CHECKING:
    from blockd.manager import BlockManager

KEY_PREFIX = "pagedkv:blockd:v1"
POOLS_KEY = f"{KEY_PREFIX}:pools"
META_KEY = f"{KEY_PREFIX}:meta"
SCHEMA_VERSION = "1"

# KEYS[1]: an index hash. ARGV[1]: msgpack map hex hash -> [block, generation, stamp], or [] for a dropped entry.
_APPLY_CHANGES_LUA = """
local changes = cmsgpack.unpack(ARGV[1])
for h, e in pairs(changes) do
  if #e == 0 then
    redis.call('HDEL', KEYS[1], h)
  else
    redis.call('HSET', KEYS[1], h, cmsgpack.pack(e))
  end
end
return 0
"""

log = structlog.get_logger(service="blockd", component="persistence")


def index_key(pool_id: str) -> str:
    return f"{KEY_PREFIX}:index:{pool_id}"


_encode = msgspec.msgpack.encode
_decode_spec = msgspec.msgpack.Decoder(PoolSpec)
_decode_entry = msgspec.msgpack.Decoder(tuple[int, int, int])


def _encode_spec(spec: PoolSpec) -> bytes:
    return _encode(spec)


class Batch(msgspec.Struct):
    """Changes for Redis, applied in one transaction."""

    collected_at: float
    full: bool = False  # replace everything Redis holds with this batch
    specs: dict[str, PoolSpec] = {}
    dropped: list[str] = []
    replaced: dict[str, dict[bytes, IndexEntry]] = {}  # pool -> its whole index
    changes: dict[str, Journal] = {}  # pool -> entries changed (None = deleted)

    def entry_count(self) -> int:
        return sum(len(v) for v in self.replaced.values()) + sum(len(v) for v in self.changes.values())


def redact(url: str) -> str:
    """A Redis URL without its password."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


def load(client: redis.Redis) -> tuple[list[PoolSpec], dict[str, dict[bytes, IndexEntry]]]:
    """Read every persisted pool and its index."""
    specs = [_decode_spec.decode(raw) for raw in client.hgetall(POOLS_KEY).values()]
    entries: dict[str, dict[bytes, IndexEntry]] = {}
    for spec in specs:
        raw = client.hgetall(index_key(spec.pool_id))
        entries[spec.pool_id] = {bytes.fromhex(h.decode()): _decode_entry.decode(v) for h, v in raw.items()}
    return specs, entries


class RedisPersistence(PoolEvents):
    """Collects index changes on the daemon's thread; a writer thread applies them to Redis."""

    def __init__(self, url: str, *, flush_interval_s: float = 0.1, socket_timeout_s: float = 2.0) -> None:
        self.url = url
        self.flush_interval_s = flush_interval_s
        self.client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
        self._queue: queue.Queue[Batch | None] = queue.Queue()
        self._unacked: collections.deque[float] = collections.deque()  # collected_at of batches not yet written
        self._registered: dict[str, PoolSpec] = {}
        self._replace: set[str] = set()
        self._dropped: list[str] = []
        self._next_flush = 0.0
        self._full_rewrite_wanted = False  # set by the writer after an outage; read by the daemon's thread
        self._run_id: str | None = None
        self.probe_interval_s = 1.0
        self.degraded = False
        self.degraded_since: float | None = None
        self.last_error: str | None = None
        self.entries_written = 0
        self.full_rewrites = 0
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="blockd-redis-writer", daemon=True)
        self._apply_script = self.client.register_script(_APPLY_CHANGES_LUA)

    # ------------------------------------------------------------------ called on the daemon's thread

    def load(self, attempts_s: float = 5.0) -> tuple[list[PoolSpec], dict[str, dict[bytes, IndexEntry]]]:
        """Read the persisted state; if Redis does not answer within attempts_s, start degraded and empty."""
        deadline = time.monotonic() + attempts_s
        while True:
            try:
                self.client.hsetnx(META_KEY, "schema", SCHEMA_VERSION)
                return load(self.client)
            except redis.RedisError as exc:
                if time.monotonic() > deadline:
                    self._mark_degraded(exc)
                    log.warning("redis unreachable at start: starting with an empty index", error=str(exc))
                    return [], {}
                time.sleep(0.2)

    def start(self) -> None:
        self._writer.start()

    def new_journal(self) -> Journal:
        return {}

    def pool_registered(self, pool: BlockPool) -> None:
        self._registered[pool.spec.pool_id] = pool.spec
        self._replace.add(pool.spec.pool_id)

    def pool_dropped(self, pool_id: str) -> None:
        self._registered.pop(pool_id, None)
        self._replace.discard(pool_id)
        self._dropped.append(pool_id)

    def tick(self, manager: BlockManager, now: float) -> None:
        """Hand the changes since the last tick to the writer, at most once per flush interval."""
        if now < self._next_flush:
            return
        self._next_flush = now + self.flush_interval_s
        batch = self.collect(manager, now)
        if batch is not None:
            self._unacked.append(batch.collected_at)
            self._queue.put(batch)

    def collect(self, manager: BlockManager, now: float) -> Batch | None:
        if self._full_rewrite_wanted:
            self._full_rewrite_wanted = False
            return self._snapshot(manager, now)
        if self.degraded:  # a full re-write follows the outage: nothing to keep until then
            for pool in manager.pools.values():
                if pool.journal:
                    pool.journal = {}
            self._replace.clear()
            self._dropped.clear()
            return None
        batch = Batch(collected_at=now)
        for pool_id, pool in manager.pools.items():
            if pool_id in self._replace:
                batch.specs[pool_id] = pool.spec
                batch.replaced[pool_id] = pool.index_snapshot()
                pool.journal = {}
            elif pool.journal:
                batch.changes[pool_id] = pool.journal
                pool.journal = {}
        self._replace.clear()
        batch.dropped, self._dropped = self._dropped, []
        if not (batch.specs or batch.dropped or batch.replaced or batch.changes):
            return None
        return batch

    def _snapshot(self, manager: BlockManager, now: float) -> Batch:
        batch = Batch(collected_at=now, full=True)
        for pool_id, dormant in manager.dormant.items():
            batch.specs[pool_id] = dormant.spec
            batch.replaced[pool_id] = dormant.entries
        for pool_id, pool in manager.pools.items():
            batch.specs[pool_id] = pool.spec
            batch.replaced[pool_id] = pool.index_snapshot()
            pool.journal = {}
        self._replace.clear()
        self._dropped.clear()
        return batch

    def flush_now(self, manager: BlockManager, timeout_s: float = 5.0) -> bool:
        """Collect everything and wait until the writer has applied it (shutdown); False if it could not."""
        self._next_flush = 0.0
        self.tick(manager, time.monotonic())
        deadline = time.monotonic() + timeout_s
        while self._unacked and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._unacked

    def stats(self, now: float) -> p.PersistenceStats:
        if self.degraded and self.degraded_since is not None:
            lag = now - self.degraded_since
        elif self._unacked:
            lag = now - self._unacked[0]
        else:
            lag = 0.0
        return p.PersistenceStats(
            enabled=True,
            state="degraded" if self.degraded else "ok",
            redis=redact(self.url),
            lag_s=round(max(lag, 0.0), 4),
            flush_interval_s=self.flush_interval_s,
            pending_batches=len(self._unacked),
            entries_written=self.entries_written,
            full_rewrites=self.full_rewrites,
            last_error=self.last_error,
        )

    def close(self) -> None:
        self._stop.set()
        self._queue.put(None)
        if self._writer.is_alive():
            self._writer.join(timeout=5)
        self.client.close()

    # ------------------------------------------------------------------ the writer thread

    def _mark_degraded(self, exc: Exception) -> None:
        if not self.degraded:
            self.degraded_since = time.monotonic()
            log.warning("redis write failed: persistence degraded, serving from memory", error=str(exc))
        self.degraded = True
        self.last_error = f"{type(exc).__name__}: {exc}"

    def _write_loop(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                batch = self._queue.get(timeout=self.probe_interval_s)
            except queue.Empty:
                self._probe(backoff)
                continue
            if batch is None:
                break
            if self.degraded and not batch.full:
                self._ack()  # superseded by the full re-write that follows recovery
                continue
            try:
                self._apply(batch)
            except (redis.RedisError, OSError) as exc:
                self._mark_degraded(exc)
                self._ack()
                self._recover(backoff)
                continue
            self._ack()
            self.entries_written += batch.entry_count()
            if batch.full:
                self.full_rewrites += 1
                if self.degraded:
                    log.info("redis is back: index re-written", entries=batch.entry_count())
                self.degraded = False
                self.degraded_since = None

    def _probe(self, backoff: float) -> None:
        """While idle, notice a Redis that went away or came back empty-handed (a new run id)."""
        try:
            run_id = self.client.info("server").get("run_id")
        except (redis.RedisError, OSError) as exc:
            self._mark_degraded(exc)
            self._recover(backoff)
            return
        if self._run_id is not None and run_id != self._run_id and not self._full_rewrite_wanted:
            log.warning("redis restarted: re-writing the index", run_id=run_id)
            self._full_rewrite_wanted = True
        self._run_id = run_id

    def _ack(self) -> None:
        if self._unacked:
            self._unacked.popleft()

    def _recover(self, backoff: float) -> None:
        """Wait until Redis answers again, then ask the daemon's thread for a full snapshot."""
        while not self._stop.is_set():
            try:
                self.client.ping()
                break
            except (redis.RedisError, OSError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
        # Batches queued meanwhile are dropped as superseded; the snapshot carries their content.
        self._full_rewrite_wanted = True

    def _apply(self, batch: Batch) -> None:
        pipe = self.client.pipeline(transaction=True)
        if batch.full:
            stale = [index_key(pid) for pid in self.client.hkeys(POOLS_KEY)]
            pipe.delete(POOLS_KEY, *stale)
            pipe.hset(META_KEY, "schema", SCHEMA_VERSION)
        for pool_id in batch.dropped:
            pipe.delete(index_key(pool_id))
            pipe.hdel(POOLS_KEY, pool_id)
        for pool_id, spec in batch.specs.items():
            pipe.hset(POOLS_KEY, pool_id, _encode_spec(spec))
        for pool_id, entries in batch.replaced.items():
            if not batch.full:
                pipe.delete(index_key(pool_id))
            if entries:
                self._apply_changes(index_key(pool_id), entries, pipe)
        for pool_id, changes in batch.changes.items():
            self._apply_changes(index_key(pool_id), changes, pipe)
        pipe.execute()

    def _apply_changes(self, key: str, changes: Journal | dict[bytes, IndexEntry], pipe: redis.client.Pipeline) -> None:
        # One msgpack blob per pool and batch, applied inside Redis by a Lua script: per entry, this process
        # pays a C-speed encode instead of redis-py's per-argument command packing.
        # Lua's msgpack predates the bin type: hashes travel (and are stored) as hex.
        blob = _encode({h.hex(): () if e is None else e for h, e in changes.items()})
        self._apply_script(keys=[key], args=[blob], client=pipe)


class NoPersistence(PoolEvents):
    """Persistence switched off: nothing is journaled, nothing survives a restart."""

    def load(self, attempts_s: float = 0.0) -> tuple[list[PoolSpec], dict[str, dict[bytes, IndexEntry]]]:
        return [], {}

    def start(self) -> None:
        pass

    def tick(self, manager: BlockManager, now: float) -> None:
        pass

    def flush_now(self, manager: BlockManager, timeout_s: float = 5.0) -> bool:
        return True

    def stats(self, now: float) -> p.PersistenceStats:
        return p.PersistenceStats(
            enabled=False, state="off", redis="", lag_s=0.0, flush_interval_s=0.0,
            pending_batches=0, entries_written=0, full_rewrites=0,
        )  # fmt: skip

    def close(self) -> None:
        pass
