"""Write-behind persistence of the prefix index and the pool specs to Redis: never waited on inside a request.

Pools journal what their blocks hold; the daemon's loop hands the journals over in batches to a writer thread,
which appends them to each pool's log in Redis and compacts a log into a snapshot once it outgrows the pool.
The bounds, the degraded state, bad data and the key schema are told in docs/architecture.md ("Persistence").
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
import time
from typing import TYPE_CHECKING, Annotated

import msgspec
import redis
import structlog

from blockd import protocol as p
from blockd.hashing import HASH_BYTES
from blockd.manager import PoolEvents
from blockd.pool import BlockPool, BlockRecord, Journal, PoolSpec

if TYPE_CHECKING:
    from blockd.manager import BlockManager

SCHEMA_VERSION = "1"
DEFAULT_QUEUE_LIMIT = 64  # batches waiting for the writer; past it, batches are dropped (durability, not requests)

_SNAPSHOT_CHUNK = 4096  # entries per snapshot blob: each C-level encode holds the GIL only briefly
_JOURNAL_LIMIT = 4096  # index changes a pool may gather before they are handed over early
_COMPACT_MIN = 50_000  # log entries a pool may gather before compaction is considered

log = structlog.get_logger(service="blockd", component="persistence")


class RedisKeys:
    """Where a deployment's persisted state lives in Redis (the schema: docs/architecture.md, "Persistence")."""

    def __init__(self, prefix: str = "pagedkv") -> None:
        self.prefix = prefix
        self.base = f"{prefix}:blockd:v{SCHEMA_VERSION}"
        self.pools = f"{self.base}:pools"
        self.meta = f"{self.base}:meta"

    def snapshot(self, pool_id: str | bytes) -> str | bytes:
        return self._pool_key("snapshot", pool_id)

    def log(self, pool_id: str | bytes) -> str | bytes:
        return self._pool_key("log", pool_id)

    def _pool_key(self, kind: str, pool_id: str | bytes) -> str | bytes:
        if isinstance(pool_id, bytes):  # a pool id as Redis holds it, even one that is not UTF-8
            return f"{self.base}:{kind}:".encode() + pool_id
        return f"{self.base}:{kind}:{pool_id}"


DEFAULT_KEYS = RedisKeys()
KEY_PREFIX = DEFAULT_KEYS.base
POOLS_KEY = DEFAULT_KEYS.pools
META_KEY = DEFAULT_KEYS.meta


def snapshot_key(pool_id: str | bytes, keys: RedisKeys = DEFAULT_KEYS) -> str | bytes:
    return keys.snapshot(pool_id)


def log_key(pool_id: str | bytes, keys: RedisKeys = DEFAULT_KEYS) -> str | bytes:
    return keys.log(pool_id)


_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_Hash = Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]
_encode = msgspec.msgpack.encode
_decode_spec = msgspec.msgpack.Decoder(PoolSpec)
_decode_changes = msgspec.msgpack.Decoder(dict[_NonNegative, tuple[_Hash, _NonNegative, _NonNegative] | None])
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)


def _valid_spec(spec: PoolSpec, field: bytes) -> str | None:
    """Why a decoded pool spec cannot be taken (None: it can)."""
    if spec.pool_id.encode() != field:
        return f"pool spec of {spec.pool_id!r} filed under {field!r}"
    if spec.num_blocks < 1 or spec.block_size < 1 or not spec.pool_id:
        return f"pool spec of {spec.pool_id!r} has {spec.num_blocks} blocks of {spec.block_size} tokens"
    return None


def _encode_spec(spec: PoolSpec) -> bytes:
    return _encode(spec)


class Batch(msgspec.Struct):
    """Changes for Redis, applied in one transaction."""

    collected_at: float
    full: bool = False  # replace everything Redis holds with this batch
    specs: dict[str, PoolSpec] = {}
    dropped: list[str | bytes] = []  # bytes: a pool id as Redis held it (an unreadable one)
    replaced: dict[str, dict[int, BlockRecord]] = {}  # pool -> what each of its indexed blocks holds
    changes: dict[str, Journal] = {}  # pool -> blocks changed (None = holds no prefix any more)

    def entry_count(self) -> int:
        return sum(len(v) for v in self.replaced.values()) + sum(len(v) for v in self.changes.values())


def redact(url: str) -> str:
    """A Redis URL without its password."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


def load_pool_records(
    client: redis.Redis, pool_id: str | bytes, keys: RedisKeys = DEFAULT_KEYS, skipped: list[str] | None = None
) -> tuple[dict[int, BlockRecord], int]:
    """What one pool's blocks held as last persisted, and how many log entries it took to rebuild it.

    A blob that does not decode, or a key of the wrong type, is left out and described in `skipped`."""
    skipped = [] if skipped is None else skipped
    records: dict[int, BlockRecord | None] = {}
    logged = 0
    for kind, key in (("snapshot", keys.snapshot(pool_id)), ("log", keys.log(pool_id))):
        try:
            blobs = client.lrange(key, 0, -1)
        except redis.ResponseError as exc:  # WRONGTYPE: not a list
            skipped.append(f"{kind} of pool {pool_id!r}: {exc}")
            continue
        for i, blob in enumerate(blobs):
            try:
                changes = _decode_changes.decode(blob)
            except _DECODE_ERRORS as exc:
                skipped.append(f"{kind} blob {i} of pool {pool_id!r}: {exc}")
                continue
            records.update(changes)
            if kind == "log":
                logged += len(changes)
    return {b: r for b, r in records.items() if r is not None}, logged


class Loaded(msgspec.Struct):
    """What a load found in Redis."""

    specs: list[PoolSpec]
    records: dict[str, dict[int, BlockRecord]]
    logged: dict[str, int]  # log entries since each pool's snapshot
    skipped: list[str]  # what was left out, and why
    unreadable_pools: list[bytes]  # pool ids whose spec was left out: their keys are deleted by the next write
    schema_mismatch: bool = False  # Redis holds another schema version here: nothing was read


def load(client: redis.Redis, keys: RedisKeys = DEFAULT_KEYS) -> Loaded:
    """Every persisted pool, its block records, and the length of its log; bad records are skipped, not fatal.

    Raises only redis.RedisError / OSError for a Redis that does not answer."""
    skipped: list[str] = []
    schema = client.hget(keys.meta, "schema") if client.type(keys.meta) in (b"hash", b"none") else b"?"
    if schema is not None and schema != SCHEMA_VERSION.encode():
        skipped.append(f"{keys.meta}: schema {schema!r}, this blockd reads {SCHEMA_VERSION!r}: nothing read")
        return Loaded([], {}, {}, skipped, [], schema_mismatch=True)
    try:
        raw_specs = client.hgetall(keys.pools)
    except redis.ResponseError as exc:
        skipped.append(f"{keys.pools}: {exc}")
        return Loaded([], {}, {}, skipped, [], schema_mismatch=True)
    specs: list[PoolSpec] = []
    unreadable: list[bytes] = []
    for field, raw in raw_specs.items():
        try:
            spec = _decode_spec.decode(raw)
            problem = _valid_spec(spec, field)
        except _DECODE_ERRORS as exc:
            problem = str(exc)
        if problem is not None:
            skipped.append(f"pool spec {field!r}: {problem}")
            unreadable.append(field)
            continue
        specs.append(spec)
    records: dict[str, dict[int, BlockRecord]] = {}
    logged: dict[str, int] = {}
    for spec in specs:
        records[spec.pool_id], logged[spec.pool_id] = load_pool_records(client, spec.pool_id, keys, skipped)
    return Loaded(specs, records, logged, skipped, unreadable)


class RedisPersistence(PoolEvents):
    """Collects index changes on the daemon's thread; a writer thread applies them to Redis."""

    def __init__(
        self,
        url: str,
        *,
        flush_interval_s: float = 0.1,
        socket_timeout_s: float = 2.0,
        keys: RedisKeys = DEFAULT_KEYS,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        password: str | None = None,
    ) -> None:
        self.url = url
        self.flush_interval_s = flush_interval_s
        self.keys = keys
        # A password in the URL wins over `password` (redis-py's from_url).
        extra = {"password": password} if password else {}
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s, **extra
        )
        self.queue_limit = queue_limit
        # Bounded: +1 for the None that stops the writer.
        self._queue: queue.Queue[Batch | None] = queue.Queue(maxsize=queue_limit + 1)
        self._unacked: collections.deque[float] = collections.deque()  # collected_at of batches not yet written
        self._replace: set[str] = set()
        self._dropped: list[str | bytes] = []
        self._next_flush = 0.0
        self._full_rewrite_wanted = False  # set by the writer after an outage; read by the daemon's thread
        self._run_id: str | None = None
        self._unloaded = False  # Redis never answered the start-up load
        self._late_load: tuple[list[PoolSpec], dict[str, dict[int, BlockRecord]]] | None = None
        self.probe_interval_s = 1.0
        self.degraded = False
        self.degraded_since: float | None = None
        self.last_error: str | None = None
        self.entries_written = 0
        self.full_rewrites = 0
        self.skipped_records = 0
        self.writer_restarts = 0
        self.dropped_batches = 0
        self._overflowed = False  # batches were dropped: a full re-write is owed once the writer has room
        self._stop = threading.Event()
        self._writer = self._new_writer()
        # What Redis holds, per pool (writer thread only): to compact a log without reading it back.
        self._persisted: dict[str, dict[int, BlockRecord | None]] = {}
        self._logged: dict[str, int] = {}

    # ------------------------------------------------------------------ called on the daemon's thread

    def _new_writer(self) -> threading.Thread:
        return threading.Thread(target=self._write_loop, name="blockd-redis-writer", daemon=True)

    def _take(self, loaded: Loaded) -> None:
        """Note what a load skipped (counted, logged once) and what the next write must clean up."""
        if loaded.skipped:
            self.skipped_records += len(loaded.skipped)
            log.warning(
                "bad records in redis skipped",
                count=len(loaded.skipped),
                total=self.skipped_records,
                first=loaded.skipped[:3],
            )
        if loaded.schema_mismatch:
            self._full_rewrite_wanted = True  # replaces what this blockd cannot read
        self._dropped.extend(loaded.unreadable_pools)

    def load(self, attempts_s: float = 5.0) -> tuple[list[PoolSpec], dict[str, dict[int, BlockRecord]]]:
        """Read the persisted state; if Redis does not answer within attempts_s, start degraded and empty."""
        deadline = time.monotonic() + attempts_s
        while True:
            try:
                loaded = load(self.client, self.keys)
                if not loaded.schema_mismatch:
                    self.client.hsetnx(self.keys.meta, "schema", SCHEMA_VERSION)
                self._take(loaded)
                self._logged = loaded.logged
                self._persisted = {pool_id: dict(pool_records) for pool_id, pool_records in loaded.records.items()}
                return loaded.specs, loaded.records
            except (redis.RedisError, OSError) as exc:
                if time.monotonic() > deadline:
                    self._mark_degraded(exc)
                    self._unloaded = True
                    log.warning(
                        "redis unreachable at start: serving without its index until it answers", error=str(exc)
                    )
                    return [], {}
                time.sleep(0.2)

    def start(self) -> None:
        self._writer.start()

    def new_journal(self) -> Journal:
        return {}

    def pool_registered(self, pool: BlockPool) -> None:
        self._replace.add(pool.spec.pool_id)

    def pool_dropped(self, pool_id: str) -> None:
        self._replace.discard(pool_id)
        self._dropped.append(pool_id)

    def tick(self, manager: BlockManager, now: float) -> None:
        """Hand the changes since the last tick to the writer: every flush interval, or sooner when a journal
        grows big (small batches keep every C-level step of the writer, which holds the GIL, short)."""
        self._supervise()
        if now < self._next_flush and not any(
            pool.journal is not None and len(pool.journal) >= _JOURNAL_LIMIT for pool in manager.pools.values()
        ):
            return
        self._next_flush = now + self.flush_interval_s
        if self._overflowed and self._queue.qsize() < self.queue_limit:
            self._full_rewrite_wanted = True  # room again: a full re-write carries what was dropped
        batch = self.collect(manager, now)
        if batch is None:
            return
        if self._queue.qsize() >= self.queue_limit:
            self._drop_batch(batch)
            return
        self._unacked.append(batch.collected_at)
        self._queue.put_nowait(batch)
        if batch.full and self._overflowed:
            self._overflowed = False
            log.info("redis writer caught up: the index is re-written", dropped_batches=self.dropped_batches)

    def _drop_batch(self, batch: Batch) -> None:
        """The writer is too far behind: drop durability (never a request) until it has room again."""
        self.dropped_batches += 1
        if batch.full:
            self._full_rewrite_wanted = True  # still owed
        if not self._overflowed:
            log.warning(
                "redis writer queue full: index changes are not persisted until it catches up",
                queue_limit=self.queue_limit,
            )
        self._overflowed = True
        self.last_error = f"writer queue full ({self.queue_limit} batches): index changes dropped until a full re-write"

    def _supervise(self) -> None:
        """A writer thread that died (it should not) is replaced, and everything is re-written."""
        if self._writer.is_alive() or self._stop.is_set() or self._writer.ident is None:
            return
        self.writer_restarts += 1
        log.error("redis writer thread died: restarted", restarts=self.writer_restarts)
        while True:  # what it left queued is superseded by the full re-write
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._unacked.clear()
        self._full_rewrite_wanted = True
        self._writer = self._new_writer()
        self._writer.start()

    def collect(self, manager: BlockManager, now: float) -> Batch | None:
        if self._full_rewrite_wanted:
            self._full_rewrite_wanted = False
            if self._late_load is not None:  # blockd started without Redis: take what it kept
                specs, records = self._late_load
                self._late_load = None
                known = manager.pools.keys() | manager.dormant.keys()
                manager.restore([s for s in specs if s.pool_id not in known], records)
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
                batch.replaced[pool_id] = pool.block_records()
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
            batch.replaced[pool_id] = dormant.records
        for pool_id, pool in manager.pools.items():
            batch.specs[pool_id] = pool.spec
            batch.replaced[pool_id] = pool.block_records()
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
            state="degraded" if self.degraded or self._overflowed else "ok",
            redis=redact(self.url),
            lag_s=round(max(lag, 0.0), 4),
            flush_interval_s=self.flush_interval_s,
            pending_batches=len(self._unacked),
            entries_written=self.entries_written,
            full_rewrites=self.full_rewrites,
            last_error=self.last_error,
            key_prefix=self.keys.base,
            skipped_records=self.skipped_records,
            writer_restarts=self.writer_restarts,
            dropped_batches=self.dropped_batches,
            queue_limit=self.queue_limit,
        )

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Full):  # full: the writer sees _stop after its current batch
            self._queue.put(None, timeout=1)
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
        while not self._stop.is_set():
            try:
                if not self._write_one():
                    break
            except Exception as exc:  # a bug or bad data must not end the writer: re-write everything instead
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("redis writer: batch failed, the index will be re-written")
                self._full_rewrite_wanted = True
                self._stop.wait(1.0)

    def _write_one(self, backoff: float = 0.1) -> bool:
        """Take one batch (or probe Redis while idle) and apply it; False when told to stop."""
        try:
            batch = self._queue.get(timeout=self.probe_interval_s)
        except queue.Empty:
            self._probe(backoff)
            return True
        if batch is None:
            return False
        if self.degraded and not batch.full:
            self._ack()  # superseded by the full re-write that follows recovery
            return True
        try:
            self._apply(batch)
        except (redis.RedisError, OSError) as exc:
            self._mark_degraded(exc)
            self._ack()
            self._recover(backoff)
            return True
        except Exception:
            self._ack()
            raise
        self._ack()
        self.entries_written += batch.entry_count()
        if batch.full:
            self.full_rewrites += 1
            if self.degraded:
                log.info("redis is back: index re-written", entries=batch.entry_count())
            self.degraded = False
            self.degraded_since = None
        return True

    def _probe(self, backoff: float) -> None:
        """While idle, notice a Redis that went away or came back empty-handed (a new run id)."""
        try:
            run_id = self.client.info("server").get("run_id")
        except (redis.RedisError, OSError) as exc:
            self._mark_degraded(exc)
            self._recover(backoff)
            return
        restarted = self._run_id is not None and run_id != self._run_id
        self._run_id = run_id
        if (restarted or self.degraded) and not self._full_rewrite_wanted:
            log.warning("redis answers again: re-writing the index", run_id=run_id, restarted=restarted)
            self._redis_back()

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
        self._redis_back()

    def _redis_back(self) -> None:
        """Redis answers after an outage: read what it kept if blockd never could, then ask for a full snapshot.

        Batches queued meanwhile are dropped as superseded; the snapshot carries their content. Pools that Redis
        kept and blockd does not know join as dormant first, so the snapshot writes them back instead of losing
        them.
        """
        if self._unloaded:
            try:
                loaded = load(self.client, self.keys)
            except (redis.RedisError, OSError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                return  # the next probe tries again
            self._take(loaded)
            self._logged = loaded.logged
            self._late_load = (loaded.specs, loaded.records)
            self._unloaded = False
        self._full_rewrite_wanted = True

    def _apply(self, batch: Batch) -> None:
        keys = self.keys
        pipe = self.client.pipeline(transaction=True)
        if batch.full:
            try:
                stale: list[bytes] = self.client.hkeys(keys.pools)
            except redis.ResponseError:  # not a hash: deleted below all the same
                stale = []
            pipe.delete(keys.pools, keys.meta, *(key for pid in stale for key in (keys.snapshot(pid), keys.log(pid))))
            pipe.hset(keys.meta, "schema", SCHEMA_VERSION)
            self._persisted.clear()
            self._logged.clear()
        for pool_id in batch.dropped:
            pipe.delete(keys.snapshot(pool_id), keys.log(pool_id))
            pipe.hdel(keys.pools, pool_id)
            if isinstance(pool_id, bytes):
                continue
            self._persisted.pop(pool_id, None)
            self._logged.pop(pool_id, None)
        for pool_id, spec in batch.specs.items():
            pipe.hset(keys.pools, pool_id, _encode_spec(spec))
        for pool_id, records in batch.replaced.items():
            self._write_snapshot(pipe, pool_id, dict(records))
        for pool_id, changes in batch.changes.items():
            persisted = self._persisted.setdefault(pool_id, {})
            persisted.update(changes)
            pipe.rpush(keys.log(pool_id), _encode(changes))
            self._logged[pool_id] = self._logged.get(pool_id, 0) + len(changes)
            # Compacted once the log holds twice the records it describes: the store never outgrows the pool.
            if self._logged[pool_id] > max(_COMPACT_MIN, 2 * len(persisted)):
                self._write_snapshot(pipe, pool_id, {b: r for b, r in persisted.items() if r is not None})
        pipe.execute()

    def _write_snapshot(
        self, pipe: redis.client.Pipeline, pool_id: str, records: dict[int, BlockRecord | None]
    ) -> None:
        """Replace a pool's snapshot and log by `records`, in chunks so no single encode stalls the request loop."""
        self._persisted[pool_id] = records
        self._logged[pool_id] = 0
        pipe.delete(self.keys.snapshot(pool_id), self.keys.log(pool_id))
        items = iter(records.items())
        while chunk := dict(itertools.islice(items, _SNAPSHOT_CHUNK)):
            pipe.rpush(self.keys.snapshot(pool_id), _encode(chunk))


class NoPersistence(PoolEvents):
    """Persistence switched off: nothing is journaled, nothing survives a restart."""

    def load(self, attempts_s: float = 0.0) -> tuple[list[PoolSpec], dict[str, dict[int, BlockRecord]]]:
        return [], {}

    def start(self) -> None:
        pass

    def tick(self, manager: BlockManager, now: float) -> None:
        pass

    def flush_now(self, manager: BlockManager, timeout_s: float = 5.0) -> bool:
        return True

    def stats(self, now: float) -> p.PersistenceStats:
        return p.PersistenceStats(
            enabled=False,
            state="off",
            redis="",
            lag_s=0.0,
            flush_interval_s=0.0,
            pending_batches=0,
            entries_written=0,
            full_rewrites=0,
        )

    def close(self) -> None:
        pass
