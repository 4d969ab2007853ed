"""`pagedkv bench tiers`: multi-turn conversations whose working set is several times the device KV, with the lower
KV tiers off, in host memory, and in host memory and on disk.

Each configuration gets its own blockd and executor (a real process each, on the CPU or one GPU). Conversations
take turns round-robin (the least friendly order for an LRU: every conversation comes back after all the others
ran), `--clients` of them in flight; every turn's prompt is the whole history so far (a first message, then each
user message and the answer to it). Figures: the prefix hit rate (cached prompt tokens / prompt tokens) against an
infinite cache's on the same token sequences, time to first token (p50, p99; and p50 of re-visited turns, the
second turn on), throughput, and the tiers' counters. Greedy decoding, so every configuration sees the same tokens
(checked: `outputs_equal`). Method and figures: docs/benchmarks.md ("tiers"). The last stdout line is one JSON
object of every figure.
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from blockd.client import BlockdClient
from common import processes
from common.net import free_port
from executor import protocol as ep
from executor.client import ExecutorClient, ExecutorUnavailable
from executor.params import SamplingParams
from pagedkv.bench.common import blockd_daemon, log_tail, table_lines
from pagedkv.bench.shapes import DEFAULT_SHAPE, SHAPES, ensure_shape

TOKEN_IDS = (4, 500)  # past the special tokens, below any generated model's vocabulary
BLOCK_SIZE = 16
CONFIGS = ("off", "host", "host+disk")
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    first_tokens: int  # the first message of each conversation
    user_tokens: int  # each later user message
    output_tokens: int  # each answer
    clients: int
    device_fraction: float  # the device KV holds this fraction of the working set
    seed: int

    def working_set_blocks(self) -> int:
        """Blocks of every conversation's whole history at its end."""
        final = self.first_tokens + (self.turns - 1) * self.user_tokens + self.turns * self.output_tokens
        return self.conversations * -(-final // BLOCK_SIZE)

    def user_messages(self) -> list[list[list[int]]]:
        rng = random.Random(self.seed)
        return [
            [
                rng.choices(range(*TOKEN_IDS), k=self.first_tokens if t == 0 else self.user_tokens)
                for t in range(self.turns)
            ]
            for _ in range(self.conversations)
        ]


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ideal_cached_tokens: int
    ttft_s: float
    output: list[int]


@dataclass
class ConfigResult:
    config: str
    flags: list[str]
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    executor_tiers: dict[str, int] = field(default_factory=dict)
    blockd_tiers: list[dict[str, Any]] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        ideal = sum(t.ideal_cached_tokens for t in self.turns)
        ttft = sorted(t.ttft_s for t in self.turns)
        revisited = sorted(t.ttft_s for t in self.turns if t.turn > 0)
        outputs = sum(len(t.output) for t in self.turns)
        return {
            "config": self.config,
            "requests": len(self.turns),
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "infinite_cache_hit_rate": round(ideal / prompt, 4) if prompt else 0.0,
            "hit_rate_of_infinite": round(cached / ideal, 4) if ideal else 0.0,
            "ttft_p50_s": round(percentile(ttft, 50), 4),
            "ttft_p99_s": round(percentile(ttft, 99), 4),
            "revisited_ttft_p50_s": round(percentile(revisited, 50), 4),
            "output_tokens_per_s": round(outputs / self.wall_s, 2) if self.wall_s else 0.0,
            "prompt_tokens_per_s": round(prompt / self.wall_s, 2) if self.wall_s else 0.0,
            "wall_s": round(self.wall_s, 2),
            "executor_tiers": self.executor_tiers,
            "blockd_tiers": self.blockd_tiers,
        }


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of sorted values, nearest rank (0 for none)."""
    if not values:
        return 0.0
    rank = max(0, min(len(values) - 1, math.ceil(q / 100 * len(values)) - 1))
    return values[rank]


class InfiniteCache:
    """What a cache that never evicts would hold: every computed full block of every sequence so far."""

    def __init__(self) -> None:
        self.blocks: set[tuple[int, ...]] = set()

    @staticmethod
    def _keys(tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[: (i + 1) * BLOCK_SIZE]) for i in range(len(tokens) // BLOCK_SIZE)]

    def hit(self, prompt: list[int]) -> int:
        """Cached tokens an admit would find (at most all but the last prompt token's block)."""
        hits = 0
        for key in self._keys(prompt)[: (len(prompt) - 1) // BLOCK_SIZE]:
            if key not in self.blocks:
                break
            hits += 1
        return hits * BLOCK_SIZE

    def computed(self, tokens: list[int]) -> None:
        self.blocks.update(self._keys(tokens))


def config_flags(config: str, workload: Workload, block_bytes: int, disk_dir: Path) -> list[str]:
    """The executor's tier flags: host memory for the whole working set (host), or for a quarter of it with the
    disk for all of it (host+disk)."""
    working = workload.working_set_blocks() * block_bytes
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
    return []


def run_config(
    model: Path, config: str, flags: list[str], num_blocks: int, workload: Workload, logs: Path, device: str
) -> ConfigResult:
    result = ConfigResult(config, flags)
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
            str(BLOCK_SIZE),
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
                _warm_up(client)
                started = time.perf_counter()
                result.turns = _converse(client, workload)
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


def _wait_ready(process: subprocess.Popen[bytes], endpoint: str, log: Path) -> None:
    def alive() -> None:
        if process.poll() is not None:
            raise processes.NotReady(f"the executor {processes.describe_exit(process.returncode)}")

    try:
        with ExecutorClient(endpoint, timeout_s=0.5) as client:
            processes.wait_until(processes.answer(client.info, ExecutorUnavailable), 180, check=alive, poll_s=0)
    except processes.NotReady as exc:
        raise click.ClickException(f"{exc}; its log:\n{log_tail(log)}") from None


def _warm_up(client: ExecutorClient) -> None:
    """First-call costs (allocations, lazy imports) out of the measured run: prompts no conversation shares."""
    for i in range(2):
        client.generate([TOKEN_IDS[1] - 1 - i] * (3 * BLOCK_SIZE), SamplingParams(max_tokens=2, temperature=0.0))


def _converse(client: ExecutorClient, workload: Workload) -> list[Turn]:
    """Every conversation's turns, round-robin, `clients` in flight; greedy, EOS ignored (fixed lengths)."""
    messages = workload.user_messages()
    history: list[list[int]] = [[] for _ in range(workload.conversations)]
    next_turn = [0] * workload.conversations
    ready = deque(range(workload.conversations))
    params = SamplingParams(max_tokens=workload.output_tokens, temperature=0.0, ignore_eos=True)
    ideal = InfiniteCache()
    inflight: dict[str, tuple[int, list[int], int, float, list[float], list[int]]] = {}
    turns: list[Turn] = []
    total = workload.conversations * workload.turns
    while len(turns) < total:
        while ready and len(inflight) < workload.clients:
            c = ready.popleft()
            t = next_turn[c]
            prompt = history[c] + messages[c][t]
            request_id = f"c{c}t{t}"
            first: list[float] = []
            inflight[request_id] = (c, prompt, ideal.hit(prompt), time.perf_counter(), first, [])
            client.submit(request_id, prompt, params)
        message = client.receive()
        if type(message) is ep.Rejected:
            raise click.ClickException(f"request {message.request_id} rejected: {message.message}")
        if type(message) is not ep.Delta or message.request_id not in inflight:
            continue
        c, prompt, ideal_hit, sent, first, output = inflight[message.request_id]
        if message.token_ids and not first:
            first.append(time.perf_counter() - sent)
        output.extend(message.token_ids)
        if message.finish_reason is None:
            continue
        del inflight[message.request_id]
        if message.finish_reason not in ("length", "stop"):
            raise click.ClickException(f"request {message.request_id} ended with {message.finish_reason}")
        t = next_turn[c]
        turns.append(Turn(c, t, len(prompt), message.cached_tokens, ideal_hit, first[0] if first else 0.0, output))
        ideal.computed(prompt + output[:-1])  # (the last token sampled is never computed)
        history[c] = prompt + output
        next_turn[c] += 1
        if next_turn[c] < workload.turns:
            ready.append(c)
    return turns


def _block_bytes(model: Path) -> int:
    from executor.checkpoint import load_config

    c = load_config(model)
    element = 2 if c.torch_dtype in ("float16", "bfloat16") else 4
    return 2 * c.num_layers * BLOCK_SIZE * c.num_kv_heads * c.head_dim * element


@click.command("tiers")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--model-shape", type=click.Choice(sorted(SHAPES)), default=DEFAULT_SHAPE, show_default=True)
@click.option("--conversations", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--turns", type=click.IntRange(min=2), default=6, show_default=True)
@click.option("--first-tokens", type=click.IntRange(min=1), default=512, show_default=True)
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
@click.option("--configs", default=",".join(CONFIGS), show_default=True, help="Comma-separated: off, host, host+disk.")
@click.option("--device", default="cpu", show_default=True, help="The executors' device (cpu, cuda, cuda:N).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--quick", is_flag=True, help="A small run: 6 conversations of 3 turns over 128-token histories.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench_tiers(
    model_dir: Path | None,
    model_shape: str,
    conversations: int,
    turns: int,
    first_tokens: int,
    user_tokens: int,
    output_tokens: int,
    clients: int,
    device_fraction: float,
    configs: str,
    device: str,
    seed: int,
    quick: bool,
    json_path: Path | None,
) -> None:
    """Multi-turn conversations over a device KV a fraction of their working set: tiers off, host, host + disk."""
    chosen = [c.strip() for c in configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown or not chosen:
        raise click.BadParameter(
            f"{', '.join(unknown) or 'none'}: choose from {', '.join(CONFIGS)}", param_hint="--configs"
        )
    if quick:
        conversations, turns, first_tokens, user_tokens, output_tokens = 6, 3, 128, 32, 8
        clients, device_fraction = 2, 0.25
    workload = Workload(conversations, turns, first_tokens, user_tokens, output_tokens, clients, device_fraction, seed)
    model = model_dir if model_dir is not None else ensure_shape(model_shape)
    block_bytes = _block_bytes(model)
    longest = first_tokens + (turns - 1) * (user_tokens + output_tokens) + output_tokens
    num_blocks = max(round(workload.working_set_blocks() * device_fraction), -(-longest // BLOCK_SIZE) * clients + 4)
    click.echo(
        f"{conversations} conversations x {turns} turns, working set {workload.working_set_blocks()} blocks of "
        f"{BLOCK_SIZE} tokens ({block_bytes:,} bytes each); device KV {num_blocks} blocks",
        err=True,
    )
    results: list[ConfigResult] = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-tiers-") as scratch:
        logs = Path(scratch)
        for config in chosen:
            flags = config_flags(config, workload, block_bytes, logs / f"disk-{config.replace('+', '-')}")
            click.echo(f"running {config} {' '.join(flags)}", err=True)
            results.append(run_config(model, config, flags, num_blocks, workload, logs, device))
    figures = [r.figures() for r in results]
    outputs = [
        [(t.conversation, t.turn, t.output) for t in sorted(r.turns, key=lambda t: (t.conversation, t.turn))]
        for r in results
    ]
    equal = all(o == outputs[0] for o in outputs)
    base = next((f for f in figures if f["config"] == "off"), None)
    for f in figures:
        f["revisited_ttft_speedup"] = (
            round(base["revisited_ttft_p50_s"] / f["revisited_ttft_p50_s"], 2)
            if base and f["revisited_ttft_p50_s"]
            else None
        )
    columns = [
        "config",
        "hit rate",
        "infinite",
        "of infinite",
        "TTFT p50",
        "TTFT p99",
        "revisit p50",
        "speedup",
        "out tok/s",
        "wall s",
    ]
    rows = [
        [
            f["config"],
            f"{f['prefix_hit_rate']:.1%}",
            f"{f['infinite_cache_hit_rate']:.1%}",
            f"{f['hit_rate_of_infinite']:.1%}",
            f"{f['ttft_p50_s'] * 1000:.1f} ms",
            f"{f['ttft_p99_s'] * 1000:.1f} ms",
            f"{f['revisited_ttft_p50_s'] * 1000:.1f} ms",
            f"{f['revisited_ttft_speedup']}x" if f["revisited_ttft_speedup"] else "-",
            f"{f['output_tokens_per_s']:.1f}",
            f"{f['wall_s']:.1f}",
        ]
        for f in figures
    ]
    for line in table_lines(columns, rows):
        click.echo(line)
    for f in figures:
        for t in f["blockd_tiers"]:
            click.echo(
                f"  {f['config']}: {t['medium']} {t['blocks']}/{t['capacity_blocks']} blocks, {t['hits']} hits, "
                f"{t['loads']} loads, {t['demotions']} demotions, {t['drops']} drops"
            )
    click.echo(f"outputs equal across configs: {'yes' if equal else 'NO'}")
    summary = {
        "benchmark": "tiers",
        "workload": asdict(workload),
        "model": str(model),
        "device": device,
        "block_size": BLOCK_SIZE,
        "block_bytes": block_bytes,
        "device_blocks": num_blocks,
        "working_set_blocks": workload.working_set_blocks(),
        "outputs_equal": equal,
        "configs": figures,
    }
    text = json.dumps(summary)
    if json_path is not None:
        json_path.write_text(text + "\n")
    click.echo(text)
    if not equal:
        raise SystemExit(1)
