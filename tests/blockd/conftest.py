"""Fixtures that run the real thing: a redis-server process and blockd processes on loopback (the process
classes are in tests/support/processes.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.processes import BlockdProcess, RedisProcess


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path / "redis")
    server.start()
    yield server
    server.server.stop()


#: The blockd tests use tiny blocks (4 tokens) so that short prompts span several; blockd itself allows only the
#: kernels' block sizes unless told otherwise.
TEST_BLOCK_SIZES = "1,2,4,8,16,32,64"


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
