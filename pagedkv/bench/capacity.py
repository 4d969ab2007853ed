"""`pagedkv bench capacity`: how many sequences a fixed KV budget holds with paging versus contiguous reservation.

A deterministic simulation of the PagedAttention paper's claim (§2.3, Fig. 2): one seeded workload through a paged
scheduler on the real `BlockPool`, contiguous (max-length) and oracle reservation, and with `--window` the
layer-grouped runs. The method and figures are in docs/benchmarks.md ("capacity"), the grouped runs in
docs/architecture.md ("Sliding windows and layer groups").
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import click

from blockd.errors import BlockdError, ErrorCode
from blockd.pool import BlockPool, PoolSpec
from common.clicks import unless_given
from pagedkv.bench.common import table_lines

#: The length distribution: lognormal prompt and output lengths (median, sigma of the underlying normal), in the
#: range of chat traces such as ShareGPT (mean prompt ~ 160-400 tokens, mean output ~ 200-340 tokens).
PROMPT_MEDIAN, PROMPT_SIGMA = 256, 1.0
OUTPUT_MEDIAN, OUTPUT_SIGMA = 192, 0.9
QUICK_REQUESTS, QUICK_KV_TOKENS = 400, 32768
CHECK_EVERY = 1000  # steps between full invariant checks of the pool
TOKEN_BYTES = 4
FP8_GAIN = 2  # blocks of 1-byte K/V per block of 16-bit K/V in the same memory


class InvariantViolation(RuntimeError):
    """The block pool or the simulation's own bookkeeping broke an invariant."""


# ------------------------------------------------------------------------------------------------- workload


def sample_lengths(
    count: int,
    *,
    max_len: int,
    seed: int,
    prompt_median: float = PROMPT_MEDIAN,
    prompt_sigma: float = PROMPT_SIGMA,
    output_median: float = OUTPUT_MEDIAN,
    output_sigma: float = OUTPUT_SIGMA,
) -> list[tuple[int, int]]:
    """`count` (prompt length, output length) pairs, each >= 1, prompt + output <= max_len; the same for a seed.

    Lognormal draws rounded to integers; the prompt is clipped to [1, max_len - 1], then the output to
    [1, max_len - prompt].
    """
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2 (one prompt and one output token), got {max_len}")
    rng = random.Random(seed)
    mu_p, mu_o = math.log(prompt_median), math.log(output_median)
    pairs = []
    for _ in range(count):
        prompt = min(max(round(rng.lognormvariate(mu_p, prompt_sigma)), 1), max_len - 1)
        output = min(max(round(rng.lognormvariate(mu_o, output_sigma)), 1), max_len - prompt)
        pairs.append((prompt, output))
    return pairs


@dataclass(eq=False)
class Request:
    index: int
    prompt_len: int
    output_len: int
    tokens: bytes  # every token id it will ever hold, packed little-endian uint32: prompt, then outputs
    generated: int = 0  # output tokens sampled so far (the last one's KV is written at the next step)
    stored: int = 0  # tokens whose KV the cache holds now
    admissions: int = 0


def make_requests(lengths: list[tuple[int, int]], seed: int) -> list[Request]:
    """Fresh requests with random token ids (seeded), distinct per request: no prefix is shared by chance."""
    rng = random.Random(seed ^ 0x5EED)
    return [Request(i, p, o, rng.randbytes((p + o) * TOKEN_BYTES)) for i, (p, o) in enumerate(lengths)]


# ----------------------------------------------------------------------------------------------- simulation


@dataclass
class SimResult:
    name: str
    max_active: int = 0
    mean_active: float = 0.0  # over saturated steps
    kv_utilization: float = 0.0  # live tokens / allocated (paged) or reserved (contiguous) slots, saturated steps
    budget_fill: float = 0.0  # live tokens / the whole KV budget, saturated steps
    preemptions: int = 0
    recomputed_tokens: int = 0  # KV computed again after preemptions
    steps: int = 0
    saturated_steps: int = 0
    completed: int = 0
    seconds: float = 0.0
    _active: list[int] = field(default_factory=list, repr=False)
    _util: list[float] = field(default_factory=list, repr=False)
    _fill: list[float] = field(default_factory=list, repr=False)

    def record(self, active: int, live: int, slots: int, budget: int, saturated: bool) -> None:
        self.steps += 1
        self.max_active = max(self.max_active, active)
        if saturated:
            self._active.append(active)
            self._util.append(live / slots if slots else 1.0)
            self._fill.append(live / budget)

    def finish(self, seconds: float) -> SimResult:
        self.saturated_steps = len(self._active)
        if self._active:
            self.mean_active = statistics.fmean(self._active)
            self.kv_utilization = statistics.fmean(self._util)
            self.budget_fill = statistics.fmean(self._fill)
        self.seconds = seconds
        return self

    def figures(self) -> dict[str, float | int]:
        return {k: v for k, v in asdict(self).items() if not k.startswith("_") and k != "name"}


Progress = Callable[[str, int, int, int], None]  # (scheduler, completed, total, step)


def _sample_and_retire(running: list[Request], release: Callable[[Request], None]) -> tuple[list[Request], int]:
    """The forward pass: every running sequence samples a token; those done are released. Returns (running, done)."""
    still = []
    for r in running:
        r.generated += 1
        if r.generated == r.output_len:
            release(r)
        else:
            still.append(r)
    return still, len(running) - len(still)


def simulate_paged(
    requests: list[Request],
    *,
    num_blocks: int,
    block_size: int,
    watermark_blocks: int,
    windows: list[int | None] | None = None,
    check_every: int = CHECK_EVERY,
    progress: Progress | None = None,
    name: str = "paged",
) -> SimResult:
    """Continuous batching over a real `BlockPool`, preempting (recompute) the newest sequence when blocks run out.

    With `windows`, the KV is in layer groups (blockd.pool.PoolSpec.group_sliding): `num_blocks` group blocks,
    each request one sequence with a table per group (`windows[g]`: the group's sliding window, None for the
    global layers'); a sliding group hands back the blocks behind its window every step (`BlockPool.slide`).
    Utilization then counts a token once per group that holds its KV."""
    started = time.perf_counter()
    windows = windows or [None]
    sliding = {w for w in windows if w is not None}
    if len(sliding) > 1:
        raise ValueError(f"one window for every sliding group, got {sorted(sliding)}")
    window = next(iter(sliding), None)  # the sliding groups' (the global groups' tables never slide)
    groups = tuple(w is not None for w in windows) if len(windows) > 1 else ()
    pool = BlockPool(PoolSpec("capacity", num_blocks, block_size, "capacity-model", 1, window, groups))
    free_queue = pool.free_queue  # its length is the pool's count of free blocks
    result = SimResult(name)
    waiting = deque(requests)
    running: list[Request] = []
    live = 0  # tokens whose KV the pool holds (once, whatever the groups)
    done = 0
    budget = num_blocks * block_size

    def seq_id(r: Request) -> str:
        return f"r{r.index}.{r.admissions}"

    def release(r: Request) -> None:
        nonlocal live
        pool.free(seq_id(r))
        live -= r.stored
        r.stored = 0

    def slide(r: Request, computed: int) -> None:
        """The sliding groups hand back what no query from `computed` on reads."""
        if window is not None:
            pool.slide(seq_id(r), computed)

    def held() -> int:
        """Tokens whose KV some group holds, once per group (the full blocks behind a window are gone)."""
        return len(windows) * live - block_size * sum(seq.holes for seq in pool.seqs.values())

    def verify(step: int) -> None:
        problems = pool.check()
        stats = pool.stats()
        if stats.tokens_held != held() or stats.live_sequences != len(running):
            problems.append(
                f"bookkeeping: the pool holds {stats.tokens_held} tokens in {stats.live_sequences} "
                f"sequences, the simulation counts {held()} in {len(running)}"
            )
        if problems:
            raise InvariantViolation(f"{name}, step {step}: " + "; ".join(problems))

    for r in requests:
        r.generated = r.stored = r.admissions = 0
    step_limit = 10 * sum(r.output_len for r in requests) + 1000  # one sequence at a time needs sum(outputs)
    while waiting or running:
        # 1. A slot for each running sequence's last sampled token; preempt the newest when blocks run out.
        preempted = False
        i = 0
        while i < len(running):
            r = running[i]
            at = r.stored * TOKEN_BYTES
            try:
                pool.append(seq_id(r), r.tokens[at : at + TOKEN_BYTES])  # (every group's table, or none)
            except BlockdError as exc:
                if exc.code is not ErrorCode.OUT_OF_BLOCKS:
                    raise
                victim = running.pop()  # r itself when it is the newest
                result.preemptions += 1
                result.recomputed_tokens += victim.stored
                release(victim)
                waiting.appendleft(victim)  # the oldest victim ends up first: FCFS order is kept
                preempted = True
                continue
            slide(r, r.stored)  # this step's query, at position stored, is the first still to come
            r.stored += 1
            live += 1
            i += 1
        # 2. Admit (prompt + tokens generated before any preemption), first come first served, unless preempted.
        if not preempted:
            while waiting:
                r = waiting[0]
                n = r.prompt_len + r.generated
                if len(free_queue) - len(windows) * -(-n // block_size) < watermark_blocks:
                    break
                r.admissions += 1
                try:
                    pool.admit(seq_id(r), r.tokens[: n * TOKEN_BYTES])
                except BlockdError as exc:
                    if exc.code is not ErrorCode.OUT_OF_BLOCKS:
                        raise
                    break
                waiting.popleft()
                running.append(r)
                r.stored = n
                live += n
        # 3. The batch this step's forward pass runs on.
        in_use = num_blocks - len(free_queue)
        result.record(len(running), held(), in_use * block_size, budget, saturated=bool(waiting))
        # The prompts just computed: the sliding groups let go of what their next queries do not read.
        for r in running:
            slide(r, r.stored)
        # 4. Sample; finished sequences leave.
        running, finished = _sample_and_retire(running, release)
        done += finished
        if progress and finished:
            progress(name, done, len(requests), result.steps)
        if result.steps % check_every == 0:
            verify(result.steps)
        if result.steps > step_limit:
            raise InvariantViolation(f"{name}: {result.steps} steps without finishing (livelock?)")
    verify(result.steps)
    if pool.num_blocks - len(free_queue) or pool.seqs or live:
        raise InvariantViolation(
            f"{name}: after every request finished {pool.num_blocks - len(free_queue)} blocks "
            f"are in use, {len(pool.seqs)} sequences live, {live} tokens held"
        )
    result.completed = done
    return result.finish(time.perf_counter() - started)


def simulate_reserved(
    requests: list[Request],
    *,
    name: str,
    kv_tokens: int,
    reserve: Callable[[Request], int],
    progress: Progress | None = None,
) -> SimResult:
    """Continuous batching where each admitted request holds `reserve(request)` contiguous slots until it ends."""
    started = time.perf_counter()
    result = SimResult(name)
    waiting = deque(requests)
    running: list[Request] = []
    live = reserved = done = 0

    def release(r: Request) -> None:
        nonlocal live, reserved
        live -= r.stored
        reserved -= reserve(r)
        r.stored = 0

    for r in requests:
        r.generated = r.stored = r.admissions = 0
        if r.prompt_len + r.output_len > reserve(r):
            raise InvariantViolation(
                f"{name}: request {r.index} needs {r.prompt_len + r.output_len} slots, reserves {reserve(r)}"
            )
        if reserve(r) > kv_tokens:
            raise InvariantViolation(f"{name}: request {r.index} reserves more than the budget {kv_tokens}")
    while waiting or running:
        for r in running:  # its reservation already holds the slot
            r.stored += 1
        live += len(running)
        while waiting and reserved + reserve(waiting[0]) <= kv_tokens:
            r = waiting.popleft()
            r.admissions += 1
            reserved += reserve(r)
            running.append(r)
            r.stored = r.prompt_len
            live += r.prompt_len
        result.record(len(running), live, reserved, kv_tokens, saturated=bool(waiting))
        running, finished = _sample_and_retire(running, release)
        done += finished
        if progress and finished:
            progress(name, done, len(requests), result.steps)
    if live or reserved:
        raise InvariantViolation(f"{name}: after every request finished {live} tokens, {reserved} slots remain")
    result.completed = done
    return result.finish(time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------------- command


def _executor_line(window: int, requests: int) -> dict[str, object]:
    """The real executor's run (`--executor`): a line, and its figures."""
    from pagedkv.bench.capacity_executor import compare

    click.echo("[+] the executor on a Gemma-3-shaped tiny model, grouped and in full", err=True)
    full, hybrid = compare(window=window, requests=requests, prompt_len=128, output_len=16, block_size=16,
                           full_sequences=2)  # fmt: skip
    click.echo(
        f"executor (tiny Gemma 3, 5 sliding layers of window {window} per global one, {requests} requests of 128 + "
        f"16 tokens): layer groups run {hybrid.mean_running:.2f} sequences at once against "
        f"{full.mean_running:.2f} in full (max {hybrid.max_running} against {full.max_running}; blocks in use at "
        f"most {hybrid.max_blocks_in_use} of {hybrid.num_blocks} group blocks against {full.max_blocks_in_use} of "
        f"{full.num_blocks} full ones; {hybrid.steps} steps against {full.steps}); greedy tokens equal"
    )
    return {
        f"executor_{run.name.replace('-', '_')}_{key}": round(value, 3) if isinstance(value, float) else value
        for run in (full, hybrid)
        for key, value in vars(run).items()
        if key not in ("name", "seconds")
    }


def _stderr_progress() -> Progress:
    """One line on stderr per quarter of the requests completed (rewritten in place on a terminal)."""
    tty = sys.stderr.isatty()
    shown: dict[str, int] = {}

    def report(name: str, completed: int, total: int, step: int) -> None:
        quarter = 4 * completed // total
        if tty:
            end = "\n" if completed == total else ""
            click.echo(f"\r  {name}: {completed}/{total} requests done, step {step}", err=True, nl=False)
            click.echo(end, err=True, nl=False)
        elif quarter > shown.get(name, 0):
            shown[name] = quarter
            click.echo(f"  {name}: {completed}/{total} requests done, step {step}", err=True)

    return report


def _fmt(value: float | str) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return f"{value:,}" if isinstance(value, int) else value


@click.command(
    "capacity",
    help=f"""Sequences a fixed KV budget holds with paging (the real BlockPool) versus contiguous reservation.

    A seeded chat-like workload: prompt lengths lognormal with median {PROMPT_MEDIAN} tokens (sigma
    {PROMPT_SIGMA}), output lengths lognormal with median {OUTPUT_MEDIAN} (sigma {OUTPUT_SIGMA}), prompt clipped
    to [1, max-len - 1] and output to [1, max-len - prompt]; every request arrives at step 0. The same workload
    runs under continuous batching three ways: paged (blocks on demand, preemption by recompute), contiguous
    (max-len slots reserved per request) and oracle (exactly prompt + output reserved). Reports the max and mean
    active sequences, KV utilization (tokens stored / slots allocated or reserved) averaged over the steps where
    requests wait, preemptions and steps; the last line of stdout is one JSON object. Progress goes to stderr.""",
)
@click.option(
    "--kv-tokens",
    type=click.IntRange(min=1),
    default=65536,
    show_default=True,
    help="KV budget in token slots (paged: kv-tokens // block-size blocks).",
)
@click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True, help="Tokens per block.")
@click.option(
    "--max-len",
    type=click.IntRange(min=2),
    default=4096,
    show_default=True,
    help="Maximum prompt + output length; what contiguous reservation reserves.",
)
@click.option("--requests", type=click.IntRange(min=1), default=2000, show_default=True, help="Requests.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of lengths and token ids.")
@click.option(
    "--watermark",
    type=click.FloatRange(0, 0.5, max_open=True),
    default=0.01,
    show_default=True,
    help="Fraction of the blocks admission keeps free for decoding (vLLM's default).",
)
@click.option(
    "--window",
    type=click.IntRange(min=1),
    default=None,
    help="Also run a Gemma-3-shaped model: sliding layers of this window in layer groups (see --sliding-per-global).",
)
@click.option(
    "--sliding-per-global",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Sliding layers per global layer (Gemma 3: 5).",
)
@click.option(
    "--executor",
    "executor_requests",
    type=click.IntRange(min=2),
    default=None,
    help="With --window: also run the real executor on a Gemma-3-shaped tiny model (CPU, in-process blockd) with "
    "this many requests of 128-token prompts, its layer groups against every layer in full, in the KV bytes of "
    "two sequences in full (pagedkv.bench.capacity_executor; about a minute on 2 cores for 6).",
)
@click.option("--prompt-median", type=click.IntRange(min=1), default=PROMPT_MEDIAN, show_default=True)
@click.option("--output-median", type=click.IntRange(min=1), default=OUTPUT_MEDIAN, show_default=True)
@click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]),
    default="auto",
    show_default=True,
    help="fp8: also run the paged scheduler with 8-bit KV blocks in the same bytes: the budget's slots are taken "
    "as 16-bit (float16/bfloat16) K/V, so 1-byte elements give twice the blocks (the executor's "
    "--kv-cache-dtype).",
)
@click.option(
    "--quick",
    is_flag=True,
    help=f"A small run for tests: {QUICK_REQUESTS} requests, {QUICK_KV_TOKENS} KV tokens "
    "(options given explicitly win).",
)
@click.pass_context
def bench_capacity(
    ctx: click.Context,
    kv_tokens: int,
    block_size: int,
    max_len: int,
    requests: int,
    seed: int,
    watermark: float,
    window: int | None,
    sliding_per_global: int,
    executor_requests: int | None,
    prompt_median: int,
    output_median: int,
    kv_cache_dtype: str,
    quick: bool,
) -> None:
    if quick:
        requests = unless_given(ctx, requests, "requests", QUICK_REQUESTS)
        kv_tokens = unless_given(ctx, kv_tokens, "kv_tokens", QUICK_KV_TOKENS)
    if executor_requests is not None and window is None:
        raise click.BadParameter("the executor's run needs a --window", param_hint="'--executor'")
    if kv_tokens < max_len:
        raise click.BadParameter(
            f"{kv_tokens} token slots hold no sequence of --max-len {max_len}; give at least --max-len",
            param_hint="'--kv-tokens'",
        )
    num_blocks = kv_tokens // block_size
    watermark_blocks = math.floor(watermark * num_blocks)
    if num_blocks - watermark_blocks < -(-max_len // block_size):
        raise click.BadParameter(
            f"{num_blocks} blocks of {block_size} ({watermark_blocks} kept free by the "
            f"watermark) cannot hold one sequence of --max-len {max_len}",
            param_hint="'--kv-tokens'",
        )
    echo = click.echo
    lengths = sample_lengths(
        requests, max_len=max_len, seed=seed, prompt_median=prompt_median, output_median=output_median
    )
    prompts, outputs = [p for p, _ in lengths], [o for _, o in lengths]
    echo(
        f"workload: {requests} requests, seed {seed}; prompt ~ lognormal(median {prompt_median}, sigma "
        f"{PROMPT_SIGMA}), output ~ lognormal(median {output_median}, sigma {OUTPUT_SIGMA}), "
        f"prompt + output <= {max_len}"
    )
    echo(
        f"          prompt mean {statistics.fmean(prompts):.0f} / median {statistics.median(prompts):.0f} / max "
        f"{max(prompts)}; output mean {statistics.fmean(outputs):.0f} / median {statistics.median(outputs):.0f} / "
        f"max {max(outputs)}; all arrive at step 0"
    )
    echo(
        f"budget:   {kv_tokens:,} KV token slots; paged: {num_blocks:,} blocks of {block_size}, watermark "
        f"{watermark_blocks} blocks"
    )
    progress = _stderr_progress()
    requests_ = make_requests(lengths, seed)
    click.echo("[1/3] paged (BlockPool, continuous batching, preemption by recompute)", err=True)
    paged = simulate_paged(
        requests_, num_blocks=num_blocks, block_size=block_size, watermark_blocks=watermark_blocks, progress=progress
    )
    click.echo(f"[2/3] contiguous ({max_len} slots reserved per request)", err=True)
    contiguous = simulate_reserved(
        requests_, name="contiguous", kv_tokens=kv_tokens, reserve=lambda r: max_len, progress=progress
    )
    click.echo("[3/3] oracle (prompt + output slots reserved per request)", err=True)
    oracle = simulate_reserved(
        requests_, name="oracle", kv_tokens=kv_tokens, reserve=lambda r: r.prompt_len + r.output_len, progress=progress
    )
    results: tuple[SimResult, ...] = (paged, contiguous, oracle)
    if window is not None:
        # The same bytes in group blocks, each one group's layers wide: groups x the blocks of every layer.
        groups = sliding_per_global + 1
        windows: list[int | None] = [None] + [window] * sliding_per_global
        grouped = dict(
            num_blocks=groups * num_blocks, block_size=block_size, watermark_blocks=groups * watermark_blocks
        )
        click.echo(f"[4/5] grouped-full ({groups} layer groups, every layer allocated in full)", err=True)
        full = simulate_paged(requests_, name="grouped-full", windows=[None] * groups, progress=progress, **grouped)
        click.echo(f"[5/5] grouped-window ({sliding_per_global} sliding groups hand back past {window})", err=True)
        hybrid = simulate_paged(requests_, name="grouped-window", windows=windows, progress=progress, **grouped)
        results += (full, hybrid)
    fp8 = None
    if kv_cache_dtype != "auto":
        fp8_blocks = FP8_GAIN * num_blocks  # the same bytes: an element takes 1 byte, not 2
        click.echo(f"[+] paged fp8 ({fp8_blocks:,} blocks of 8-bit K/V in the same bytes)", err=True)
        fp8 = simulate_paged(
            requests_,
            num_blocks=fp8_blocks,
            block_size=block_size,
            watermark_blocks=math.floor(watermark * fp8_blocks),
            progress=progress,
            name="paged_fp8",
        )
        results += (fp8,)
    for res in results:
        if res.completed != requests:
            raise click.ClickException(f"{res.name}: {res.completed} of {requests} requests completed")

    columns = [
        "scheduler",
        "max active",
        "mean active",
        "KV utilization",
        "budget holding tokens",
        "preemptions",
        "steps",
        "saturated steps",
        "seconds",
    ]
    cells = [
        [
            r.name,
            _fmt(r.max_active),
            f"{r.mean_active:.1f}",
            f"{r.kv_utilization:.1%}",
            f"{r.budget_fill:.1%}",
            _fmt(r.preemptions),
            _fmt(r.steps),
            _fmt(r.saturated_steps),
            f"{r.seconds:.1f}",
        ]
        for r in results
    ]
    echo("")
    for line in table_lines(columns, cells):
        echo(line)
    echo(
        f"max active: over all steps; mean active, KV utilization (tokens stored / slots allocated, paged: blocks "
        f"in use x {block_size}, or reserved) and budget holding tokens (tokens stored / {kv_tokens:,}): averaged "
        f"over the saturated steps (requests waiting)"
    )
    echo(
        f"paged holds {paged.mean_active / contiguous.mean_active:.1f}x the sequences of contiguous reservation "
        f"({paged.mean_active / oracle.mean_active:.2f}x oracle); recomputed {paged.recomputed_tokens:,} tokens "
        f"after {paged.preemptions:,} preemptions ({os.cpu_count()} cores)"
    )
    if fp8 is not None:
        echo(
            f"paged fp8 ({kv_cache_dtype}, {FP8_GAIN}x the blocks in the same bytes) holds "
            f"{fp8.mean_active / paged.mean_active:.2f}x the sequences of paged 16-bit K/V (mean active "
            f"{fp8.mean_active:.1f} vs {paged.mean_active:.1f}; max {fp8.max_active} vs {paged.max_active})"
        )
    figures: dict[str, object] = {}
    for res in results:
        figures.update(
            {
                f"{res.name.replace('-', '_')}_{k}": (round(v, 4) if isinstance(v, float) else v)
                for k, v in res.figures().items()
            }
        )
    if window is not None:
        echo(
            f"grouped-window (a Gemma-3 shape: {sliding_per_global} sliding layers of window {window} per global "
            f"one) holds {hybrid.mean_active / full.mean_active:.2f}x the sequences of every layer allocated in "
            f"full (mean active, saturated steps; max active {hybrid.max_active} against {full.max_active})"
        )
    figures = {
        "paged_max_active": paged.max_active,
        "contiguous_max_active": contiguous.max_active,
        "oracle_max_active": oracle.max_active,
        "paged_kv_utilization": round(paged.kv_utilization, 4),
        "contiguous_kv_utilization": round(contiguous.kv_utilization, 4),
        "oracle_kv_utilization": round(oracle.kv_utilization, 4),
        "paged_vs_contiguous_mean_active": round(paged.mean_active / contiguous.mean_active, 3),
        **figures,
        "requests": requests,
        "kv_tokens": kv_tokens,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_len": max_len,
        "watermark_blocks": watermark_blocks,
        "seed": seed,
        "prompt_lognormal": {"median": prompt_median, "sigma": PROMPT_SIGMA},
        "output_lognormal": {"median": output_median, "sigma": OUTPUT_SIGMA},
        "window": window,
        "sliding_per_global": sliding_per_global if window is not None else None,
        "prompt_mean": round(statistics.fmean(prompts), 1),
        "output_mean": round(statistics.fmean(outputs), 1),
        "quick": quick,
    }
    if window is not None:
        figures["grouped_window_vs_full_mean_active"] = round(hybrid.mean_active / full.mean_active, 3)
    if executor_requests is not None:
        assert window is not None
        figures |= _executor_line(window, executor_requests)
    if fp8 is not None:
        figures["kv_cache_dtype"] = kv_cache_dtype
        figures["fp8_vs_auto_mean_active"] = round(fp8.mean_active / paged.mean_active, 3)
    echo(json.dumps(figures))
