"""The executor's lower KV tiers: host memory (`--host-kv-memory`, pinned on CUDA), a local disk directory
(`--disk-kv-dir`, `--disk-kv-size`) and the deployment's shared tier (executor.shared_tier). blockd directs
(blockd.tiers: which hash goes where, when); this moves the bytes, in the order of blockd's ops, on the step's
thread before the step's forward pass: a save copies a device block out before the step that reuses it writes
there. A host load is a copy (on CUDA queued on the stream, from pinned memory). A disk or shared load opens its
file there and then, in order with the other ops, and a reader thread reads it and checks its checksum (the
step's thread helps with local files while it waits for them: `_wait`), beside the step's forward pass for other
sequences when it takes longer than the step waits; `land` copies its bytes in, and until then the sequence it
belongs to is not scheduled and its blocks are not committed, so nothing reads them. Disk writes go
behind, on a thread of their own; a disk load of a block still waiting for its write takes the copy waiting (the
writer checksums and writes it), so nothing is ever read that was not written whole. The file format:
executor.kv_tiers.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import structlog
import torch

from blockd.tiers import MEDIUM_CPU, MEDIUM_SHARED, TierHeld, TierOp, TierSpec
from executor.kv_tiers import (
    SUFFIX,
    TEMP_SUFFIX,
    BadBlock,
    Dropped,
    KvLayout,
    decode_block,
    read_block_file,
    write_block_file,
)
from executor.shared_tier import SharedStore

log = structlog.get_logger("executor")

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]
COUNTERS = (
    "saves_cpu",
    "saves_disk",
    "spills",
    "loads_cpu",
    "loads_disk",
    "loads_abandoned",
    "written",
    "write_failures",
)
# Threads that read and check block files (file reads and the checksum let go of the GIL: they run side by side, and
# beside the step's forward pass); the step's thread is one more while it waits for them (`TierStore._wait`). On
# 2 CPUs a second reader beside it made 40 loads a third slower (144 against 107 us a block): they only took turns.
READERS = max(1, min(4, (os.cpu_count() or 1) - 1))
# Free read buffers kept for reuse (executor.tier_store._ReadBuffers), in bytes.
READ_BUFFER_BYTES = 64 << 20


@dataclass
class Moved:
    """What `TierStore.run` did to the loads: device blocks whose load failed at once, and the loads reading
    (device block -> ticket, for `land`)."""

    failed: list[int] = field(default_factory=list)
    reading: dict[int, int] = field(default_factory=dict)


@dataclass
class Landed:
    """The tickets of the reads `TierStore.land` copied in, and of those that failed (their blocks to recompute)."""

    loaded: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    in_flight: int = 0  # reads still going on after it (of any ticket)


@dataclass(eq=False)
class _Read:
    """One disk or shared load's read: taken by one thread (a reader, or the step's while it waits), done once."""

    op: TierOp
    file: BinaryIO
    done: threading.Event = field(default_factory=threading.Event)
    taken: bool = False  # (under TierStore._claims)
    payload: memoryview | None = None
    error: BaseException | None = None
    buffer: bytearray | None = None  # what it read into: back to the pool once landed or thrown away


class _ReadBuffers:
    """Read buffers a block file's size (and a byte, to tell a longer file), used again and again: a new one's
    pages are faulted in one by one as the read fills it, which cost about as much as the read and the checksum
    together (a 128 KiB block: some 90 us of 200). Readers take them; the step's thread gives them back once their
    bytes are copied in. It keeps up to `keep` free ones."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self.keep = keep
        self._free: deque[bytearray] = deque()  # (append and pop are atomic: no lock between the threads)

    def take(self) -> bytearray:
        try:
            return self._free.pop()
        except IndexError:
            return bytearray(self.size)

    def give(self, buffer: bytearray | None) -> None:
        if buffer is not None and len(self._free) < self.keep:
            self._free.append(buffer)


class TierStore:
    """The host buffer and the disk directory of one executor's KV blocks, and their counters."""

    def __init__(
        self,
        layout: KvLayout,
        kv_caches: KvCaches,
        *,
        host_bytes: int = 0,
        disk_dir: Path | None = None,
        disk_bytes: int = 0,
        shared: SharedStore | None = None,
    ) -> None:
        self.layout = layout
        self.shared = shared
        self.kv_caches = kv_caches
        self.device = kv_caches[0][0].device
        # Each layer's K and V as rows of bytes, a row a block: a block's parts are then plain row views.
        self._rows = [t.view(t.shape[0], -1).view(torch.uint8) for kv in kv_caches for t in kv]
        block = layout.block_bytes
        self.host_blocks = host_bytes // block
        pin = self.device.type == "cuda"
        self.host = torch.zeros((self.host_blocks, block), dtype=torch.uint8, pin_memory=pin)
        self.host_hash: list[bytes | None] = [None] * self.host_blocks
        self.disk_dir = disk_dir
        self.disk_blocks = disk_bytes // layout.file_bytes if disk_dir is not None else 0
        self.disk: OrderedDict[bytes, None] = OrderedDict()  # hashes on disk (or queued for it), oldest first
        # Every key from the start: the writer thread counts too, and a report iterating the counters while a
        # first count adds a key would fail.
        self.counters: Counter[str] = Counter(dict.fromkeys([*COUNTERS, *(f"dropped_{r.value}" for r in Dropped)], 0))
        self._pending: dict[bytes, bytes] = {}  # hash -> a block's bytes queued for the writer (it checksums them)
        self._lock = threading.Lock()  # guards _pending between the step's thread and the writer
        self._queue: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._d2h = False  # device-to-host copies queued on the stream, not yet waited for
        self._lost: list[bytes] = []  # disk entries dropped since blockd last heard (`take_drops`)
        self._unwritten: list[bytes] = []  # hashes whose write failed, for the step's thread (under _lock)
        self._readers: ThreadPoolExecutor | None = None  # made at the first file load
        self._reads: dict[int, _Read] = {}  # ticket -> a disk or shared load still to land
        self._tickets = itertools.count()
        self._claims = threading.Lock()  # guards each read's `taken`
        self._buffers = _ReadBuffers(layout.file_bytes + 1, max(2 * READERS, READ_BUFFER_BYTES // layout.file_bytes))
        self.help_with_reads = True  # the step's thread reads local disk files while it waits for them (`_wait`)
        if disk_dir is not None and self.disk_blocks:
            disk_dir.mkdir(parents=True, exist_ok=True)
            self._scan()
            self._writer = threading.Thread(target=self._write_behind, name="kv-tier-writer", daemon=True)
            self._writer.start()

    # ------------------------------------------------------------------------------------ what blockd hears

    def spec(self) -> TierSpec:
        """What the tiers hold now, for (re-)registration."""
        host = [TierHeld(h, s) for s, h in enumerate(self.host_hash) if h is not None]
        disk = [TierHeld(h) for h in self.disk]
        if self.shared is None:
            return TierSpec(self.host_blocks, self.disk_blocks, host, disk)
        shared = self.shared
        return TierSpec(self.host_blocks, self.disk_blocks, host, disk, shared.shared_id, shared.blocks, shared.held())

    def take_shared_reports(self) -> tuple[list[bytes], list[bytes]]:
        """The shared tier's finished writes and its lost blocks since the last step (blockd.tiers)."""
        return self.shared.take_reports() if self.shared is not None else ([], [])

    # ------------------------------------------------------------------------------------ blockd's ops

    def run(self, ops: list[TierOp]) -> Moved:
        """Every op in order. A save, spill, discard and host load is done when this returns; a disk or shared load
        is begun (its file opened here, in order with the rest) and read and checked on a reader thread, its
        bytes copied in by a later `land` (until then the block must not be read). Returns the device blocks whose
        load failed now and the loads still reading."""
        moved = Moved()
        for op in ops:
            if op.medium == MEDIUM_SHARED:
                self._run_shared(op, moved)
            elif op.kind == "save":
                if op.medium == MEDIUM_CPU:
                    self._to_host(op.slot, op.block, op.block_hash)
                else:
                    self._to_disk(op.block_hash, self._device_block(op.block))
                self.counters[f"saves_{op.medium.lower()}"] += 1
            elif op.kind == "spill":
                self._sync()
                self._to_disk(op.block_hash, self.host[op.slot])
                self.host_hash[op.slot] = None
                self.counters["spills"] += 1
            elif op.kind == "load" and op.medium == MEDIUM_CPU:
                # (now: a later op of this step may give the slot to another block; on CUDA a stream-ordered copy)
                self._copy_in([(op.block, self.host[op.slot])])
                self.counters["loads_cpu"] += 1
            elif op.kind == "load":
                self._begin_load(op, self._open_disk(op.block_hash), moved)
            else:
                self.disk.pop(op.block_hash, None)
                with self._lock:
                    self._pending.pop(op.block_hash, None)
                self._queue.put(("delete", op.block_hash))
        return moved

    def _run_shared(self, op: TierOp, moved: Moved) -> None:
        if self.shared is None:
            raise RuntimeError("blockd sent a shared-tier move to an executor without --shared-kv-dir")
        if op.kind == "save":
            self.shared.write(op.block_hash, self._device_block(op.block).cpu().numpy().tobytes())
        elif op.kind == "load":
            self._begin_load(op, self.shared.open(op.block_hash), moved)
        elif op.kind == "discard":
            self.shared.discard(op.block_hash)

    def _begin_load(self, op: TierOp, source: bytes | BinaryIO | None, moved: Moved) -> None:
        """A disk or shared load: failed (None: not there), done now (the bytes of a write still queued), or its
        opened file handed to a reader."""
        if source is None:
            moved.failed.append(op.block)
        elif isinstance(source, bytes):
            self._copy_in([(op.block, torch.frombuffer(bytearray(source), dtype=torch.uint8))])
            self._loaded(op, None)
        else:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="kv-tier-reader")
            ticket = next(self._tickets)
            read = _Read(op, source)
            self._reads[ticket] = read
            self._readers.submit(self._perform, read)
            moved.reading[op.block] = ticket

    def _perform(self, read: _Read) -> None:
        """Read and check one file, unless another thread has taken it."""
        with self._claims:
            if read.taken:
                return
            read.taken = True
        try:
            read.buffer = self._buffers.take()
            read.payload = read_block_file(self.layout, read.op.block_hash, read.file, read.buffer)
        except BaseException as exc:  # (handed to the step's thread, which tells a bad file from a bug)
            read.error = exc
        finally:
            read.done.set()

    def land(self, keep: Collection[int], *, wait_s: float = 0.0) -> Landed:
        """Copy in the loads whose read has finished, of those whose ticket is in `keep` (the others' blocks were
        given back meanwhile: their bytes are thrown away), waiting up to `wait_s` for `keep`'s. A read that
        failed drops its file (counted); its ticket is in `failed`."""
        landed = Landed()
        if wait_s > 0:
            self._wait(keep, wait_s)
        arrived: list[tuple[int, torch.Tensor]] = []
        finished: list[_Read] = []
        for ticket, read in list(self._reads.items()):
            if not read.done.is_set():
                continue
            del self._reads[ticket]
            finished.append(read)
            error = read.error
            if error is not None and not isinstance(error, BadBlock | OSError):
                raise error  # (a bug, not a bad file)
            if ticket not in keep:
                if error is not None:
                    self._failed_read(read.op, error)  # bad all the same: dropped, not kept for the next to ask
                else:
                    self.counters["loads_abandoned"] += 1
                continue
            if error is None:
                assert read.payload is not None
                arrived.append((read.op.block, torch.frombuffer(read.payload, dtype=torch.uint8)))
                self._loaded(read.op, None)
                landed.loaded.append(ticket)
            else:
                self._failed_read(read.op, error)
                landed.failed.append(ticket)
        self._copy_in(arrived)  # (on CUDA from pageable memory: its bytes are taken when the call returns)
        del arrived
        for read in finished:
            read.payload = None
            self._buffers.give(read.buffer)
        landed.in_flight = len(self._reads)
        return landed

    def _wait(self, keep: Collection[int], wait_s: float) -> None:
        """Wait up to `wait_s` for `keep`'s reads. The step's thread reads local disk files itself meanwhile
        (with `help_with_reads`), taking them from the readers, so a wait is never slower than reading them all
        on the step's thread; a shared volume's (a network's: it may hang) it leaves to the readers. A read once
        begun runs to its end: a disk that hangs in one can hold the step past `wait_s`."""
        deadline = time.monotonic() + wait_s
        wanted = [r for t, r in self._reads.items() if t in keep]
        if self.help_with_reads:
            for read in wanted:
                if time.monotonic() >= deadline:
                    break
                if read.op.medium != MEDIUM_SHARED:
                    self._perform(read)
        for read in wanted:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            read.done.wait(left)

    def _loaded(self, op: TierOp, error: BadBlock | OSError | None) -> None:
        if op.medium == MEDIUM_SHARED:
            assert self.shared is not None
            self.shared.loaded(op.block_hash, error)
        elif error is None:
            self.counters["loads_disk"] += 1

    def _failed_read(self, op: TierOp, error: BadBlock | OSError) -> None:
        if op.medium == MEDIUM_SHARED:
            self._loaded(op, error)
        elif isinstance(error, BadBlock):
            self._drop(op.block_hash, error.reason, str(error))
        else:
            self._drop(op.block_hash, Dropped.TRUNCATED, f"cannot read it: {error.strerror or error}")

    def _device_block(self, block: int) -> torch.Tensor:
        """Block `block` of every layer, K then V, as one uint8 tensor on the device."""
        return torch.cat([rows[block] for rows in self._rows])

    def _to_host(self, slot: int, block: int, block_hash: bytes) -> None:
        parts = [rows[block] for rows in self._rows]
        cuda = self.device.type == "cuda"
        torch._foreach_copy_(list(self.host[slot].split(self.layout.layer_bytes)), parts, non_blocking=cuda)
        self._d2h = self._d2h or cuda
        self.host_hash[slot] = block_hash

    def _to_disk(self, block_hash: bytes, payload: torch.Tensor) -> None:
        if self.disk_dir is None:
            raise RuntimeError("blockd sent a disk move to an executor without --disk-kv-dir")
        data = payload.cpu().numpy().tobytes()  # a snapshot: the slot or block is free for reuse at once
        with self._lock:
            self._pending[block_hash] = data
        self.disk[block_hash] = None
        self.disk.move_to_end(block_hash)
        self._queue.put(("write", block_hash))

    def _copy_in(self, blocks: list[tuple[int, torch.Tensor]]) -> None:
        """Stored blocks' bytes (every layer, K then V) into their device blocks, in one call: every torch call
        lets go of the GIL and must take it back from the reader and writer threads, so a copy a layer and
        block cost far more under load than the copies themselves."""
        if not blocks:
            return
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        n = self.layout.layer_bytes
        cuda = self.device.type == "cuda"
        for block, source in blocks:
            targets += [rows[block] for rows in self._rows]
            sources += (source.to(self.device, non_blocking=True) if cuda else source).split(n)
        torch._foreach_copy_(targets, sources, non_blocking=cuda)

    def _open_disk(self, block_hash: bytes) -> bytes | BinaryIO | None:
        """A disk load's first half (executor.shared_tier.SharedStore.open is the shared tier's)."""
        if self.disk_dir is None:
            raise RuntimeError("blockd sent a disk move to an executor without --disk-kv-dir")
        with self._lock:
            queued = self._pending.get(block_hash)
        if queued is not None:  # not written yet: the bytes themselves
            return queued
        try:
            return self._path(block_hash).open("rb", buffering=0)  # (read whole into a buffer: no copy through another)
        except OSError as exc:  # gone, or unreadable
            with self._lock:
                unwritten = block_hash in self._unwritten
            if unwritten:  # its write failed (counted there): forgotten, not counted again
                self._forget(block_hash)
            else:
                self._drop(block_hash, Dropped.TRUNCATED, f"cannot read it: {exc.strerror or exc}")
        return None

    def _forget(self, block_hash: bytes) -> None:
        if block_hash in self.disk:
            del self.disk[block_hash]
            self._lost.append(block_hash)

    def _drop(self, block_hash: bytes, reason: Dropped, detail: str) -> None:
        self.counters[f"dropped_{reason.value}"] += 1
        self._forget(block_hash)
        with contextlib.suppress(OSError):
            self._path(block_hash).unlink()
        log.warning(
            "kv_tier_block_dropped", block_hash=block_hash.hex(), reason=reason.value, detail=detail, **self.dropped()
        )

    def take_drops(self) -> list[bytes]:
        """The disk entries lost since the last call, for blockd's directory (sent with the next step): dropped
        files, and blocks whose write failed (a full disk), so that blockd never sends a load of them."""
        with self._lock:
            unwritten, self._unwritten = self._unwritten, []
            unwritten = [h for h in unwritten if h not in self._pending]  # not queued again since
        for block_hash in unwritten:
            self._forget(block_hash)
        lost, self._lost = self._lost, []
        return lost

    def report(self) -> dict[str, int]:
        """Every counter, and what each tier holds now."""
        return {
            **self.counters,
            **self.dropped(),
            "host_held": sum(h is not None for h in self.host_hash),
            "disk_held": len(self.disk),
            "pending_writes": self.pending_writes(),
            **(self.shared.report() if self.shared is not None else {}),
        }

    def dropped(self) -> dict[str, int]:
        return {f"dropped_{r.value}": self.counters[f"dropped_{r.value}"] for r in Dropped}

    def _sync(self) -> None:
        if self._d2h:
            torch.cuda.current_stream(self.device).synchronize()
            self._d2h = False

    # ------------------------------------------------------------------------------------ the disk

    def _path(self, block_hash: bytes) -> Path:
        assert self.disk_dir is not None
        return self.disk_dir / f"{block_hash.hex()}{SUFFIX}"

    def _scan(self) -> None:
        """At start: keep the block files that are whole and of this layout (oldest first, within the budget);
        drop and count every other one (a torn write's temporary file, a corrupt, foreign or stale file)."""
        assert self.disk_dir is not None
        found: list[tuple[float, bytes]] = []
        theirs = 0
        for path in self.disk_dir.iterdir():
            if path.name.endswith(TEMP_SUFFIX):
                self.counters[f"dropped_{Dropped.TRUNCATED.value}"] += 1
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                block_hash = bytes.fromhex(path.name.removesuffix(SUFFIX))
                decode_block(self.layout, block_hash, path.read_bytes())
            except ValueError:
                self.counters[f"dropped_{Dropped.FOREIGN.value}"] += 1
                path.unlink(missing_ok=True)
                continue
            except OSError:  # not a readable file (a directory, no permission): not ours to delete
                self.counters[f"dropped_{Dropped.CORRUPT.value}"] += 1
                continue
            except BadBlock as exc:
                self.counters[f"dropped_{exc.reason.value}"] += 1
                if exc.theirs:  # whole, of another model: a deployment sharing the directory still reads it
                    theirs += 1
                else:
                    path.unlink(missing_ok=True)
                continue
            try:
                found.append((path.stat().st_mtime, block_hash))
            except OSError:  # deleted meanwhile (by whoever shares the directory): not there, then
                continue
        found.sort()
        over = max(len(found) - self.disk_blocks, 0)
        for _, block_hash in found[:over]:  # the budget shrank: the oldest go
            self._path(block_hash).unlink(missing_ok=True)
        for _, block_hash in found[over:]:
            self.disk[block_hash] = None
        log.info("kv_tier_disk_scanned", blocks=len(self.disk), over_budget=over, left_theirs=theirs, **self.dropped())

    def _write_behind(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            action, block_hash = item
            path = self._path(block_hash)
            try:
                if action == "delete":
                    path.unlink(missing_ok=True)
                    continue
                with self._lock:
                    data = self._pending.get(block_hash)
                if data is None:
                    continue  # discarded meanwhile
                write_block_file(path, self.layout, block_hash, data)
                self.counters["written"] += 1
                with self._lock:
                    if self._pending.get(block_hash) is data:
                        del self._pending[block_hash]
            except OSError as exc:  # a full or failing disk: the block is not kept there, and blockd hears it
                self.counters["write_failures"] += 1
                failures = self.counters["write_failures"]
                with self._lock:
                    if action == "write" and self._pending.get(block_hash) is data:
                        del self._pending[block_hash]
                        self._unwritten.append(block_hash)
                if failures & (failures - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a full disk does not flood the log
                    log.warning(
                        "kv_tier_write_failed", block_hash=block_hash.hex(), error=str(exc), write_failures=failures
                    )

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued write is on disk, then stop the writer and the readers (shutdown; tests)."""
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout_s)
            self._writer = None
        if self.shared is not None:
            self.shared.flush(timeout_s)

    def pending_writes(self) -> int:
        with self._lock:
            return len(self._pending)
