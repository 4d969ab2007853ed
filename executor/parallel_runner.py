"""The step across a tensor-parallel group: rank 0's runner broadcasts each step's plan (the batch's tensors, or a
block copy) before running its own share, and the workers' loop (`serve_worker`) receives it and runs theirs.

The traffic, the idle pings and failure as a unit: docs/architecture.md ("Tensor parallelism").
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping

import structlog
import torch
import torch.distributed as dist

from blockd.client import MirroredSequence
from executor.model import ForwardBatch
from executor.parallel import all_reduce, broadcast
from executor.runner import LoadedModel, ModelRunner
from executor.scheduler import Chunk
from pagedkv_kernels import dispatch

log = structlog.get_logger("executor")

EX_GROUP_FAILED = 70  # a rank of the tensor-parallel group died or stopped answering
OP_STOP, OP_STEP, OP_COPY, OP_PING = 0, 1, 2, 3
_HEADER = 6


def _header(device: torch.device, *values: int) -> torch.Tensor:
    out = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    if values:
        out[: len(values)] = torch.tensor(values, dtype=torch.int64)
    return out


def send_batch(batch: ForwardBatch) -> None:
    t, (s, w), n = batch.input_ids.numel(), batch.block_tables.shape, batch.logits_indices.numel()
    device = batch.input_ids.device
    groups = 0 if batch.group_slots is None else batch.group_slots.shape[0]  # layer groups past the first
    broadcast(_header(device, OP_STEP, t, s, w, n, groups))
    parts: tuple[torch.Tensor, ...] = (
        batch.input_ids,
        batch.positions,
        batch.slot_mapping,
        batch.logits_indices,
        batch.block_tables.reshape(-1),
        batch.query_start_loc,
        batch.seq_lens,
    )
    if batch.group_slots is not None and batch.group_tables is not None:
        parts += (batch.group_slots.reshape(-1), batch.group_tables.reshape(-1))
    broadcast(torch.cat([p.to(torch.int64) for p in parts]))


def receive_batch(header: list[int], device: torch.device) -> ForwardBatch:
    t, s, w, n, g = header[1:6]
    payload = torch.empty((3 + g) * t + n + (1 + g) * s * w + 2 * s + 1, dtype=torch.int64, device=device)
    broadcast(payload)
    ids, pos, slots, logits, tables, starts, lens, group_slots, group_tables = payload.split(
        [t, t, t, n, s * w, s + 1, s, g * t, g * s * w]
    )
    return ForwardBatch(
        input_ids=ids,
        positions=pos,
        slot_mapping=slots,
        block_tables=tables.to(torch.int32).view(s, w),
        query_start_loc=starts.to(torch.int32),
        seq_lens=lens.to(torch.int32),
        logits_indices=logits,
        group_slots=group_slots.view(g, t) if g else None,
        group_tables=group_tables.to(torch.int32).view(g, s, w) if g else None,
    )


def broadcast_int(value: int, device: torch.device) -> int:
    """Rank 0's `value` on every rank (the KV cache's size in blocks: one pool, one set of block ids)."""
    out = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(out, src=0)  # on the startup group: the ranks finish loading at their own pace
    return int(out.item())


def _ping(device: torch.device) -> None:
    broadcast(_header(device, OP_PING))
    all_reduce(torch.zeros(1, device=device))  # every rank must answer: a paused one times this out


class ParallelRunner(ModelRunner):
    """Rank 0's runner: each op is sent to the group, then run here on this rank's share."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_blocks: int,
        block_size: int,
        backend: dispatch.Backend = "auto",
        ping_s: float = 5.0,
    ) -> None:
        super().__init__(loaded, num_blocks=num_blocks, block_size=block_size, backend=backend)
        self._lock = threading.Lock()  # one op at a time on the group: steps and pings
        self._last_op = time.monotonic()
        self._closed = False
        self.ping_s = ping_s
        self.steps = 0
        self.step_s = 0.0  # wall time of the steps' forward passes here, plan broadcast included
        self.broadcast_s = 0.0  # of which sending the plan
        self._pinger = threading.Thread(target=self._ping_while_idle, name="tp-ping", daemon=True)
        self._pinger.start()

    @property
    def collective_s(self) -> float:
        """Seconds this rank spent in the model's collectives so far (all-reduces, the logits' gather)."""
        collectives = self.model.collectives
        return collectives.seconds if collectives is not None else 0.0

    @contextlib.contextmanager
    def _op(self) -> Iterator[None]:
        with self._lock:
            try:
                yield
            except (RuntimeError, dist.DistError) as exc:
                fail(f"a collective failed: {exc}")
            self._last_op = time.monotonic()

    def execute(self, chunks: list[Chunk], tables: Mapping[str, MirroredSequence]) -> torch.Tensor:
        batch = self.build_batch(chunks, tables)
        with self._op():
            started = time.perf_counter()
            send_batch(batch)
            sent = time.perf_counter()
            logits = self.model(batch, self.kv_caches, self.backend)
            self.steps += 1
            self.broadcast_s += sent - started
            self.step_s += time.perf_counter() - started
            return logits

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        with self._op():
            broadcast(_header(self.device, OP_COPY, len(pairs)))
            broadcast(torch.tensor([x for pair in pairs for x in pair], device=self.device))
            super().copy_blocks(pairs)

    def stats(self) -> dict[str, float]:
        """The steps so far: how many, their time here, and how much of it went to collectives."""
        return {
            "steps": self.steps,
            "step_s": round(self.step_s, 4),
            "collective_s": round(self.collective_s + self.broadcast_s, 4),
            "broadcast_s": round(self.broadcast_s, 4),
        }

    def close(self) -> None:
        """Tell the workers to stop (a clean shutdown: they exit 0); log the steps' time in collectives."""
        log.info("tensor_parallel_stats", **self.stats())
        with self._lock:
            self._closed = True
            with contextlib.suppress(RuntimeError, dist.DistError):
                broadcast(_header(self.device, OP_STOP))

    def _ping_while_idle(self) -> None:
        while True:
            time.sleep(self.ping_s / 4)
            with self._lock:
                if self._closed:
                    return
                if time.monotonic() - self._last_op < self.ping_s:
                    continue
                try:
                    _ping(self.device)
                except (RuntimeError, dist.DistError) as exc:
                    fail(f"a rank did not answer the idle ping: {exc}")
                self._last_op = time.monotonic()


def fail(reason: str) -> None:
    """The group stops as a unit: this process exits at once (its workers die with it, blockd reclaims the pool by
    its lease, gateways fail over)."""
    log.error("tensor_parallel_group_failed", reason=reason, pid=os.getpid())
    os._exit(EX_GROUP_FAILED)


def serve_worker(runner: ModelRunner) -> None:
    """A worker's loop: run each op rank 0 sends until it says stop. A failed collective raises (the worker exits
    non-zero; rank 0 has failed or will fail the same op)."""
    device = runner.device
    header_t = _header(device)
    while True:
        broadcast(header_t)
        header = header_t.tolist()
        op = header[0]
        if op == OP_STOP:
            return
        if op == OP_PING:
            all_reduce(torch.zeros(1, device=device))
        elif op == OP_STEP:
            batch = receive_batch(header, device)
            runner.model(batch, runner.kv_caches, runner.backend)
        elif op == OP_COPY:
            flat = torch.empty(2 * header[1], dtype=torch.int64, device=device)
            broadcast(flat)
            values = flat.tolist()
            ModelRunner.copy_blocks(runner, list(zip(values[::2], values[1::2], strict=True)))
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")
