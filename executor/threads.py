"""How many torch threads the CPU forward pass uses, adjusted to what other processes take of the machine
(/proc/stat, less this process's own time) while the engine is stepping. Why and how: docs/architecture.md
("CPU threads").
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
    """This process's CPU seconds, its reaped children's included: a child it ran and waited for (the C++ compiler
    building the CPU kernels at the first step) is its own work, not a neighbour's."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


Reading = tuple[float | None, float, float]  # (the machine's busy seconds, this process's, the clock)


class ThreadGovernor:
    """Resizes torch's team from what the rest of the machine used while the engine stepped. The engine calls
    `step` at the start of each forward pass and `idle` when it runs out of work: only the stretches between the
    first step after idle and the next `idle` are measured, so what others did while this engine had nothing to
    do (another system of a benchmark warming up, a compile before the first request) is not taken for
    contention the next steps will meet."""

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
        self._start: Reading | None = None  # the reading that opened the stretch of steps now running; None: idle
        # The window's closed stretches so far: the others' CPU seconds and the seconds they span (None: a reading
        # of /proc/stat failed in one, and the window decides nothing).
        self._others_s: float | None = 0.0
        self._span_s = 0.0
        self.others = 0.0  # cores the rest of the machine used over the last window

    def _read(self) -> Reading:
        return self._busy(), self._own(), self._clock()

    def _close_stretch(self) -> Reading:
        """Add the stretch open since `_start` to the window; returns the reading that ended it."""
        assert self._start is not None
        (busy0, own0, t0), end = self._start, self._read()
        busy1, own1, t1 = end
        if busy0 is None or busy1 is None or self._others_s is None:
            self._others_s = None
        else:
            self._others_s += max(0.0, (busy1 - busy0) - (own1 - own0))
        self._span_s += max(0.0, t1 - t0)
        return end

    @property
    def measuring(self) -> bool:
        """Whether a stretch of steps is being measured (False before the first step and after `idle`)."""
        return self._start is not None

    def idle(self) -> None:
        """The engine has no work left: end the stretch being measured, so the wait until the next step is not."""
        if self._start is not None:
            self._close_stretch()
            self._start = None

    def step(self) -> int:
        """Count one step; at each window's end (`window` seconds of steps, `min_steps` of them at least), resize
        the team. Returns the thread count now in force."""
        if self._start is None:  # the first step after idle (or ever): a stretch starts here
            self._start = self._read()
        self._steps += 1
        if self._steps < self.min_steps or self._span_s + self._clock() - self._start[2] < self.window:
            return self.threads
        self._start = self._close_stretch()  # the stretch goes on into the next window
        others_s, span_s = self._others_s, self._span_s
        self._steps, self._others_s, self._span_s = 0, 0.0, 0.0
        if others_s is None or span_s <= 0:
            return self.threads
        self.others = others_s / span_s
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
