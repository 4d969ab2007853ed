"""`pagedkv bench peer --startup`: how long pagedkv and vLLM take to start, on the same checkpoints and KV memory.

Three cases, each started afresh in a new process every time:

- `default` and `1gb`: loading a checkpoint (the default model; a ~1 GB float32 llama generated once, or
  `--startup-model`). pagedkv: what a user waits for before the engine can take requests: the model loaded
  (`executor.runner.load_model`), its KV cache allocated and its pool registered with a real blockd (the calls
  `build_engine` makes), in a child process that imported torch and the executor first. vLLM: the `vllm.LLM(...)`
  construction in `peer_driver.py` (vLLM imported before it), once with its default compilation (torch.compile)
  and once with `enforce_eager`. Each also gets `launch_s`: from starting the process to its answer, imports and
  interpreter start included.
- `serve`: from launching `pagedkv serve` (one executor, the default model, CPU, a free port) until its
  gateway's GET /health answers 200 with every executor healthy; vLLM: from launching `vllm serve` (through the
  driver's `serve` mode) until its /health answers 200. Each server is then stopped (SIGTERM to its process
  group, SIGKILL after a grace period) before anything else starts.

vLLM keeps compiled artifacts (and other startup caches) under VLLM_CACHE_ROOT: every case and vLLM setting gets a
fresh one of its own in a temporary directory, so round 0 is a **cold** start and rounds 1..`--runs` are **warm**
(they reuse what round 0 wrote). pagedkv has no such cache; its round 0 is its first start. Every checkpoint file
is read once before round 0, so both systems read weights from the page cache. Rounds alternate the systems
(pagedkv, vLLM compiled, vLLM eager, per case); medians are over the warm rounds. Ratios are pagedkv's seconds ÷
vLLM's (below 1.0: pagedkv starts faster), against the faster vLLM setting and against each.

A vLLM start that fails is reported and not retried (the rest still runs; the command then exits 1); a pagedkv
start that fails stops the command.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx

from common import processes
from common.cpu import machine_busy_s
from common.home import pagedkv_home
from common.net import free_port
from pagedkv.bench.common import blockd_process, log_tail, table_lines
from pagedkv.bench.peer_systems import (
    SERVER_STOP_GRACE_S,
    DriverError,
    VllmSystem,
    check_setup,
    driver_env,
    read_loadavg,
)
from pagedkv.bench.shapes import ensure_checkpoint as shared_ensure_checkpoint
from pagedkv.bench.throughput import bench_model

#: The cases in the order each round runs them.
CASES = ("default", "1gb", "serve")
CASE_LABELS = {"default": "load default model", "1gb": "load 1 GB checkpoint", "serve": "serve → /health"}
SYSTEMS = ("pagedkv", "vllm-compiled", "vllm-eager")
SYSTEM_LABELS = {"pagedkv": "pagedkv", "vllm-compiled": "vLLM compiled", "vllm-eager": "vLLM eager"}
#: The ~1 GB checkpoint: a llama of 260,080,640 float32 parameters (1,040,322,560 bytes of safetensors).
BIG_CHECKPOINT: dict[str, Any] = dict(
    arch="llama",
    hidden_size=1024,
    intermediate_size=4096,
    layers=16,
    heads=16,
    kv_heads=8,
    vocab_size=4096,
    max_position=4096,
    dtype="float32",
    seed=0,
)
#: `--quick`'s stand-in (the tests' tiny model): the command's plumbing without a gigabyte to write.
QUICK_CHECKPOINT: dict[str, Any] = dict(
    arch="llama",
    hidden_size=128,
    layers=2,
    heads=4,
    kv_heads=2,
    vocab_size=512,
    max_position=512,
    dtype="float32",
    seed=0,
)
START_TIMEOUT_S = 1200.0  # vLLM compiling on a busy 2-core machine has taken ~200 s
#: Between two probes of a starting server: finer than processes.POLL_S, as the seconds to healthy are the figure.
_MEASURE_POLL_S = processes.POLL_S / 5


class PeerFailed(Exception):
    """A vLLM start failed: reported, and that case and setting are not tried again."""


# --------------------------------------------------------------------------------------------- the checkpoint


def checkpoint_name(options: dict[str, Any]) -> str:
    o = options
    return (
        f"startup-{o['arch']}-h{o['hidden_size']}-l{o['layers']}-i{o.get('intermediate_size') or 'auto'}"
        f"-v{o['vocab_size']}-{o['dtype']}"
    )


def default_checkpoint_dir(options: dict[str, Any]) -> Path:
    return pagedkv_home() / "models" / "bench" / checkpoint_name(options)


def ensure_checkpoint(directory: Path, options: dict[str, Any]) -> Path:
    """The startup checkpoint in `directory`, generated there unless it holds a complete one (see
    shapes.ensure_checkpoint)."""
    return shared_ensure_checkpoint(directory, options, what="the startup checkpoint", option="--startup-model")


def checkpoint_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def read_through(directory: Path) -> None:
    """Read every file of a checkpoint once, so neither system is the first to pull it from the disk."""
    for path in sorted(directory.iterdir()):
        if path.is_file():
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass


# ------------------------------------------------------------------------------------------ rounds and figures


@dataclass
class Launch:
    """One measured start."""

    seconds: float  # the compared figure: the construction (load cases) or launch to healthy (serve)
    launch_s: float | None = None  # load cases: from starting the process to its answer
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class StartupRecord:
    case: str
    round: int  # 0: cold (vLLM's fresh cache), 1..runs: warm
    system: str
    seconds: float | None
    launch_s: float | None
    load_before: list[float]  # /proc/loadavg's 1, 5 and 15 minute figures just before
    machine_busy: float | None  # share of the machine's CPU busy (every process) during the start
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("seconds", "launch_s"):
            if data[key] is not None:
                data[key] = round(data[key], 3)
        if data["machine_busy"] is not None:
            data["machine_busy"] = round(data["machine_busy"], 3)
        return data


def startup_schedule(cases: Sequence[str], systems: Sequence[str], runs: int) -> list[tuple[int, str, str]]:
    """(round, case, system) in the order they run: round 0 (cold), then `runs` warm rounds; in each round every
    case, and in each case every system in turn."""
    return [(r, case, system) for r in range(runs + 1) for case in cases for system in systems]


def run_startup_rounds(
    cases: Sequence[str],
    systems: Sequence[str],
    runs: int,
    measure: Callable[[str, str, int], Launch],
    report: Callable[[StartupRecord], None] = lambda record: None,
) -> list[StartupRecord]:
    """Every start of the schedule, measured by `measure(case, system, round)`; a PeerFailed is recorded and its
    case and system skipped after; anything else propagates."""
    records: list[StartupRecord] = []
    failed: set[tuple[str, str]] = set()
    cpus = os.cpu_count() or 1
    for round_, case, system in startup_schedule(cases, systems, runs):
        if (case, system) in failed:
            continue
        load, busy, started = read_loadavg(), machine_busy_s(), time.perf_counter()
        try:
            launch = measure(case, system, round_)
        except PeerFailed as exc:
            failed.add((case, system))
            record = StartupRecord(case, round_, system, None, None, load, None, error=str(exc))
        else:
            wall, busy_after = time.perf_counter() - started, machine_busy_s()
            share = None
            if busy is not None and busy_after is not None and wall > 0:
                share = min(1.0, max(0.0, (busy_after - busy) / (wall * cpus)))
            record = StartupRecord(case, round_, system, launch.seconds, launch.launch_s, load, share, launch.detail)
        records.append(record)
        report(record)
    return records


@dataclass
class CaseSummary:
    medians: dict[str, float]  # system -> median seconds over the warm rounds
    launch_medians: dict[str, float]  # system -> median launch_s over the warm rounds (load cases)
    cold: dict[str, float]  # system -> round 0's seconds
    ratio: float | None  # pagedkv ÷ the faster vLLM setting (warm medians)
    best_vllm: str | None
    ratios: dict[str, float]  # vLLM setting -> pagedkv ÷ it (warm medians)
    cold_ratios: dict[str, float]  # vLLM setting -> pagedkv's round 0 ÷ its cold start
    errors: dict[str, str]

    def as_json(self) -> dict[str, Any]:
        def rounded(d: dict[str, float]) -> dict[str, float]:
            return {k: round(v, 4) for k, v in d.items()}

        return {
            "medians_s": rounded(self.medians),
            "launch_medians_s": rounded(self.launch_medians),
            "cold_s": rounded(self.cold),
            "ratio": None if self.ratio is None else round(self.ratio, 4),
            "best_vllm": self.best_vllm,
            "ratios": rounded(self.ratios),
            "cold_ratios": rounded(self.cold_ratios),
            "errors": self.errors,
        }


def summarize(records: Sequence[StartupRecord], case: str) -> CaseSummary:
    mine = [r for r in records if r.case == case]
    warm: dict[str, list[float]] = {}
    launches: dict[str, list[float]] = {}
    cold: dict[str, float] = {}
    errors: dict[str, str] = {}
    for r in mine:
        if r.error is not None:
            errors[r.system] = r.error
        elif r.seconds is not None and r.round == 0:
            cold[r.system] = r.seconds
        elif r.seconds is not None:
            warm.setdefault(r.system, []).append(r.seconds)
            if r.launch_s is not None:
                launches.setdefault(r.system, []).append(r.launch_s)
    medians = {k: statistics.median(v) for k, v in warm.items()}
    ours = medians.get("pagedkv")
    ratios = {k: ours / v for k, v in medians.items() if k != "pagedkv" and ours is not None and v > 0}
    cold_ratios = {k: cold["pagedkv"] / v for k, v in cold.items() if k != "pagedkv" and "pagedkv" in cold and v > 0}
    others = {k: v for k, v in medians.items() if k != "pagedkv"}
    best = min(others, key=lambda k: others[k]) if others else None
    ratio = ratios.get(best) if best is not None else None
    return CaseSummary(
        medians,
        {k: statistics.median(v) for k, v in launches.items()},
        cold,
        ratio,
        best,
        ratios,
        cold_ratios,
        errors,
    )


# ------------------------------------------------------------------------------------------------ processes


def measure_pagedkv_load(spec: dict[str, Any], log: Path) -> Launch:
    """pagedkv's load in a fresh process (`python -m pagedkv.bench.peer_load_child SPEC`); ClickException if it
    fails."""
    started = time.perf_counter()
    with open(log, "ab") as log_file:
        done = subprocess.run(
            [sys.executable, "-m", "pagedkv.bench.peer_load_child", json.dumps(spec)],
            stdout=subprocess.PIPE,
            stderr=log_file,
            stdin=subprocess.DEVNULL,
            timeout=START_TIMEOUT_S,
            check=False,
        )
    launch_s = time.perf_counter() - started
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    reply: dict[str, Any] = {}
    with contextlib.suppress(ValueError, IndexError):
        reply = json.loads(lines[-1])
    if done.returncode != 0 or not reply.get("ok"):
        raise click.ClickException(
            f"pagedkv's load of {spec['model']} failed (exit {done.returncode}); the end of its log {log}:\n  "
            + log_tail(log)
        )
    detail = {k: v for k, v in reply.items() if k not in ("ok", "load_s")}
    return Launch(reply["load_s"], launch_s, detail)


def measure_vllm_load(
    python: Path, driver: Path, msg: dict[str, Any], env: dict[str, str], log: Path, cwd: Path, name: str
) -> Launch:
    """vLLM's `LLM(...)` in a fresh driver process; PeerFailed if it fails."""
    started = time.perf_counter()
    peer = VllmSystem(name, python, driver, env, log, cwd)
    try:
        reply = peer.call(msg)
        launch_s = time.perf_counter() - started
    except DriverError as exc:
        raise PeerFailed(exc.message) from None
    finally:
        peer.close()
    detail = {k: reply.get(k) for k in ("vllm", "torch", "block_size", "compilation", "cache_root")}
    return Launch(float(reply["load_s"]), launch_s, detail)


class _LineTimes:
    """Reads a pipe line by line in a thread, copying each line to a log and noting when it arrived."""

    def __init__(self, stream: Any, log: Any, started: float) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream, log, started), daemon=True)
        self._thread.start()

    def _read(self, stream: Any, log: Any, started: float) -> None:
        for raw in iter(stream.readline, b""):
            self.lines.append((time.perf_counter() - started, raw.decode(errors="replace").rstrip()))
            with contextlib.suppress(ValueError, OSError):
                log.write(raw)
                log.flush()

    def join(self) -> None:
        self._thread.join(timeout=10)


def _stop_group(process: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Stop the server's process group; how it went."""
    (stopped,) = processes.stop([process], SERVER_STOP_GRACE_S)
    return {"stop_s": round(stopped.seconds, 3), "stopped_cleanly": stopped.clean, "exit": stopped.returncode}


def _healthy_pagedkv(response: Any) -> bool:
    if response.status_code != 200:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    executors = body.get("executors") if isinstance(body, dict) else None
    return (
        body.get("status") == "ok"
        and bool(executors)
        and all(isinstance(e, dict) and e.get("healthy") is True for e in executors)
    )


def measure_server(
    command: list[str],
    env: dict[str, str],
    url: str,
    healthy: Callable[[Any], bool],
    log: Path,
    on_failure: Callable[[str], Exception],
    phases: Callable[[list[tuple[float, str]]], dict[str, float]] = lambda lines: {},
    timeout_s: float = START_TIMEOUT_S,
) -> Launch:
    """Launch a server in a session of its own, poll `url` until `healthy(response)`, stop it; the seconds from
    launch to healthy. `on_failure(message)` is raised when it exits first or is not healthy in time."""
    started = time.perf_counter()
    process = processes.start(command, log, env=env, pipe_stderr=True)
    with open(log, "ab") as log_file:
        lines = _LineTimes(process.stderr, log_file, started)
        problem = None
        try:
            with httpx.Client(timeout=2.0) as client:

                def healthy_now() -> float | None:
                    try:
                        return time.perf_counter() - started if healthy(client.get(url)) else None
                    except httpx.HTTPError:
                        return None

                def alive() -> None:
                    if process.poll() is not None:
                        raise _Exited(f"exited ({process.returncode}) before {url} was healthy")

                seconds = processes.wait_until(healthy_now, timeout_s, check=alive, poll_s=_MEASURE_POLL_S)
        except _Exited as exc:
            problem = str(exc)
        except processes.NotReady:
            problem = f"was not healthy at {url} within {timeout_s:g} s"
        finally:
            stop = _stop_group(process)
            lines.join()
    if problem is not None:
        raise on_failure(f"{' '.join(command[:4])} ... {problem}; the end of its log {log}:\n" + log_tail(log))
    return Launch(seconds, None, {**phases(lines.lines), **stop})


class _Exited(Exception):
    """The server exited before it was healthy."""


_READY = re.compile(r"^(blockd|executor-\d+|gateway) ready:")


def pagedkv_serve_phases(lines: list[tuple[float, str]]) -> dict[str, float]:
    """When `pagedkv serve` said each child was ready (seconds after launch), from its progress lines."""
    found = {}
    for t, line in lines:
        match = _READY.match(line)
        if match:
            found[f"{match.group(1)}_ready_s"] = round(t, 3)
    return found


# ------------------------------------------------------------------------------------------------- the command


@dataclass
class StartupConfig:
    runs: int
    quick: bool
    vllm_python: Path | None
    vllm_driver: Path
    model_dir: Path | None  # the default model's slot: None = the generated default model
    startup_model: Path | None  # the 1 GB checkpoint's directory: None = under $PAGEDKV_HOME
    kv_cache_memory: str
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    threads: int | None

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> StartupConfig:
        """From `bench peer`'s options by name (its click context's params)."""
        return cls(**{name: params[name] for name in cls.__dataclass_fields__})


def run_startup(cfg: StartupConfig) -> None:
    """The whole `--startup` command: progress on stderr, tables and one last JSON line on stdout."""
    echo = click.echo
    budget, python = check_setup(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.kv_cache_memory, cfg.vllm_python)
    big_options = QUICK_CHECKPOINT if cfg.quick else BIG_CHECKPOINT
    big_dir = ensure_checkpoint(
        (cfg.startup_model or default_checkpoint_dir(big_options)).expanduser().absolute(), big_options
    )
    default_given = cfg.model_dir is not None
    default_dir, default_config = bench_model(cfg.model_dir)
    _, big_config = bench_model(big_dir)
    models = {"default": (Path(default_dir).resolve(), default_config), "1gb": (big_dir.resolve(), big_config)}
    for directory, _ in models.values():
        read_through(directory)
    sizes = {case: checkpoint_bytes(d) for case, (d, _) in models.items()}

    echo(
        f"startup: {os.cpu_count()} cores, float32 on cpu, KV {budget / 2**30:.3g} GiB each, max_num_seqs "
        f"{cfg.max_num_seqs}, max_num_batched_tokens {cfg.max_num_batched_tokens}; vLLM: {python}"
    )
    for case, (directory, config) in models.items():
        echo(
            f"  {case:>7}: {directory} ({config.architecture}, {config.num_layers} layers, hidden "
            f"{config.hidden_size}, vocab {config.vocab_size}; {sizes[case]:,} bytes)"
        )

    keep_logs = False
    work = Path(tempfile.mkdtemp(prefix="pagedkv-bench-startup-"))
    try:
        with contextlib.ExitStack() as stack:
            endpoint, _blockd = stack.enter_context(
                blockd_process(work / "blockd.log", "--no-persistence", "--lease-timeout", "3600")
            )

            def cache_root(case: str, system: str) -> Path:
                return work / "vllm-cache" / f"{case}-{system}"

            def vllm_env(case: str, system: str) -> dict[str, str]:
                root = cache_root(case, system)
                root.mkdir(parents=True, exist_ok=True)
                return {**driver_env(None), "VLLM_CACHE_ROOT": str(root)}

            def cache_files(case: str, system: str) -> int:
                root = cache_root(case, system)
                return sum(len(files) for _, _, files in os.walk(root)) if root.is_dir() else 0

            def measure(case: str, system: str, round_: int) -> Launch:
                tag = f"{case}-{system}-r{round_}"
                eager = system == "vllm-eager"
                if case == "serve":
                    port = free_port()
                    if system == "pagedkv":
                        return measure_server(
                            _pagedkv_serve_command(port, budget, default_dir if default_given else None, work, tag),
                            _pagedkv_serve_env(cfg),
                            f"http://127.0.0.1:{port}/health",
                            _healthy_pagedkv,
                            work / f"{tag}.log",
                            click.ClickException,
                            pagedkv_serve_phases,
                        )
                    before = cache_files(case, system)
                    command = [
                        str(python.absolute()),
                        str(cfg.vllm_driver.absolute()),
                        "serve",
                        str(models["default"][0]),
                        *_vllm_serve_args(port, budget, cfg, models["default"][1].max_model_len, eager),
                    ]
                    launch = measure_server(
                        command,
                        vllm_env(case, system),
                        f"http://127.0.0.1:{port}/health",
                        lambda response: response.status_code == 200,
                        work / f"{tag}.log",
                        PeerFailed,
                    )
                    launch.detail["cache_files_before"] = before
                    return launch
                directory, config = models[case]
                if system == "pagedkv":
                    spec = {
                        "model": str(directory),
                        "endpoint": endpoint,
                        "pool_id": f"startup-{tag}",
                        "kv_cache_bytes": budget,
                        "block_size": cfg.block_size,
                        "max_num_seqs": cfg.max_num_seqs,
                        "max_num_batched_tokens": cfg.max_num_batched_tokens,
                        "threads": cfg.threads,
                    }
                    return measure_pagedkv_load(spec, work / f"{tag}.log")
                before = cache_files(case, system)
                msg = {
                    "op": "load",
                    "model": str(directory),
                    "dtype": "float32",
                    "kv_cache_bytes": budget,
                    "max_num_seqs": cfg.max_num_seqs,
                    "max_num_batched_tokens": cfg.max_num_batched_tokens,
                    "max_model_len": config.max_model_len,
                    "enable_prefix_caching": True,
                    "enforce_eager": eager,
                    "seed": 0,
                }
                launch = measure_vllm_load(
                    python, cfg.vllm_driver, msg, vllm_env(case, system), work / f"{tag}.log", work, system
                )
                launch.detail["cache_files_before"] = before
                return launch

            def progress(record: StartupRecord) -> None:
                what = f"  round {record.round} ({'cold' if record.round == 0 else 'warm'}) {record.case:>7} " + (
                    f"{SYSTEM_LABELS[record.system]:>13}: "
                )
                if record.error is not None:
                    click.echo(what + f"FAILED: {record.error}", err=True)
                    return
                extra = "" if record.launch_s is None else f" (process start to ready {record.launch_s:.2f} s)"
                click.echo(what + f"{record.seconds:.2f} s{extra}", err=True)

            total = len(startup_schedule(CASES, SYSTEMS, cfg.runs))
            click.echo(
                f"{total} starts: round 0 (cold: fresh vLLM caches), then {cfg.runs} warm round(s); each case "
                "alternates pagedkv, vLLM compiled, vLLM eager",
                err=True,
            )
            records = run_startup_rounds(CASES, SYSTEMS, cfg.runs, measure, progress)
        summaries = {case: summarize(records, case) for case in CASES}
        errors = [r for r in records if r.error is not None]
        keep_logs = bool(errors)

        echo("")
        for line in startup_runs_table(records):
            echo("  " + line)
        echo("")
        for line in startup_summary_table(summaries):
            echo(line)
        echo(
            f"seconds: load cases = the construction alone (pagedkv: model + KV cache + blockd registration; vLLM: "
            f"LLM(...)), serve = launch to a healthy /health; medians of {cfg.runs} warm round(s); cold = round 0 "
            f"(fresh VLLM_CACHE_ROOT); ratio = pagedkv ÷ the faster vLLM setting (< 1: pagedkv starts faster); "
            f"{os.cpu_count()} cores" + (" [--quick: tiny checkpoint, figures mean nothing]" if cfg.quick else "")
        )
        if errors:
            echo(f"vLLM failures: {len(errors)}; logs kept in {work}")

        def ratio_of(case: str) -> float | None:
            value = summaries[case].ratio
            return None if value is None else round(value, 4)

        serve = summaries["serve"]
        echo(
            json.dumps(
                {
                    "ratio_default_model": ratio_of("default"),
                    "ratio_1gb": ratio_of("1gb"),
                    "ratio_serve": ratio_of("serve"),
                    "serve_to_healthy_s": _round(serve.medians.get("pagedkv")),
                    "vllm_serve_to_healthy_s": {k: round(v, 4) for k, v in serve.medians.items() if k != "pagedkv"},
                    "startup": {
                        "cases": {case: s.as_json() for case, s in summaries.items()},
                        "runs": [r.as_json() for r in records],
                        "models": {
                            case: {"dir": str(d), "bytes": sizes[case], "max_model_len": c.max_model_len}
                            for case, (d, c) in models.items()
                        },
                        "vllm": {
                            r.system: {k: r.detail.get(k) for k in ("vllm", "torch", "block_size", "compilation")}
                            for r in records
                            if r.system != "pagedkv" and r.case != "serve" and r.error is None
                        },
                    },
                    "vllm_python": str(python),
                    "kv_cache_bytes": budget,
                    "block_size": cfg.block_size,
                    "max_num_seqs": cfg.max_num_seqs,
                    "max_num_batched_tokens": cfg.max_num_batched_tokens,
                    "runs": cfg.runs,
                    "cpu_count": os.cpu_count(),
                    "quick": cfg.quick,
                    "logs": str(work) if keep_logs else None,
                }
            )
        )
        if errors:
            failed = sorted({f"{r.case}/{SYSTEM_LABELS[r.system]}" for r in errors})
            raise click.ClickException(f"vLLM failed to start in {', '.join(failed)}; logs in {work}")
    except BaseException:
        keep_logs = True
        raise
    finally:
        if not keep_logs:
            shutil.rmtree(work, ignore_errors=True)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _pagedkv_serve_command(port: int, budget: int, model: Path | None, work: Path, tag: str) -> list[str]:
    command = [sys.executable, "-m", "pagedkv.serve", "--port", str(port), "--kv-cache-memory", str(budget)]
    command += ["--log-dir", str(work / f"{tag}-logs")]
    return command + (["--model", str(model)] if model is not None else [])


def _pagedkv_serve_env(cfg: StartupConfig) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PAGEDKV_EXECUTOR_MAX_NUM_SEQS"] = str(cfg.max_num_seqs)
    env["PAGEDKV_EXECUTOR_MAX_NUM_BATCHED_TOKENS"] = str(cfg.max_num_batched_tokens)
    env["PAGEDKV_EXECUTOR_BLOCK_SIZE"] = str(cfg.block_size)
    return env


def _vllm_serve_args(port: int, budget: int, cfg: StartupConfig, max_model_len: int, eager: bool) -> list[str]:
    args = ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--seed", "0"]
    args += ["--kv-cache-memory-bytes", str(budget), "--max-model-len", str(max_model_len)]
    args += ["--max-num-seqs", str(cfg.max_num_seqs), "--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
    return args + ["--enable-prefix-caching"] + (["--enforce-eager"] if eager else [])


def startup_runs_table(records: Sequence[StartupRecord]) -> list[str]:
    rows = []
    for r in records:
        rows.append(
            [
                f"{r.round} {'cold' if r.round == 0 else 'warm'}",
                CASE_LABELS[r.case],
                SYSTEM_LABELS[r.system],
                " ".join(f"{x:.2f}" for x in r.load_before) or "?",
                "?" if r.machine_busy is None else f"{r.machine_busy:.0%}",
                "FAILED" if r.seconds is None else f"{r.seconds:.2f}",
                "-" if r.launch_s is None else f"{r.launch_s:.2f}",
            ]
        )
    columns = ["round", "case", "system", "load before", "machine busy", "seconds", "process start to ready s"]
    return table_lines(columns, rows, left=3)


def startup_summary_table(summaries: dict[str, CaseSummary]) -> list[str]:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    columns = ["case", *(f"{SYSTEM_LABELS[s]} s" for s in SYSTEMS), "cold: pagedkv / vLLM compiled / eager"]
    columns += ["pagedkv ÷ best vLLM"]
    rows = []
    for case, s in summaries.items():
        cold = " / ".join(cell(s.cold.get(system)) for system in SYSTEMS)
        ratio = "-" if s.ratio is None else f"{s.ratio:.2f} (vs {SYSTEM_LABELS[s.best_vllm or '']})"
        rows.append([CASE_LABELS[case], *(cell(s.medians.get(system)) for system in SYSTEMS), cold, ratio])
    return table_lines(columns, rows)


__all__ = [
    "BIG_CHECKPOINT",
    "CASES",
    "QUICK_CHECKPOINT",
    "SYSTEMS",
    "Launch",
    "PeerFailed",
    "StartupConfig",
    "StartupRecord",
    "ensure_checkpoint",
    "measure_server",
    "run_startup",
    "run_startup_rounds",
    "startup_schedule",
    "summarize",
]
