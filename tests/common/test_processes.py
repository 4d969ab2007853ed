"""common.processes on real child processes: a session of its own with its log, waiting for a probe, the log's
tail, and the stop of a whole group within its one grace period."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from common import processes

#: A child that ignores SIGTERM: only the SIGKILL after the grace period stops it.
STUBBORN = (
    "import signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)"
)


def _wait_for_line(log: Path, text: str) -> None:
    processes.wait_until(lambda: True if text in log.read_text() else None, 10, poll_s=0.01)


def test_a_child_leads_its_own_session_and_logs_to_its_file(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    log.write_text("earlier\n")
    code = "import os, sys; print('leads', os.getsid(0) == os.getpid()); print('err', file=sys.stderr)"
    child = processes.start([sys.executable, "-c", code], log)
    assert child.wait(timeout=30) == 0
    assert log.read_text().splitlines() == ["earlier", "leads True", "err"]  # appended, stderr with stdout


def test_stop_takes_the_whole_group_within_the_grace_period(tmp_path: Path) -> None:
    log = tmp_path / "group.log"
    # A leader that ignores SIGTERM, with a grandchild that does too: only the group's SIGKILL ends both.
    leader = processes.start(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {STUBBORN!r}])\nexec({STUBBORN!r})",
        ],
        log,
    )
    processes.wait_until(lambda: True if log.read_text().count("up") == 2 else None, 30, poll_s=0.01)
    started = time.monotonic()
    (stopped,) = processes.stop([leader], grace_s=0.5)
    assert 0.5 <= time.monotonic() - started < 5
    assert not stopped.clean and stopped.returncode == -signal.SIGKILL
    assert not processes._group_alive(leader.pid)


def test_stop_continues_a_stopped_child_so_it_exits_on_sigterm(tmp_path: Path) -> None:
    child = processes.start([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "c.log")
    os.kill(child.pid, signal.SIGSTOP)
    (stopped,) = processes.stop([child], grace_s=20)
    assert stopped.clean and stopped.returncode == -signal.SIGTERM and stopped.seconds < 10


def test_stop_of_several_shares_one_deadline(tmp_path: Path) -> None:
    children = [processes.start([sys.executable, "-c", STUBBORN], tmp_path / f"{i}.log") for i in range(3)]
    for i in range(3):
        _wait_for_line(tmp_path / f"{i}.log", "up")
    started = time.monotonic()
    stopped = processes.stop(children, grace_s=0.5)
    assert time.monotonic() - started < 1.5 + 1  # one grace period for the three, not three
    assert [s.clean for s in stopped] == [False, False, False]


def test_wait_until_returns_the_answer_raises_on_timeout_and_stops_on_check(tmp_path: Path) -> None:
    answers = iter([None, None, "ready"])
    assert processes.wait_until(lambda: next(answers), 10, poll_s=0) == "ready"
    with pytest.raises(processes.NotReady, match=r"within 0\.05 s"):
        processes.wait_until(lambda: None, 0.05, poll_s=0.01)
    child = processes.start([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "gone.log")

    def alive() -> None:
        if child.poll() is not None:
            raise RuntimeError(f"the child {processes.describe_exit(child.returncode)}")

    with pytest.raises(RuntimeError, match="the child exited with code 3"):
        processes.wait_until(lambda: None, 30, check=alive, poll_s=0.01)


def test_wait_until_notes_a_slow_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "NOTE_EVERY_S", 0.02)
    notes: list[float] = []
    with pytest.raises(processes.NotReady):
        processes.wait_until(lambda: None, 0.2, poll_s=0.01, note=notes.append)
    assert notes and all(0.02 <= n <= 0.5 for n in notes)


def test_answer_turns_unavailable_into_none() -> None:
    def ask() -> int:
        raise ConnectionError

    assert processes.answer(ask, ConnectionError)() is None
    assert processes.answer(lambda: 7, ConnectionError)() == 7
    with pytest.raises(ValueError):
        processes.answer(lambda: int("x"), ConnectionError)()


def test_tail_and_describe_exit(tmp_path: Path) -> None:
    log = tmp_path / "long.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert processes.tail(log, 3) == "line 97\nline 98\nline 99"
    assert processes.tail(log).splitlines() == [f"line {i}" for i in range(100 - processes.LOG_TAIL_LINES, 100)]
    assert processes.tail(tmp_path / "missing.log") == ""
    assert processes.describe_exit(2) == "exited with code 2"
    assert processes.describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
