"""Rank 0's side of a tensor-parallel group: start the workers (ranks 1..N-1, `executor.parallel_worker`), join
the rendezvous with them, watch them, stop them; or, when the ranks are started apart (one per node or pod),
admit the workers that ask to join (`executor.parallel_rendezvous`).

Started here, the workers are rank 0's children in its process group (a stop of the executor's group takes them
too) and get SIGTERM from the kernel when rank 0 exits. A worker that exits while the group serves stops the
group: rank 0 exits too (`parallel_runner.fail`); one started apart is seen by the collectives instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.auth import KeySet
from executor.parallel import destroy_group, free_port, init_group
from executor.parallel_rendezvous import GroupSettings, Placement, admit_workers, new_token
from executor.parallel_runner import fail

_PR_SET_PDEATHSIG = 1
_WATCH_S = 0.2


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker is told on its command line (one JSON argument)."""

    rank: int
    world: int
    port: int
    model_dir: str
    device: str
    dtype: str  # "auto" or a name of executor.runner.DTYPES
    backend: str
    block_size: int
    expert_parallel: bool
    timeout_s: float
    log_level: str = "info"
    master: str = "127.0.0.1"  # the store's host: rank 0's address
    token: str = ""  # the group's token (parallel.prove_membership)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One device per rank: cuda:(base + rank) on CUDA; the CPU is every rank's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class WorkerGroup:
    """Ranks 1..N-1 of a group whose rank 0 is this process."""

    def __init__(self, processes: list[subprocess.Popen[bytes]]) -> None:
        self.processes = processes
        self._stopping = False
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    @classmethod
    def start(
        cls,
        size: int,
        model_dir: Path,
        device: torch.device,
        *,
        dtype: str,
        backend: str,
        block_size: int,
        expert_parallel: bool,
        timeout_s: float,
        log_level: str,
    ) -> WorkerGroup:
        """Start the workers and join the group as rank 0 (returns once every rank has joined)."""
        port, token = free_port(), new_token()
        processes = []
        for rank in range(1, size):
            spec = WorkerSpec(
                rank,
                size,
                port,
                str(model_dir),
                str(rank_device(device, rank)),
                dtype,
                backend,
                block_size,
                expert_parallel,
                timeout_s,
                log_level,
                token=token,
            )
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "executor.parallel_worker", spec.to_json()],
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent,
                )
            )
        group = cls(processes)
        init_group(0, size, port, device, timeout_s, token=token)
        return group

    @classmethod
    def admit(
        cls, where: Placement, settings: GroupSettings, device: torch.device, *, keys: KeySet | None, pool_id: str,
        join_timeout_s: float,
    ) -> WorkerGroup:  # fmt: skip
        """The leader of ranks started apart: admit them (RendezvousError if they do not all come in time), then
        host the group's store (it listens on every interface; rank 0 reaches it on loopback). No children to
        watch: a worker lost later fails the step's collectives or the idle ping."""
        admit_workers(where, settings, keys=keys, pool_id=pool_id, timeout_s=join_timeout_s)
        init_group(0, where.size, settings.store_port, device, settings.timeout_s, token=settings.token)
        return cls([])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def _watch(self) -> None:
        while not self._stopping:
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is not None and not self._stopping:
                    fail(f"rank {rank} (pid {process.pid}) exited with status {code}")
            time.sleep(_WATCH_S)

    def expect_exit(self) -> None:
        """From now on a worker's exit is a shutdown, not a failure (before telling them to stop)."""
        self._stopping = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """After `ParallelRunner.close`: wait for the workers to exit, killing any that do not."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        with contextlib.suppress(RuntimeError, ValueError):  # a failed peer may have left it half broken
            destroy_group()
