"""Executor tests: a real blockd process per test, checked for leaked blocks at teardown; executor processes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from executor.client import ExecutorUnavailable
from tests.support.processes import BlockdProcess, ExecutorProcess
from tests.support.waiting import wait_for


@pytest.fixture
def blockd(tmp_path: Path) -> Iterator[BlockdProcess]:
    """A real blockd process (no persistence); at teardown every pool must hold zero blocks."""
    daemon = BlockdProcess(["--no-persistence"], tmp_path / "blockd.log")
    daemon.start()
    yield daemon
    try:
        if daemon.alive():
            with daemon.client() as client:
                stats = client.stats()
                leaks = {p.pool_id: p.blocks_in_use for p in stats.pools if p.blocks_in_use}
                assert not leaks, f"blocks still in use after the test: {leaks}"
                assert client.check() == []
    finally:
        if daemon.alive():
            daemon.kill9()


@pytest.fixture
def start_executor(tmp_path: Path) -> Iterator[Callable[..., ExecutorProcess]]:
    """start_executor(model, blockd_endpoint, *flags): a ready executor process; all are killed at teardown."""
    started: list[ExecutorProcess] = []

    def start(model: Path, blockd_endpoint: str, *args: str) -> ExecutorProcess:
        executor = ExecutorProcess(model, blockd_endpoint, tmp_path / f"executor-{len(started)}.log", *args)
        started.append(executor)
        executor.wait_ready()
        return executor

    yield start
    for executor in started:
        _let_it_hand_blocks_back(executor)
        executor.stop()


def _let_it_hand_blocks_back(executor: ExecutorProcess, timeout_s: float = 10.0) -> None:
    """Gives an idle executor time to send its last frees before the kill: a sequence that finished while
    another ran is freed within a few steps, not at once (the blockd fixture's leak check judges the result)."""
    try:
        with executor.client(timeout_s=2) as client:

            def handed_back() -> bool:
                load = client.load()
                if not load.blockd_reachable or load.running or load.waiting:
                    return True  # not idle: whatever it holds is the test's to explain
                return load.free_blocks == load.num_blocks

            with contextlib.suppress(AssertionError):  # still held: the blockd fixture's leak check says what
                wait_for(handed_back, timeout_s, what="the executor's last frees")
    except ExecutorUnavailable:  # a dead or wedged executor has nothing more to hand back
        return
