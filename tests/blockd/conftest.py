"""Fixtures that run the real thing: a redis-server process and blockd processes on loopback (the process
classes are in tests/support/processes.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.processes import TEST_BLOCK_SIZES, BlockdProcess, RedisProcess


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis")
    server.start()
    yield server
    server.server.stop()


@pytest.fixture
def start_blockd(tmp_path: Path) -> Iterator[Callable[..., BlockdProcess]]:
    """start_blockd(*flags): a running blockd with those flags; every one started is killed at teardown."""
    started: list[BlockdProcess] = []

    def start(*args: str) -> BlockdProcess:
        if "--block-sizes" not in args:
            args = (*args, "--block-sizes", TEST_BLOCK_SIZES)
        daemon = BlockdProcess(list(args), tmp_path / f"blockd-{len(started)}.log")
        daemon.start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        if daemon.alive():
            daemon.kill9()
