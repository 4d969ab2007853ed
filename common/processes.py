"""Child processes, one way for `pagedkv serve`, the tools, the benchmarks and the tests: start one in a session of
its own with its output in a log file, wait until a probe answers, read its log's last lines, stop its process group
with one grace period."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

#: Between SIGTERM and SIGKILL.
STOP_GRACE_S = 10.0
#: Between two probes of a child that is not ready yet.
POLL_S = 0.25
#: Lines of a child's log quoted when it fails.
LOG_TAIL_LINES = 20
#: How often a slow wait says what it still waits for.
NOTE_EVERY_S = 15.0
_TAIL_BYTES = 64 * 1024
_GONE_WITHIN_S = 10.0  # a killed group's members are gone within milliseconds; this bounds a stuck one
_GONE_POLL_S = 0.01
_PR_SET_PDEATHSIG = 1


class NotReady(TimeoutError):
    """A child's probe did not answer in time."""


@dataclass(frozen=True)
class Stopped:
    """How a stop went."""

    seconds: float  # from the SIGTERM until the child was gone
    clean: bool  # it exited within the grace period (no SIGKILL needed)
    returncode: int | None


def start(
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    pipe_stderr: bool = False,
    die_with_parent: bool = False,
    file_size_limit: int | None = None,
) -> subprocess.Popen[bytes]:
    """`argv` in a session (so a process group) of its own, stdin closed, stdout and stderr appended to `log`
    (stderr piped instead with `pipe_stderr`). Its own session: a terminal's Ctrl-C reaches only the parent, which
    stops it, and `stop` takes whatever it starts with it. `die_with_parent`: the kernel sends it SIGTERM when the
    parent thread that started it exits. `file_size_limit`: no file it writes grows past this many bytes
    (RLIMIT_FSIZE, SIGXFSZ ignored, so such a write fails with EFBIG as on a full disk: `pagedkv chaos`)."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.PIPE if pipe_stderr else subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_in_child(die_with_parent, file_size_limit) if die_with_parent or file_size_limit else None,
        )


def _in_child(die_with_parent: bool, file_size_limit: int | None) -> Callable[[], None]:
    def setup() -> None:
        if die_with_parent:
            _die_with_parent()
        if file_size_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (an ignored signal stays ignored across exec)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return setup


def _die_with_parent() -> None:
    # In the child between fork and exec. PDEATHSIG fires when the parent *thread* that forked exits: start such a
    # child from a thread that outlives it (the main thread, normally).
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def answer(ask: Callable[[], T], unavailable: type[Exception]) -> Callable[[], T | None]:
    """A probe of `ask`: its answer, or None while it raises `unavailable` (a client that finds nobody there)."""

    def probe() -> T | None:
        try:
            return ask()
        except unavailable:
            return None

    return probe


def wait_until(
    probe: Callable[[], T | None],
    timeout_s: float,
    *,
    check: Callable[[], object] | None = None,
    poll_s: float = POLL_S,
    note: Callable[[float], None] | None = None,
) -> T:
    """`probe()` until it returns something other than None, and that. Before each probe `check()`, which raises to
    stop the wait (a child exited). NotReady once `timeout_s` has passed: the last probe comes after the deadline,
    so a slow probe is never what fails the wait. `note(seconds waited)` every NOTE_EVERY_S meanwhile."""
    started = time.monotonic()
    next_note = started + NOTE_EVERY_S
    while True:
        if check is not None:
            check()
        value = probe()
        if value is not None:
            return value
        now = time.monotonic()
        if now - started > timeout_s:
            raise NotReady(f"not ready within {timeout_s:g} s")
        if note is not None and now >= next_note:
            next_note = now + NOTE_EVERY_S
            note(now - started)
        time.sleep(poll_s)


def tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log (from its last 64 KiB); "" when it cannot be read."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


def describe_exit(code: int) -> str:
    """ "exited with code N", or "was killed by SIGNAME" for a negative return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop(processes: Sequence[subprocess.Popen[Any]], grace_s: float = STOP_GRACE_S) -> list[Stopped]:
    """SIGTERM each process's group (and SIGCONT: a stopped process acts on nothing until continued); SIGKILL
    the group of any still running `grace_s` after (one deadline for them all), and what any leader left in its
    group; returns once every group is empty. A process that leads no group gets the signals alone."""
    started = time.monotonic()
    for process in processes:
        _signal(process, signal.SIGTERM)
        _signal(process, signal.SIGCONT)
    deadline = started + grace_s
    stopped = []
    for process in processes:
        clean = True
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            clean = False
        _signal(process, signal.SIGKILL)
        process.wait()
        stopped.append(Stopped(time.monotonic() - started, clean, process.returncode))
    gone_by = time.monotonic() + _GONE_WITHIN_S
    for process in processes:
        while _group_alive(process.pid) and time.monotonic() < gone_by:
            time.sleep(_GONE_POLL_S)
    return stopped


def _signal(process: subprocess.Popen[Any], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:  # it leads no group (or its group is gone): the process alone, if still there
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(sig)
    except PermissionError:
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: a killed child's orphans wait for their
    reaper (which may be slow to come), holding nothing."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return True
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if state != "Z" and int(pgrp) == pgid:
            return True
    return False
