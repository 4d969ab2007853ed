"""`pagedkv serve` and LocalStack: startup, failure reporting, clean shutdown, nothing left running."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from common.net import check_port_free, free_ports
from pagedkv.cli import main
from pagedkv.serve import LocalStack, PortInUse, StackFailed
from pagedkv.tools.model_gen import write_model
from tests.support.models import TINY
from tests.support.waiting import wait_for

SERVE = [sys.executable, "-m", "pagedkv.serve"]  # serve.py has its own __main__ guard (so has cli.py)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("serve-model") / "tiny-serve", arch="llama", quiet=True, **TINY)


@pytest.fixture(scope="module")
def mismatched_model(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """The tiny model's weights (a vocabulary of 512) with the tokenizer of a model twice its vocabulary."""
    root = tmp_path_factory.mktemp("mismatched")
    bigger = write_model(root / "bigger", arch="llama", quiet=True, **{**TINY, "vocab_size": 1024})
    model = root / "tiny-mismatched"
    shutil.copytree(tiny_model, model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(bigger / name, model / name)
    return model


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something listens on for the test's duration."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def running(pid: int) -> bool:
    """Whether pid is a live process (a zombie nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains text."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and running(int(proc.name)):
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(proc.name))
    return found


# ------------------------------------------------------------------------------------------ without a gateway


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    for port in ports:
        check_port_free("127.0.0.1", port)


def test_free_ports_leave_out_the_ports_promised_elsewhere() -> None:
    for _ in range(20):
        promised = free_ports(8)  # free again at once: the kernel may hand any of them out next
        ports = free_ports(8, avoid=promised)
        assert len(set(ports)) == 8 and not set(ports) & set(promised)


def test_busy_port_is_a_clear_error_before_anything_starts(
    tmp_path: Path, busy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_HOME", str(tmp_path / "home"))  # where the default model would be generated
    result = CliRunner().invoke(
        main,
        [
            "serve",
            "--port",
            str(busy_port),
            "--state-dir",
            str(tmp_path / "state"),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
    )
    assert result.exit_code == 1, result.output
    assert f"cannot listen on 127.0.0.1:{busy_port}" in result.output and "--port" in result.output
    assert not (tmp_path / "state").exists() and not (tmp_path / "logs").exists()
    assert not (tmp_path / "home").exists()

    stack = LocalStack(port=busy_port, state_dir=tmp_path / "state", progress=None)
    with pytest.raises(PortInUse):
        stack.start()
    assert stack.processes == {} and not (tmp_path / "state").exists()


def test_help_is_fast_and_complete() -> None:
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for option in (
        "--model",
        "--executors",
        "--device",
        "--host",
        "--port",
        "--routing",
        "--kv-cache-memory",
        "--state-dir",
        "--log-dir",
        "--scheduling-policy",
    ):
        assert option in result.output
    # --help must not pay for torch
    subprocess.run(
        [sys.executable, "-c", "import sys, pagedkv.serve; assert 'torch' not in sys.modules"], check=True, timeout=30
    )
    assert "Usage:" in subprocess.run([*SERVE, "--help"], capture_output=True, text=True, check=True, timeout=30).stdout


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="executors"):
        LocalStack(executors=0)
    with pytest.raises(ValueError, match="device"):
        LocalStack(device="tpu")
    with pytest.raises(ValueError, match="routing"):
        LocalStack(routing="random")
    with pytest.raises(RuntimeError, match="not started"):
        LocalStack().blockd_endpoint  # noqa: B018


def test_more_cuda_executors_than_devices_is_a_clear_error(tmp_path: Path, tiny_model: Path) -> None:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    stack = LocalStack(model_dir=tiny_model, device="cuda", executors=count + 1, port=0, progress=None)
    with pytest.raises(StackFailed, match=f"need {count + 1} CUDA devices, but this machine has {count}"):
        stack.start()
    assert stack.processes == {}


def test_a_child_failing_at_startup_is_named_with_its_log_and_nothing_stays_running(
    tmp_path: Path, tiny_model: Path
) -> None:
    progress: list[str] = []
    stack = LocalStack(
        model_dir=tiny_model,
        executor_args=["--num-blocks", "0"],
        state_dir=tmp_path / "state",
        port=0,
        startup_timeout_s=60,
        progress=progress.append,
    )
    started = time.monotonic()
    with pytest.raises(StackFailed) as failure:
        stack.start()
    assert time.monotonic() - started < 30
    assert failure.value.component == "executor-0" and failure.value.returncode == 2
    assert "--num-blocks" in failure.value.log_tail and "--num-blocks" in str(failure.value)
    assert "executor-0 exited with code 2" in str(failure.value)
    assert set(stack.processes) == {"blockd", "executor-0"}  # the gateway waits for healthy executors
    for name, process in stack.processes.items():
        assert process.returncode is not None, name
        assert not running(process.pid), name
    assert (tmp_path / "state" / "logs" / "executor-0.log").is_file()  # a given state dir is kept
    assert any(line.startswith("blockd ready") for line in progress), progress


def test_a_chosen_port_taken_before_the_gateway_binds_it_is_chosen_again(
    tiny_model: Path, tmp_path: Path, busy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Port 0 asked: the port the stack picks can be taken by another process before the gateway binds it (CI runs
    stacks side by side). The gateway then exits with "Address already in use", and the stack tries a fresh port;
    a port the caller gave is never swapped (test_busy_port_is_a_clear_error_before_anything_starts)."""
    picks = iter([busy_port])
    real = LocalStack._free_port
    monkeypatch.setattr(LocalStack, "_free_port", lambda self: next(picks, None) or real(self))
    progress: list[str] = []
    stack = LocalStack(model_dir=tiny_model, state_dir=tmp_path / "state", port=0, progress=progress.append)
    try:
        stack.start()
        assert stack.port != busy_port
        assert httpx.get(f"{stack.url}/health", timeout=10).status_code == 200
        assert any(f"port {busy_port} was taken" in line for line in progress), progress
    finally:
        stack.stop()


# ---------------------------------------------------------------------------------- end to end (needs gateway)


class ServeProcess:
    """`pagedkv serve` as a subprocess; its stdout and stderr go to files that the test reads."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.out, self.err = tmp_path / "serve.out", tmp_path / "serve.err"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.process = subprocess.Popen(
                [*SERVE, *args], stdout=out, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"}
            )

    def output(self) -> str:
        return f"--- stdout\n{self.out.read_text()}\n--- stderr\n{self.err.read_text()}"

    def wait_ready(self, timeout_s: float = 60.0) -> tuple[str, dict[str, int]]:
        """The URL and the child pids that serve printed once ready."""

        def ready() -> str | None:
            assert self.process.poll() is None, f"serve exited with {self.process.returncode}\n{self.output()}"
            text = self.out.read_text()
            return text if "Ctrl-C stops everything" in text else None

        try:
            text = wait_for(ready, timeout_s, 0.1, "pagedkv serve to print its URL")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.output()}") from None
        url = re.search(r"^\s*url\s+(http://\S+)$", text, re.MULTILINE)
        pids = re.search(r"^\s*processes\s+(.+)$", text, re.MULTILINE)
        assert url and pids, text
        return url.group(1), {name: int(pid) for name, pid in (p.split("=") for p in pids.group(1).split())}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    started: list[ServeProcess] = []

    def start(*args: str) -> ServeProcess:
        started.append(ServeProcess(tmp_path, *args))
        return started[-1]

    yield start
    for process in started:
        process.stop()


def test_serve_runs_a_stack_until_sigint_and_leaves_nothing_running(
    tmp_path: Path, tiny_model: Path, serve_process: Callable[..., ServeProcess]
) -> None:
    state = tmp_path / "state"
    serve = serve_process(
        "--model",
        str(tiny_model),
        "--executors",
        "2",
        "--port",
        "0",
        "--kv-cache-memory",
        "64MiB",
        "--state-dir",
        str(state),
    )
    url, pids = serve.wait_ready()
    assert set(pids) == {"blockd", "executor-0", "executor-1", "gateway"}
    redis_pid = int((state / "blockd" / "redis.pid").read_text())  # blockd's own child
    assert running(redis_pid)
    out = serve.out.read_text()
    assert "model      tiny-serve" in out and f"curl {url}/v1/chat/completions" in out
    assert '"model": "tiny-serve"' in out

    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 200, health.text
    body = health.json()
    assert body["status"] == "ok" and len(body["executors"]) == 2
    assert all(e["healthy"] for e in body["executors"]), body
    models = httpx.get(f"{url}/v1/models", timeout=10)
    assert models.status_code == 200 and "tiny-serve" in [m["id"] for m in models.json()["data"]], models.text

    # The printed curl example works as printed.
    curl = shlex.split(next(line for line in out.splitlines() if line.strip().startswith("curl ")))
    completion = httpx.post(
        curl[1], content=curl[curl.index("-d") + 1], timeout=30, headers=dict([curl[curl.index("-H") + 1].split(": ")])
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["message"]["role"] == "assistant"

    serve.process.send_signal(signal.SIGINT)
    assert serve.process.wait(timeout=20) == 0, serve.output()
    for name, pid in {**pids, "redis": redis_pid}.items():
        assert not running(pid), f"{name} ({pid}) survived\n{serve.output()}"
    assert (state / "logs" / "gateway.log").is_file()  # a given state dir is kept


def test_serve_exits_nonzero_naming_a_child_that_dies(
    tmp_path: Path, tiny_model: Path, serve_process: Callable[..., ServeProcess]
) -> None:
    serve = serve_process("--model", str(tiny_model), "--port", "0", "--kv-cache-memory", "64MiB")
    _, pids = serve.wait_ready()
    os.kill(pids["executor-0"], signal.SIGKILL)
    assert serve.process.wait(timeout=20) == 1, serve.output()
    assert "executor-0 was killed by SIGKILL" in serve.err.read_text()
    for name, pid in pids.items():
        assert not running(pid), f"{name} ({pid}) survived\n{serve.output()}"


def test_serve_fails_fast_saying_why_when_the_gateway_refuses_every_executor(
    tmp_path: Path, mismatched_model: Path, serve_process: Callable[..., ServeProcess]
) -> None:
    # The executors load the weights happily; only the gateway sees that its tokenizer (1024 ids) cannot
    # drive a model of 512. serve used to print "still waiting for gateway" until its 300 s timeout.
    serve = serve_process(
        "--model",
        str(mismatched_model),
        "--executors",
        "2",
        "--port",
        "0",
        "--kv-cache-memory",
        "64MiB",
        "--state-dir",
        str(tmp_path / "state"),
    )
    code = serve.process.wait(timeout=90)
    err = serve.err.read_text()
    assert code == 1, serve.output()
    assert "the gateway cannot serve with these executors: it refused every executor" in err, err
    assert "vocabulary of 512 tokens" in err and "has 1024: another model" in err, err
    assert "the last lines of" in err and "gateway.log" in err and "executor_refused" in err, err
    assert "still waiting for gateway" not in err, err
    assert "Ctrl-C stops everything" not in serve.out.read_text()
    # serve never printed its children's pids: look for any process still serving this checkpoint.
    assert not processes_mentioning(str(tmp_path / "state")), serve.output()
    assert (tmp_path / "state" / "logs" / "gateway.log").is_file()


def test_local_stack_reports_a_refused_executor_within_seconds(tmp_path: Path, mismatched_model: Path) -> None:
    progress: list[str] = []
    stack = LocalStack(
        model_dir=mismatched_model, port=0, kv_cache_memory="64MiB", persistence=False, progress=progress.append
    )
    with pytest.raises(StackFailed) as failure:
        stack.start()
    assert failure.value.component == "gateway" and failure.value.returncode is None
    assert "executor_refused" in failure.value.log_tail
    # Everything was up, and it all stopped again: nothing stays running behind the failure.
    assert set(stack.processes) == {"blockd", "executor-0", "gateway"}
    for name, process in stack.processes.items():
        assert process.returncode is not None and not running(process.pid), name
    gateway_ready = [line for line in progress if line.startswith("still waiting for gateway")]
    assert not gateway_ready, progress  # failed before the first 15 s note


def test_local_stack_api(tmp_path: Path, tiny_model: Path) -> None:
    progress: list[str] = []
    with LocalStack(
        model_dir=tiny_model,
        port=0,
        kv_cache_memory="64MiB",
        routing="round-robin",
        persistence=False,
        log_dir=tmp_path / "logs",
        progress=progress.append,
    ) as stack:
        assert stack.base_url == stack.url + "/v1" and stack.model_name == "tiny-serve"
        assert stack.blockd_endpoint.startswith("tcp://127.0.0.1:") and len(stack.executor_endpoints) == 1
        ready = [line.split()[0] for line in progress[1:] if not line.startswith("still waiting")]  # slow machine
        assert ready == ["blockd", "executor-0", "gateway"], progress
        health = httpx.get(f"{stack.url}/health", timeout=10).json()
        assert [e["endpoint"] for e in health["executors"]] == stack.executor_endpoints
        stack.check()  # all alive

        stack.kill("executor-0")
        with pytest.raises(StackFailed) as failure:
            stack.check()
        assert failure.value.component == "executor-0" and failure.value.returncode == -signal.SIGKILL
        with pytest.raises(KeyError, match="executor-7"):
            stack.kill("executor-7")
        processes, state_dir = stack.processes, stack.state_dir
    assert all(not running(p.pid) for p in processes.values())
    assert not state_dir.exists()  # a temporary state dir goes with the stack
    assert (tmp_path / "logs" / "gateway.log").is_file()  # a given log dir stays
