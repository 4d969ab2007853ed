"""Fixtures that run the real thing: a redis-server process and blockd processes on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from blockd.client import BlockdClient, BlockdUnavailable
from blockd.embedded_redis import EmbeddedRedis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A real redis-server on a loopback port that a test can kill and start again."""

    def __init__(self, state_dir: Path) -> None:
        self.port = free_port()
        self.server = EmbeddedRedis(state_dir, port=self.port)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self, state_dir: Path | None = None) -> None:
        if state_dir is not None:
            self.server.state_dir = state_dir
        self.server.start()

    def kill(self) -> None:
        self.server.kill()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)

    def pause(self) -> None:
        assert self.server.process is not None
        self.server.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.server.process is not None
        self.server.process.send_signal(signal.SIGCONT)


class BlockdProcess:
    """One blockd daemon process, started with the given flags, that a test can kill -9 and restart."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.args = args
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "blockd.server", "--endpoint", self.endpoint, *self.args],
            stdout=log,
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + timeout_s
        with BlockdClient(self.endpoint, timeout_s=0.5) as client:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"blockd exited with {self.process.returncode}:\n{self.log()}")
                try:
                    client.pools()
                    return
                except BlockdUnavailable:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"blockd did not come up:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def terminate(self) -> int:
        assert self.process is not None
        self.process.terminate()
        return self.process.wait(timeout=20)

    def client(self, timeout_s: float = 3.0) -> BlockdClient:
        return BlockdClient(self.endpoint, timeout_s=timeout_s)


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
def start_blockd(tmp_path: Path) -> Iterator:
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
            daemon.process.kill()  # type: ignore[union-attr]
            daemon.process.wait()  # type: ignore[union-attr]


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "condition"):
    """Poll until predicate() is truthy; return its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
