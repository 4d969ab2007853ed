"""`pagedkv bench peer --serve`: `vllm serve` and `pagedkv serve` side by side, driven by vLLM's own client.

One server at a time on the same model, KV memory and limits, each driven through every load by `vllm bench
serve` (through `vllm_cli.py` in the vLLM environment) and stopped; reported: both systems' tok/s, TTFT and TPOT
and pagedkv ÷ vLLM. The method: docs/benchmarks.md ("Serving side by side").
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import click

from common import processes
from common.net import free_port
from pagedkv.bench.common import log_tail, table_lines
from pagedkv.bench.peer_systems import SERVER_STOP_GRACE_S, check_setup, driver_env, read_loadavg
from pagedkv.bench.throughput import bench_model

VLLM_CLI = Path(__file__).with_name("vllm_cli.py")
SYSTEMS = ("vllm", "pagedkv")  # the order the servers run in: vLLM's start is the likelier failure, so first
LABELS = {"vllm": "vLLM", "pagedkv": "pagedkv"}
DEFAULT_STARTUP_TIMEOUT_S = 900.0


# ---------------------------------------------------------------------------------------------------- loads


@dataclass(frozen=True)
class Load:
    name: str
    max_concurrency: int | None  # None: no cap (arrivals alone set the load)
    request_rate: float  # math.inf: all requests at once (then max_concurrency caps what is in flight)

    def describe(self) -> str:
        if math.isinf(self.request_rate):
            return f"{self.max_concurrency} in flight at a time (--max-concurrency {self.max_concurrency})"
        return f"Poisson arrivals at {self.request_rate:g} req/s (--request-rate {self.request_rate:g})"

    def client_args(self) -> list[str]:
        args = ["--request-rate", "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"]
        if self.max_concurrency is not None:
            args += ["--max-concurrency", str(self.max_concurrency)]
        return args


LOADS: dict[str, Load] = {
    "concurrent16": Load("concurrent16", 16, math.inf),
    "rate4": Load("rate4", None, 4.0),
}


@dataclass(frozen=True)
class ServeWorkload:
    prompts: int
    input_len: int
    output_len: int
    warmups: int  # requests before each measured load, unmeasured (vLLM's --num-warmups)

    def describe(self) -> str:
        return (
            f"{self.prompts} prompts of {self.input_len} random tokens, {self.output_len} output tokens each "
            f"(ignore_eos), {self.warmups} warm-up requests first"
        )


SERVE_WORKLOAD = ServeWorkload(prompts=200, input_len=256, output_len=64, warmups=16)
QUICK_SERVE_WORKLOAD = ServeWorkload(prompts=16, input_len=32, output_len=8, warmups=4)


# ------------------------------------------------------------------------------------------ vLLM's results


class ResultError(click.ClickException):
    """vLLM's client wrote no result, or one without the figures compared."""


#: The keys of vLLM's result JSON read here -> the names they get (the medians are what the ratios compare).
RESULT_KEYS = {
    "completed": "completed",
    "failed": "failed",
    "duration": "duration_s",
    "total_input_tokens": "input_tokens",
    "total_output_tokens": "output_tokens",
    "request_throughput": "requests_per_s",
    "output_throughput": "output_tok_s",
    "median_ttft_ms": "ttft_p50_ms",
    "p99_ttft_ms": "ttft_p99_ms",
    "median_tpot_ms": "tpot_p50_ms",
    "p99_tpot_ms": "tpot_p99_ms",
    "median_itl_ms": "itl_p50_ms",
    "median_e2el_ms": "e2el_p50_ms",
}
REQUIRED_KEYS = ("completed", "output_throughput", "median_ttft_ms", "median_tpot_ms")


@dataclass
class ServeFigures:
    """One load against one server, as vLLM's client measured it."""

    completed: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    requests_per_s: float
    output_tok_s: float
    ttft_p50_ms: float
    tpot_p50_ms: float
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    e2el_p50_ms: float | None = None
    output_lens: list[int] | None = None  # per request (with --save-detailed)
    errors: list[str] = field(default_factory=list)  # the failed requests' errors (with --save-detailed)
    load_before: list[float] = field(default_factory=list)  # /proc/loadavg just before the client ran

    def as_json(self) -> dict[str, Any]:
        figures = {k: v for k, v in asdict(self).items() if k not in ("output_lens", "errors")}
        figures["errors"] = self.errors[:5]
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}


def parse_result(data: Mapping[str, Any]) -> ServeFigures:
    """The figures of one result JSON of `vllm bench serve --save-result`; ResultError without the ones compared."""
    missing = [k for k in REQUIRED_KEYS if not isinstance(data.get(k), int | float)]
    if missing:
        raise ResultError(f"vLLM's result has no {', '.join(missing)} (keys: {', '.join(sorted(data)) or 'none'})")
    values: dict[str, Any] = {}
    for key, name in RESULT_KEYS.items():
        value = data.get(key)
        values[name] = value if isinstance(value, int | float) and not isinstance(value, bool) else None
    for name in ("completed", "failed", "input_tokens", "output_tokens"):
        values[name] = int(values[name] or 0)
    for name in ("duration_s", "requests_per_s"):
        values[name] = float(values[name] or 0.0)
    lens = data.get("output_lens")
    errors = data.get("errors")
    return ServeFigures(
        **values,
        output_lens=[int(n) for n in lens] if isinstance(lens, list) else None,
        errors=[str(e) for e in errors if e] if isinstance(errors, list) else [],
    )


def read_result(path: Path) -> ServeFigures:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultError(f"vLLM's client wrote no result to {path}") from None
    except (OSError, ValueError) as exc:
        raise ResultError(f"vLLM's result {path} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ResultError(f"vLLM's result {path} is not a JSON object")
    return parse_result(data)


def check_complete(figures: ServeFigures, workload: ServeWorkload, what: str) -> None:
    """A ClickException unless every request completed with exactly its output length: the two systems must do
    the same work, or their figures compare nothing."""
    if figures.failed or figures.completed != workload.prompts:
        first = f"; the first error: {figures.errors[0].strip()[-800:]}" if figures.errors else ""
        raise click.ClickException(
            f"{what}: {figures.completed} of {workload.prompts} requests completed, {figures.failed} failed{first}"
        )
    short = [n for n in figures.output_lens or [] if n != workload.output_len]
    expected = workload.prompts * workload.output_len
    if short or figures.output_tokens != expected:
        raise click.ClickException(
            f"{what}: {figures.output_tokens} output tokens, not {expected} ({workload.prompts} requests of "
            f"{workload.output_len}; {len(short)} requests of another length): is ignore_eos honoured?"
        )


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or not theirs:
        return None
    return round(ours / theirs, 4)


def serve_ratios(ours: ServeFigures, theirs: ServeFigures) -> dict[str, float | None]:
    """pagedkv ÷ vLLM of output tok/s (aim: >= 1), TTFT p50 and TPOT p50 (aim: <= 1)."""
    return {
        "tok_s": _ratio(ours.output_tok_s, theirs.output_tok_s),
        "ttft_p50": _ratio(ours.ttft_p50_ms, theirs.ttft_p50_ms),
        "tpot_p50": _ratio(ours.tpot_p50_ms, theirs.tpot_p50_ms),
    }


def meets_aim(ratios: Mapping[str, float | None]) -> bool | None:
    """tok/s ratio >= 1 and TTFT, TPOT ratios <= 1; None when one is missing."""
    tok, ttft, tpot = ratios.get("tok_s"), ratios.get("ttft_p50"), ratios.get("tpot_p50")
    if tok is None or ttft is None or tpot is None:
        return None
    return tok >= 1.0 and ttft <= 1.0 and tpot <= 1.0


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def comparison_table(results: Mapping[str, Mapping[str, ServeFigures]]) -> list[str]:
    """Per load: a row for each system and one of the ratios pagedkv ÷ vLLM. `results`: load -> system -> figures."""
    columns = ["load", "system", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "TTFT p99 ms", "TPOT p99 ms"]
    rows: list[list[str]] = []
    for load, by_system in results.items():
        for system in SYSTEMS:
            f = by_system.get(system)
            if f is None:
                continue
            rows.append(
                [
                    load,
                    LABELS[system],
                    _cell(f.output_tok_s),
                    _cell(f.ttft_p50_ms),
                    _cell(f.tpot_p50_ms, 2),
                    _cell(f.ttft_p99_ms),
                    _cell(f.tpot_p99_ms, 2),
                ]
            )
        if all(s in by_system for s in SYSTEMS):
            r = serve_ratios(by_system["pagedkv"], by_system["vllm"])
            aim = {True: " (aim met)", False: " (aim missed)", None: ""}[meets_aim(r)]
            rows.append(
                [
                    load,
                    "pagedkv ÷ vLLM" + aim,
                    _cell(r["tok_s"], 2),
                    _cell(r["ttft_p50"], 2),
                    _cell(r["tpot_p50"], 2),
                    "",
                    "",
                ]
            )
    return table_lines(columns, rows, left=2)


# -------------------------------------------------------------------------------------------------- servers


class ServerFailed(click.ClickException):
    pass


def _get_json(url: str, timeout_s: float = 2.0) -> tuple[int, Any]:
    """(status, parsed body) of a GET; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except (OSError, ValueError):
        return 0, None
    try:
        return status, json.loads(body or b"null")
    except ValueError:
        return status, None


class Server:
    """One server process (vLLM's API server, or `pagedkv serve`) in a process group of its own, logging to `log`."""

    def __init__(
        self,
        system: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log: Path,
        port: int,
        model_name: str,
        cwd: Path | None = None,
    ) -> None:
        self.system, self.argv, self.env, self.log, self.cwd = system, list(argv), dict(env), log, cwd
        self.port, self.model_name = port, model_name
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def label(self) -> str:
        return LABELS.get(self.system, self.system)

    def start(self) -> None:
        # Its own process group: stop() takes all it started with it (vLLM's engine core).
        self.process = processes.start(self.argv, self.log, env=self.env, cwd=self.cwd)

    def check(self) -> None:
        """ServerFailed when the server has exited."""
        assert self.process is not None
        code = self.process.poll()
        if code is not None:
            raise ServerFailed(
                f"{self.label} exited with code {code}; the end of its log {self.log}:\n{log_tail(self.log)}"
            )

    def wait_ready(self, timeout_s: float, progress: Callable[[str], None]) -> float:
        """Seconds until /health answers 200 and /v1/models lists the model; ServerFailed when the server exits,
        serves another model, or is not ready in time."""
        started = time.monotonic()
        last = "no answer yet"

        def ready() -> bool | None:
            nonlocal last
            status, _ = _get_json(self.url + "/health")
            if status == 200:
                status, body = _get_json(self.url + "/v1/models")
                models = [m.get("id") for m in (body or {}).get("data", []) if isinstance(m, dict)]
                if status == 200 and self.model_name in models:
                    return True
                if status == 200 and models:
                    raise ServerFailed(
                        f"{self.label} serves {', '.join(map(str, models))}, not {self.model_name} (the name the "
                        f"client asks for); its log: {self.log}"
                    )
                last = f"/v1/models answered {status}"
            elif status:
                last = f"/health answered {status}"
            return None

        def note(seconds: float) -> None:
            progress(f"  still waiting for {self.label} ({seconds:.0f} s, {last})")

        try:
            processes.wait_until(ready, timeout_s, check=self.check, note=note)
        except processes.NotReady:
            raise ServerFailed(
                f"{self.label} was not ready within {timeout_s:g} s ({last}); the end of its log "
                f"{self.log}:\n{log_tail(self.log)}"
            ) from None
        return time.monotonic() - started

    def stop(self, grace_s: float = SERVER_STOP_GRACE_S) -> None:
        if self.process is not None:
            processes.stop([self.process], grace_s)

    @contextlib.contextmanager
    def running(self, timeout_s: float, progress: Callable[[str], None]) -> Iterator[float]:
        """Start, wait until ready (yielding the seconds that took), and stop whatever happens."""
        try:
            self.start()
            yield self.wait_ready(timeout_s, progress)
        finally:
            progress(f"stopping {self.label}")
            self.stop()


@dataclass(frozen=True)
class ServeSetup:
    """What both servers share and how each is started."""

    model_dir: Path
    model_name: str
    kv_cache_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    vllm_python: Path
    vllm_cli: Path
    vllm_bind: str | None  # VLLM_CPU_OMP_THREADS_BIND, or None for vLLM's default
    vllm_eager: bool
    pagedkv_threads: int | None  # OMP_NUM_THREADS of pagedkv's executor (None: pagedkv serve's choice)
    pagedkv_env: Mapping[str, str] = field(default_factory=dict)  # --serve-pagedkv-env, over the bench's own


def vllm_server(setup: ServeSetup, port: int, log: Path, cwd: Path) -> Server:
    argv = [
        str(setup.vllm_python.absolute()),  # not resolved: a venv's python is a symlink to keep
        str(setup.vllm_cli.absolute()),
        "serve",
        str(setup.model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        setup.model_name,
        "--tokenizer",
        str(setup.model_dir),
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--kv-cache-memory-bytes",
        str(setup.kv_cache_bytes),
        "--max-num-seqs",
        str(setup.max_num_seqs),
        "--max-num-batched-tokens",
        str(setup.max_num_batched_tokens),
        "--enable-prefix-caching",
        "--disable-uvicorn-access-log",  # pagedkv's gateway logs no accesses either
    ]
    if setup.vllm_eager:
        argv.append("--enforce-eager")
    # cwd: a folder of its own, where no package of pagedkv's (kernels, executor) shadows one of vLLM's imports.
    return Server(
        "vllm", argv, env=driver_env(setup.vllm_bind), log=log, port=port, model_name=setup.model_name, cwd=cwd
    )


def pagedkv_server(setup: ServeSetup, port: int, log: Path, log_dir: Path) -> Server:
    argv = [
        sys.executable,
        "-m",
        "pagedkv.cli",
        "serve",
        "--model",
        str(setup.model_dir),
        "--executors",
        "1",
        "--port",
        str(port),
        "--kv-cache-memory",
        str(setup.kv_cache_bytes),
        "--log-dir",
        str(log_dir),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKV_EXECUTOR_")}
    # `pagedkv serve` has no flags for these; its executor reads every option from PAGEDKV_EXECUTOR_<NAME>.
    env |= {
        "PAGEDKV_EXECUTOR_MAX_NUM_SEQS": str(setup.max_num_seqs),
        "PAGEDKV_EXECUTOR_MAX_NUM_BATCHED_TOKENS": str(setup.max_num_batched_tokens),
        "PAGEDKV_EXECUTOR_BLOCK_SIZE": str(setup.block_size),
        "PAGEDKV_EXECUTOR_DTYPE": "float32",
        "PAGEDKV_EXECUTOR_SEED": "0",
    }
    if setup.pagedkv_threads is not None:
        env["OMP_NUM_THREADS"] = str(setup.pagedkv_threads)
    env |= setup.pagedkv_env
    return Server("pagedkv", argv, env=env, log=log, port=port, model_name=setup.model_name)


#: What the gateway's log says of load held: steps that ran past --executor-timeout (kept in rotation), executors
#: taken for lost, streams failed, requests refused at the door.
GATEWAY_EVENTS = ("executor_step_long", "executor_out_of_rotation", "stream_failed", "request_refused")


def gateway_events(log: Path) -> dict[str, int]:
    """Counts of GATEWAY_EVENTS in the gateway's JSON log."""
    counts = dict.fromkeys(GATEWAY_EVENTS, 0)
    with contextlib.suppress(OSError), open(log, errors="replace") as lines:
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") in counts:
                counts[entry["event"]] += 1
    return counts


def pagedkv_env(assignments: Sequence[str]) -> dict[str, str]:
    """--serve-pagedkv-env's NAME=VALUE pairs; a bad one is a usage error."""
    env = {}
    for assignment in assignments:
        name, equals, value = assignment.partition("=")
        if not equals or not name.startswith("PAGEDKV_"):
            raise click.BadParameter(f"{assignment!r} is not PAGEDKV_NAME=VALUE", param_hint="'--serve-pagedkv-env'")
        env[name] = value
    return env


# --------------------------------------------------------------------------------------------------- client


def client_argv(
    setup: ServeSetup,
    server: Server,
    load: Load,
    workload: ServeWorkload,
    seed: int,
    result_dir: Path,
    result_name: str,
) -> list[str]:
    """`vllm bench serve` against `server` for one load (through vllm_cli.py, by the vLLM environment)."""
    return [
        str(setup.vllm_python.absolute()),
        str(setup.vllm_cli.absolute()),
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        setup.model_name,
        "--tokenizer",
        str(setup.model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(workload.input_len),
        "--random-output-len",
        str(workload.output_len),
        "--num-prompts",
        str(workload.prompts),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--num-warmups",
        str(workload.warmups),
        *load.client_args(),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_name,
    ]


def run_client(argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path, timeout_s: float) -> None:
    """Run vLLM's client to its end, its output to `log`, in a process group that goes with it on any error."""
    process = processes.start(argv, log, env=env, cwd=cwd)
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise click.ClickException(
            f"vLLM's client did not finish within {timeout_s:g} s; the end of its log {log}:\n{log_tail(log)}"
        ) from None
    finally:
        if process.poll() is None:
            processes.stop([process])
    if code != 0:
        raise click.ClickException(f"vLLM's client exited with code {code}; the end of its log {log}:\n{log_tail(log)}")


def load_seed(seed: int, load: str) -> int:
    """Each load's dataset seed: the same for both servers, another for each load (no load finds the previous
    one's prompts in the prefix cache)."""
    return seed + list(LOADS).index(load)


# -------------------------------------------------------------------------------------------------- command


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while the bench runs, so the servers are stopped as after Ctrl-C."""

    def interrupted(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupted)
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _work_dir(progress: Callable[[str], None]) -> Iterator[Path]:
    """A temporary folder for the servers' and the client's logs and results: removed after a run that succeeded,
    kept (and named) after one that did not."""
    path = Path(tempfile.mkdtemp(prefix="pagedkv-bench-peer-serve-"))
    try:
        yield path
    except BaseException:
        progress(f"the logs are kept in {path}")
        raise
    shutil.rmtree(path, ignore_errors=True)


def run_serve_bench(
    *,
    loads: Sequence[str],
    prompts: int | None,
    quick: bool,
    vllm_python: Path | None,
    vllm_cli: Path,
    vllm_threads: str,
    bind_cpus: str,
    vllm_eager: bool,
    model_dir: Path | None,
    kv_cache_memory: str,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    threads: int | None,
    seed: int,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    client_timeout_s: float | None = None,
    pagedkv_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The whole `--serve` run; prints the tables and, last on stdout, the JSON object it returns."""
    echo = click.echo

    def progress(line: str) -> None:
        click.echo(line, err=True)

    workload = QUICK_SERVE_WORKLOAD if quick else SERVE_WORKLOAD
    if prompts is not None:
        workload = ServeWorkload(prompts, workload.input_len, workload.output_len, workload.warmups)
    names = list(LOADS) if "all" in loads else [n for n in LOADS if n in loads]
    if vllm_threads == "both":
        raise click.BadParameter(
            "--serve runs one vLLM setting: default or bind (the default with --serve)", param_hint="'--vllm-threads'"
        )
    budget, python = check_setup(max_num_seqs, max_num_batched_tokens, kv_cache_memory, vllm_python)
    model_dir, config = bench_model(model_dir)
    model_dir = Path(model_dir).resolve()
    bind = bind_cpus if vllm_threads == "bind" else None
    setup = ServeSetup(
        model_dir=model_dir,
        model_name=model_dir.name,  # what pagedkv's gateway calls it; vLLM gets it as --served-model-name
        kv_cache_bytes=budget,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        vllm_python=python,
        vllm_cli=vllm_cli,
        vllm_bind=bind,
        vllm_eager=vllm_eager,
        pagedkv_threads=threads,
        pagedkv_env=dict(pagedkv_env or {}),
    )
    if client_timeout_s is None:  # generous: a starved 2-core machine, and 4 req/s takes prompts / 4 s at least
        client_timeout_s = 600.0 + workload.prompts * workload.output_len * 0.5

    vllm_threads_text = f"VLLM_CPU_OMP_THREADS_BIND={bind}" if bind else "its default threads"
    echo(
        f"model:    {model_dir} ({config.architecture}, {config.num_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}), served as {setup.model_name}; cpu, float32; {os.cpu_count()} cores"
    )
    echo(
        f"limits:   KV {budget / 2**30:.3g} GiB each, max_num_seqs {max_num_seqs}, max_num_batched_tokens "
        f"{max_num_batched_tokens}, prefix caching on; pagedkv: 1 executor, blocks of {block_size}"
        + (f", {threads} threads" if threads else "")
        + "".join(f", {name}={value}" for name, value in setup.pagedkv_env.items())
        + f"; vLLM: {python}, {vllm_threads_text}"
        + (", enforce_eager" if vllm_eager else "")
    )
    echo(f"workload: {workload.describe()}; client: vllm bench serve --backend openai-chat, seed {seed}")
    for name in names:
        echo(f"load {name}: {LOADS[name].describe()}")

    results: dict[str, dict[str, ServeFigures]] = {name: {} for name in names}
    startup_s: dict[str, float] = {}
    gateway_log: dict[str, dict[str, int]] = {}  # per load: gateway_events after it (cumulative)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_as_interrupt())
        tmp = stack.enter_context(_work_dir(progress))
        client_env = driver_env(None)
        for system in SYSTEMS:
            port = free_port()
            if system == "vllm":
                server = vllm_server(setup, port, tmp / "vllm-serve.log", tmp)
            else:
                server = pagedkv_server(setup, port, tmp / "pagedkv-serve.log", tmp / "pagedkv-logs")
            progress(f"starting {server.label} on {server.url} (log: {server.log})")
            with server.running(startup_timeout_s, progress) as ready_s:
                startup_s[system] = round(ready_s, 1)
                progress(f"{server.label} ready in {ready_s:.1f} s")
                for name in names:
                    load = LOADS[name]
                    result_name = f"{system}-{name}.json"
                    log = tmp / f"client-{system}-{name}.log"
                    argv = client_argv(setup, server, load, workload, load_seed(seed, name), tmp, result_name)
                    loadavg = read_loadavg()
                    progress(
                        f"  [{name}] {server.label}: vllm bench serve, {workload.prompts} prompts, "
                        f"{load.describe()} (load before {' '.join(f'{x:.2f}' for x in loadavg) or '?'})"
                    )
                    started = time.monotonic()
                    run_client(argv, client_env, tmp, log, client_timeout_s)
                    server.check()
                    figures = read_result(tmp / result_name)
                    if system == "pagedkv":
                        events = gateway_events(tmp / "pagedkv-logs" / "gateway.log")
                        progress(f"  [{name}] pagedkv's gateway so far: {json.dumps(events)}")
                        gateway_log[name] = events
                    figures.load_before = loadavg
                    check_complete(figures, workload, f"{server.label} under load {name}")
                    results[name][system] = figures
                    progress(
                        f"  [{name}] {server.label}: {figures.output_tok_s:,.1f} output tok/s, TTFT p50 "
                        f"{figures.ttft_p50_ms:,.1f} ms, TPOT p50 {figures.tpot_p50_ms:,.2f} ms "
                        f"({time.monotonic() - started:.1f} s with the client's start)"
                    )

    ratios = {name: serve_ratios(by["pagedkv"], by["vllm"]) for name, by in results.items()}
    echo("")
    for line in comparison_table(results):
        echo(line)
    echo(
        "aim: pagedkv ÷ vLLM output tok/s >= 1.0, TTFT and TPOT p50 <= 1.0; one run each, servers in turn; "
        f"{os.cpu_count()} cores" + (" [--quick: figures mean nothing]" if quick else "")
    )
    figures_json = {
        "serve_ratios": ratios,
        "aim_met": {name: meets_aim(r) for name, r in ratios.items()},
        "loads": {
            name: {
                "load": asdict(LOADS[name]) | {"request_rate": _rate_json(LOADS[name].request_rate)},
                "seed": load_seed(seed, name),
                **{system: results[name][system].as_json() for system in SYSTEMS},
            }
            for name in names
        },
        "workload": asdict(workload),
        "startup_s": startup_s,
        "client": "vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --dataset-name random",
        "model": str(model_dir),
        "served_model_name": setup.model_name,
        "kv_cache_bytes": budget,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "block_size": block_size,
        "pagedkv_executors": 1,
        "pagedkv_threads": threads,
        "pagedkv_env": setup.pagedkv_env,
        "pagedkv_gateway_events": gateway_log,
        "vllm_python": str(python),
        "vllm_threads_bind": bind,
        "vllm_eager": vllm_eager,
        "seed": seed,
        "cpu_count": os.cpu_count(),
        "quick": quick,
    }
    echo(json.dumps(figures_json))
    return figures_json


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


__all__ = [
    "LOADS",
    "QUICK_SERVE_WORKLOAD",
    "SERVE_WORKLOAD",
    "Load",
    "ServeFigures",
    "ServeWorkload",
    "check_complete",
    "client_argv",
    "comparison_table",
    "meets_aim",
    "parse_result",
    "run_serve_bench",
    "serve_ratios",
]
