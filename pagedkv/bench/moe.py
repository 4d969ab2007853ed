"""`pagedkv bench moe`: the mixture-of-experts feed-forward (`pagedkv_kernels.moe`) against every expert on every token.

For each token count: the grouped CPU path ("torch"), on CUDA also the fused Triton kernel, and the dense form that
runs all E experts on all T tokens and masks by the routing weights (what a model without grouping does). Reports
milliseconds, the dense time over each path's (> 1: faster than dense), the bytes of the chosen experts' weights
read per second, and the largest difference from the grouped path. The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import click
import torch
import torch.nn.functional as F

from pagedkv.bench.common import table_lines
from pagedkv_kernels.moe import experts

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENS, QUICK_TOKENS = (1, 8, 64, 256, 2048), (1, 64)
# The dense form holds [E, T, 2I], [E, T, I] and [E, T, H]; past this many elements in all it is skipped ("skip").
DENSE_LIMIT = 1 << 28

Timer = Callable[[Callable[[], object]], float]  # runs fn repeatedly, returns milliseconds per call


def wall_timer(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median wall-clock milliseconds of `repeats` calls after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cuda_timer(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def dense(
    hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token (SiLU), then each token's k chosen outputs weighted and summed."""
    inter = w_down.shape[2]
    gate_up = torch.einsum("th,eih->eti", hidden, w_gate_up)
    act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    out = torch.einsum("eti,ehi->eth", act, w_down)
    mask = torch.zeros(hidden.shape[0], w_gate_up.shape[0], dtype=out.dtype, device=out.device)
    mask.scatter_(1, ids, weights.to(out.dtype))
    return torch.einsum("eth,te->th", out, mask)


def bench_tokens(
    num_tokens: int,
    *,
    num_experts: int,
    hidden_size: int,
    inter: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer,
    weights: tuple[torch.Tensor, torch.Tensor],
    paths: Sequence[str],
) -> dict[str, Any]:
    """One row: every path on T tokens routed at random (distinct top-k per token, softmaxed weights)."""
    gen = torch.Generator().manual_seed(num_tokens)
    w_gate_up, w_down = weights
    hidden = torch.randn(num_tokens, hidden_size, generator=gen).to(dtype=dtype, device=device)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(device)
    routing = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), dim=-1).to(device)
    active = int(torch.unique(ids).numel())
    weight_bytes = active * 3 * hidden_size * inter * w_down.element_size()
    row: dict[str, Any] = {"tokens": num_tokens, "active_experts": active}
    grouped = experts(hidden, ids, routing, w_gate_up, w_down, backend="torch")
    for path in paths:
        got = experts(hidden, ids, routing, w_gate_up, w_down, backend=path)
        row[f"{path}_ms"] = timer(lambda path=path: experts(hidden, ids, routing, w_gate_up, w_down, backend=path))
        row[f"{path}_gbps"] = weight_bytes / (row[f"{path}_ms"] * 1e-3) / 1e9
        row[f"{path}_err"] = float((got.float() - grouped.float()).abs().max())
    if num_experts * num_tokens * (3 * inter + hidden_size) <= DENSE_LIMIT:
        row["dense_err"] = float((dense(hidden, ids, routing, *weights).float() - grouped.float()).abs().max())
        row["dense_ms"] = timer(lambda: dense(hidden, ids, routing, *weights))
        for path in paths:
            row[f"{path}_vs_dense"] = row["dense_ms"] / row[f"{path}_ms"]
    return row


def run_benchmarks(
    *,
    device: torch.device,
    dtype: torch.dtype,
    num_experts: int,
    hidden_size: int,
    inter: int,
    top_k: int,
    tokens: Sequence[int],
    timer: Timer,
    paths: Sequence[str] | None = None,
    echo: Callable[[str], None] = click.echo,
) -> dict[str, Any]:
    """Every token count's row, the table echoed; `paths` default: torch, and triton on CUDA."""
    if paths is None:
        paths = ("torch", "triton") if device.type == "cuda" else ("torch",)
    gen = torch.Generator().manual_seed(0)
    weights = (
        (torch.randn(num_experts, 2 * inter, hidden_size, generator=gen) * hidden_size**-0.5).to(dtype).to(device),
        (torch.randn(num_experts, hidden_size, inter, generator=gen) * inter**-0.5).to(dtype).to(device),
    )
    shape = dict(num_experts=num_experts, hidden_size=hidden_size, inter=inter, top_k=top_k)
    rows = []
    for t in tokens:
        rows.append(bench_tokens(t, **shape, dtype=dtype, device=device, timer=timer, weights=weights, paths=paths))
        echo(f"tokens {t}: done")
    columns = ["tokens", "active_experts", "dense_ms"]
    for path in paths:
        columns += [f"{path}_ms", f"{path}_vs_dense", f"{path}_gbps", f"{path}_err"]
    cells = [[_fmt(r.get(c, "skip")) for c in columns] for r in rows]
    echo(f"\nmoe: E={num_experts} H={hidden_size} I={inter} top-{top_k} {str(dtype).removeprefix('torch.')} {device}")
    echo("(vs_dense > 1: faster than all experts on all tokens; gbps: chosen experts' weight bytes per second)")
    for line in table_lines(columns, cells, left=0):
        echo(line)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return {
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        **shape,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


@click.command("moe")
@click.option("--quick", is_flag=True, help=f"Token counts {QUICK_TOKENS} only.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None, help="Default: bfloat16 on CUDA, else float32.")
@click.option("--experts", "num_experts", type=click.IntRange(1), default=64, show_default=True)
@click.option("--hidden", "hidden_size", type=click.IntRange(1), default=1024, show_default=True)
@click.option(
    "--inter", type=click.IntRange(1), default=512, show_default=True, help="Each expert's intermediate size."
)
@click.option("--top-k", type=click.IntRange(1), default=8, show_default=True)
@click.option("--tokens", "token_list", type=click.IntRange(1), multiple=True, help="Token counts (repeatable).")
@click.option(
    "--threads",
    type=click.IntRange(1),
    default=None,
    help="torch's CPU threads (default: torch's). On a shared machine 1 avoids waits on descheduled threads.",
)
def bench_moe(
    quick: bool,
    device: str,
    dtype: str | None,
    num_experts: int,
    hidden_size: int,
    inter: int,
    top_k: int,
    token_list: tuple[int, ...],
    threads: int | None,
) -> None:
    """Benchmark the MoE experts: grouped (CPU path), fused Triton (CUDA), against all experts on all tokens."""
    problem = None
    if top_k > num_experts:
        problem = f"--top-k {top_k} is more than --experts {num_experts}"
    elif device == "cuda" and not torch.cuda.is_available():
        problem = "--device cuda: no CUDA GPU is available (torch.cuda.is_available() is False)"
    elif device != "cpu" and torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        problem = "TRITON_INTERPRET is set: the kernel would run in the interpreter; unset it to benchmark"
    if problem:
        click.echo(problem)
        click.echo(json.dumps({"error": problem}))
        sys.exit(2)
    if threads is not None:
        torch.set_num_threads(threads)
    on = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    results = run_benchmarks(
        device=on,
        dtype=DTYPES[dtype or ("bfloat16" if on.type == "cuda" else "float32")],
        num_experts=num_experts,
        hidden_size=hidden_size,
        inter=inter,
        top_k=top_k,
        tokens=token_list or (QUICK_TOKENS if quick else TOKENS),
        timer=cuda_timer if on.type == "cuda" else wall_timer,
    )
    click.echo(json.dumps(results))
