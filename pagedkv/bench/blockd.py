"""`pagedkv bench blockd`: block operations per second in-process, and step round trips over ZeroMQ.

One op = one block granted, reused as a prefix hit, or freed. The workload is the same in every phase:
512-token prompts, half of them opening with one of a few shared 256-token prefixes, each sequence decoding
16 tokens one step at a time, committing its computed blocks, then freed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click

from blockd import protocol as p
from blockd.client import BlockdClient, PoolClient
from blockd.embedded_redis import EmbeddedRedis
from blockd.pool import BlockPool, PoolSpec
from common.net import free_port
from common.tokens import pack_tokens
from pagedkv.bench.common import blockd_daemon, table_lines

PROMPT = 512
SHARED = 256
DECODE = 16
BLOCK_SIZE = 16
SAMPLED = pack_tokens([7])


@dataclass
class Workload:
    prompts: list[bytes]  # packed token ids, as an executor sends them

    @classmethod
    def make(cls, count: int, seed: int = 0) -> Workload:
        rng = random.Random(seed)
        shared = [[rng.randrange(32000) for _ in range(SHARED)] for _ in range(4)]
        prompts = []
        for i in range(count):
            head = rng.choice(shared) if i % 2 else [rng.randrange(32000) for _ in range(SHARED)]
            prompts.append(pack_tokens(head + [rng.randrange(32000) for _ in range(PROMPT - SHARED)]))
        return cls(prompts)


def inproc_block_ops_per_s(work: Workload, live: int = 64, num_blocks: int = 16384) -> tuple[float, int]:
    """The in-process core alone: (block ops per second, ops) over the whole workload."""
    pool = BlockPool(PoolSpec("bench", num_blocks, BLOCK_SIZE, "bench-model", 1))
    ids = [f"s{i}" for i in range(len(work.prompts))]
    one_token = [pack_tokens([t]) for t in range(DECODE)]
    window: list[str] = []
    ops = 0
    started = time.perf_counter()
    for seq_id, prompt in zip(ids, work.prompts, strict=False):
        ops += len(pool.admit(seq_id, prompt).blocks)
        for token in one_token:
            ops += len(pool.append(seq_id, token).blocks)
        pool.commit(seq_id, PROMPT + DECODE - 1)
        window.append(seq_id)
        if len(window) > live:
            ops += pool.free(window.pop(0))
    elapsed = time.perf_counter() - started
    assert not pool.check()
    return ops / elapsed, ops


@dataclass
class RpcFigures:
    steps: int
    p50_us: float
    p99_us: float
    block_ops_per_s: float


def rpc_steps(endpoint: str, work: Workload, seqs_per_step: int, pool_id: str) -> RpcFigures:
    """Drive blockd like an executor: every step one round trip, `seqs_per_step` sequences decoding."""
    client = BlockdClient(endpoint, timeout_s=10.0)
    pool = PoolClient(client, pool_id=pool_id, num_blocks=16384, block_size=BLOCK_SIZE, model_id="bench-model")
    pool.register()
    admits_per_step = max(1, seqs_per_step // DECODE)  # each sequence lives DECODE steps
    running: dict[str, int] = {}  # sequence -> decode steps left
    prompts = iter(enumerate(work.prompts))
    latencies: list[float] = []
    ops = 0
    started = time.perf_counter()
    while True:
        finished = [s for s, left in running.items() if left == 0]
        for s in finished:
            del running[s]
        step: list[p.StepOp] = [p.Free(s) for s in finished]
        step += [p.Append(s, SAMPLED) for s in running]
        # A real executor commits when a block fills; committing every step would add only no-ops.
        step += [
            p.Commit(s, PROMPT + DECODE - left)
            for s, left in running.items()
            if (PROMPT + DECODE - left) % BLOCK_SIZE == 0
        ]
        for s in running:
            running[s] -= 1
        for _ in range(admits_per_step):
            nxt = next(prompts, None) if len(running) < seqs_per_step else None
            if nxt is None:
                break
            step.append(p.Admit(f"r{nxt[0]}", nxt[1]))
            running[f"r{nxt[0]}"] = DECODE
        if not step:
            break
        t0 = time.perf_counter()
        results = pool.step(step)
        latencies.append(time.perf_counter() - t0)
        for op, result in zip(step, results, strict=False):
            if type(result) is p.OpError:
                raise RuntimeError(f"{op}: {result.code}: {result.message}")
            if type(op) is p.Free:
                ops += result.freed
            elif type(op) in (p.Admit, p.Append):
                ops += len(result.blocks)
    elapsed = time.perf_counter() - started
    pool.unregister()
    client.close()
    latencies.sort()
    return RpcFigures(
        steps=len(latencies),
        p50_us=statistics.median(latencies) * 1e6,
        p99_us=latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e6,
        block_ops_per_s=ops / elapsed,
    )


@click.command("blockd")
@click.option("--sequences", default=4000, show_default=True, help="Sequences in the in-process workload.")
@click.option("--rpc-sequences", default=3000, show_default=True, help="Sequences per RPC phase.")
@click.option("--seqs-per-step", default=64, show_default=True, help="Sequences decoding in each RPC step.")
@click.option("--repeat", default=3, show_default=True, help="Runs of each phase; the best is reported.")
@click.option("--quick", is_flag=True, help="A small run for smoke tests (figures are not meaningful).")
def bench_blockd(sequences: int, rpc_sequences: int, seqs_per_step: int, repeat: int, quick: bool) -> None:
    """Block ops/s of the in-process core; step round trips over ZeroMQ without and with Redis persistence."""
    if quick:
        sequences, rpc_sequences, repeat = 300, 200, 1
    echo = click.echo
    echo(
        f"workload: {PROMPT}-token prompts (half share a {SHARED}-token prefix), {DECODE} decode steps each, "
        f"block size {BLOCK_SIZE}"
    )

    echo(f"[1/3] in-process core: {sequences} sequences × {repeat} runs")
    work = Workload.make(sequences)
    inproc = []
    for run in range(repeat):
        rate, ops = inproc_block_ops_per_s(work)
        inproc.append(rate)
        echo(f"      run {run + 1}: {rate:,.0f} block ops/s ({ops:,} ops)")
    best_inproc = max(inproc)

    rpc_work = Workload.make(rpc_sequences, seed=1)
    figures: dict[str, list[RpcFigures]] = {"plain": [], "persist": []}
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-") as tmp, contextlib.ExitStack() as stack:
        redis_server = EmbeddedRedis(Path(tmp) / "redis", port=free_port())
        redis_url = redis_server.start()
        stack.callback(redis_server.stop)
        endpoints = {
            "plain": stack.enter_context(blockd_daemon(Path(tmp) / "plain.log", "--no-persistence")),
            "persist": stack.enter_context(blockd_daemon(Path(tmp) / "persist.log", "--redis-url", redis_url)),
        }
        for run in range(repeat):  # interleaved, so both phases see the same machine
            for phase, label in (("plain", "[2/3] rpc, no persistence"), ("persist", "[3/3] rpc, with Redis")):
                fig = rpc_steps(endpoints[phase], rpc_work, seqs_per_step, pool_id=f"bench-{phase}-{run}")
                figures[phase].append(fig)
                echo(
                    f"{label}: run {run + 1}: {fig.steps} steps, p50 {fig.p50_us:.0f} µs, "
                    f"p99 {fig.p99_us:.0f} µs, {fig.block_ops_per_s:,.0f} block ops/s"
                )

    plain = max(figures["plain"], key=lambda f: f.block_ops_per_s)
    persist = max(figures["persist"], key=lambda f: f.block_ops_per_s)
    ratio = persist.block_ops_per_s / plain.block_ops_per_s
    rows = [
        ("in-process core", f"{best_inproc:,.0f}", "-", "-"),
        ("rpc step, no persistence", f"{plain.block_ops_per_s:,.0f}", f"{plain.p50_us:.0f}", f"{plain.p99_us:.0f}"),
        (
            "rpc step, Redis write-behind",
            f"{persist.block_ops_per_s:,.0f}",
            f"{persist.p50_us:.0f}",
            f"{persist.p99_us:.0f}",
        ),
    ]
    echo("")
    for line in table_lines(["phase", "block ops/s", "p50 µs", "p99 µs"], rows):
        echo(line)
    echo(
        f"persistence throughput ratio (with ÷ without): {ratio:.3f}   [{seqs_per_step} sequences per step, "
        f"best of {repeat}, {os.cpu_count()} cores]"
    )
    echo(
        json.dumps(
            {
                "inproc_block_ops_per_s": round(best_inproc),
                "rpc_step_p50_us": round(plain.p50_us, 1),
                "rpc_step_p99_us": round(plain.p99_us, 1),
                "rpc_block_ops_per_s": round(plain.block_ops_per_s),
                "rpc_persist_step_p50_us": round(persist.p50_us, 1),
                "rpc_persist_step_p99_us": round(persist.p99_us, 1),
                "rpc_persist_block_ops_per_s": round(persist.block_ops_per_s),
                "persist_throughput_ratio": round(ratio, 3),
                "seqs_per_step": seqs_per_step,
                "quick": quick,
            }
        )
    )
