"""The deployment's shared KV tier as one executor sees it (`--shared-kv-dir`, `--shared-kv-size`): a directory
every executor of the deployment mounts (a compose volume, a Kubernetes ReadWriteMany claim). blockd directs
(blockd.tiers: a write at each commit, loads, discards to make room); this moves the bytes. Writes go behind on a
thread of their own and are reported to blockd once whole (`take_reports`), so no executor loads a block before
it is on the volume; every load checks the file (executor.kv_tiers), so a corrupt, partial or foreign file is
dropped and counted, never read.

Layout: `<dir>/tier-id` (the directory's identity, made once by the first executor: two mounts of one volume are
one tier whatever their paths) and `<dir>/<layout digest>/<hash hex>.kvb`, so executors of another model, KV dtype
or block size never meet the same file name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import secrets
import threading
import time
from collections import Counter
from pathlib import Path
from typing import BinaryIO

import structlog

from blockd.tiers import TierHeld
from executor.kv_tiers import SUFFIX, TEMP_SUFFIX, BadBlock, Dropped, KvLayout, write_block_file

log = structlog.get_logger("executor")

ID_FILE = "tier-id"
# A temporary file older than this is a dead writer's (a live one renames within seconds): a scan removes it.
STALE_TEMP_S = 600.0
COUNTERS = ("written", "write_failures", "loads", "discards")


def tier_id(directory: Path) -> str:
    """The directory's identity, created by the first executor that mounts it (O_EXCL: racing starts agree)."""
    path = directory / ID_FILE
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
    for _ in range(50):  # another executor created it a moment ago and is still writing it
        text = path.read_text().strip()
        if text:
            return text
        time.sleep(0.01)
    raise RuntimeError(f"{path} is empty: remove it, or let the executor that is creating it finish")


class SharedStore:
    """The shared directory's block files of this executor's KV layout, and this executor's writes to it."""

    def __init__(self, layout: KvLayout, directory: Path, capacity_bytes: int) -> None:
        self.layout = layout
        directory.mkdir(parents=True, exist_ok=True)
        digest = hashlib.blake2b(layout.encoded(), digest_size=12).hexdigest()
        self.dir = directory / digest
        self.dir.mkdir(exist_ok=True)
        # Pools with the same id share blockd's entries: the same volume and the same layout.
        self.shared_id = f"{tier_id(directory)}-{digest}"
        self.blocks = capacity_bytes // layout.file_bytes
        self.counters: Counter[str] = Counter(dict.fromkeys([*COUNTERS, *(f"dropped_{r.value}" for r in Dropped)], 0))
        self._lock = threading.Lock()  # guards what the writer and the step's thread both touch
        self._pending: dict[bytes, bytes] = {}  # hash -> bytes queued for the writer
        self._written: list[bytes] = []  # whole on the volume, not yet told to blockd
        self._lost: list[bytes] = []  # failed writes and bad files, not yet told to blockd
        self._queue: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = threading.Thread(
            target=self._write_behind, name="kv-shared-writer", daemon=True
        )
        self._writer.start()

    def held(self) -> list[TierHeld]:
        """The whole-sized files of this layout on the volume now, oldest first (their content is checked when
        loaded), for blockd's directory at each registration; a dead writer's temporary files go."""
        found: list[tuple[float, bytes]] = []
        now = time.time()
        for entry in os.scandir(self.dir):
            try:
                stat = entry.stat()
            except OSError:  # deleted meanwhile by another executor
                continue
            if entry.name.endswith(TEMP_SUFFIX):
                if now - stat.st_mtime > STALE_TEMP_S:
                    self.counters[f"dropped_{Dropped.TRUNCATED.value}"] += 1
                    Path(entry.path).unlink(missing_ok=True)
                continue
            if not entry.name.endswith(SUFFIX) or stat.st_size != self.layout.file_bytes:
                continue  # (a torn or foreign file is dropped when a load reads it)
            try:
                found.append((stat.st_mtime, bytes.fromhex(entry.name.removesuffix(SUFFIX))))
            except ValueError:
                continue
        found.sort()
        return [TierHeld(h) for _, h in found[-self.blocks :]] if self.blocks else []

    # ------------------------------------------------------------------------------------ blockd's ops

    def write(self, block_hash: bytes, data: bytes) -> None:
        """Queue a block's bytes (a snapshot: the device block is free for reuse at once)."""
        with self._lock:
            self._pending[block_hash] = data
        self._queue.put(("write", block_hash))

    def open(self, block_hash: bytes) -> bytes | BinaryIO | None:
        """A load's first half, on the step's thread in the order of blockd's ops: the bytes of a write of this
        executor's still queued, or the block file opened (read and checked off the step's thread,
        `executor.kv_tiers.read_block_file`: a discard meanwhile does not take the open file away); None when it
        cannot be opened (dropped and counted, blockd told)."""
        with self._lock:
            queued = self._pending.get(block_hash)
        if queued is not None:
            return queued
        try:
            return self._path(block_hash).open("rb", buffering=0)  # (read whole into a buffer: no copy through another)
        except OSError as exc:  # gone (discarded by another executor, or deleted by hand)
            self._drop(block_hash, Dropped.TRUNCATED, f"cannot read it: {exc.strerror or exc}", delete=False)
            return None

    def loaded(self, block_hash: bytes, error: BadBlock | OSError | None) -> bool:
        """A load's second half: it read (None) or failed with `error` (the file dropped and counted, blockd
        told). Returns whether the block may be used."""
        if error is None:
            self.counters["loads"] += 1
            return True
        if isinstance(error, BadBlock):
            self._drop(block_hash, error.reason, str(error), delete=not error.theirs)
        else:
            self._drop(block_hash, Dropped.TRUNCATED, f"cannot read it: {error.strerror or error}", delete=False)
        return False

    def discard(self, block_hash: bytes) -> None:
        with self._lock:
            self._pending.pop(block_hash, None)
        self._queue.put(("delete", block_hash))

    def take_reports(self) -> tuple[list[bytes], list[bytes]]:
        """(written, lost) since the last call, for the next step's message to blockd."""
        with self._lock:
            written, self._written = self._written, []
            lost, self._lost = self._lost, []
        return written, lost

    def report(self) -> dict[str, int]:
        with self._lock:
            pending = len(self._pending)
        return {**{f"shared_{k}": v for k, v in self.counters.items()}, "shared_pending_writes": pending}

    # ------------------------------------------------------------------------------------ the volume

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / f"{block_hash.hex()}{SUFFIX}"

    def _drop(self, block_hash: bytes, reason: Dropped, detail: str, *, delete: bool) -> None:
        self.counters[f"dropped_{reason.value}"] += 1
        with self._lock:
            self._lost.append(block_hash)
        if delete:
            with contextlib.suppress(OSError):
                self._path(block_hash).unlink()
        log.warning("kv_shared_block_dropped", block_hash=block_hash.hex(), reason=reason.value, detail=detail)

    def _write_behind(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            action, block_hash = item
            path = self._path(block_hash)
            if action == "delete":
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                self.counters["discards"] += 1
                continue
            with self._lock:
                data = self._pending.get(block_hash)
            if data is None:
                continue  # discarded meanwhile
            try:
                # A temporary name of this writer's own: executors writing the same block never share one.
                write_block_file(path, self.layout, block_hash, data, f".{os.getpid()}.{secrets.token_hex(4)}")
            except OSError as exc:  # a full or failing volume: not kept there, and blockd hears it
                self.counters["write_failures"] += 1
                failures = self.counters["write_failures"]
                with self._lock:
                    if self._pending.get(block_hash) is data:
                        del self._pending[block_hash]
                    self._lost.append(block_hash)
                if failures & (failures - 1) == 0:  # the 1st, 2nd, 4th...: a full volume does not flood the log
                    log.warning(
                        "kv_shared_write_failed", block_hash=block_hash.hex(), error=str(exc), failures=failures
                    )
                continue
            self.counters["written"] += 1
            with self._lock:
                if self._pending.get(block_hash) is data:
                    del self._pending[block_hash]
                self._written.append(block_hash)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued write is on the volume, then stop the writer (shutdown; tests)."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout_s)
            self._writer = None
