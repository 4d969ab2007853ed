"""`pagedkv bench tiers`: multi-turn conversations whose working set is several times the device KV, with the
lower KV tiers off, in host memory, in host memory and on disk, and with FP8 blocks (and a host tier); then the
same conversations on vLLM's CPU build with its prefix caching, and with its CPU offloading.

Each pagedkv configuration gets its own blockd and executor (a real process each, on the CPU or one GPU); each vLLM
configuration its own `vllm serve` (`tiers_vllm.py`). The workload, its infinite-cache reference and the driver
are in `tiers_workload.py`. Figures: the prefix hit rate against an infinite cache's, time to first token (p50,
p99) of the re-visited turns (the second on) and of all turns, throughput, the tiers' counters, and pagedkv ÷ vLLM.
`--rounds N` runs every configuration once per round, the order reversed every second round (`peer_rounds.schedule`,
as `bench peer` alternates its systems), and reports each figure's median over the rounds and each round's own.
Greedy decoding: the configurations of the model's KV dtype see the same tokens (checked: `outputs_equal`). Method
and figures: docs/benchmarks.md ("KV tiers"). The last stdout line is one JSON object of every figure.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from blockd.client import BlockdClient
from common import processes
from common.cpu import machine_busy_s
from common.limits import SUPPORTED_BLOCK_SIZES
from common.net import free_port
from executor import protocol as ep
from executor.client import ExecutorClient, ExecutorUnavailable
from executor.params import SamplingParams
from pagedkv.bench.common import blockd_daemon, log_tail, table_lines
from pagedkv.bench.peer_rounds import schedule
from pagedkv.bench.peer_serve import VLLM_CLI, ServerFailed
from pagedkv.bench.peer_systems import default_vllm_python, read_loadavg
from pagedkv.bench.shapes import DEFAULT_SHAPE, SHAPES, ensure_shape
from pagedkv.bench.tiers_vllm import VllmSettings, run_vllm
from pagedkv.bench.tiers_workload import (
    BLOCK_SIZE,
    BackendError,
    ConfigResult,
    Event,
    Workload,
    converse,
    warm_up,
)

PAGEDKV_CONFIGS = ("off", "host", "host+disk", "fp8")
VLLM_CONFIGS = ("vllm", "vllm+offload")
CONFIGS = PAGEDKV_CONFIGS + VLLM_CONFIGS
#: Each vLLM configuration against the pagedkv one that keeps the same KV: the device only, or a host tier too.
PEERS = {"vllm": "off", "vllm+offload": "host"}
MAX_NUM_SEQS = 128  # the executor's defaults, given to vLLM too
MAX_NUM_BATCHED_TOKENS = 2048
REQUEST_TIMEOUT_S = 600.0
#: The issue's aims: re-visited TTFT p50 this many times better than tiers off, hits this share of the infinite's.
AIM_SPEEDUP, AIM_OF_INFINITE = 3.0, 0.9


class ExecutorBackend:
    """pagedkv's executor over its ZeroMQ protocol (`ExecutorClient`)."""

    def __init__(self, client: ExecutorClient) -> None:
        self.client = client

    def submit(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.client.submit(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    def receive(self) -> Event:
        while True:
            message = self.client.receive()
            if type(message) is ep.Rejected:
                raise BackendError(f"request {message.request_id} rejected: {message.message}")
            if type(message) is ep.Delta:
                return Event(message.request_id, list(message.token_ids), message.finish_reason, message.cached_tokens)


def block_bytes(model: Path, block_size: int, kv_dtype: str = "auto") -> int:
    """Bytes of one KV block of the model: K and V of every layer, in the model's dtype or in 8 bits."""
    from executor.checkpoint import load_config

    c = load_config(model)
    element = 1 if kv_dtype.startswith("fp8") else 2 if c.torch_dtype in ("float16", "bfloat16") else 4
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * element


def config_flags(config: str, workload: Workload, model: Path, disk_dir: Path) -> list[str]:
    """The executor's flags: host memory for the whole working set (host; fp8, in 8-bit blocks), or for a quarter
    of it with the disk for all of it (host+disk)."""
    working = workload.working_set_blocks() * block_bytes(model, workload.block_size)
    if config == "host":
        return ["--host-kv-memory", str(working)]
    if config == "host+disk":
        return [
            "--host-kv-memory",
            str(working // 4),
            "--disk-kv-dir",
            str(disk_dir),
            "--disk-kv-size",
            str(2 * working),
        ]
    if config == "fp8":
        fp8_working = workload.working_set_blocks() * block_bytes(model, workload.block_size, "fp8")
        return ["--kv-cache-dtype", "fp8_e4m3", "--host-kv-memory", str(fp8_working)]
    return []


def run_pagedkv(
    model: Path,
    config: str,
    flags: list[str],
    num_blocks: int,
    workload: Workload,
    logs: Path,
    device: str,
    progress: Callable[[str], None],
) -> ConfigResult:
    result = ConfigResult(config, "pagedkv", flags)
    slug = config.replace("+", "-")
    with blockd_daemon(logs / f"blockd-{slug}.log", "--no-persistence") as blockd:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        log = logs / f"executor-{slug}.log"
        argv = [
            sys.executable,
            "-m",
            "executor.main",
            "--model",
            str(model),
            "--device",
            device,
            "--blockd",
            blockd,
            "--bind",
            endpoint,
            "--block-size",
            str(workload.block_size),
            "--num-blocks",
            str(num_blocks),
            "--log-level",
            "warning",
            *flags,
        ]
        process = processes.start(argv, log)
        try:
            _wait_ready(process, endpoint, log)
            with ExecutorClient(endpoint, timeout_s=REQUEST_TIMEOUT_S) as client:
                backend = ExecutorBackend(client)
                warm_up(backend, workload.block_size)
                started = time.perf_counter()
                result.turns = converse(backend, workload, progress)
                result.wall_s = time.perf_counter() - started
                result.executor_tiers = dict(client.load().tiers)
            with BlockdClient(blockd, timeout_s=5) as bc:
                for pool in bc.stats().pools:
                    result.blockd_tiers += [
                        {"medium": t.medium, "capacity_blocks": t.capacity_blocks, "blocks": t.blocks}
                        | {k: getattr(t.counters, k) for k in ("hits", "loads", "demotions", "drops")}
                        for t in pool.tiers
                    ]
        finally:
            processes.stop([process])
    return result


@dataclass(frozen=True)
class Setup:
    """What every configuration's run shares: the model, the workload and the device KV it gets."""

    model: Path
    workload: Workload
    block_size: int
    one_block: int  # bytes of one block in the model's KV dtype
    num_blocks: int  # the device KV, in those blocks
    device: str
    vllm: VllmSettings


@dataclass
class Run:
    """One configuration's run in one round, and the machine around it."""

    round: int  # 1-based
    result: ConfigResult
    load_before: list[float]  # /proc/loadavg's 1, 5 and 15 minute figures just before the run
    machine_cpu_share: float | None  # of the machine's CPU, what all processes (the run's own too) used during it
    others_cpu_share: float | None  # of it, what processes other than the bench and its reaped children used


def own_cpu_s() -> float:
    """CPU seconds of this process (every thread) and of its children once reaped: the executors and blockds the
    bench stops and waits for, and vLLM's server with what it reaped of its own."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_config(config: str, setup: Setup, logs: Path, progress: Callable[[str], None], note: str = "") -> ConfigResult:
    """One configuration on fresh processes. A vLLM that fails raises ServerFailed or BackendError; a pagedkv
    configuration that fails is the command's error."""
    workload, model = setup.workload, setup.model
    if config in VLLM_CONFIGS:
        offload = workload.working_set_blocks() * setup.one_block if config == "vllm+offload" else None
        kv_bytes = setup.num_blocks * setup.one_block
        progress(f"running {config} (vllm serve, {kv_bytes:,} KV bytes{', ' + note if note else ''})")
        return run_vllm(
            config, model, setup.vllm, workload, kv_bytes, offload, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, logs, progress
        )
    flags = config_flags(config, workload, model, logs / f"disk-{config.replace('+', '-')}")
    # The same device bytes: 8-bit blocks are 2x (16-bit models) or 4x (float32) as many.
    blocks = setup.num_blocks
    if config == "fp8":
        blocks = setup.num_blocks * setup.one_block // block_bytes(model, setup.block_size, "fp8")
    progress(" ".join(["running", config, "--num-blocks", str(blocks), *flags, *([f"({note})"] if note else [])]))
    try:
        return run_pagedkv(model, config, flags, blocks, workload, logs, setup.device, progress)
    except BackendError as exc:
        raise click.ClickException(f"{config}: {exc}") from None


#: The figures a configuration's row gives as their median over the rounds; its flags and counters are its first
#: round's, its speedup the median of each round's (`median_row`).
MEDIAN_FIGURES = (
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "infinite_cache_tokens",
    "prefix_hit_rate",
    "infinite_cache_hit_rate",
    "hit_rate_of_infinite",
    "ttft_p50_s",
    "ttft_p99_s",
    "revisited_ttft_p50_s",
    "revisited_ttft_p99_s",
    "output_tokens_per_s",
    "prompt_tokens_per_s",
    "wall_s",
    "turns_equal_to_reference",
)


RUN_ONLY = ("round", "load_before", "machine_cpu_share", "others_cpu_share")  # a run's, not a median row's


def run_figures(run: Run, reference: ConfigResult | None) -> dict[str, Any]:
    """One run's figures, its round and the machine's load, and how many of its turns answered as the reference's."""
    f = {"round": run.round} | run.result.figures()
    f["load_before"] = run.load_before
    for key in ("machine_cpu_share", "others_cpu_share"):
        share = getattr(run, key)
        f[key] = round(share, 3) if share is not None else None
    if reference is not None:
        theirs, ours = run.result.outputs(), reference.outputs()
        f["turns_equal_to_reference"] = sum(theirs[k] == ours.get(k) for k in theirs)
    return f


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A configuration's runs, one per round, as one row: the median of each figure over the rounds, the re-visited
    speedup the median of the rounds' own (each against the same round's off) with their range."""
    row = {k: v for k, v in rows[0].items() if k not in RUN_ONLY}
    for key in MEDIAN_FIGURES:
        if key in row:
            m = statistics.median(r[key] for r in rows)
            row[key] = int(m) if isinstance(rows[0][key], int) and float(m).is_integer() else round(m, 4)
    speedups = [r["revisited_ttft_speedup"] for r in rows if r["revisited_ttft_speedup"] is not None]
    row["revisited_ttft_speedup"] = round(statistics.median(speedups), 2) if speedups else None
    row["revisited_ttft_speedup_range"] = [min(speedups), max(speedups)] if speedups else None
    row["rounds"] = len(rows)
    return row


def _wait_ready(process: subprocess.Popen[bytes], endpoint: str, log: Path) -> None:
    def alive() -> None:
        if process.poll() is not None:
            raise processes.NotReady(f"the executor {processes.describe_exit(process.returncode)}")

    try:
        with ExecutorClient(endpoint, timeout_s=0.5) as client:
            processes.wait_until(processes.answer(client.info, ExecutorUnavailable), 180, check=alive, poll_s=0)
    except processes.NotReady as exc:
        raise click.ClickException(f"{exc}; its log:\n{log_tail(log)}") from None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def comparisons(figures: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, bool | None]]:
    """pagedkv ÷ vLLM for each vLLM configuration against its pagedkv peer, and whether each aim is met."""
    pairs = []
    for theirs, ours in PEERS.items():
        a, b = figures.get(ours), figures.get(theirs)
        if a is None or b is None:
            continue
        pairs.append(
            {
                "pagedkv": ours,
                "vllm": theirs,
                # below 1: pagedkv's first tokens come sooner
                "revisited_ttft_p50": _ratio(a["revisited_ttft_p50_s"], b["revisited_ttft_p50_s"]),
                "revisited_ttft_p99": _ratio(a["revisited_ttft_p99_s"], b["revisited_ttft_p99_s"]),
                "ttft_p50": _ratio(a["ttft_p50_s"], b["ttft_p50_s"]),
                # above 1: pagedkv hits more, answers faster
                "prefix_hit_rate": _ratio(a["prefix_hit_rate"], b["prefix_hit_rate"]),
                "output_tokens_per_s": _ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            }
        )
    # Each system's best that ran: vLLM's CPU offloading may not run at all (it needs a GPU in 0.32).
    best_vllm = next((figures[n] for n in ("vllm+offload", "vllm") if n in figures), None)
    if best_vllm is not None and "host" in figures and not any(p["pagedkv"] == "host" for p in pairs):
        a, b = figures["host"], best_vllm
        pairs.append(
            {
                "pagedkv": "host",
                "vllm": b["config"],
                "revisited_ttft_p50": _ratio(a["revisited_ttft_p50_s"], b["revisited_ttft_p50_s"]),
                "revisited_ttft_p99": _ratio(a["revisited_ttft_p99_s"], b["revisited_ttft_p99_s"]),
                "ttft_p50": _ratio(a["ttft_p50_s"], b["ttft_p50_s"]),
                "prefix_hit_rate": _ratio(a["prefix_hit_rate"], b["prefix_hit_rate"]),
                "output_tokens_per_s": _ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            }
        )
    with_tiers = [p for p in pairs if p["pagedkv"] == "host"]  # the aim: pagedkv with its tier, vLLM its best
    tiered = [f for name, f in figures.items() if name in PAGEDKV_CONFIGS and name != "off"]
    aims: dict[str, bool | None] = {
        "revisited_ttft_speedup_ge_3": all((f["revisited_ttft_speedup"] or 0) >= AIM_SPEEDUP for f in tiered)
        if tiered and "off" in figures
        else None,
        "hit_rate_ge_90pct_of_infinite": all(f["hit_rate_of_infinite"] >= AIM_OF_INFINITE for f in tiered)
        if tiered
        else None,
        "ahead_of_vllm": all(
            (p["revisited_ttft_p50"] or 9) < 1 and (p["output_tokens_per_s"] or 0) > 1 for p in with_tiers
        )
        if with_tiers
        else None,
    }
    return pairs, aims


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _speedup(f: dict[str, Any]) -> str:
    """The re-visited p50 speedup against off, with its range over the rounds where there were several."""
    if not f["revisited_ttft_speedup"]:
        return "-"
    low, high = f.get("revisited_ttft_speedup_range") or (None, None)
    spread = f" ({low}..{high})" if low != high else ""
    return f"{f['revisited_ttft_speedup']}x{spread}"


def round_lines(runs: list[dict[str, Any]], rounds: int) -> list[str]:
    """Each run in the order they ran: its round, the machine's load before it and its CPU during it, its figures
    and its speedup against the same round's off; then each tier's speedups over the rounds."""
    columns = ["round", "config", "load", "machine CPU", "others CPU", "revisit p50", "revisit p99", "TTFT p50"]
    columns += ["speedup", "out tok/s", "wall s"]
    rows = [
        [
            str(f["round"]),
            f["config"],
            f"{f['load_before'][0]:.2f}" if f["load_before"] else "-",
            f"{f['machine_cpu_share']:.0%}" if f["machine_cpu_share"] is not None else "-",
            f"{f['others_cpu_share']:.0%}" if f["others_cpu_share"] is not None else "-",
            _ms(f["revisited_ttft_p50_s"]),
            _ms(f["revisited_ttft_p99_s"]),
            _ms(f["ttft_p50_s"]),
            f"{f['revisited_ttft_speedup']}x" if f["revisited_ttft_speedup"] else "-",
            f"{f['output_tokens_per_s']:.1f}",
            f"{f['wall_s']:.1f}",
        ]
        for f in runs
    ]
    lines = [f"each run, {rounds} rounds alternated (load: the 1-minute load average before it):"]
    lines += table_lines(columns, rows)
    tiers: dict[str, list[float]] = {}
    for f in runs:
        if f["revisited_ttft_speedup"] and f["config"] != "off":
            tiers.setdefault(f["config"], []).append(f["revisited_ttft_speedup"])
    if tiers:
        lines.append(
            "revisit p50 speedup against the same round's off, median (min..max) of the rounds: "
            + ", ".join(
                f"{name} {statistics.median(v):.2f}x ({min(v)}..{max(v)}; {', '.join(f'{x}x' for x in v)})"
                for name, v in tiers.items()
            )
        )
    return lines


def report_lines(figures: list[dict[str, Any]], pairs: list[dict[str, Any]], aims: dict[str, bool | None]) -> list[str]:
    columns = ["config", "hit rate", "infinite", "of infinite", "revisit p50", "revisit p99", "TTFT p50", "TTFT p99"]
    columns += ["speedup", "out tok/s", "wall s"]
    rows = [
        [
            f["config"],
            f"{f['prefix_hit_rate']:.1%}",
            f"{f['infinite_cache_hit_rate']:.1%}",
            f"{f['hit_rate_of_infinite']:.1%}",
            _ms(f["revisited_ttft_p50_s"]),
            _ms(f["revisited_ttft_p99_s"]),
            _ms(f["ttft_p50_s"]),
            _ms(f["ttft_p99_s"]),
            _speedup(f),
            f"{f['output_tokens_per_s']:.1f}",
            f"{f['wall_s']:.1f}",
        ]
        for f in figures
    ]
    lines = table_lines(columns, rows)
    for f in figures:
        for t in f["blockd_tiers"]:
            lines.append(
                f"  {f['config']}: {t['medium']} {t['blocks']}/{t['capacity_blocks']} blocks, {t['hits']} hits, "
                f"{t['loads']} loads, {t['demotions']} demotions, {t['drops']} drops"
            )
    for p in pairs:
        lines.append(
            f"pagedkv {p['pagedkv']} / {p['vllm']}: revisit p50 {p['revisited_ttft_p50']}, revisit p99 "
            f"{p['revisited_ttft_p99']}, TTFT p50 {p['ttft_p50']} (below 1: pagedkv sooner); hit rate "
            f"{p['prefix_hit_rate']}, out tok/s {p['output_tokens_per_s']} (above 1: pagedkv ahead)"
        )
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    lines.append("aims: " + ", ".join(f"{name} {verdict[met]}" for name, met in aims.items()))
    return lines


def _choose(configs: str) -> list[str]:
    chosen = [c.strip() for c in configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown or not chosen:
        raise click.BadParameter(
            f"{', '.join(unknown) or 'none'}: choose from {', '.join(CONFIGS)}", param_hint="--configs"
        )
    return chosen


@click.command("tiers")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--model-shape", type=click.Choice(sorted(SHAPES)), default=DEFAULT_SHAPE, show_default=True)
@click.option("--conversations", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--turns", type=click.IntRange(min=2), default=8, show_default=True)
@click.option(
    "--history-tokens",
    type=click.IntRange(min=2),
    default=2048,
    show_default=True,
    help="A conversation's history at its last turn: a first message, then each turn's user message and answer.",
)
@click.option("--user-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--output-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--clients", type=click.IntRange(min=1), default=4, show_default=True, help="Conversations in flight.")
@click.option(
    "--device-fraction",
    type=click.FloatRange(min=0.01, max=1.0),
    default=0.125,
    show_default=True,
    help="The device KV holds this fraction of the working set (every history at its end).",
)
@click.option(
    "--configs",
    default=",".join(CONFIGS),
    show_default=True,
    help=f"Comma-separated: {', '.join(CONFIGS)} (without the vllm ones, no vLLM rows).",
)
@click.option(
    "--block-size",
    "block_size_choice",
    type=click.Choice([str(b) for b in SUPPORTED_BLOCK_SIZES]),
    default=str(BLOCK_SIZE),
    show_default=True,
    help="Tokens per KV block, every system's (vLLM's CPU attention takes multiples of 32 only).",
)
@click.option("--device", default="cpu", show_default=True, help="The executors' device (cpu, cuda, cuda:N).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="A small run: 6 conversations of 3 turns over 192-token histories.")
@click.option(
    "--vllm-python",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The vLLM environment's interpreter (default: .venv-peer/bin/python); without it the vLLM rows are skipped.",
)
@click.option(
    "--vllm-cli",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=VLLM_CLI,
    show_default="vllm_cli.py beside this module",
    help="The script --vllm-python runs as vLLM's command line (tests give a fake).",
)
@click.option("--vllm-eager", is_flag=True, help="vLLM without torch.compile (enforce_eager).")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run every configuration (vLLM's too, a fresh vllm serve each time) once per round, the order reversed "
    "every second round, so that the machine's load swings land on all alike; the table gives each figure's median "
    "over the rounds and the speedup as the median (min..max) of each round's against that round's off.",
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_tiers(
    model_dir: Path | None,
    model_shape: str,
    conversations: int,
    turns: int,
    history_tokens: int,
    user_tokens: int,
    output_tokens: int,
    clients: int,
    device_fraction: float,
    configs: str,
    block_size_choice: str,
    device: str,
    seed: int,
    quick: bool,
    vllm_python: Path | None,
    vllm_cli: Path,
    vllm_eager: bool,
    rounds: int,
    json_path: Path | None,
) -> None:
    """Multi-turn conversations over a device KV a fraction of their working set: tiers off, host, host + disk,
    FP8; and vLLM with prefix caching and with its CPU offloading. With --rounds, every configuration (vLLM's too)
    runs once per round in alternated orders; the figures are medians over the rounds, each run's are listed."""
    chosen = _choose(configs)
    block_size = int(block_size_choice)
    if quick:
        conversations, turns, history_tokens, user_tokens, output_tokens = 6, 3, 192, 24, 8
        clients, device_fraction = 2, 0.25
    workload = Workload(
        conversations, turns, history_tokens, user_tokens, output_tokens, clients, device_fraction, seed
    )
    try:
        workload.check()
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--history-tokens") from None
    model = model_dir if model_dir is not None else ensure_shape(model_shape)
    one_block = block_bytes(model, block_size)
    longest_blocks = -(-workload.longest_tokens // block_size)
    num_blocks = max(round(workload.working_set_blocks() * device_fraction), longest_blocks * clients + 4)
    python = vllm_python if vllm_python is not None else default_vllm_python()
    skipped: dict[str, str] = {}
    if not python.exists():
        for c in [c for c in chosen if c in VLLM_CONFIGS]:
            skipped[c] = f"no vLLM environment: {python} does not exist (make peer-env, or --vllm-python)"
            chosen.remove(c)
    setup = Setup(
        model, workload, block_size, one_block, num_blocks, device, VllmSettings(python, vllm_cli, vllm_eager)
    )

    def progress(line: str) -> None:
        click.echo(line, err=True)

    progress(
        f"{conversations} conversations x {turns} turns over {history_tokens}-token histories, working set "
        f"{workload.working_set_blocks()} blocks of {block_size} tokens ({one_block:,} bytes each); device KV "
        f"{num_blocks} blocks ({num_blocks * one_block:,} bytes; fp8: "
        f"{num_blocks * one_block // block_bytes(model, block_size, 'fp8')} blocks in the same bytes); "
        f"{rounds} round(s)"
    )
    runs: list[Run] = []
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-tiers-") as scratch:
        for round_, config in schedule(chosen, rounds, alternate=True):
            if config in skipped:  # a vLLM that failed once is not started again
                continue
            logs = Path(scratch) / f"round{round_}"  # fresh disk tiers and logs each round
            logs.mkdir(exist_ok=True)
            load, busy, own, started = read_loadavg(), machine_busy_s(), own_cpu_s(), time.monotonic()
            tag = f"[round {round_}/{rounds}] " if rounds > 1 else ""
            load_text = f"load {load[0]:.2f}" if load else ""
            try:
                result = run_config(config, setup, logs, lambda line, tag=tag: progress(f"{tag}{line}"), load_text)
            except (ServerFailed, BackendError) as exc:
                why = exc.message if isinstance(exc, ServerFailed) else str(exc)
                skipped[config] = f"failed{f' in round {round_}' if rounds > 1 else ''}: {why}"
                progress(f"  {tag}{config} failed: {why}")
                continue
            wall, busy_after, own_after = time.monotonic() - started, machine_busy_s(), own_cpu_s()
            share = others = None
            if busy is not None and busy_after is not None and wall > 0:
                share = (busy_after - busy) / (wall * cpus)
                others = max(0.0, (busy_after - busy) - (own_after - own)) / (wall * cpus)
            runs.append(Run(round_, result, load, share, others))
            progress(f"  {tag}{config} done in {wall:.0f} s")
    # The model's own KV dtype sees the same tokens everywhere, every round; FP8 and vLLM are compared turn by turn
    # with the first round's first such configuration.
    same = [r.result for r in runs if r.result.system == "pagedkv" and r.result.config != "fp8"]
    reference = same[0] if same else None
    equal = all(r.outputs() == same[0].outputs() for r in same)
    per_run = [run_figures(r, reference) for r in runs]
    for f in per_run:
        base = next((b for b in per_run if b["round"] == f["round"] and b["config"] == "off"), None)
        f["revisited_ttft_speedup"] = (
            round(base["revisited_ttft_p50_s"] / f["revisited_ttft_p50_s"], 2)
            if base and f["system"] == "pagedkv" and f["revisited_ttft_p50_s"]
            else None
        )
    figures = [
        median_row([f for f in per_run if f["config"] == c]) for c in chosen if any(f["config"] == c for f in per_run)
    ]
    by_name = {f["config"]: f for f in figures}
    pairs, aims = comparisons(by_name)
    for line in report_lines(figures, pairs, aims):
        click.echo(line)
    if rounds > 1:
        for line in round_lines(per_run, rounds):
            click.echo(line)
    for config, why in skipped.items():
        click.echo(f"{config}: {why}")
    click.echo(
        f"outputs equal across the {reference.config if reference else '-'} KV dtype's configs: "
        f"{'yes' if equal else 'NO'}"
    )
    summary = {
        "benchmark": "tiers",
        "workload": asdict(workload) | {"first_tokens": workload.first_tokens},
        "model": str(model),
        "device": device,
        "block_size": block_size,
        "block_bytes": one_block,
        "device_blocks": num_blocks,
        "device_kv_bytes": num_blocks * one_block,
        "working_set_blocks": workload.working_set_blocks(),
        "rounds": rounds,
        "cpus": cpus,
        "outputs_equal": equal,
        "configs": figures,
        "runs": per_run,
        "skipped": skipped,
        "pagedkv_over_vllm": pairs,
        "aims": aims,
    }
    text = json.dumps(summary)
    if json_path is not None:
        json_path.write_text(text + "\n")
    click.echo(text)
    if not equal:
        raise SystemExit(1)
