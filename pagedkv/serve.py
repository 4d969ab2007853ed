"""`pagedkv serve`: a whole local stack (blockd, N executors, the gateway) as child processes of one command.

Children run as `python -m <module>` with this interpreter, so the stack works without the venv on PATH, each
started by common.processes in its own session (a terminal's Ctrl-C reaches only this process, which then stops
them in order: gateway, executors, blockd) and told by the kernel to stop if this process dies without doing so.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, Self

import click
import httpx

from blockd.client import BlockdClient, BlockdUnavailable
from common import net, processes
from common.auth import ClientCurve, KeySet, generate
from common.default_model import default_model_dir, ensure_default_model
from common.processes import STOP_GRACE_S  # by name too: in LocalStack, its `processes` property hides the module
from common.tokenizer_cache import TokenizerResolutionError, resolve
from executor.client import ExecutorClient, ExecutorUnavailable
from gateway import ROUTING_POLICIES, TOOL_CALL_PARSERS  # the package alone: no torch, so --help stays fast

DEVICES = ("cpu", "cuda")
_PROBE_TIMEOUT_S = 0.3


GATEWAY_BIND_TRIES = 3  # a chosen port another process took first: tries with fresh ports


class StackFailed(RuntimeError):
    """The stack could not start, or a child died. `component` names the child (None: not one child's fault)."""

    def __init__(
        self, message: str, *, component: str | None = None, returncode: int | None = None, log_tail: str = ""
    ) -> None:
        super().__init__(message)
        self.component = component
        self.returncode = returncode
        self.log_tail = log_tail


class PortInUse(StackFailed, net.PortInUse):
    """The gateway's port is taken: raised before anything is started."""


def _stderr(line: str) -> None:
    click.echo(line, err=True)


class LocalStack:
    """blockd, `executors` executors and the gateway as child processes; `start()` returns once all are healthy.

    Use as a context manager (`with LocalStack(...) as stack:`), or call start() and stop() yourself. Logs of
    each child go to `<log_dir>/<name>.log`; the state directory (blockd's Redis) is a fresh temporary one,
    removed by stop(), unless `state_dir` is given.
    """

    def __init__(
        self,
        *,
        model_dir: Path | None = None,
        executors: int = 1,
        device: str = "cpu",
        host: str = "127.0.0.1",
        port: int = 8000,
        routing: str = "prefix",
        kv_cache_memory: str | None = None,
        state_dir: Path | None = None,
        persistence: bool = True,
        executor_args: Sequence[str] = (),
        gateway_args: Sequence[str] = (),
        log_dir: Path | None = None,
        startup_timeout_s: float = 300.0,
        progress: Callable[[str], None] | None = _stderr,
        keys: bool = True,
        tensor_parallel_size: int = 1,
        expert_parallel: bool = False,
    ) -> None:
        if executors < 1:
            raise ValueError(f"executors must be at least 1, not {executors}")
        if device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, not {routing!r}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is out of range")
        self._given_model_dir = Path(model_dir).expanduser().resolve() if model_dir is not None else None
        self.executors = executors
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, not {tensor_parallel_size}")
        self.tensor_parallel_size = tensor_parallel_size  # devices (processes) per executor
        self.expert_parallel = expert_parallel
        self.device = device
        self.host = host
        self.port = port
        self._port_chosen = False  # port 0 asked: start() chose one (and may choose again: GATEWAY_BIND_TRIES)
        self.routing = routing
        self.kv_cache_memory = kv_cache_memory
        self._given_state_dir = Path(state_dir).expanduser().resolve() if state_dir is not None else None
        self.persistence = persistence
        self.executor_args = tuple(executor_args)
        self.gateway_args = tuple(gateway_args)
        self._given_log_dir = Path(log_dir).expanduser().resolve() if log_dir is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.keys = keys  # a CURVE key set of its own (<state-dir>/keys) for blockd, executors and gateway
        self._progress = progress or (lambda _line: None)
        self._state_dir: Path | None = None
        self._owns_state_dir = False
        self._blockd_port: int | None = None
        self._executor_ports: list[int] = []
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._last_health = "no answer yet"
        self._started = False
        self._stopped = False

    # ------------------------------------------------------------------------------------------ properties

    @property
    def model_dir(self) -> Path:
        """The checkpoint served: the one given, or the generated default model's directory."""
        if self._given_model_dir is not None:
            return self._given_model_dir
        return default_model_dir()

    @property
    def model_name(self) -> str:
        """The model name clients ask the gateway for."""
        args = list(self.gateway_args)
        for i, arg in enumerate(args):
            if arg == "--served-model-name" and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith("--served-model-name="):
                return arg.split("=", 1)[1]
        return self.model_dir.name

    @property
    def url(self) -> str:
        """http://host:port of the gateway (a wildcard host becomes loopback, which is where clients here go)."""
        if self.port == 0:
            raise RuntimeError("the gateway's port is chosen by start(): start the stack first")
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API root, for clients' base_url."""
        return self.url + "/v1"

    @property
    def blockd_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self._require(self._blockd_port)}"

    @property
    def executor_endpoints(self) -> list[str]:
        self._require(self._blockd_port)
        return [f"tcp://127.0.0.1:{port}" for port in self._executor_ports]

    @property
    def state_dir(self) -> Path:
        return self._require(self._state_dir)

    @property
    def log_dir(self) -> Path:
        return self._given_log_dir or self.state_dir / "logs"

    @property
    def keys_dir(self) -> Path | None:
        """The stack's key directory (`blockd-cli --keys DIR`, PAGEDKV_KEYS=DIR); None when started without keys."""
        return self.state_dir / "keys" if self.keys else None

    def operator_keys(self) -> ClientCurve | None:
        """The operator's CURVE keys for blockd and executor clients; None without keys."""
        if self.keys_dir is None:
            return None
        return KeySet(self.keys_dir).client("operator")

    @property
    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        """Child name (blockd, executor-0.., gateway) -> its process, for those started so far."""
        return dict(self._processes)

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    @staticmethod
    def _require(value: Any) -> Any:
        if value is None:
            raise RuntimeError("the stack is not started")
        return value

    # ------------------------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Start every child and return once the gateway reports all executors healthy.

        StackFailed (PortInUse for a taken port, before anything starts) when a child exits early or the stack
        is not ready within startup_timeout_s; whatever was started is stopped again first.
        """
        if self._started:
            raise RuntimeError("a LocalStack starts once; make a new one")
        self._started = True
        self._port_chosen = self.port == 0
        if self.port == 0:
            self.port = self._free_port()
        else:
            try:
                net.check_port_free(self.host, self.port)
            except net.PortInUse as exc:
                raise PortInUse(str(exc)) from None
        try:
            self._start()
        except BaseException:  # Ctrl-C included: leave nothing running behind
            self.stop()
            raise

    def _start(self) -> None:
        if self.device == "cuda":
            self._check_cuda()
        model_dir = self._model()
        deadline = time.monotonic() + self.startup_timeout_s  # after generating the default model, if it had to be
        if self._given_state_dir is not None:
            self._state_dir = self._given_state_dir
            self._state_dir.mkdir(parents=True, exist_ok=True)
        else:
            self._state_dir = Path(tempfile.mkdtemp(prefix="pagedkv-serve-"))
            self._owns_state_dir = True
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.keys_dir is not None:
            generate(self.keys_dir, [f"executor-{i}" for i in range(self.executors)], force=True)
        # Not the gateway's port: it listens last, and the kernel may hand that port out until then.
        self._blockd_port, *self._executor_ports = net.free_ports(1 + self.executors, avoid=(self.port,))
        self._progress(
            f"starting blockd and {self.executors} executor(s) of {model_dir} on {self.device}; logs in {self.log_dir}"
        )

        # The gateway's tokenizer is resolved (transformers, in a child process) while the executors load.
        warming = threading.Thread(target=_warm_tokenizer_cache, args=(model_dir,), daemon=True)
        warming.start()
        blockd = ["--endpoint", self.blockd_endpoint, "--state-dir", str(self.state_dir / "blockd")]
        self._spawn("blockd", "blockd.main", blockd if self.persistence else [*blockd, "--no-persistence"])
        for i, endpoint in enumerate(self.executor_endpoints):
            args = [
                "--model",
                str(model_dir),
                "--device",
                f"cuda:{i * self.tensor_parallel_size}" if self.device == "cuda" else "cpu",
                "--blockd",
                self.blockd_endpoint,
                "--bind",
                endpoint,
                "--pool-id",
                f"executor-{i}",
            ]
            if self.kv_cache_memory is not None:
                args += ["--kv-cache-memory", self.kv_cache_memory]
            args += self._parallel_args()
            self._spawn(f"executor-{i}", "executor.main", [*args, *self.executor_args])

        # The gateway starts last, once the executors answer: a failing executor is then reported as itself,
        # not as an unhealthy gateway, and the gateway does not wait on executors still loading.
        probes: dict[str, Callable[[], str | None]] = {"blockd": self._probe_blockd}
        for i, endpoint in enumerate(self.executor_endpoints):
            probes[f"executor-{i}"] = lambda endpoint=endpoint: self._probe_executor(endpoint)
        self._wait_ready(probes, deadline)

        # A port chosen free here can be taken by another process before the gateway binds it: then it tries
        # another (never a port the caller gave).
        for attempt in range(GATEWAY_BIND_TRIES):
            try:
                self._start_gateway(model_dir, warming, deadline)
                return
            except StackFailed as exc:
                taken = exc.component == "gateway" and "Address already in use" in exc.log_tail
                if not (taken and self._port_chosen) or attempt == GATEWAY_BIND_TRIES - 1:
                    raise
                self._progress(f"port {self.port} was taken before the gateway bound it: trying another")
                self._processes.pop("gateway", None)
                self.port = self._free_port()

    def _free_port(self) -> int:
        return net.free_ports(1, self.host if self.host not in ("", "::") else "127.0.0.1")[0]

    def _start_gateway(self, model_dir: Path, warming: threading.Thread, deadline: float) -> None:
        gateway = [
            "--model",
            str(model_dir),
            "--executors",
            ",".join(self.executor_endpoints),
            "--blockd",
            self.blockd_endpoint,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--routing",
            self.routing,
            *self.gateway_args,
        ]
        warming.join(max(0.0, deadline - time.monotonic()))
        self._spawn("gateway", "gateway.main", gateway)
        self._wait_ready({"gateway": self._probe_gateway}, deadline)

    def _parallel_args(self) -> list[str]:
        """An executor of several devices: a tensor-parallel group (executor/parallel.py), one pool at blockd."""
        if self.tensor_parallel_size == 1:
            return []
        args = ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        return [*args, "--enable-expert-parallel"] if self.expert_parallel else args

    def _check_cuda(self) -> None:
        import torch  # only here: --help and CPU stacks need no CUDA probe

        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        needed = self.executors * self.tensor_parallel_size
        if available < needed:
            raise StackFailed(
                f"{self.executors} executor(s) of {self.tensor_parallel_size} device(s) on cuda need {needed} CUDA "
                f"devices, but this machine has {available}"
            )

    def _model(self) -> Path:
        if self._given_model_dir is not None:
            if not self._given_model_dir.is_dir():
                raise StackFailed(f"model directory {self._given_model_dir} does not exist")
            return self._given_model_dir
        if not (default_model_dir() / "config.json").is_file():
            self._progress(f"generating the default model in {default_model_dir()} (once)")
        # Here in the parent, so the children find it complete instead of each generating it.
        return ensure_default_model()

    def _spawn(self, name: str, module: str, args: list[str]) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PAGEDKV_KEYS", None)
        if self.keys_dir is not None:
            env["PAGEDKV_KEYS"] = str(self.keys_dir)  # each child reads its own key and trusts the others'
        if self.device == "cpu" and name.startswith("executor-") and "OMP_NUM_THREADS" not in os.environ:
            # Executors on one CPU share its cores: torch would otherwise give each of them all of them.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.executors))
        self._processes[name] = processes.start(
            [sys.executable, "-m", module, *args], self.log_path(name), env=env, die_with_parent=True
        )

    def _wait_ready(self, probes: dict[str, Callable[[], str | None]], deadline: float) -> None:
        """Poll each probe (None: not ready; a string: ready, with what to say) until all are ready."""
        waiting = dict(probes)

        def all_ready() -> bool | None:
            for name, probe in list(waiting.items()):
                note = probe()
                if note is not None:
                    del waiting[name]
                    self._progress(f"{name} ready: {note}")
            return None if waiting else True

        def still_waiting(seconds: float) -> None:
            self._progress(f"still waiting for {', '.join(waiting)} ({seconds:.0f} s)")

        try:
            processes.wait_until(all_ready, max(0.0, deadline - time.monotonic()), check=self.check, note=still_waiting)
        except processes.NotReady:
            tails = "\n".join(
                f"--- {name} ({self.log_path(name)}) ---\n{processes.tail(self.log_path(name))}" for name in waiting
            )
            detail = f"; gateway /health said: {self._last_health}" if "gateway" in waiting else ""
            raise StackFailed(
                f"the stack was not ready within {self.startup_timeout_s:g} s: still waiting for "
                f"{', '.join(waiting)}{detail}\n{tails}",
                component=next(iter(waiting)),
                log_tail=tails,
            ) from None

    def _probe_blockd(self) -> str | None:
        with BlockdClient(self.blockd_endpoint, timeout_s=_PROBE_TIMEOUT_S, curve=self.operator_keys()) as client:
            try:
                client.pools()
            except BlockdUnavailable:
                return None
        return self.blockd_endpoint

    def _probe_executor(self, endpoint: str) -> str | None:
        with ExecutorClient(endpoint, timeout_s=_PROBE_TIMEOUT_S, curve=self.operator_keys()) as client:
            try:
                info = client.info()
            except ExecutorUnavailable:
                return None
        return f"{endpoint}, {info.device}, {info.num_blocks} KV blocks of {info.block_size} tokens"

    def _probe_gateway(self) -> str | None:
        try:
            response = httpx.get(f"{self.url}/health", timeout=2.0)
            body = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            self._last_health = f"{type(exc).__name__}: {exc}"
            return None
        self._last_health = f"{response.status_code} {body}"
        executors = body.get("executors") if isinstance(body, dict) else None
        self._check_refused(body, executors)
        healthy = [e for e in executors or [] if isinstance(e, dict) and e.get("healthy") is True]
        if response.status_code == 200 and len(executors or []) == self.executors == len(healthy):
            return f"{self.base_url} (model {self.model_name})"
        return None

    def _check_refused(self, body: Any, executors: Any) -> None:
        """StackFailed when the gateway refused an executor (another model: e.g. a tokenizer larger than the
        executor's vocabulary). That is final: the stack waits for every executor, and the refused one stays
        out of rotation, so waiting on would only print "still waiting for gateway" until the timeout."""
        refused = [e for e in executors or [] if isinstance(e, dict) and e.get("refused")]
        if not refused:
            return
        reasons = "\n".join(f"  {e.get('endpoint')}: {e['refused']}" for e in refused)
        summary = (
            "it refused every executor"
            if len(refused) == len(executors)
            else f"it refused {len(refused)} of {len(executors)} executors"
        )
        tail = processes.tail(self.log_path("gateway"))
        raise StackFailed(
            f"the gateway cannot serve with these executors: {summary}, because\n{reasons}\n"
            f"the last lines of {self.log_path('gateway')}:\n{tail}",
            component="gateway",
            log_tail=tail,
        )

    def check(self) -> None:
        """StackFailed naming the first child that has exited (with its exit code and log tail), if any."""
        for name, process in self._processes.items():
            code = process.poll()
            if code is not None:
                tail = processes.tail(self.log_path(name))
                raise StackFailed(
                    f"{name} {processes.describe_exit(code)}; the last lines of {self.log_path(name)}:\n{tail}",
                    component=name,
                    returncode=code,
                    log_tail=tail,
                )

    def kill(self, name: str) -> None:
        """SIGKILL one child (as a crash would): blockd, executor-N or gateway."""
        if name not in self._processes:
            raise KeyError(f"no child named {name!r}; there are {', '.join(self._processes) or 'none'}")
        process = self._processes[name]
        if process.poll() is None:
            process.kill()
            process.wait()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the gateway, then the executors, then blockd, each tier (with what it left in its process
        groups) waited for up to grace_s before SIGKILL; then remove the state directory if it is a temporary one.
        Safe to call more than once."""
        if self._stopped:
            return
        self._stopped = True
        tiers = [["gateway"], [n for n in self._processes if n.startswith("executor-")], ["blockd"]]
        for tier in tiers:
            processes.stop([self._processes[n] for n in tier if n in self._processes], grace_s)
        if self._owns_state_dir and self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------ CLI


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived."""


def _curl_example(stack: LocalStack) -> str:
    payload = json.dumps(
        {"model": stack.model_name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}
    )
    auth = " -H 'Authorization: Bearer $API_KEY'" if "--api-key" in stack.gateway_args else ""
    return f"curl {stack.base_url}/chat/completions -H 'Content-Type: application/json'{auth} -d {shlex.quote(payload)}"


@click.command("serve", context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint directory (config.json, safetensors, tokenizer). Default: the generated default "
    "model (see `pagedkv make-model`), created on first use.",
)
@click.option(
    "--executors",
    type=click.IntRange(min=1),
    default=1,
    help="Executor processes; on cuda one per device (cuda:0, cuda:1, ...).",
)
@click.option("--device", type=click.Choice(DEVICES), default="cpu", help="Where the executors run the model.")
@click.option("--host", default="127.0.0.1", help="Address the HTTP API listens on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, help="HTTP port (0: any free port).")
@click.option(
    "--routing",
    type=click.Choice(ROUTING_POLICIES),
    default="prefix",
    help="How the gateway picks an executor: prefix (the one holding the longest cached prefix), "
    "least-loaded or round-robin.",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(TOOL_CALL_PARSERS),
    default="auto",
    help="How the gateway finds tool calls in the model's output: hermes, llama3_json, none; auto: by the "
    "model's chat template.",
)
@click.option(
    "--kv-cache-memory",
    default=None,
    help="KV cache of each executor: bytes like 2GiB, or on cuda a fraction of free memory like 0.9. "
    "Default: the executor's (256MiB on cpu, 0.9 on cuda).",
)
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
    default="auto",
    help="KV cache element type of each executor (its --kv-cache-dtype): fp8 blocks take half the bytes of float16.",
)
@click.option(
    "--speculative-config",
    default=None,
    help="Speculative decoding of each executor (its --speculative-config, vLLM's JSON), e.g. "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'.',
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where blockd keeps its prefix index (embedded Redis) and the logs, kept after exit. "
    "Default: a temporary directory, removed on exit.",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where each process logs (blockd.log, executor-N.log, gateway.log). Default: <state-dir>/logs.",
)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help="An API key clients must send (Authorization: Bearer KEY); repeatable. Needed with a --host beyond "
    "loopback unless --insecure.",
)
@click.option(
    "--tensor-parallel-size",
    type=click.IntRange(min=1),
    default=1,
    help="Devices each executor spans (its heads, MLP rows and vocabulary split over them); on cuda executor i "
    "takes cuda:i*N .. cuda:i*N+N-1, on cpu N processes share the cores.",
)
@click.option(
    "--enable-expert-parallel",
    is_flag=True,
    help="With --tensor-parallel-size: split MoE experts whole by rank instead of slicing every expert.",
)
@click.option(
    "--scheduling-policy",
    type=click.Choice(["fcfs", "priority"]),
    default="fcfs",
    help="The executors' (see pagedkv-executor --help): priority lets requests' `priority` order the queue and "
    "preempt worse-ranked ones.",
)
@click.option("--insecure", is_flag=True, help="Serve an open API on a --host beyond loopback.")
def serve(
    model_dir: Path | None,
    executors: int,
    device: str,
    host: str,
    port: int,
    routing: str,
    tool_call_parser: str,
    kv_cache_memory: str | None,
    kv_cache_dtype: str,
    speculative_config: str | None,
    state_dir: Path | None,
    log_dir: Path | None,
    api_keys: tuple[str, ...],
    tensor_parallel_size: int,
    enable_expert_parallel: bool,
    scheduling_policy: str,
    insecure: bool,
) -> None:
    """Run a whole local stack: blockd, executors and the OpenAI-compatible gateway, until Ctrl-C.

    Prints the URL, the model name and a curl example once everything is healthy. Ctrl-C (or SIGTERM) stops
    every process cleanly and exits 0; if a process dies while serving, the rest are stopped and the exit
    status is 1.
    """
    stack = LocalStack(
        model_dir=model_dir,
        executors=executors,
        device=device,
        host=host,
        port=port,
        routing=routing,
        kv_cache_memory=kv_cache_memory,
        state_dir=state_dir,
        log_dir=log_dir,
        tensor_parallel_size=tensor_parallel_size,
        expert_parallel=enable_expert_parallel,
        executor_args=[
            *([] if kv_cache_dtype == "auto" else ["--kv-cache-dtype", kv_cache_dtype]),
            *([] if scheduling_policy == "fcfs" else ["--scheduling-policy", scheduling_policy]),
            *([] if speculative_config is None else ["--speculative-config", speculative_config]),
        ],
        gateway_args=[
            *(a for key in api_keys for a in ("--api-key", key)),
            *(["--insecure"] if insecure else []),
            *([] if tool_call_parser == "auto" else ["--tool-call-parser", tool_call_parser]),
        ],
    )

    def interrupted(_signum: int, _frame: FrameType | None) -> None:
        # Once: a second Ctrl-C must not cut the orderly shutdown short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _Interrupted

    previous = {s: signal.signal(s, interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            stack.start()
            temporary = state_dir is None and log_dir is None
            pids = " ".join(f"{name}={process.pid}" for name, process in stack.processes.items())
            click.echo(
                f"\npagedkv is serving {stack.model_name} with {executors} executor(s) on {device}\n\n"
                f"  url        {stack.url}\n"
                f"  api        {stack.base_url}\n"
                f"  model      {stack.model_name}\n"
                f"  logs       {stack.log_dir}{' (removed on exit)' if temporary else ''}\n"
                f"  keys       {stack.keys_dir} (blockd-cli --endpoint {stack.blockd_endpoint} --keys "
                f"{stack.keys_dir})\n"
                f"  processes  {pids}\n\n"
                f"Try:\n  {_curl_example(stack)}\n\n"
                "Ctrl-C stops everything."
            )
            while True:
                stack.check()
                time.sleep(0.5)
        except _Interrupted:
            click.echo("stopping...", err=True)
            stack.stop()
            click.echo("stopped", err=True)
        except StackFailed as exc:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stack.stop()
            message = str(exc)
            if state_dir is None and log_dir is None and stack.processes:
                message += "\n(the logs were in a temporary directory, now removed: keep them with --log-dir)"
            raise click.ClickException(message) from None
        finally:
            stack.stop()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _warm_tokenizer_cache(model_dir: Path) -> None:
    with contextlib.suppress(TokenizerResolutionError, OSError):  # a failure is the gateway's to report
        resolve(model_dir)


if __name__ == "__main__":
    serve()
