"""`pagedkv bench tensor-parallel`: one model served by an executor of each `--sizes` (tensor-parallel size 1, 2,
...), the same greedy requests to each: output tokens per second, and of a group's step time how much went to
its collectives (the plan's broadcast, the all-reduces, the logits' gather; a wait for a slower rank counts too).

Each size is a real blockd and a real `pagedkv-executor --tensor-parallel-size N` (processes on loopback); the
requests are submitted at once over the executor protocol and timed until the last finishes. The greedy outputs
of every size must be the same tokens (reported as `same_outputs`). The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from blockd.client import BlockdClient, BlockdUnavailable
from common import processes
from common.net import free_port
from executor.client import ExecutorClient, ExecutorUnavailable, tokens_of
from executor.params import SamplingParams


def _start(argv: list[str], log: Path, threads: int | None = None) -> Any:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads is not None:  # torch's team in each process (a group divides it among its ranks)
        env["OMP_NUM_THREADS"] = str(threads)
    return processes.start([sys.executable, "-m", *argv], log, env=env)


def run_size(
    model: Path, size: int, prompts: list[list[int]], max_tokens: int, workdir: Path, threads: int | None = None
) -> dict[str, Any]:
    blockd_endpoint = f"tcp://127.0.0.1:{free_port()}"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    blockd = _start(["blockd.main", "--endpoint", blockd_endpoint, "--no-persistence"], workdir / f"blockd-{size}.log")
    log = workdir / f"executor-{size}-{time.monotonic_ns()}.log"
    executor = None
    try:
        with BlockdClient(blockd_endpoint, timeout_s=0.5) as client:
            processes.wait_until(processes.answer(client.pools, BlockdUnavailable), 60)
        executor = _start(
            [
                "executor.main",
                "--model",
                str(model),
                "--blockd",
                blockd_endpoint,
                "--bind",
                endpoint,
                "--tensor-parallel-size",
                str(size),
                "--max-num-seqs",
                str(len(prompts)),
                "--kv-cache-memory",
                "64MiB",
            ],
            log,
            threads,
        )
        with ExecutorClient(endpoint, timeout_s=0.5) as probe:
            processes.wait_until(processes.answer(probe.info, ExecutorUnavailable), 300)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        with ExecutorClient(endpoint, timeout_s=300) as client:
            client.generate(prompts[0][:8], SamplingParams(max_tokens=2, temperature=0.0))  # warm up
            started = time.perf_counter()
            for i, prompt in enumerate(prompts):
                client.submit(f"r{i}", prompt, params)
            outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
            done = 0
            while done < len(prompts):
                delta = client.receive()
                outputs[delta.request_id] += tokens_of([delta])
                done += delta.finish_reason is not None
            seconds = time.perf_counter() - started
        executor.send_signal(signal.SIGTERM)
        exit_code = executor.wait(timeout=60)  # 0: the group stopped cleanly, its workers too
        stats = _stats(log)
    finally:
        processes.stop([p for p in (executor, blockd) if p is not None])
    tokens = sum(len(o) for o in outputs.values())
    return {
        "tensor_parallel_size": size,
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_s": round(tokens / seconds, 2),
        "exit_code": exit_code,
        **stats,
        "outputs": [outputs[f"r{i}"] for i in range(len(prompts))],
    }


def _stats(log: Path) -> dict[str, Any]:
    """The group's `tensor_parallel_stats` line (logged at shutdown), less what is not a number; {} for size 1."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if "tensor_parallel_stats" in line:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                return {}
            fields = ("steps", "step_s", "collective_s", "broadcast_s")
            found = {k: event[k] for k in fields if k in event}
            if found.get("step_s"):
                found["collective_share"] = round(found["collective_s"] / found["step_s"], 3)
            return found
    return {}


@click.command("tensor-parallel")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False, path_type=Path), required=True)
@click.option("--sizes", default="1,2", show_default=True, help="Tensor-parallel sizes, comma-separated.")
@click.option("--requests", type=click.IntRange(1), default=8, show_default=True)
@click.option("--prompt-len", type=click.IntRange(1), default=64, show_default=True)
@click.option("--max-tokens", type=click.IntRange(1), default=32, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--threads",
    type=click.IntRange(1),
    default=None,
    help="torch threads of each executor (OMP_NUM_THREADS; a group splits them among its ranks). Default: torch's.",
)
def bench_tensor_parallel(
    model_dir: Path, sizes: str, requests: int, prompt_len: int, max_tokens: int, seed: int, threads: int | None
) -> None:
    """Output tok/s of one executor per tensor-parallel size, and its steps' time in collectives."""
    try:
        size_list = [int(s) for s in sizes.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"{sizes!r} is not a comma-separated list of sizes", param_hint="--sizes") from None
    from executor.checkpoint import load_config

    vocab = load_config(model_dir).vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-tp-") as workdir:
        for size in size_list:
            click.echo(f"tensor-parallel size {size} ...", err=True)
            results.append(run_size(model_dir, size, prompts, max_tokens, Path(workdir), threads))
    same = all(r["outputs"] == results[0]["outputs"] for r in results)
    click.echo(f"{'size':>4} {'tok/s':>9} {'steps':>6} {'step s':>8} {'collective s':>13} {'share':>6}")
    for r in results:
        click.echo(
            f"{r['tensor_parallel_size']:>4} {r['tok_s']:>9.1f} {r.get('steps', '-')!s:>6} "
            f"{r.get('step_s', '-')!s:>8} {r.get('collective_s', '-')!s:>13} {r.get('collective_share', '-')!s:>6}"
        )
    click.echo(f"greedy outputs the same at every size: {same}")
    for r in results:
        del r["outputs"]
    click.echo(json.dumps({"results": results, "same_outputs": same, "cpu_count": os.cpu_count(), "threads": threads}))
