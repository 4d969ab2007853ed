"""`pagedkv bench peer`: pagedkv's engine against vLLM's offline `LLM.generate`, same model, requests and limits.

vLLM runs in a virtual environment of its own (`make peer-env` builds `.venv-peer` with the community CPU build):
this process starts `peer_driver.py` under that environment's interpreter (`--vllm-python`), once per vLLM
thread setting, and speaks JSON lines with it (see the driver's docstring). pagedkv runs in this process with a
real blockd subprocess, built as `pagedkv bench throughput` builds it.

Per workload: every system gets an untimed warm-up, then `--runs` rounds; each round runs pagedkv, then each vLLM
setting, one after the other (A/B/C/A/B/C...), each over the whole workload (all requests submitted at once, greedy,
`ignore_eos`, exactly each request's output length), timed over generation only. Before each run the machine's
load average is read; during it, the CPU seconds of that system's process tree (pagedkv: this process and blockd;
vLLM: the driver and its engine-core process) and of the whole machine. Reported: every run, the median tok/s
of each system, and the ratio pagedkv ÷ the faster vLLM setting (by median). The outputs of the first run of each
are compared token for token; every request where they differ is checked at its first differing position with
transformers' logits: a near tie is when the two systems' tokens are transformers' top two and the top two
logits are within `--tie-tolerance`.

Neither system may reuse the KV of another run: pagedkv's runs carry their own cache salt, and vLLM's prefix cache
is reset before each run. Within a run both cache prefixes (the `prefix` workload's point).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import click

from common.clicks import unless_given
from common.cpu import machine_busy_s
from common.units import parse_size
from pagedkv.bench.common import threads_option
from pagedkv.bench.peer_driver import process_cpu_seconds, process_state, tree_cpu_seconds, tree_pids
from pagedkv.bench.throughput import BenchRequest, bench_model, make_workload

DRIVER = Path(__file__).with_name("peer_driver.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
PEER_PYTHON = Path(".venv-peer") / "bin" / "python"
DEFAULT_KV = "1GiB"
DEFAULT_RUNS = 3
DEFAULT_TIE_TOLERANCE = 1e-3
#: Divergences checked against transformers per comparison at most (each is one forward pass).
MAX_TIE_CHECKS = 64
#: Requests (and output tokens each, at most) of every system's warm-up.
WARMUP_REQUESTS = 16
WARMUP_OUTPUT = 16


# ------------------------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    requests: int
    prompt_range: tuple[int, int]  # with a shared prefix: the length of each request's own part after it
    output_range: tuple[int, int]
    prefix_len: int = 0  # > 0: consecutive groups of `group_size` requests share a prefix of this many tokens
    group_size: int = 1

    def describe(self) -> str:
        text = f"{self.requests} requests, "
        if self.prefix_len:
            groups = -(-self.requests // self.group_size)
            text += (
                f"{groups} groups of {self.group_size} sharing a {self.prefix_len}-token prefix, then "
                f"{self.prompt_range[0]}-{self.prompt_range[1]} tokens of their own, "
            )
        else:
            text += f"prompts {self.prompt_range[0]}-{self.prompt_range[1]}, "
        return text + f"outputs {self.output_range[0]}-{self.output_range[1]} tokens"


WORKLOADS: dict[str, WorkloadSpec] = {
    "default": WorkloadSpec("default", 256, (16, 256), (16, 256)),
    "long": WorkloadSpec("long", 96, (16, 256), (16, 1024)),
    "prefix": WorkloadSpec("prefix", 256, (16, 256), (16, 256), prefix_len=512, group_size=16),
}
QUICK_WORKLOADS: dict[str, WorkloadSpec] = {
    "default": WorkloadSpec("default", 8, (8, 32), (8, 32)),
    "long": WorkloadSpec("long", 4, (8, 32), (8, 96)),
    "prefix": WorkloadSpec("prefix", 8, (8, 16), (8, 32), prefix_len=32, group_size=4),
}


def build_workload(spec: WorkloadSpec, vocab_size: int, special_ids: set[int], seed: int) -> list[BenchRequest]:
    """The workload's seeded requests: `make_workload`'s, with each group's shared prefix put in front."""
    requests = make_workload(spec.requests, spec.prompt_range, spec.output_range, vocab_size, special_ids, seed)
    if not spec.prefix_len:
        return requests
    rng = random.Random(f"{seed}-prefix")
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    prefixes: dict[int, list[int]] = {}
    shared = []
    for i, r in enumerate(requests):
        prefix = prefixes.setdefault(i // spec.group_size, rng.choices(allowed, k=spec.prefix_len))
        shared.append(BenchRequest(r.request_id, prefix + r.prompt, r.output_len))
    return shared


def warmup_requests(requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    return [
        BenchRequest(f"warm-{r.request_id}", r.prompt, min(r.output_len, WARMUP_OUTPUT))
        for r in requests[:WARMUP_REQUESTS]
    ]


# ------------------------------------------------------------------------------------------ runs and results


@dataclass
class RunResult:
    """One system's pass over one workload."""

    outputs: dict[str, list[int]]
    seconds: float
    cpu_s: float  # CPU seconds of the system's process tree over the generation

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())


@dataclass
class RunRecord:
    workload: str
    round: int  # 1-based
    system: str
    seconds: float
    output_tokens: int
    cpu_s: float
    load_before: list[float]  # /proc/loadavg's 1, 5 and 15 minute figures just before the run
    others_cpu_share: float | None  # of the machine's CPU, what other processes used during the run
    neighbour: bool = False  # run with the bench's busy-loop neighbour (--noisy-neighbour)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_s_per_token(self) -> float:
        return self.cpu_s / self.output_tokens if self.output_tokens else 0.0

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "seconds": round(self.seconds, 4),
            "cpu_s": round(self.cpu_s, 3),
            "tok_s": round(self.tok_s, 2),
            "cpu_s_per_token": round(self.cpu_s_per_token, 7),
        }


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


def schedule(systems: Sequence[str], runs: int) -> list[tuple[int, str]]:
    """The order of the timed runs: round by round, every system once per round in the given order."""
    return [(round_, name) for round_ in range(1, runs + 1) for name in systems]


BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
#: The neighbour's own bound: it stops by itself even if the bench is killed without cleaning up.
NEIGHBOUR_LIMIT_S = 1800.0


@contextlib.contextmanager
def busy_neighbour(limit_s: float = NEIGHBOUR_LIMIT_S) -> Iterator[subprocess.Popen[bytes]]:
    """Another process saturating one core (a bounded busy loop) for the duration of the block."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_LOOP, str(limit_s)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


RUNNABLE = frozenset("RSD")  # states of a process not (yet) stopped; gone, zombie or "T"/"t" are done


def _wait_for(done: Callable[[], bool], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.001)


@contextlib.contextmanager
def paused(roots: Sequence[int], wait_s: float = 2.0) -> Iterator[list[int]]:
    """The processes of these trees stopped (SIGSTOP) for the block and continued (SIGCONT) after, whatever
    happens in it. The bench keeps every system loaded for the whole session, and an idle system is not idle: a
    loaded vLLM's processes took about a tenth of a core doing nothing (its engine core polls), enough to slow
    the team of OpenMP threads of whichever system is being timed. Yields the pids stopped, once each is seen
    stopped (a signal takes effect when its target is next scheduled, not when kill returns) or `wait_s` has
    passed: one in uninterruptible sleep stops only when it wakes, and the run need not wait for that. Likewise
    returns once each is seen going on again, or after `wait_s`."""
    stopped: list[int] = []
    try:
        for root in roots:
            for pid in tree_pids(root):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
        _wait_for(lambda: all(process_state(pid) not in RUNNABLE for pid in stopped), wait_s)
        yield stopped
    finally:
        for pid in reversed(stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        _wait_for(lambda: all(process_state(pid) != "T" for pid in stopped), wait_s)


def run_rounds(
    workload: str,
    requests: Sequence[BenchRequest],
    systems: Sequence[System],
    runs: int,
    report: Callable[[RunRecord], None] = lambda record: None,
    *,
    warm_up: bool = True,
    neighbour: bool = False,
    pause_idle: bool = True,
) -> tuple[list[RunRecord], dict[str, list[dict[str, list[int]]]]]:
    """Every system's warm-up, then the alternated timed runs; the records and each system's outputs per run.
    With `neighbour`, each timed run has a busy-loop process beside it (started just before, stopped after).
    With `pause_idle`, the other systems' processes are paused during each timed run (see `paused`)."""
    by_name = {s.name: s for s in systems}
    if warm_up:
        warm = warmup_requests(requests)
        for system in systems:
            system.run(warm, f"{workload}-warmup")
    records: list[RunRecord] = []
    outputs: dict[str, list[dict[str, list[int]]]] = {s.name: [] for s in systems}
    cpus = os.cpu_count() or 1
    tag = "-noisy" if neighbour else ""
    for round_, name in schedule([s.name for s in systems], runs):
        idle = [pid for s in systems if s.name != name for pid in s.background_pids()] if pause_idle else []
        load = read_loadavg()
        with paused(idle), busy_neighbour() if neighbour else contextlib.nullcontext():
            busy = machine_busy_s()
            started = time.perf_counter()
            result = by_name[name].run(requests, f"{workload}{tag}-run{round_}")
            wall = time.perf_counter() - started
            busy_after = machine_busy_s()
        short = [r for r in requests if len(result.outputs.get(r.request_id, ())) != r.output_len]
        if short:  # the runs must do the same work, or tok/s compares nothing
            r = short[0]
            raise click.ClickException(
                f"{name} generated {len(result.outputs.get(r.request_id, ()))} tokens for {r.request_id} of "
                f"{workload}, not its {r.output_len} ({len(short)} requests off)"
            )
        others = None
        if busy is not None and busy_after is not None and wall > 0:
            others = max(0.0, (busy_after - busy) - result.cpu_s) / (wall * cpus)
        record = RunRecord(
            workload, round_, name, result.seconds, result.output_tokens, result.cpu_s, load, others, neighbour
        )
        records.append(record)
        outputs[name].append(result.outputs)
        report(record)
    return records, outputs


def medians(records: Sequence[RunRecord]) -> dict[str, float]:
    """Each system's median tok/s over its runs (in order of first appearance)."""
    by_system: dict[str, list[float]] = {}
    for r in records:
        by_system.setdefault(r.system, []).append(r.tok_s)
    return {name: statistics.median(values) for name, values in by_system.items()}


def ratio_against_best(meds: dict[str, float], ours: str = "pagedkv") -> tuple[float | None, str | None]:
    """ours ÷ the fastest other system by median, and which one that is; (None, None) without both."""
    others = {k: v for k, v in meds.items() if k != ours}
    if ours not in meds or not others:
        return None, None
    best = max(others, key=lambda k: others[k])
    return (meds[ours] / others[best] if others[best] > 0 else None), best


# ------------------------------------------------------------------------------------------ output equality


@dataclass(frozen=True)
class Divergence:
    request_id: str
    position: int  # index into the output of the first token that differs (or where one output ends)
    ours: int | None
    theirs: int | None


def compare_outputs(
    requests: Sequence[BenchRequest], ours: dict[str, list[int]], theirs: dict[str, list[int]]
) -> list[Divergence]:
    """The first difference of every request whose outputs differ, in workload order."""
    found = []
    for r in requests:
        a, b = ours.get(r.request_id, []), theirs.get(r.request_id, [])
        if a == b:
            continue
        position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        found.append(
            Divergence(
                r.request_id,
                position,
                a[position] if position < len(a) else None,
                b[position] if position < len(b) else None,
            )
        )
    return found


@dataclass(frozen=True)
class TieCheck:
    divergence: Divergence
    top: tuple[int, int]  # transformers' two most likely tokens at that point
    gap: float  # their logits' difference
    near_tie: bool  # the two systems' tokens are those two, and the gap is within the tolerance


def check_near_tie(
    logits_at: Callable[[list[int]], Sequence[float]],
    request: BenchRequest,
    divergence: Divergence,
    common: list[int],
    tolerance: float,
) -> TieCheck:
    """Whether a divergence is a near tie: `logits_at(ids)` gives the next-token logits after `ids` (transformers
    in the command); `common` is the output the two systems agree on before the divergence."""
    logits = list(logits_at(list(request.prompt) + common[: divergence.position]))
    order = sorted(range(len(logits)), key=lambda t: logits[t], reverse=True)[:2]
    top = (order[0], order[1])
    gap = float(logits[top[0]] - logits[top[1]])
    tokens = {divergence.ours, divergence.theirs}
    return TieCheck(divergence, top, gap, tokens == set(top) and gap <= tolerance)


def hf_logits_fn(model_dir: Path) -> Callable[[list[int]], list[float]]:
    """transformers' float32 next-token logits after a sequence of token ids."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logits_at(ids: list[int]) -> list[float]:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0, -1].tolist()

    return logits_at


# -------------------------------------------------------------------------------------------------- systems


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
        from executor.params import SamplingParams

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
    pass


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
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
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
    python = resolve_vllm_python(vllm_python)
    if not python.exists():
        raise click.ClickException(
            f"no vLLM environment: {python} does not exist. Build it with `make peer-env`, or give --vllm-python."
        )
    return budget, python


def resolve_vllm_python(given: Path | None) -> Path:
    if given is not None:
        return given
    for base in (Path.cwd(), REPO_ROOT):
        if (base / PEER_PYTHON).exists():
            return base / PEER_PYTHON
    return REPO_ROOT / PEER_PYTHON


# ------------------------------------------------------------------------------------------------ reporting


def _table(columns: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]

    def line(cells: list[str]) -> str:
        return "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(cells, widths)))

    return [line(columns), *(line(row) for row in rows)]


def runs_table(records: Sequence[RunRecord], labels: dict[str, str]) -> list[str]:
    rows = [
        [
            str(r.round),
            labels.get(r.system, r.system),
            " ".join(f"{x:.2f}" for x in r.load_before) or "?",
            "?" if r.others_cpu_share is None else f"{r.others_cpu_share:.0%}",
            f"{r.seconds:.2f}",
            f"{r.output_tokens:,}",
            f"{r.tok_s:,.1f}",
            f"{r.cpu_s_per_token * 1e3:.3f}",
        ]
        for r in records
    ]
    columns = ["run", "system", "load before", "others' CPU", "seconds", "tokens", "tok/s", "CPU ms/token"]
    return _table(columns, rows)


def plot_runs(path: Path, records: Sequence[RunRecord], labels: dict[str, str]) -> str | None:
    """A PNG of tok/s per run for every system, one panel per workload; the reason when it cannot be made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'pagedkv[bench]')"
    workloads = list(dict.fromkeys(r.workload for r in records))
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in records if r.workload == workload]
        for system, neighbour in dict.fromkeys((r.system, r.neighbour) for r in mine):
            points = [(r.round, r.tok_s) for r in mine if r.system == system and r.neighbour == neighbour]
            label = labels.get(system, system) + (", busy neighbour" if neighbour else "")
            ax.plot(*zip(*points), marker="o", linestyle="--" if neighbour else "-", label=label)
        ax.set_title(f"workload: {workload}")
        ax.set_xlabel("run")
        ax.set_ylabel("output tok/s")
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({r.round for r in mine}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("pagedkv vs vLLM (offline, same requests), tok/s per run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------------------------------- command


@dataclass
class WorkloadReport:
    spec: WorkloadSpec
    records: list[RunRecord] = field(default_factory=list)
    medians: dict[str, float] = field(default_factory=dict)
    ratio: float | None = None
    best_vllm: str | None = None
    equality: dict[str, Any] = field(default_factory=dict)
    noisy_records: list[RunRecord] = field(default_factory=list)
    noisy_medians: dict[str, float] = field(default_factory=dict)

    def falls(self) -> dict[str, float]:
        """Each system's fall in median tok/s with the busy neighbour: 1 - noisy / quiet."""
        return {k: 1 - self.noisy_medians[k] / v for k, v in self.medians.items() if v and k in self.noisy_medians}

    def noisy_ok(self) -> bool | None:
        """pagedkv falls by no more than the vLLM setting the ratio is taken against (None: not measured)."""
        falls = self.falls()
        if "pagedkv" not in falls or self.best_vllm not in falls:
            return None
        return falls["pagedkv"] <= falls[self.best_vllm]


def _special_ids(model_dir: Path, config: Any) -> set[int]:
    from pagedkv.bench.throughput import _special_ids as special

    return special(model_dir, config)


@click.command(
    "peer",
    help=f"""pagedkv against vLLM on this machine: the same requests to pagedkv's engine (a real blockd) and to
    vLLM's offline LLM.generate, run in vLLM's own virtual environment by path (--vllm-python; `make peer-env`
    builds .venv-peer).

    Workloads (seeded; greedy, ignore_eos, exactly each request's output length):
    default = {WORKLOADS["default"].describe()};
    long = {WORKLOADS["long"].describe()};
    prefix = {WORKLOADS["prefix"].describe()} (prefix caching on in both).
    Same model (vLLM loads the same directory), the same KV memory, max_num_seqs and max_num_batched_tokens.

    Each system gets an untimed warm-up, then --runs rounds alternate the systems (pagedkv, vLLM with its default
    threads, vLLM with VLLM_CPU_OMP_THREADS_BIND=--bind-cpus, ...), each timed over generation only. Reported:
    every run with the load average before it and the CPU seconds per token of its process tree; the median
    tok/s of each; the ratio pagedkv ÷ the faster vLLM setting; token equality of the outputs, with each
    divergence checked for a near tie against transformers' logits. Progress on stderr; the last line of stdout
    is one JSON object (ratio_default, ratio_long, ratio_prefix: null where not run).

    All systems stay loaded for the whole bench; during each timed run the others' processes are paused
    (SIGSTOP, then SIGCONT; --no-pause-idle keeps them running): an idle vLLM's engine core polls, taking about
    a tenth of a core, which slows whichever system is being timed.

    --noisy-neighbour: after each workload's rounds, the same rounds again with another process saturating a
    core beside each run (a bounded busy loop the bench starts just before and stops after it); reported: each
    system's median with the neighbour and its fall from the quiet median, and whether pagedkv falls by no more
    than the vLLM setting the ratio is taken against (JSON: noisy_ok_default, ...).

    --quick: tiny workloads and one round, for tests; the figures mean nothing.

    --serve: serving instead, side by side: `vllm serve` and `pagedkv serve` (one executor) in turn, never both at
    once, with the same model, KV memory, max_num_seqs and max_num_batched_tokens (vLLM bound to --bind-cpus
    unless --vllm-threads default), each driven by vLLM's own client, `vllm bench serve --backend openai-chat`:
    random prompts of 256 tokens, 64 output tokens (ignore_eos), --serve-prompts per load, seeded; loads
    concurrent16 (16 in flight) and rate4 (Poisson, 4 req/s). Reported per load: both systems' output tok/s,
    TTFT and TPOT, and pagedkv ÷ vLLM of each (aim: tok/s >= 1, TTFT and TPOT p50 <= 1); the last line of stdout
    is one JSON object (serve_ratios). With --quick: 16 prompts of 32 tokens, 8 output tokens.

    --startup measures startup instead (see pagedkv/bench/peer_startup.py): loading the default model and a ~1 GB
    checkpoint (generated once, or --startup-model) in pagedkv against vLLM's LLM(...) construction, compiled and
    enforce_eager, cold (fresh vLLM caches) then warm; and `pagedkv serve` against `vllm serve` until /health is
    healthy. Each start is a new process; --runs warm rounds, medians; the last line of stdout is one JSON object
    (ratio_default_model, ratio_1gb, ratio_serve: pagedkv seconds ÷ the faster vLLM setting's, below 1.0 is
    faster; serve_to_healthy_s). With --quick: a tiny checkpoint instead of 1 GB.""",
)
@click.option("--startup", is_flag=True, help="Measure startup (load and serve-to-healthy times) instead.")
@click.option(
    "--startup-model",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="--startup's ~1 GB checkpoint: used if this directory holds one, generated into it otherwise "
    "(default: under $PAGEDKV_HOME/models/bench).",
)
@click.option(
    "--workload",
    "workloads",
    type=click.Choice([*WORKLOADS, "all"]),
    multiple=True,
    default=("all",),
    show_default=True,
    help="Which workloads to run (repeatable).",
)
@click.option("--runs", type=click.IntRange(min=1), default=DEFAULT_RUNS, show_default=True, help="Rounds.")
@click.option("--quick", is_flag=True, help="Tiny workloads and one round, for tests.")
@click.option(
    "--noisy-neighbour",
    is_flag=True,
    help="Also run every round with a core-saturating busy loop beside it, and report each system's fall.",
)
@click.option(
    "--pause-idle/--no-pause-idle",
    default=True,
    show_default=True,
    help="Pause (SIGSTOP) the other systems' processes during each timed run: a loaded, idle vLLM polls.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a PNG of tok/s per run for both systems here (needs matplotlib).",
)
@click.option(
    "--vllm-python",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"The vLLM environment's interpreter (default: {PEER_PYTHON}, in the current directory or the repository).",
)
@click.option(
    "--vllm-driver",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=DRIVER,
    show_default="peer_driver.py beside this module",
    help="The script --vllm-python runs (tests give a fake).",
)
@click.option(
    "--vllm-threads",
    type=click.Choice(["both", "default", "bind"]),
    default="both",
    show_default=True,
    help="vLLM's thread settings to run: its default, VLLM_CPU_OMP_THREADS_BIND=--bind-cpus, or both.",
)
@click.option(
    "--bind-cpus",
    default=f"0-{(os.cpu_count() or 1) - 1}",
    show_default=True,
    help="VLLM_CPU_OMP_THREADS_BIND of the bound setting.",
)
@click.option("--vllm-eager", is_flag=True, help="vLLM without torch.compile (enforce_eager).")
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint directory (default: the generated default llama).",
)
@click.option("--kv-cache-memory", default=DEFAULT_KV, show_default=True, help="KV memory of each system.")
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True, help="pagedkv's block size.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option(
    "--tie-tolerance",
    type=click.FloatRange(min=0),
    default=DEFAULT_TIE_TOLERANCE,
    show_default=True,
    help="Largest gap between transformers' top two logits that makes a divergence a near tie.",
)
@threads_option("pagedkv's torch intra-op threads (default: torch's own choice, one per core).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the workloads.")
@click.option(
    "--serve",
    is_flag=True,
    help="Serving instead: `vllm serve` and `pagedkv serve` in turn, driven by `vllm bench serve` (see below).",
)
@click.option(
    "--serve-prompts",
    type=click.IntRange(min=1),
    default=None,
    help="--serve: prompts per load (default 200; --quick: 16).",
)
@click.option(
    "--serve-load",
    "serve_loads",
    type=click.Choice(["concurrent16", "rate4", "all"]),
    multiple=True,
    default=("all",),
    show_default=True,
    help="--serve: which loads to run (repeatable).",
)
@click.option(
    "--vllm-cli",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=Path(__file__).with_name("vllm_cli.py"),
    show_default="vllm_cli.py beside this module",
    help="--serve: the script --vllm-python runs as vLLM's command line (tests give a fake).",
)
@click.pass_context
def bench_peer(
    ctx: click.Context,
    startup: bool,
    startup_model: Path | None,
    workloads: tuple[str, ...],
    runs: int,
    quick: bool,
    noisy_neighbour: bool,
    pause_idle: bool,
    plot_path: Path | None,
    vllm_python: Path | None,
    vllm_driver: Path,
    vllm_threads: str,
    bind_cpus: str,
    vllm_eager: bool,
    model_dir: Path | None,
    kv_cache_memory: str,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    tie_tolerance: float,
    threads: int | None,
    seed: int,
    serve: bool,
    serve_prompts: int | None,
    serve_loads: tuple[str, ...],
    vllm_cli: Path,
) -> None:
    if serve:
        from pagedkv.bench.peer_serve import run_serve_bench

        run_serve_bench(
            loads=serve_loads,
            prompts=serve_prompts,
            quick=quick,
            vllm_python=vllm_python,
            vllm_cli=vllm_cli,
            vllm_threads=str(unless_given(ctx, vllm_threads, "vllm_threads", "bind")),
            bind_cpus=bind_cpus,
            vllm_eager=vllm_eager,
            model_dir=model_dir,
            kv_cache_memory=kv_cache_memory,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            threads=threads,
            seed=seed,
        )
        return
    import torch

    from executor.runner import kv_bytes_per_block
    from pagedkv.bench.common import blockd_process
    from pagedkv.bench.throughput import build_engine

    echo = click.echo
    specs = QUICK_WORKLOADS if quick else WORKLOADS
    if quick:
        runs = unless_given(ctx, runs, "runs", 1)
    if startup:
        from pagedkv.bench.peer_startup import StartupConfig, run_startup

        run_startup(StartupConfig.from_params({**ctx.params, "runs": runs}))
        return
    names = list(specs) if "all" in workloads else list(dict.fromkeys(workloads))
    budget, python = check_setup(max_num_seqs, max_num_batched_tokens, kv_cache_memory, vllm_python)
    if threads is not None:
        torch.set_num_threads(threads)
    pagedkv_threads = torch.get_num_threads()
    settings: list[tuple[str, str | None]] = []
    if vllm_threads in ("both", "default"):
        settings.append(("vllm-default", None))
    if vllm_threads in ("both", "bind"):
        settings.append(("vllm-bind", bind_cpus))
    labels = {"pagedkv": "pagedkv", "vllm-default": "vLLM default threads", "vllm-bind": f"vLLM bind {bind_cpus}"}

    model_dir, config = bench_model(model_dir)
    special = _special_ids(model_dir, config)
    plans = {name: build_workload(specs[name], config.vocab_size, special, seed) for name in names}
    max_len = max(len(r.prompt) + r.output_len for reqs in plans.values() for r in reqs)
    if max_len > config.max_model_len:
        raise click.ClickException(
            f"the workloads need {max_len} tokens a sequence; the model holds {config.max_model_len}"
        )
    per_block = kv_bytes_per_block(config, block_size, torch.float32)
    num_blocks = budget // per_block
    if (num_blocks - max(1, num_blocks // 100)) * block_size < max_len:
        raise click.BadParameter(
            f"{budget:,} bytes hold no sequence of {max_len} tokens", param_hint="'--kv-cache-memory'"
        )

    echo(
        f"model:    {model_dir} ({config.architecture}, {config.num_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}); cpu, float32; pagedkv: {pagedkv_threads} torch threads, "
        f"{num_blocks:,} blocks of {block_size}; {os.cpu_count()} cores"
    )
    echo(
        f"limits:   KV {budget / 2**30:.3g} GiB each, max_num_seqs {max_num_seqs}, max_num_batched_tokens "
        f"{max_num_batched_tokens}, longest sequence {max_len}; vLLM: {python}"
        + (", enforce_eager" if vllm_eager else "")
    )

    reports: dict[str, WorkloadReport] = {}
    vllm_info: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedkv-bench-peer-")))
        endpoint, blockd = stack.enter_context(
            blockd_process(tmp / "blockd.log", "--no-persistence", "--lease-timeout", "3600")
        )
        click.echo(f"starting vLLM ({', '.join(labels[n] for n, _ in settings)}) and loading pagedkv", err=True)
        peers: list[VllmSystem] = []
        for name, bind in settings:
            peer = VllmSystem(name, python, vllm_driver, driver_env(bind), tmp / f"{name}.log", tmp)
            stack.callback(peer.close)
            peers.append(peer)
        load_msg = {
            "op": "load",
            "model": str(Path(model_dir).resolve()),
            "dtype": "float32",
            "kv_cache_bytes": budget,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max_len,
            "enable_prefix_caching": True,
            "enforce_eager": vllm_eager,
            "seed": 0,
        }
        for peer in peers:  # both load at once; nothing is timed yet
            peer.send(load_msg)
        engine = build_engine(
            model_dir,
            endpoint,
            device=torch.device("cpu"),
            dtype=torch.float32,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        stack.callback(_quietly, engine.pool.client.close)
        stack.callback(_quietly, engine.pool.unregister)
        for peer in peers:
            peer.info = peer.receive()
            vllm_info[peer.name] = {k: v for k, v in peer.info.items() if k != "ok"}
            info = peer.info
            click.echo(
                f"  {labels[peer.name]}: vLLM {info.get('vllm')} (torch {info.get('torch')}) loaded in "
                f"{info.get('load_s', 0):.1f} s; blocks of {info.get('block_size')}, compilation "
                f"{info.get('compilation')}, VLLM_CPU_OMP_THREADS_BIND={info.get('threads_bind')}",
                err=True,
            )
        systems: list[System] = [PagedSystem(engine, blockd.pid), *peers]

        for name in names:
            spec, requests = specs[name], plans[name]
            total = sum(r.output_len for r in requests)
            click.echo(f"[{name}] {spec.describe()}; {total:,} output tokens; warm-up, then {runs} rounds", err=True)

            def progress(record: RunRecord, name: str = name) -> None:
                where = f"{name}, busy neighbour" if record.neighbour else name
                click.echo(
                    f"  [{where}] run {record.round} {labels[record.system]:>22}: {record.output_tokens:,} tokens in "
                    f"{record.seconds:.2f} s = {record.tok_s:,.1f} tok/s (load before "
                    f"{' '.join(f'{x:.2f}' for x in record.load_before)})",
                    err=True,
                )

            records, outputs = run_rounds(name, requests, systems, runs, progress, pause_idle=pause_idle)
            report = WorkloadReport(spec, records, medians(records))
            report.ratio, report.best_vllm = ratio_against_best(report.medians)
            report.equality = _equality(requests, outputs, model_dir, tie_tolerance, labels)
            if noisy_neighbour:
                click.echo(f"[{name}] again, each run with a busy-loop neighbour on one core", err=True)
                report.noisy_records, _ = run_rounds(
                    name, requests, systems, runs, progress, warm_up=False, neighbour=True, pause_idle=pause_idle
                )
                report.noisy_medians = medians(report.noisy_records)
            reports[name] = report

    plot_note = None
    if plot_path is not None:
        plot_note = plot_runs(
            plot_path, [r for rep in reports.values() for r in (*rep.records, *rep.noisy_records)], labels
        )
        click.echo(f"plot: {plot_path}" if plot_note is None else f"no plot: {plot_note}", err=True)

    for name, report in reports.items():
        echo("")
        echo(f"workload {name}: {report.spec.describe()}")
        for line in runs_table(report.records, labels):
            echo("  " + line)
        meds = "; ".join(f"{labels[k]} {v:,.1f}" for k, v in report.medians.items())
        echo(f"  median tok/s: {meds}")
        if report.ratio is not None:
            echo(f"  ratio pagedkv ÷ {labels[report.best_vllm or '']}: {report.ratio:.2f}")
        for line in report.equality["lines"]:
            echo("  " + line)

    echo("")
    columns = ["workload", "pagedkv tok/s", *(f"{labels[n]} tok/s" for n, _ in settings), "pagedkv ÷ best vLLM"]
    rows = [
        [
            name,
            f"{rep.medians.get('pagedkv', 0):,.1f}",
            *(f"{rep.medians.get(n, 0):,.1f}" for n, _ in settings),
            "-" if rep.ratio is None else f"{rep.ratio:.2f}",
        ]
        for name, rep in reports.items()
    ]
    for line in _summary_table(columns, rows):
        echo(line)
    echo(
        f"medians of {runs} run(s) each, alternated; {os.cpu_count()} cores"
        + ("; the other systems paused during each run" if pause_idle else "")
        + (" [--quick: figures mean nothing]" if quick else "")
    )
    if noisy_neighbour:
        echo("")
        echo("with a busy-loop neighbour on one core (median tok/s, and the fall from the quiet median):")
        columns = ["workload", *(labels[n] for n in ("pagedkv", *(n for n, _ in settings))), "pagedkv falls least"]
        rows = []
        for name, rep in reports.items():
            falls = rep.falls()
            cells = [
                f"{rep.noisy_medians.get(n, 0):,.1f} ({-100 * falls.get(n, 0):+.0f} %)"
                for n in ("pagedkv", *(n for n, _ in settings))
            ]
            ok = rep.noisy_ok()
            rows.append([name, *cells, "-" if ok is None else "yes" if ok else "no"])
        for line in _summary_table(columns, rows):
            echo(line)

    def ratio_of(name: str) -> float | None:
        rep = reports.get(name)
        return None if rep is None or rep.ratio is None else round(rep.ratio, 4)

    echo(
        json.dumps(
            {
                "ratio_default": ratio_of("default"),
                "ratio_long": ratio_of("long"),
                "ratio_prefix": ratio_of("prefix"),
                **({f"noisy_ok_{name}": rep.noisy_ok() for name, rep in reports.items()} if noisy_neighbour else {}),
                "workloads": {
                    name: {
                        "spec": asdict(rep.spec),
                        "medians_tok_s": {k: round(v, 2) for k, v in rep.medians.items()},
                        "best_vllm": rep.best_vllm,
                        "runs": [r.as_json() for r in rep.records],
                        "equality": {k: v for k, v in rep.equality.items() if k != "lines"},
                        **(
                            {
                                "noisy_medians_tok_s": {k: round(v, 2) for k, v in rep.noisy_medians.items()},
                                "noisy_falls": {k: round(v, 4) for k, v in rep.falls().items()},
                                "noisy_runs": [r.as_json() for r in rep.noisy_records],
                            }
                            if noisy_neighbour
                            else {}
                        ),
                    }
                    for name, rep in reports.items()
                },
                "vllm": vllm_info,
                "vllm_python": str(python),
                "model": str(model_dir),
                "kv_cache_bytes": budget,
                "block_size": block_size,
                "num_blocks": num_blocks,
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
                "pagedkv_threads": pagedkv_threads,  # as configured: the thread governor may have changed it since
                "runs": runs,
                "pause_idle": pause_idle,
                "seed": seed,
                "tie_tolerance": tie_tolerance,
                "plot": None if plot_path is None or plot_note else str(plot_path),
                "cpu_count": os.cpu_count(),
                "quick": quick,
            }
        )
    )


def _quietly(fn: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        fn()


def _summary_table(columns: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    return [
        "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(cells, widths)))
        for cells in (columns, *rows)
    ]


def _equality(
    requests: Sequence[BenchRequest],
    outputs: dict[str, list[dict[str, list[int]]]],
    model_dir: Path,
    tolerance: float,
    labels: dict[str, str],
) -> dict[str, Any]:
    """Token equality of pagedkv's first run against each vLLM setting's first run (near ties checked), and of
    each system's runs among themselves."""
    lines: list[str] = []
    result: dict[str, Any] = {"requests": len(requests), "against": {}, "repeatable": {}}
    logits_at: Callable[[list[int]], list[float]] | None = None
    by_id = {r.request_id: r for r in requests}
    ours = outputs["pagedkv"][0]
    for system, runs in outputs.items():
        same = all(run == runs[0] for run in runs[1:])
        result["repeatable"][system] = same
        if not same:
            lines.append(f"{labels[system]}: its runs' outputs differ from each other")
    for system, runs in outputs.items():
        if system == "pagedkv":
            continue
        found = compare_outputs(requests, ours, runs[0])
        checks: list[TieCheck] = []
        if found and logits_at is None:
            logits_at = hf_logits_fn(model_dir)
        for d in found[:MAX_TIE_CHECKS]:
            assert logits_at is not None
            checks.append(check_near_tie(logits_at, by_id[d.request_id], d, ours[d.request_id], tolerance))
        ties = sum(c.near_tie for c in checks)
        text = f"outputs: pagedkv = {labels[system]} on {len(requests) - len(found)}/{len(requests)} requests"
        if found:
            text += f"; of {len(checks)} divergences checked, {ties} near ties (top-two logits within {tolerance:g})"
            if len(found) > len(checks):
                text += f", {len(found) - len(checks)} not checked"
        lines.append(text)
        for c in checks:
            if not c.near_tie:
                d = c.divergence
                agrees = {d.ours: "pagedkv", d.theirs: labels[system]}.get(c.top[0], "neither")
                lines.append(
                    f"  NOT a near tie: request {d.request_id} at output token {d.position}: pagedkv {d.ours}, "
                    f"{labels[system]} {d.theirs}; transformers' top two {c.top} {c.gap:.3g} apart "
                    f"(transformers picks {c.top[0]}: {agrees})"
                )
        result["against"][system] = {
            "equal_requests": len(requests) - len(found),
            "divergences": [
                {
                    **asdict(c.divergence),
                    "top_two": list(c.top),
                    "gap": c.gap,
                    "near_tie": c.near_tie,
                    "transformers_agrees_with": (
                        "pagedkv"
                        if c.top[0] == c.divergence.ours
                        else system
                        if c.top[0] == c.divergence.theirs
                        else None
                    ),
                }
                for c in checks
            ],
            "unchecked": max(0, len(found) - len(checks)),
            "near_ties": ties,
        }
    result["lines"] = lines
    return result


__all__ = [
    "QUICK_WORKLOADS",
    "WORKLOADS",
    "Divergence",
    "RunRecord",
    "TieCheck",
    "bench_peer",
    "build_workload",
    "check_near_tie",
    "compare_outputs",
    "medians",
    "paused",
    "ratio_against_best",
    "run_rounds",
    "schedule",
]
