"""The systems `pagedkv bench peer` compares, and what every mode of it (offline, `--serve`, `--startup`) needs to
run vLLM: the driver's environment, the setup checks, the machine's load.

vLLM runs in a virtual environment of its own (`make peer-env` builds `.venv-peer` with the community CPU build),
never imported here: `VllmSystem` starts `peer_driver.py` under that environment's interpreter and speaks JSON lines
with it (see the driver's docstring). `PagedSystem` is pagedkv's engine in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import click

from common import processes
from common.units import parse_size
from executor.params import SamplingParams
from pagedkv.bench.peer_driver import process_cpu_seconds, tree_cpu_seconds
from pagedkv.bench.throughput import BenchRequest

DRIVER = Path(__file__).with_name("peer_driver.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = Path(".venv-peer") / "bin" / "python"
#: The stop of a server that stops children of its own (`pagedkv serve`: tier by tier, STOP_GRACE_S each; vLLM's
#: engine core) before its group is killed.
SERVER_STOP_GRACE_S = 6 * processes.STOP_GRACE_S
_QUIT_WAIT_S = 30.0  # a driver told to quit shuts vLLM down first


@dataclass
class RunResult:
    """One system's pass over one workload."""

    outputs: dict[str, list[int]]
    seconds: float
    cpu_s: float  # CPU seconds of the system's process tree over the generation

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())


class System(Protocol):
    name: str

    def run(self, requests: Sequence[BenchRequest], salt: str) -> RunResult: ...

    def background_pids(self) -> list[int]:
        """The roots of this system's processes outside the bench's own (paused while another system runs)."""
        ...


def read_loadavg() -> list[float]:
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except (OSError, ValueError):
        return []


class PagedSystem:
    """pagedkv's engine in this process, its pool in a real blockd subprocess."""

    name = "pagedkv"

    def __init__(self, engine: Any, blockd_pid: int) -> None:
        self.engine, self.blockd_pid = engine, blockd_pid

    def _cpu(self) -> float:
        return process_cpu_seconds(os.getpid()) + tree_cpu_seconds(self.blockd_pid)

    def background_pids(self) -> list[int]:
        return [self.blockd_pid]  # the engine is the bench's own process

    def run(self, requests: Sequence[BenchRequest], salt: str) -> RunResult:
        engine = self.engine
        outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
        cut = len(salt) + 1
        cpu0, started = self._cpu(), time.perf_counter()
        for r in requests:
            params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
            engine.add_request(f"{salt}-{r.request_id}", r.prompt, params, cache_salt=salt)
        while engine.has_work():
            for delta in engine.step():
                outputs[delta.request_id[cut:]].extend(delta.token_ids)
        seconds, cpu_s = time.perf_counter() - started, self._cpu() - cpu0
        return RunResult(outputs, seconds, cpu_s)


class DriverError(click.ClickException):
    """The vLLM driver failed or exited; the message quotes its log."""


class VllmSystem:
    """vLLM's `LLM` in a driver process under the vLLM environment's interpreter (one per thread setting)."""

    def __init__(self, name: str, python: Path, driver: Path, env: dict[str, str], log: Path, cwd: Path) -> None:
        self.name, self.log = name, log
        self._log_file = open(log, "ab")
        # Absolute paths, since the driver runs elsewhere; not resolved: a venv's python is a symlink to keep.
        self.process = subprocess.Popen(
            [str(python.absolute()), str(driver.absolute())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env=env,
            cwd=cwd,
            text=True,
            bufsize=1,
        )
        self.info: dict[str, Any] = {}

    def send(self, msg: dict[str, Any]) -> None:
        stdin: IO[str] = self.process.stdin  # type: ignore[assignment]
        try:
            stdin.write(json.dumps(msg) + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def receive(self) -> dict[str, Any]:
        stdout: IO[str] = self.process.stdout  # type: ignore[assignment]
        line = stdout.readline()
        if not line:
            raise self._died()
        reply = json.loads(line)
        if not reply.get("ok"):
            raise DriverError(f"{self.name}: the vLLM driver failed: {reply.get('error')} (its log: {self.log})")
        return reply

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.send(msg)
        return self.receive()

    def _died(self) -> DriverError:
        code = self.process.wait(timeout=30)
        tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
        lines = "\n  ".join(tail) or "(nothing)"
        return DriverError(f"{self.name}: the vLLM driver exited ({code}); the end of its log {self.log}:\n  {lines}")

    def background_pids(self) -> list[int]:
        return [self.process.pid]

    def run(self, requests: Sequence[BenchRequest], salt: str) -> RunResult:
        reply = self.call(
            {
                "op": "generate",
                "requests": [
                    {"id": r.request_id, "prompt": list(r.prompt), "output_len": r.output_len} for r in requests
                ],
                "reset_prefix_cache": True,
            }
        )
        return RunResult({k: list(v) for k, v in reply["outputs"].items()}, reply["seconds"], reply["cpu_s"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.process.poll() is None:
                self.call({"op": "quit"})
        try:
            self.process.wait(timeout=_QUIT_WAIT_S)
        except subprocess.TimeoutExpired:
            processes.stop([self.process])
        self._log_file.close()


def driver_env(bind: str | None) -> dict[str, str]:
    """The driver's environment: this one without PYTHONPATH (pagedkv's packages would shadow vLLM's imports), on
    the CPU, with vLLM's OpenMP threads bound to `bind` (e.g. "0-1"), or vLLM's default ("auto") when None."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_CPU_OMP_THREADS_BIND")}
    env["VLLM_TARGET_DEVICE"] = "cpu"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return env


def check_setup(
    max_num_seqs: int, max_num_batched_tokens: int, kv_cache_memory: str, vllm_python: Path | None
) -> tuple[int, Path]:
    """What every mode of the command checks before starting anything: the limits agree, the KV budget parses,
    the vLLM environment exists. The budget in bytes and the vLLM interpreter, or a clear usage error."""
    if max_num_batched_tokens < max_num_seqs:
        raise click.BadParameter(
            f"{max_num_batched_tokens} is below --max-num-seqs {max_num_seqs}", param_hint="'--max-num-batched-tokens'"
        )
    try:
        budget = parse_size(kv_cache_memory)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--kv-cache-memory'") from None
    python = vllm_python if vllm_python is not None else default_vllm_python()
    if not python.exists():
        raise click.ClickException(
            f"no vLLM environment: {python} does not exist. Build it with `make peer-env`, or give --vllm-python."
        )
    return budget, python


def default_vllm_python() -> Path:
    """PEER_PYTHON in the current directory, else in the repository (where `make peer-env` builds it)."""
    for base in (Path.cwd(), REPO_ROOT):
        if (base / PEER_PYTHON).exists():
            return base / PEER_PYTHON
    return REPO_ROOT / PEER_PYTHON
