"""`pagedkv bench throughput`: this engine against `transformers` static batching, same model, requests and KV memory.

`--blockd compare` runs the engine against the daemon and against an in-process blockd instead. Workload, both
systems, the turn-taking and the figures: docs/benchmarks.md, "throughput". The last stdout line is one JSON
object; progress goes to stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import click

from blockd.client import PoolClient
from blockd.inprocess import InProcessBlockd
from common.clicks import unless_given
from common.cpu import machine_busy_s
from common.default_model import ensure_default_model
from common.units import parse_size
from executor.model_config import CheckpointError, UnsupportedModel
from executor.params import SamplingParams
from pagedkv.bench.common import (
    blockd_daemon,
    length_range_option,
    requests_option,
    table_lines,
    threads_option,
)

DEFAULT_REQUESTS = 256
DEFAULT_PROMPT_RANGE = (16, 256)
DEFAULT_OUTPUT_RANGE = (16, 256)
#: The default KV budget: what a static batch of this many max-length sequences needs.
DEFAULT_BUDGET_SEQS = 6
QUICK_REQUESTS = 24
QUICK_PROMPT_RANGE = (8, 64)
QUICK_OUTPUT_RANGE = (8, 64)
DTYPE_NAMES = ("float32", "float16", "bfloat16")


# ------------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt: list[int]
    output_len: int


def make_workload(
    count: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    special_ids: set[int],
    seed: int,
) -> list[BenchRequest]:
    """Seeded requests: uniform prompt and output lengths, uniform random token ids outside `special_ids`."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    requests = []
    for i in range(count):
        prompt_len = rng.randint(*prompt_range)
        output_len = rng.randint(*output_range)
        requests.append(BenchRequest(f"r{i}", rng.choices(allowed, k=prompt_len), output_len))
    return requests


@dataclass
class RunResult:
    name: str
    output_tokens: int = 0  # what users get: each request's own output length
    seconds: float = 0.0
    max_active: int = 0
    steps: int = 0  # forward passes (hf: one per token position of each batch, the prefill's included)
    computed_tokens: int = 0  # hf: tokens generated including those past a request's own length
    preemptions: int = 0
    first_tokens: list[int] = field(default_factory=list)  # the first request's output

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0


class Progress:
    """A line on stderr about every tenth of the tokens (and at the end)."""

    def __init__(self, name: str, total: int) -> None:
        self.name, self.total = name, total
        self.shown = 0

    def update(self, done: int, seconds: float, extra: str = "") -> None:
        tenth = 10 * done // max(1, self.total)
        if tenth > self.shown or (done == self.total and self.shown <= 10):
            self.shown = tenth if done < self.total else 11
            click.echo(f"  {self.name:>7}: {done:,}/{self.total:,} tokens in {seconds:.1f} s{extra}", err=True)


def _synchronize(device: Any) -> None:
    import torch  # torch, and what imports it (the executor's engine, runner, checkpoint), on use: --help is fast

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- pagedkv side


def build_engine(
    model_dir: Path,
    endpoint: str | None,
    *,
    device: Any,
    dtype: Any,
    num_blocks: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    speculative: Any = None,
) -> Any:
    """The engine as the executor builds it: model and KV cache here, its pool registered with blockd (at
    `endpoint`; None: an in-process blockd, `blockd.inprocess.InProcessBlockd`, behind the same pool client)."""
    from executor.engine import Engine, EngineLimits  # torch on use (see _synchronize)
    from executor.runner import ModelRunner, load_model

    loaded = load_model(model_dir, device, dtype)
    limits = EngineLimits(max_num_seqs, max_num_batched_tokens, speculative=speculative)  # (--speculative-config)
    if endpoint is None:
        runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=block_size)
        pool = PoolClient(
            InProcessBlockd(timeout_s=10.0),
            pool_id="bench-throughput",
            num_blocks=num_blocks,
            block_size=block_size,
            model_id=loaded.config.model_id,
            sliding_window=runner.groups.window,
            groups=runner.groups.pool_groups,
        )
        engine = Engine(runner, pool, limits, seed=0)
    else:
        engine = Engine.assemble(
            loaded,
            endpoint,
            pool_id="bench-throughput",
            num_blocks=num_blocks,
            block_size=block_size,
            limits=limits,
            seed=0,
            timeout_s=10.0,
        )
    engine.pool.register()
    return engine


class PagedRun:
    """The engine working through one workload, resumable: every request is submitted at once (timed), then
    `advance` runs steps until a number of output tokens is reached; only the time inside counts."""

    def __init__(self, engine: Any, requests: list[BenchRequest], salt: str) -> None:
        self.engine, self.requests, self.salt = engine, requests, salt
        self.result = RunResult("pagedkv")
        self.total = sum(r.output_len for r in requests)
        self.first_id = f"{salt}-{requests[0].request_id}"
        self.submitted = False
        self.preempted_before = engine.scheduler.num_preemptions
        self.steps_before = engine.steps  # forward passes (a step that only frees blocks runs none)

    @property
    def done(self) -> bool:
        return self.submitted and not self.engine.has_work()

    def advance(self, target_tokens: int, min_s: float = 0.0) -> None:
        """Steps until more than `target_tokens` output tokens are out and `min_s` has passed, or all are done."""
        engine, result, scheduler = self.engine, self.result, self.engine.scheduler
        device = engine.runner.device
        started = time.perf_counter()
        if not self.submitted:
            for r in self.requests:
                params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
                # The salt keeps runs (warm-up, repeats) from reusing each other's prompt blocks.
                engine.add_request(f"{self.salt}-{r.request_id}", r.prompt, params, cache_salt=self.salt)
            self.submitted = True
        while engine.has_work():
            # (once every token is out, the last steps only free blocks: run them now)
            ahead = target_tokens < result.output_tokens < self.total
            if ahead and time.perf_counter() - started >= min_s:
                break
            deltas = engine.step()
            result.max_active = max(result.max_active, len(scheduler.running))
            for delta in deltas:
                result.output_tokens += len(delta.token_ids)
                if delta.request_id == self.first_id:
                    result.first_tokens += delta.token_ids
        _synchronize(device)
        result.seconds += time.perf_counter() - started
        result.computed_tokens = result.output_tokens
        result.steps = engine.steps - self.steps_before
        result.preemptions = scheduler.num_preemptions - self.preempted_before

    def status(self) -> str:
        s = self.engine.scheduler
        return f"{len(s.running)} running, {len(s.waiting)} waiting"


# ------------------------------------------------------------------------------------------- transformers side


def load_hf(model_dir: Path, device: Any, dtype: Any) -> tuple[Any, int]:
    """The transformers model with end-of-sequence switched off (no sequence stops early); its pad token id."""
    import transformers  # on use, as torch (see _synchronize)
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else model.config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    pad = gen.pad_token_id if gen.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    gen.eos_token_id = None  # generate then runs every row to max_new_tokens, like ignore_eos
    gen.pad_token_id = pad
    gen.do_sample = False
    for name in ("temperature", "top_p", "top_k"):  # unset sampling knobs: no warnings for greedy
        if hasattr(gen, name):
            setattr(gen, name, None)
    return model, pad


class HfRun:
    """FCFS static batches through `generate`: left-padded prompts, every row generating the batch's longest
    output; only each request's own output length counts as output tokens.

    `run(pause)` calls `pause()` after every generated token but a batch's last (from a stopping criterion that
    never stops a row), so that another system can take a turn right there, in this thread; the time spent in
    `pause` is left out of this run's."""

    def __init__(self, model: Any, pad_id: int, requests: list[BenchRequest], batch_size: int) -> None:
        self.model, self.pad_id = model, pad_id
        self.batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
        self.batch_number = 0
        self.result = RunResult("hf")
        self.total = sum(r.output_len for r in requests)
        self.done = False
        self._counted = 0  # output tokens of the batches before the current one
        self._started = 0.0
        self._paused_s = 0.0

    def status(self) -> str:
        return f"batch {self.batch_number}/{len(self.batches)}"

    def run(self, pause: Callable[[], None] = lambda: None) -> None:
        import torch  # on use (see _synchronize)

        device = self.model.device
        _synchronize(device)
        self._started = time.perf_counter()
        with torch.inference_mode():
            for batch in self.batches:
                self._generate(batch, pause)
        _synchronize(device)
        self.result.seconds = time.perf_counter() - self._started - self._paused_s
        self.done = True

    def _pause(self, pause: Callable[[], None]) -> None:
        _synchronize(self.model.device)
        started = time.perf_counter()
        self.result.seconds = started - self._started - self._paused_s  # so far
        pause()
        self._paused_s += time.perf_counter() - started

    def _generate(self, batch: list[BenchRequest], pause: Callable[[], None]) -> None:
        import torch  # on use (see _synchronize)
        import transformers

        run, result, device = self, self.result, self.model.device
        width = max(len(r.prompt) for r in batch)
        new = max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        outputs = [r.output_len for r in batch]
        self.batch_number += 1

        class TakeTurns(transformers.StoppingCriteria):
            """Called after every generated token: never stops a row; lets the other system take a turn."""

            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                made = input_ids.shape[1] - width
                result.output_tokens = run._counted + sum(min(made, n) for n in outputs)
                if made < new:
                    run._pause(pause)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        out = self.model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            do_sample=False,
            max_new_tokens=new,
            stopping_criteria=transformers.StoppingCriteriaList([TakeTurns()]),
        )
        generated = out[:, width:].tolist()
        if any(len(g) != new for g in generated):
            raise click.ClickException(
                f"transformers generated {len(generated[0])} tokens, not {new}: end-of-sequence was not switched off"
            )
        if self.batch_number == 1:
            result.first_tokens = generated[0][: batch[0].output_len]
        self._counted += sum(outputs)
        result.output_tokens = self._counted
        result.computed_tokens += len(batch) * new
        result.steps += new
        result.max_active = max(result.max_active, len(batch))


#: Each system's turns last at least this long (seconds), so that the two models do not evict each other from
#: the CPU caches at every step; short enough that load from elsewhere falls on both alike.
TURN_S = 0.2


def run_interleaved(paged: PagedRun, hf: HfRun, progress: bool = True) -> tuple[RunResult, RunResult]:
    """Both runs to the end in this thread, taking turns of about TURN_S: transformers generates until it has
    more output tokens out than the engine (and TURN_S has passed), then the engine steps until it has more than
    transformers, and so on. Each system's time is the sum of its own turns, so any stretch of the run (and any
    burst of load from elsewhere on a shared machine) holds about the same work of both. One thread, not two: two
    would each get their own OpenMP team, whose idle workers spin and slow down the other's."""
    assert paged.total == hf.total  # the same workload
    reports = {"pagedkv": Progress("pagedkv", paged.total), "hf": Progress("hf", hf.total)}

    def report(run: PagedRun | HfRun) -> None:
        if progress:
            reports[run.result.name].update(run.result.output_tokens, run.result.seconds, f", {run.status()}")

    turn_started = time.perf_counter()

    def engine_turn() -> None:  # called by transformers after every token
        nonlocal turn_started
        if paged.done or hf.result.output_tokens <= paged.result.output_tokens:
            return
        if time.perf_counter() - turn_started < TURN_S:
            return
        report(hf)
        paged.advance(hf.result.output_tokens, TURN_S)
        report(paged)
        turn_started = time.perf_counter()

    hf.run(engine_turn)
    report(hf)
    paged.advance(paged.total)
    report(paged)
    return paged.result, hf.result


def run_alternating(a: PagedRun, b: PagedRun) -> tuple[RunResult, RunResult]:
    """Two engines through the same workload in this thread, taking turns of about TURN_S (each until it has
    more output tokens out than the other), each timed over its own turns."""
    assert a.total == b.total
    while not (a.done and b.done):
        for run, other in ((a, b), (b, a)):
            if not run.done:
                run.advance(other.result.output_tokens if not other.done else run.total, TURN_S)
    return a.result, b.result


def _compare_blockd(
    model_dir: Path, requests: list[BenchRequest], repeat: int, settings: dict[str, Any], **build: Any
) -> None:
    """`--blockd compare`: the engine against the daemon and against an in-process blockd, taking turns."""
    echo = click.echo
    with (
        tempfile.TemporaryDirectory(prefix="pagedkv-bench-") as tmp,
        blockd_daemon(Path(tmp) / "blockd.log", "--no-persistence", "--lease-timeout", "3600") as ep,
    ):
        engines = {"daemon": build_engine(model_dir, ep, **build), "inprocess": build_engine(model_dir, None, **build)}
        warm = [BenchRequest(f"w{i}", r.prompt[:16], 4) for i, r in enumerate(requests[:2])]
        for engine in engines.values():
            PagedRun(engine, warm, "warmup").advance(10**9)
        runs: dict[str, list[RunResult]] = {name: [] for name in engines}
        try:
            for run in range(repeat):
                first, second = ("daemon", "inprocess") if run % 2 == 0 else ("inprocess", "daemon")
                a = PagedRun(engines[first], requests, f"run{run}")
                b = PagedRun(engines[second], requests, f"run{run}")
                run_alternating(a, b)
                runs[first].append(a.result)
                runs[second].append(b.result)
                echo(
                    f"[run {run + 1}/{repeat}] daemon {runs['daemon'][-1].tok_s:,.1f} tok/s, in-process "
                    f"{runs['inprocess'][-1].tok_s:,.1f} tok/s: ratio "
                    f"{runs['daemon'][-1].tok_s / runs['inprocess'][-1].tok_s:.3f}",
                    err=True,
                )
        finally:
            with contextlib.suppress(Exception):
                engines["daemon"].pool.unregister()
                engines["daemon"].pool.client.close()
    ratios = [d.tok_s / i.tok_s for d, i in zip(runs["daemon"], runs["inprocess"], strict=True)]
    daemon = statistics.median(r.tok_s for r in runs["daemon"])
    inprocess = statistics.median(r.tok_s for r in runs["inprocess"])
    ratio = statistics.median(ratios)
    match = runs["daemon"][0].first_tokens == runs["inprocess"][0].first_tokens
    echo(
        f"blockd daemon {daemon:,.1f} tok/s, in-process {inprocess:,.1f} tok/s (medians of {repeat}); ratio "
        f"daemon / in-process {ratio:.3f} (runs: {', '.join(f'{r:.3f}' for r in ratios)}); "
        f"most concurrent {max(r.max_active for r in runs['daemon'])}; first request identical: {match}"
    )
    echo(
        json.dumps(
            {
                "daemon_tok_s": round(daemon, 3),
                "inprocess_tok_s": round(inprocess, 3),
                "ratio": round(ratio, 4),
                "ratios": [round(r, 4) for r in ratios],
                "max_active": max(r.max_active for r in runs["daemon"]),
                "output_tokens": runs["daemon"][0].output_tokens,
                "first_request_match": match,
                "requests": len(requests),
                "repeat": repeat,
                **settings,
                **{k: str(v) if k in ("device", "dtype") else v for k, v in build.items()},
            }
        )
    )


# ---------------------------------------------------------------------------------------------------- command


def bench_model(model_dir: Path | None) -> tuple[Path, Any]:
    """The benchmark's checkpoint (the default model, generated on first use, when none is given) and its
    config; a usage error naming --model when it cannot be served."""
    from executor.checkpoint import load_config  # torch on use (_synchronize)

    if model_dir is None:
        click.echo("using the default model (generated on first use)", err=True)
        model_dir = ensure_default_model()
    try:
        return model_dir, load_config(model_dir)
    except (CheckpointError, UnsupportedModel) as exc:
        raise click.BadParameter(str(exc), param_hint="'--model'") from None


class OtherLoad:
    """How much of the machine's CPU went to other processes (blockd included) while the timed runs ran."""

    def __enter__(self) -> Self:
        self.busy, self.own, self.wall = machine_busy_s(), time.process_time(), time.perf_counter()
        self.share: float | None = None
        return self

    def __exit__(self, *_: object) -> None:
        busy = machine_busy_s()
        if busy is None or self.busy is None:
            return
        others = (busy - self.busy) - (time.process_time() - self.own)
        self.share = max(0.0, others) / ((time.perf_counter() - self.wall) * (os.cpu_count() or 1))


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def special_ids(model_dir: Path, config: Any) -> set[int]:
    ids = set(config.eos_token_ids)
    if config.bos_token_id is not None:
        ids.add(config.bos_token_id)
    try:
        import transformers  # on use (see _synchronize)

        ids.update(transformers.AutoTokenizer.from_pretrained(model_dir).all_special_ids)
    except (OSError, ValueError, KeyError):  # no usable tokenizer: the config's ids are all we know of
        return ids
    return ids


@click.command(
    "throughput",
    help=f"""Output tokens/s of this engine (real blockd, continuous batching, paged KV cache) against transformers
    static batching on the same model, the same requests and the same KV memory budget.

    Workload (seeded): --requests prompts of random token ids, prompt and output lengths uniform in
    --prompt-range and --output-range; greedy, ignore_eos, max_tokens = each request's output length, all
    submitted at once. The KV budget gives pagedkv budget // bytes-per-block blocks, and transformers batches of
    budget // (bytes-per-token x max_len) requests, max_len = longest prompt + longest output (a contiguous cache
    reserves the maximum for every sequence). transformers runs FCFS batches, left-padded, each until its longest
    output is done; only each request's own output tokens count. Both run a tiny untimed warm-up first; then the
    two take turns of about {TURN_S} s, each timed over its own turns only (so load from elsewhere falls on both
    alike), --repeat times; the best of each is reported. The first request's tokens are compared (float32: they
    should match). Progress goes to stderr; the last line of stdout is one JSON object.

    --quick: {QUICK_REQUESTS} requests, prompts and outputs in {QUICK_PROMPT_RANGE[0]}-{QUICK_PROMPT_RANGE[1]}
    tokens (options given explicitly win), for tests; the figures mean nothing.""",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint directory (default: the generated default llama, `ensure_default_model`).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default=None,
    help="Where both systems run (default: cuda if available, else cpu).",
)
@click.option(
    "--dtype",
    type=click.Choice(DTYPE_NAMES),
    default=None,
    help="Weights and KV cache dtype of both (default: float32 on cpu, bfloat16 on cuda).",
)
@requests_option(DEFAULT_REQUESTS, "Requests in the workload.")
@length_range_option("--prompt-range", DEFAULT_PROMPT_RANGE, "MIN MAX prompt length in tokens (uniform).")
@length_range_option(
    "--output-range",
    DEFAULT_OUTPUT_RANGE,
    "MIN MAX output length in tokens (uniform); exactly this many are generated.",
)
@click.option(
    "--kv-cache-memory",
    default=None,
    help=f"KV budget of each system in bytes (65536, 512k, 24MiB; binary units). Default: what a static "
    f"batch of {DEFAULT_BUDGET_SEQS} max-length sequences of the workload needs in this model and "
    "dtype.",
)
@click.option(
    "--block-size", type=click.IntRange(min=1), default=16, show_default=True, help="pagedkv tokens per KV block."
)
@click.option(
    "--max-num-seqs",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="pagedkv: most sequences in one step.",
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="pagedkv: most tokens in one step (prefill chunks and decodes); at least --max-num-seqs.",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Timed runs of the pair (each a fresh pass over the workload); the best of each is reported.",
)
@threads_option("torch intra-op threads of both (default: torch's own choice, one per core).")
@click.option(
    "--blockd",
    "blockd_mode",
    type=click.Choice(["daemon", "inprocess", "compare"]),
    default="daemon",
    show_default=True,
    help="pagedkv's blockd: a real daemon over ZeroMQ (as served), or a BlockManager in this process behind the "
    "same pool client (blockd.inprocess). compare: no transformers; the engine against the daemon and the engine "
    "against an in-process blockd take turns on the workload, and their ratio (daemon / in-process) is the cost "
    "of blockd being its own service.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of lengths and token ids.")
@click.option("--quick", is_flag=True, help="A tiny run for tests (see above).")
@click.pass_context
def bench_throughput(
    ctx: click.Context,
    model_dir: Path | None,
    device: str | None,
    dtype: str | None,
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    kv_cache_memory: str | None,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    repeat: int,
    threads: int | None,
    blockd_mode: str,
    seed: int,
    quick: bool,
) -> None:
    import torch  # on use (see _synchronize)

    from executor.runner import DTYPES, kv_bytes_per_block

    if quick:
        num_requests = unless_given(ctx, num_requests, "num_requests", QUICK_REQUESTS)
        prompt_range = unless_given(ctx, prompt_range, "prompt_range", QUICK_PROMPT_RANGE)
        output_range = unless_given(ctx, output_range, "output_range", QUICK_OUTPUT_RANGE)
    if max_num_batched_tokens < max_num_seqs:
        raise click.BadParameter(
            f"{max_num_batched_tokens} is below --max-num-seqs {max_num_seqs} (every decoding sequence needs a token)",
            param_hint="'--max-num-batched-tokens'",
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter("no CUDA device is available", param_hint="'--device'")
    if dtype is None:
        dtype = "bfloat16" if device == "cuda" else "float32"
    torch_device, torch_dtype = torch.device(device), DTYPES[dtype]
    if threads is not None:
        torch.set_num_threads(threads)

    model_dir, config = bench_model(model_dir)

    requests = make_workload(
        num_requests, prompt_range, output_range, config.vocab_size, special_ids(model_dir, config), seed
    )
    max_len = max(len(r.prompt) for r in requests) + max(r.output_len for r in requests)
    if max_len > config.max_model_len:
        raise click.BadParameter(
            f"the workload's longest prompt + longest output is {max_len} tokens; the model "
            f"holds {config.max_model_len}",
            param_hint="'--prompt-range'/'--output-range'",
        )
    per_token = kv_bytes_per_block(config, 1, torch_dtype)
    per_block = kv_bytes_per_block(config, block_size, torch_dtype)
    if kv_cache_memory is None:
        budget = DEFAULT_BUDGET_SEQS * max_len * per_token
    else:
        try:
            budget = parse_size(kv_cache_memory)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--kv-cache-memory'") from None
    hf_batch = budget // (per_token * max_len)
    num_blocks = budget // per_block
    watermark = max(1, num_blocks // 100)  # the scheduler's default
    if hf_batch < 1 or num_blocks - watermark < -(-max_len // block_size):
        need = max(per_token * max_len, (-(-max_len // block_size) + 1) * per_block)
        raise click.BadParameter(
            f"{budget:,} bytes hold no sequence of the workload's max length {max_len} "
            f"({per_token:,} bytes per token); give at least {need:,}",
            param_hint="'--kv-cache-memory'",
        )
    hf_batch = min(hf_batch, num_requests)

    if blockd_mode == "compare":
        _compare_blockd(
            model_dir,
            requests,
            repeat,
            {"prompt_range": list(prompt_range), "output_range": list(output_range), "seed": seed},
            device=torch_device,
            dtype=torch_dtype,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        return

    echo = click.echo
    prompts = [len(r.prompt) for r in requests]
    outputs = [r.output_len for r in requests]
    echo(
        f"model:    {model_dir} ({config.architecture}, {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads}/{config.num_kv_heads} heads of {config.head_dim}, vocab {config.vocab_size}); "
        f"{device}, {dtype}, {torch.get_num_threads()} threads"
    )
    echo(
        f"workload: {num_requests} requests, seed {seed}; prompt uniform {prompt_range[0]}-{prompt_range[1]} "
        f"(mean {statistics.fmean(prompts):.0f}), output uniform {output_range[0]}-{output_range[1]} (mean "
        f"{statistics.fmean(outputs):.0f}, {sum(outputs):,} in all); greedy, ignore_eos; max_len {max_len}"
    )
    echo(
        f"KV:       {budget:,} bytes ({_mib(budget)}) each; pagedkv {num_blocks:,} blocks of {block_size} "
        f"({num_blocks * block_size:,} token slots), transformers batches of {hf_batch} x {max_len} slots"
    )

    blockd_flags = ("--no-persistence", "--lease-timeout", "3600")  # a long lease: the pool idles while hf runs
    with contextlib.ExitStack() as stack:
        if blockd_mode == "daemon":
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedkv-bench-"))
            ep: str | None = stack.enter_context(blockd_daemon(Path(tmp) / "blockd.log", *blockd_flags))
        else:
            ep = None
        click.echo("loading both models; warm-up", err=True)
        engine = build_engine(
            model_dir,
            ep,
            device=torch_device,
            dtype=torch_dtype,
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        hf_model, pad_id = load_hf(model_dir, torch_device, torch_dtype)
        paged_runs, hf_runs = [], []
        try:
            warm = [BenchRequest(f"w{i}", r.prompt[:16], 4) for i, r in enumerate(requests[:2])]
            run_interleaved(
                PagedRun(engine, warm, "warmup"), HfRun(hf_model, pad_id, warm, min(2, hf_batch)), progress=False
            )
            with OtherLoad() as load:
                for run in range(repeat):
                    click.echo(
                        f"[run {run + 1}/{repeat}] pagedkv ({num_blocks} blocks, every request at once) and "
                        f"transformers (static batches of {hf_batch}), taking turns",
                        err=True,
                    )
                    paged_run, hf_run = run_interleaved(
                        PagedRun(engine, requests, f"run{run}"), HfRun(hf_model, pad_id, requests, hf_batch)
                    )
                    paged_runs.append(paged_run)
                    hf_runs.append(hf_run)
        finally:
            with contextlib.suppress(Exception):
                engine.pool.unregister()
                engine.pool.client.close()

    paged = max(paged_runs, key=lambda r: r.tok_s)
    hf = max(hf_runs, key=lambda r: r.tok_s)
    if paged.output_tokens != hf.output_tokens:
        raise click.ClickException(f"pagedkv generated {paged.output_tokens} tokens, transformers {hf.output_tokens}")
    ratio = paged.tok_s / hf.tok_s
    first_len = requests[0].output_len
    match = paged.first_tokens == hf.first_tokens
    diverge = next(
        (i for i, (a, b) in enumerate(zip(paged.first_tokens, hf.first_tokens, strict=False)) if a != b), None
    )

    columns = [
        "system",
        "requests",
        "output tokens",
        "seconds",
        "output tok/s",
        "max concurrent",
        "KV budget",
        "forward passes",
        "computed tokens",
    ]
    cells = [
        [
            f"pagedkv ({num_blocks} blocks of {block_size}, blockd {blockd_mode})",
            f"{num_requests:,}",
            f"{paged.output_tokens:,}",
            f"{paged.seconds:.1f}",
            f"{paged.tok_s:,.1f}",
            f"{paged.max_active:,}",
            _mib(budget),
            f"{paged.steps:,}",
            f"{paged.computed_tokens:,}",
        ],
        [
            f"transformers (batches of {hf_batch})",
            f"{num_requests:,}",
            f"{hf.output_tokens:,}",
            f"{hf.seconds:.1f}",
            f"{hf.tok_s:,.1f}",
            f"{hf.max_active:,}",
            _mib(budget),
            f"{hf.steps:,}",
            f"{hf.computed_tokens:,}",
        ],
    ]
    echo("")
    for line in table_lines(columns, cells):
        echo(line)
    wasted = hf.computed_tokens - hf.output_tokens
    echo(
        f"ratio pagedkv / transformers: {ratio:.2f}x output tok/s; {paged.max_active / hf.max_active:.1f}x the "
        f"sequences at once; pagedkv preempted {paged.preemptions} times; transformers computed {wasted:,} tokens "
        f"past their requests' ends ({wasted / hf.computed_tokens:.0%}) [best of {repeat}, {os.cpu_count()} cores]"
    )
    if load.share is not None:
        echo(
            f"other processes (blockd included) used {load.share:.0%} of the machine's CPU during the timed runs"
            + (": figures disturbed, rerun on a quieter machine" if load.share > 0.15 else "")
        )
    if match:
        echo(f"first request ({first_len} tokens): identical greedy output from both")
    else:
        echo(
            f"first request ({first_len} tokens): outputs differ from token {diverge} on "
            f"({'unexpected in float32' if dtype == 'float32' else f'{dtype} rounding differs between the two'})"
        )
    echo(
        json.dumps(
            {
                "pagedkv_tok_s": round(paged.tok_s, 3),
                "hf_tok_s": round(hf.tok_s, 3),
                "ratio": round(ratio, 4),
                "pagedkv_max_active": paged.max_active,
                "hf_max_active": hf.max_active,
                "pagedkv_output_tokens": paged.output_tokens,
                "hf_output_tokens": hf.output_tokens,
                "pagedkv_seconds": round(paged.seconds, 3),
                "hf_seconds": round(hf.seconds, 3),
                "pagedkv_steps": paged.steps,
                "pagedkv_preemptions": paged.preemptions,
                "hf_decode_steps": hf.steps,
                "hf_computed_tokens": hf.computed_tokens,
                "other_cpu_share": None if load.share is None else round(load.share, 3),
                "first_request_match": match,
                "first_request_diverges_at": diverge,
                "model": str(model_dir),
                "model_id": config.model_id,
                "device": device,
                "dtype": dtype,
                "threads": torch.get_num_threads(),
                "requests": num_requests,
                "prompt_range": list(prompt_range),
                "output_range": list(output_range),
                "seed": seed,
                "blockd": blockd_mode,
                "kv_cache_bytes": budget,
                "kv_bytes_per_token": per_token,
                "block_size": block_size,
                "num_blocks": num_blocks,
                "hf_batch_size": hf_batch,
                "max_len": max_len,
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens,
                "repeat": repeat,
                "cpu_count": os.cpu_count(),
                "quick": quick,
            }
        )
    )


__all__ = [
    "HfRun",
    "PagedRun",
    "bench_throughput",
    "blockd_daemon",
    "make_workload",
    "run_interleaved",
]
