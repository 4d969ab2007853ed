"""Running `pagedkv bench peer`'s systems: the alternated timed rounds, the other systems paused during each run,
the busy neighbour of `--noisy-neighbour`, and the medians and ratio of what they measured."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from common import processes
from common.cpu import machine_busy_s
from pagedkv.bench.peer_driver import process_state, tree_pids
from pagedkv.bench.peer_systems import System, read_loadavg
from pagedkv.bench.peer_workloads import warmup_requests
from pagedkv.bench.throughput import BenchRequest


@dataclass
class RunRecord:
    workload: str
    round: int  # 1-based
    system: str
    seconds: float
    output_tokens: int
    cpu_s: float
    load_before: list[float]  # /proc/loadavg's 1, 5 and 15 minute figures just before the run
    others_cpu_share: float | None  # of the machine's CPU, what other processes used during the run
    neighbour: bool = False  # run with the bench's busy-loop neighbour (--noisy-neighbour)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_s_per_token(self) -> float:
        return self.cpu_s / self.output_tokens if self.output_tokens else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "seconds": round(self.seconds, 4),
            "cpu_s": round(self.cpu_s, 3),
            "tok_s": round(self.tok_s, 2),
            "cpu_s_per_token": round(self.cpu_s_per_token, 7),
        }


def schedule(systems: Sequence[str], runs: int, *, alternate: bool = False) -> list[tuple[int, str]]:
    """The order of the timed runs: round by round, every system once per round in the given order; with
    `alternate`, in the reverse order every second round (the 2nd, 4th, ...), so that over the rounds no system
    is always the one run first, or always the one run right after another."""
    return [
        (round_, name)
        for round_ in range(1, runs + 1)
        for name in (list(reversed(systems)) if alternate and round_ % 2 == 0 else systems)
    ]


BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
#: The neighbour's own bound: it stops by itself even if the bench is killed without cleaning up.
NEIGHBOUR_LIMIT_S = 1800.0


@contextlib.contextmanager
def busy_neighbour(limit_s: float = NEIGHBOUR_LIMIT_S) -> Iterator[subprocess.Popen[bytes]]:
    """Another process saturating one core (a bounded busy loop) for the duration of the block."""
    proc = processes.start([sys.executable, "-c", BUSY_LOOP, str(limit_s)], Path(os.devnull))
    try:
        yield proc
    finally:
        processes.stop([proc])


RUNNABLE = frozenset("RSD")  # states of a process not (yet) stopped; gone, zombie or "T"/"t" are done


def _wait_for(done: Callable[[], bool], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.001)


@contextlib.contextmanager
def paused(roots: Sequence[int], wait_s: float = 2.0) -> Iterator[list[int]]:
    """The processes of these trees stopped (SIGSTOP) for the block and continued (SIGCONT) after, whatever
    happens in it. The bench keeps every system loaded for the whole session, and an idle system is not idle: a
    loaded vLLM's processes took about a tenth of a core doing nothing (its engine core polls), enough to slow
    the team of OpenMP threads of whichever system is being timed. Yields the pids stopped, once each is seen
    stopped (a signal takes effect when its target is next scheduled, not when kill returns) or `wait_s` has
    passed: one in uninterruptible sleep stops only when it wakes, and the run need not wait for that. Likewise
    returns once each is seen going on again, or after `wait_s`."""
    stopped: list[int] = []
    try:
        for root in roots:
            for pid in tree_pids(root):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
        _wait_for(lambda: all(process_state(pid) not in RUNNABLE for pid in stopped), wait_s)
        yield stopped
    finally:
        for pid in reversed(stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        _wait_for(lambda: all(process_state(pid) != "T" for pid in stopped), wait_s)


def run_rounds(
    workload: str,
    requests: Sequence[BenchRequest],
    systems: Sequence[System],
    runs: int,
    report: Callable[[RunRecord], None] = lambda record: None,
    *,
    warm_up: bool = True,
    neighbour: bool = False,
    pause_idle: bool = True,
) -> tuple[list[RunRecord], dict[str, list[dict[str, list[int]]]]]:
    """Every system's warm-up, then the alternated timed runs; the records and each system's outputs per run.
    With `neighbour`, each timed run has a busy-loop process beside it (started just before, stopped after).
    With `pause_idle`, the other systems' processes are paused during each timed run (see `paused`)."""
    by_name = {s.name: s for s in systems}
    if warm_up:
        warm = warmup_requests(requests)
        for system in systems:
            system.run(warm, f"{workload}-warmup")
    records: list[RunRecord] = []
    outputs: dict[str, list[dict[str, list[int]]]] = {s.name: [] for s in systems}
    cpus = os.cpu_count() or 1
    tag = "-noisy" if neighbour else ""
    for round_, name in schedule([s.name for s in systems], runs):
        idle = [pid for s in systems if s.name != name for pid in s.background_pids()] if pause_idle else []
        load = read_loadavg()
        with paused(idle), busy_neighbour() if neighbour else contextlib.nullcontext():
            busy = machine_busy_s()
            started = time.perf_counter()
            result = by_name[name].run(requests, f"{workload}{tag}-run{round_}")
            wall = time.perf_counter() - started
            busy_after = machine_busy_s()
        short = [r for r in requests if len(result.outputs.get(r.request_id, ())) != r.output_len]
        if short:  # the runs must do the same work, or tok/s compares nothing
            r = short[0]
            raise click.ClickException(
                f"{name} generated {len(result.outputs.get(r.request_id, ()))} tokens for {r.request_id} of "
                f"{workload}, not its {r.output_len} ({len(short)} requests off)"
            )
        others = None
        if busy is not None and busy_after is not None and wall > 0:
            others = max(0.0, (busy_after - busy) - result.cpu_s) / (wall * cpus)
        record = RunRecord(
            workload, round_, name, result.seconds, result.output_tokens, result.cpu_s, load, others, neighbour
        )
        records.append(record)
        outputs[name].append(result.outputs)
        report(record)
    return records, outputs


def medians(records: Sequence[RunRecord]) -> dict[str, float]:
    """Each system's median tok/s over its runs (in order of first appearance)."""
    by_system: dict[str, list[float]] = {}
    for r in records:
        by_system.setdefault(r.system, []).append(r.tok_s)
    return {name: statistics.median(values) for name, values in by_system.items()}


def ratio_against_best(meds: dict[str, float], ours: str = "pagedkv") -> tuple[float | None, str | None]:
    """ours ÷ the fastest other system by median, and which one that is; (None, None) without both."""
    others = {k: v for k, v in meds.items() if k != ours}
    if ours not in meds or not others:
        return None, None
    best = max(others, key=lambda k: others[k])
    return (meds[ours] / others[best] if others[best] > 0 else None), best
