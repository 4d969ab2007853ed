"""`pagedkv bench kernels`: paged attention on a CUDA GPU against its memory bandwidth and torch SDPA.

Decode: batch x context grid, GQA 32 query / 4 kv heads, head_dim 128, physical blocks permuted.
Reports time, K/V bytes read per second as a fraction of a measured device-to-device copy bandwidth
(bytes read + written per second: what the memory system sustains), and SDPA's time over ours on the
same K/V stored contiguously (> 1: paged is faster). Prefill: causal full-sequence attention in
TFLOP/s, against SDPA likewise. Progress and tables go to stdout; the last line is one JSON object.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import click
import torch
import torch.nn.functional as F

from pagedkv.bench.common import table_lines
from pagedkv_kernels.dispatch import paged_attention
from pagedkv_kernels.heuristics import choose_num_splits, device_num_sms
from pagedkv_kernels.validate import SUPPORTED_BLOCK_SIZES

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 4, 128
DECODE_BATCHES, DECODE_CONTEXTS = (1, 8, 64, 256), (512, 2048, 8192, 32768)
PREFILL_CASES = ((1, 2048), (1, 8192), (4, 4096))  # (sequences, tokens each)
QUICK_DECODE_BATCHES, QUICK_DECODE_CONTEXTS = (1, 64), (2048, 8192)
QUICK_PREFILL_CASES = ((1, 2048),)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

Timer = Callable[[Callable[[], object]], float]  # runs fn repeatedly, returns milliseconds per call


def cuda_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds per call, timed with CUDA events by triton.testing.do_bench."""
    import triton.testing  # only on a CUDA device: the CPU path never loads it

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def make_paged(
    kv_lens: list[int],
    q_lens: list[int],
    dtype: torch.dtype,
    block_size: int,
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, Any]:
    """Random q and K/V caches whose blocks are handed out in permuted order, plus the metadata."""
    n_blocks = [math.ceil(kv / block_size) for kv in kv_lens]
    total = sum(n_blocks)
    physical = torch.randperm(total, device=device).to(torch.int32)
    tables = torch.zeros((len(kv_lens), max(n_blocks)), dtype=torch.int32, device=device)
    used = 0
    for s, n in enumerate(n_blocks):
        tables[s, :n] = physical[used : used + n]
        used += n
    shape = (total, block_size, num_kv_heads, head_dim)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dict(
        q=torch.randn(sum(q_lens), num_heads, head_dim, device=device, dtype=dtype),
        key_cache=torch.randn(shape, device=device, dtype=dtype),
        value_cache=torch.randn(shape, device=device, dtype=dtype),
        block_tables=tables,
        query_start_loc=starts,
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
    )


def contiguous_kv(cache: torch.Tensor, tables: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Every sequence's K (or V) as one contiguous `[num_seqs, num_kv_heads, kv_len, head_dim]` tensor."""
    num_seqs, (_, block_size, num_kv_heads, head_dim) = tables.shape[0], cache.shape
    out = torch.empty((num_seqs, num_kv_heads, kv_len, head_dim), dtype=cache.dtype, device=cache.device)
    n = math.ceil(kv_len / block_size)
    for s in range(num_seqs):  # one sequence at a time keeps the temporary small
        out[s] = cache[tables[s, :n].long()].reshape(-1, num_kv_heads, head_dim)[:kv_len].transpose(0, 1)
    return out


def _fits(nbytes: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes < 0.8 * free


def bench_decode(
    batch: int,
    context: int,
    *,
    dtype: torch.dtype,
    block_size: int,
    device: torch.device,
    timer: Timer,
    copy_bw: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, Any]:
    """One decode step: `batch` sequences, one query token each, `context` tokens of KV each."""
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * elem
    row: dict[str, Any] = dict(batch=batch, context=context)
    if not _fits(2 * kv_bytes + (64 << 20), device):  # paged caches + the contiguous copy for SDPA
        return {**row, "skipped": f"K/V of {kv_bytes / 2**30:.1f} GiB (x2 for SDPA) does not fit"}
    p = make_paged([context] * batch, [1] * batch, dtype, block_size, device, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = torch.empty_like(p["q"])
    ms = timer(lambda: paged_attention(**p, scale=scale, out=out, backend="triton"))

    # SDPA on contiguous K/V. For decode, the group's query heads act as 8 query rows of one kv head
    # (no mask: a decode token sees everything), which is exact GQA without expanding K/V.
    group = num_heads // num_kv_heads
    k = contiguous_kv(p["key_cache"], p["block_tables"], context)
    v = contiguous_kv(p["value_cache"], p["block_tables"], context)
    q = p["q"].view(batch, num_kv_heads, group, head_dim)
    sdpa_ms = timer(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale))
    expected = F.scaled_dot_product_attention(q, k, v, scale=scale).reshape(batch, num_heads, head_dim)
    max_err = (out.float() - expected.float()).abs().max().item()
    splits = choose_num_splits(
        batch, num_kv_heads, p["block_tables"].shape[1] * block_size, num_sms=device_num_sms(device)
    )
    bw = kv_bytes / (ms * 1e-3)
    return {
        **row,
        "num_splits": splits,
        "ms": ms,
        "gbps": bw / 1e9,
        "bw_fraction": bw / copy_bw,
        "sdpa_ms": sdpa_ms,
        "vs_sdpa": sdpa_ms / ms,
        "max_abs_err": max_err,
    }


def bench_prefill(
    num_seqs: int,
    seq_len: int,
    *,
    dtype: torch.dtype,
    block_size: int,
    device: torch.device,
    timer: Timer,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, Any]:
    """Causal prefill of `num_seqs` fresh sequences of `seq_len` tokens (their K/V already in the cache)."""
    p = make_paged(
        [seq_len] * num_seqs, [seq_len] * num_seqs, dtype, block_size, device, num_heads, num_kv_heads, head_dim
    )
    scale = head_dim**-0.5
    out = torch.empty_like(p["q"])
    ms = timer(lambda: paged_attention(**p, scale=scale, out=out, backend="triton"))
    # Causal: query i sees i + 1 keys; 2 flops per multiply-add, in both QK^T and PV.
    flops = 4 * num_seqs * num_heads * head_dim * seq_len * (seq_len + 1) / 2

    q = p["q"].view(num_seqs, seq_len, num_heads, head_dim).transpose(1, 2)
    k = contiguous_kv(p["key_cache"], p["block_tables"], seq_len)
    v = contiguous_kv(p["value_cache"], p["block_tables"], seq_len)
    group = num_heads // num_kv_heads

    def sdpa(gqa: bool) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)

    gqa = True
    try:
        expected = sdpa(gqa)
    except (RuntimeError, TypeError):  # a backend without GQA: expand K/V instead
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), False
        expected = sdpa(gqa)
    sdpa_ms = timer(lambda: sdpa(gqa))
    max_err = (out.float() - expected.transpose(1, 2).reshape(out.shape).float()).abs().max().item()
    return {
        "num_seqs": num_seqs,
        "seq_len": seq_len,
        "ms": ms,
        "tflops": flops / (ms * 1e-3) / 1e12,
        "sdpa_ms": sdpa_ms,
        "sdpa_tflops": flops / (sdpa_ms * 1e-3) / 1e12,
        "vs_sdpa": sdpa_ms / ms,
        "max_abs_err": max_err,
    }


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _table(rows: list[dict[str, Any]], columns: list[str], echo: Callable[[str], None]) -> None:
    cells = [[_fmt(r[c]) if c in r else ("skip" if "skipped" in r else "-") for c in columns] for r in rows]
    for line in table_lines(columns, cells, left=0):
        echo(line)


def run_benchmarks(
    *,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    decode_grid: Iterable[tuple[int, int]],
    prefill_cases: Iterable[tuple[int, int]],
    timer: Timer,
    echo: Callable[[str], None] = click.echo,
    copy_bytes: int = 1 << 30,
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    head_dim: int = HEAD_DIM,
) -> dict[str, Any]:
    """Run the decode grid and prefill cases; print progress and tables; return every figure."""
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    copy_bw = copy_bandwidth(device, timer, copy_bytes)
    echo(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)")
    decode = []
    for batch, context in decode_grid:
        echo(f"decode batch={batch} context={context} ...")
        row = bench_decode(
            batch, context, dtype=dtype, block_size=block_size, device=device, timer=timer, copy_bw=copy_bw, **heads
        )
        if "skipped" in row:
            echo(f"  skipped: {row['skipped']}")
        decode.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    prefill = []
    for num_seqs, seq_len in prefill_cases:
        echo(f"prefill seqs={num_seqs} len={seq_len} ...")
        prefill.append(
            bench_prefill(num_seqs, seq_len, dtype=dtype, block_size=block_size, device=device, timer=timer, **heads)
        )
    echo("\ndecode (bw_fraction: K/V bytes read per second / copy bandwidth; vs_sdpa > 1: paged faster)")
    _table(
        decode,
        ["batch", "context", "num_splits", "ms", "gbps", "bw_fraction", "sdpa_ms", "vs_sdpa", "max_abs_err"],
        echo,
    )
    echo("\nprefill (causal)")
    _table(prefill, ["num_seqs", "seq_len", "ms", "tflops", "sdpa_tflops", "vs_sdpa", "max_abs_err"], echo)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return {
        "cuda": device.type == "cuda",
        "device": name,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": block_size,
        **heads,
        "copy_gbps": copy_bw / 1e9,
        "decode": decode,
        "prefill": prefill,
    }


@click.command("kernels")
@click.option("--quick", is_flag=True, help="A small grid (batch 1, 64 x context 2k, 8k; one prefill case).")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="bfloat16", show_default=True)
@click.option(
    "--block-size", type=click.Choice([str(b) for b in SUPPORTED_BLOCK_SIZES]), default="16", show_default=True
)
def bench_kernels(quick: bool, dtype: str, block_size: str) -> None:
    """Benchmark paged attention (decode and prefill) on a CUDA GPU against bandwidth and torch SDPA."""
    problem = None
    if not torch.cuda.is_available():
        problem = "pagedkv bench kernels needs a CUDA GPU; none is available (torch.cuda.is_available() is False)"
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        problem = "TRITON_INTERPRET is set: the kernels would run in the interpreter; unset it to benchmark"
    if problem:
        click.echo(problem)
        click.echo(json.dumps({"error": problem, "cuda": torch.cuda.is_available()}))
        sys.exit(2)
    batches, contexts = (QUICK_DECODE_BATCHES, QUICK_DECODE_CONTEXTS) if quick else (DECODE_BATCHES, DECODE_CONTEXTS)
    results = run_benchmarks(
        device=torch.device("cuda"),
        dtype=DTYPES[dtype],
        block_size=int(block_size),
        decode_grid=[(b, c) for b in batches for c in contexts],
        prefill_cases=QUICK_PREFILL_CASES if quick else PREFILL_CASES,
        timer=cuda_timer,
        copy_bytes=(256 << 20) if quick else (1 << 30),
    )
    click.echo(json.dumps(results))
