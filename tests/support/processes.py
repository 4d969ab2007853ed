"""The real services as child processes a test can start, kill -9 and start again: redis-server, blockd, an
executor. Fixtures that manage them live in the conftest.py files; these classes are what those fixtures (and
tests that need a process of their own) build on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import redis

from blockd.client import BlockdClient, BlockdUnavailable
from blockd.embedded_redis import EmbeddedRedis
from common import processes
from common.auth import ClientCurve
from common.net import free_port
from executor import protocol as ep
from executor.client import ExecutorClient, ExecutorUnavailable
from tests.support.waiting import wait_for

__all__ = ["BlockdProcess", "ExecutorProcess", "RedisProcess", "free_port", "wait_for"]

T = TypeVar("T")


def _until_it_answers(
    name: str,
    process: subprocess.Popen[bytes],
    ask: Callable[[], T],
    unavailable: type[Exception],
    log: Callable[[], str],
    timeout_s: float,
) -> T:
    """ask() until it answers instead of raising `unavailable`; RuntimeError with the log if the process exits
    first or `timeout_s` passes. (Each ask waits out its own client timeout: no sleep needed between them.)"""

    def alive() -> None:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log()}")

    try:
        return processes.wait_until(processes.answer(ask, unavailable), timeout_s, check=alive, poll_s=0)
    except processes.NotReady:
        raise RuntimeError(f"{name} did not come up:\n{log()}") from None


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

    def __init__(self, args: list[str], log_path: Path, curve: ClientCurve | None = None) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.args = args
        self.log_path = log_path
        self.curve = curve  # the keys its clients use (an operator's), when it serves CURVE
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        self.process = processes.start(
            [sys.executable, "-m", "blockd.main", "--endpoint", self.endpoint, *self.args],
            self.log_path,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        with BlockdClient(self.endpoint, timeout_s=0.5, curve=self.curve) as client:
            _until_it_answers("blockd", self.process, client.pools, BlockdUnavailable, self.log, timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def terminate(self) -> int:
        """SIGTERM (SIGKILL after the grace period); its exit code."""
        assert self.process is not None
        (stopped,) = processes.stop([self.process])
        assert stopped.returncode is not None
        return stopped.returncode

    def client(self, timeout_s: float = 3.0, curve: ClientCurve | None = None) -> BlockdClient:
        return BlockdClient(self.endpoint, timeout_s=timeout_s, curve=curve or self.curve)


class ExecutorProcess:
    """One `pagedkv-executor` process on a free loopback port, serving `model` against the blockd at
    `blockd_endpoint` (small step limits, so the tests' few requests still interleave)."""

    def __init__(
        self, model: Path, blockd_endpoint: str, log_path: Path, *args: str, curve: ClientCurve | None = None
    ) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.log_path = log_path
        self.curve = curve  # the keys its clients use (a gateway's), when it serves CURVE
        command = [
            sys.executable,
            "-m",
            "executor.main",
            "--model",
            str(model),
            "--blockd",
            blockd_endpoint,
            "--bind",
            self.endpoint,
            "--max-num-batched-tokens",
            "64",
            "--max-num-seqs",
            "8",
            *args,
        ]
        self.process = processes.start(command, log_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout_s: float = 60.0) -> ep.Info:
        with ExecutorClient(self.endpoint, timeout_s=0.5, curve=self.curve) as client:
            return _until_it_answers("executor", self.process, client.info, ExecutorUnavailable, self.log, timeout_s)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, timeout_s: float = 30.0) -> ExecutorClient:
        return ExecutorClient(self.endpoint, timeout_s=timeout_s, curve=self.curve)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


#: The blockd tests use tiny blocks (4 tokens) so that short prompts span several; blockd itself allows only the
#: kernels' block sizes unless told otherwise.
TEST_BLOCK_SIZES = "1,2,4,8,16,32,64"
