"""How many torch threads the CPU forward pass uses, adjusted to what other processes take of the machine
(/proc/stat, less this process's own time). Why and how: docs/architecture.md ("CPU threads").
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import structlog
import torch

from common.cpu import machine_busy_s

log = structlog.get_logger("executor")


def own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


class ThreadGovernor:
    def __init__(
        self,
        max_threads: int,
        *,
        cores: int | None = None,
        window: float = 1.0,
        min_steps: int = 8,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        busy: Callable[[], float | None] = machine_busy_s,
        own: Callable[[], float] = own_cpu_s,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.cores = cores or len(os.sched_getaffinity(0))
        self.window, self.min_steps = window, min_steps
        self.threads = self.max_threads
        self._contended_windows = 0
        self._set, self._busy, self._own, self._clock = set_threads, busy, own, clock
        self._steps = 0
        self._mark = self._read()
        self.others = 0.0  # cores the rest of the machine used over the last window

    def _read(self) -> tuple[float | None, float, float]:
        return self._busy(), self._own(), self._clock()

    def step(self) -> int:
        """Count one step; at each window's end, resize the team. Returns the thread count now in force."""
        self._steps += 1
        if self._steps < self.min_steps or self._clock() - self._mark[2] < self.window:
            return self.threads
        self._steps = 0
        mark, self._mark = self._mark, self._read()
        (busy0, own0, t0), (busy1, own1, t1) = mark, self._mark
        if busy0 is None or busy1 is None or t1 <= t0:
            return self.threads
        self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        # Hysteresis: shrink after two windows with others at 0.6 of a core or more, grow back only below 0.4, so a
        # neighbour at the edge does not flip the team every window.
        self._contended_windows = self._contended_windows + 1 if self.others >= 0.6 else 0
        if self._contended_windows >= 2:
            wanted = max(1, min(self.max_threads, self.cores - round(self.others)))
        elif self.others < 0.4:
            wanted = self.max_threads
        else:
            wanted = self.threads
        if wanted != self.threads:
            self.threads = wanted
            self._set(wanted)
            log.info("torch_threads_resized", threads=wanted, others_cores=round(self.others, 2))
        return self.threads
