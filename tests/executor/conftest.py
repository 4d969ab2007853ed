"""Executor tests: a real blockd process per test, checked for leaked blocks at teardown; executor processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.processes import BlockdProcess, ExecutorProcess


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
        executor.stop()
