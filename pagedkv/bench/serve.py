"""`pagedkv bench serve`: a whole stack under streaming OpenAI clients, and prefix routing against round-robin.

Workloads, phases and the definition of each figure: docs/benchmarks.md, "serving". Tables go to stdout, progress
bars to stderr; the last stdout line is one JSON object of every figure and parameter (also `--json PATH`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from common.clicks import unless_given
from common.units import parse_size
from pagedkv.bench.common import length_range_option, requests_option, table_lines
from pagedkv.serve import LocalStack, StackFailed

#: Token ids of every prompt: past the special tokens (0-3), below any test model's vocabulary (512).
TOKEN_IDS = (4, 500)
DEFAULT_CLIENTS = 16
DEFAULT_REQUESTS = 128
DEFAULT_PROMPT_RANGE = (32, 512)
DEFAULT_OUTPUT_RANGE = (16, 128)
DEFAULT_PREFIX_GROUPS = 8
DEFAULT_GROUP_SIZE = 8
DEFAULT_PREFIX_TOKENS = 384
DEFAULT_SUFFIX_TOKENS = 32
DEFAULT_ROUTING_OUTPUT = 16
# --quick: about half a minute on 2 CPU cores with the default model, most of it starting the three stacks.
QUICK_CLIENTS = 8
QUICK_REQUESTS = 48
QUICK_PROMPT_RANGE = (32, 256)
QUICK_OUTPUT_RANGE = (16, 64)
QUICK_PREFIX_GROUPS = 4
QUICK_GROUP_SIZE = 6
QUICK_PREFIX_TOKENS = 256
QUICK_SUFFIX_TOKENS = 32
QUICK_ROUTING_OUTPUT = 8
#: Untimed requests before each measured phase: first-call costs (allocations, lazy imports) stay out of it.
WARMUP_REQUESTS, WARMUP_PROMPT, WARMUP_OUTPUT = 4, 8, 2
REQUEST_TIMEOUT_S = 600.0
COMPARED_POLICIES = ("prefix", "round-robin")  # what part 2 sets side by side


# ------------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class ServeRequest:
    prompt: list[int]
    max_tokens: int
    group: int | None = None  # the prefix group (routing workload)


@dataclass(frozen=True)
class PrefixWorkload:
    leaders: list[ServeRequest]  # the first request of each group, sent (and finished) first
    followers: list[ServeRequest]  # the rest, shuffled: the measured requests
    prefixes: list[list[int]]  # each group's shared prefix


def _tokens(rng: random.Random, count: int, first: int | None = None) -> list[int]:
    """`count` random token ids; the first one is `first` when given."""
    ids = rng.choices(range(*TOKEN_IDS), k=count)
    if first is not None and count:
        ids[0] = first
    return ids


def make_load_workload(
    count: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> list[ServeRequest]:
    """Seeded requests: prompt and output lengths uniform in their ranges, uniform random token ids."""
    rng = random.Random(f"load:{seed}")
    requests = []
    for _ in range(count):
        prompt_len, output_len = rng.randint(*prompt_range), rng.randint(*output_range)
        requests.append(ServeRequest(_tokens(rng, prompt_len), output_len))
    return requests


def make_prefix_workload(
    groups: int, group_size: int, prefix_tokens: int, suffix_tokens: int, output_tokens: int, seed: int
) -> PrefixWorkload:
    """Seeded groups sharing a prefix each; distinct first tokens keep groups' prefixes and a group's suffixes
    from sharing anything by chance (see the module docstring)."""
    span = TOKEN_IDS[1] - TOKEN_IDS[0]
    if groups > span or group_size > span:
        raise ValueError(f"at most {span} groups of at most {span} requests (distinct first tokens)")
    rng = random.Random(f"prefix:{seed}")
    prefix_firsts = rng.sample(range(*TOKEN_IDS), groups)
    prefixes = [_tokens(rng, prefix_tokens, first) for first in prefix_firsts]
    leaders, followers = [], []
    for g, prefix in enumerate(prefixes):
        suffix_firsts = rng.sample(range(*TOKEN_IDS), group_size)
        members = [
            ServeRequest(prefix + _tokens(rng, suffix_tokens, first), output_tokens, g) for first in suffix_firsts
        ]
        leaders.append(members[0])
        followers += members[1:]
    rng.shuffle(followers)
    return PrefixWorkload(leaders, followers, prefixes)


def make_warmup(seed: int, count: int = WARMUP_REQUESTS) -> list[ServeRequest]:
    """Tiny random requests, from their own generator so that the measured workloads do not depend on them."""
    rng = random.Random(f"warmup:{seed}")
    return [ServeRequest(_tokens(rng, WARMUP_PROMPT), WARMUP_OUTPUT) for _ in range(count)]


# ------------------------------------------------------------------------------------------------- figures


@dataclass
class RequestResult:
    max_tokens: int
    chunk_times: list[float] = field(default_factory=list)  # seconds from sending, one per text-carrying chunk
    prompt_tokens: int = 0  # from the final usage chunk
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def gaps(self) -> list[float]:
        # A chunk carrying several tokens counts as one gap: there is no telling them apart.
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), interpolating linearly between ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@dataclass(frozen=True)
class Summary:
    requests: int
    completed: int
    errors: int  # may count more than requests - completed: the routing runs add their leaders' failures
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    short_outputs: int  # completed with fewer tokens than asked (ignore_eos should prevent it)
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    first_error: str | None = None

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.seconds if self.seconds > 0 else 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def figures(self, prefix: str) -> dict[str, Any]:
        """Every figure, keys prefixed (`load_`, `prefix_routed_`, ...), for the JSON line."""
        values = {
            "requests": self.requests,
            "completed": self.completed,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
            "requests_per_s": round(self.requests_per_s, 4),
            "output_tokens": self.output_tokens,
            "output_tok_s": round(self.output_tok_s, 3),
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p99_ms": self.ttft_p99_ms,
            "itl_p50_ms": self.itl_p50_ms,
            "itl_p99_ms": self.itl_p99_ms,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_fraction": round(self.cached_fraction, 4),
            "short_outputs": self.short_outputs,
            "first_error": self.first_error,
        }
        return {prefix + k: v for k, v in values.items()}


def summarize(results: Sequence[RequestResult], seconds: float) -> Summary:
    """Figures of one phase: latencies from the requests that completed, throughput over `seconds`."""
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    errors = [r.error for r in results if r.error is not None]
    return Summary(
        requests=len(results),
        completed=len(ok),
        errors=len(errors),
        seconds=seconds,
        output_tokens=sum(r.completion_tokens for r in ok),
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        cached_tokens=sum(r.cached_tokens for r in ok),
        short_outputs=sum(r.completion_tokens < r.max_tokens for r in ok),
        ttft_p50_ms=_ms(percentile(ttfts, 50)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        itl_p50_ms=_ms(percentile(gaps, 50)),
        itl_p99_ms=_ms(percentile(gaps, 99)),
        first_error=errors[0] if errors else None,
    )


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator rounded, or None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 4)


# ------------------------------------------------------------------------------------------------- clients


async def stream_one(
    client: Any, model: str, request: ServeRequest, clock: Callable[[], float] = time.perf_counter
) -> RequestResult:
    """One streamed completion (`client` an `openai.AsyncOpenAI`): chunk arrival times (by `clock`) and the final
    usage. A failure is recorded in the result, never raised: the other requests go on."""
    import openai  # the bench extra's (see _client)

    result = RequestResult(request.max_tokens)
    usage = None
    started = clock()
    try:
        stream = await client.completions.create(
            model=model,
            prompt=request.prompt,
            max_tokens=request.max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                result.chunk_times.append(clock() - started)
            usage = chunk.usage or usage  # the last chunk carries it (some servers send it on every chunk)
    except openai.OpenAIError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    if usage is None:  # include_usage asked for it: a stream without it was cut short
        result.error = "the stream ended without a usage chunk"
        return result
    result.prompt_tokens, result.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    details = usage.prompt_tokens_details
    result.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
    return result


async def run_requests(
    client: Any, model: str, requests: Sequence[ServeRequest], clients: int, on_done: Callable[[], None] = lambda: None
) -> tuple[list[RequestResult], float]:
    """Every request in order, `clients` at a time (each worker takes the next one as soon as it is free);
    the results in request order and the wall time from the first sending to the last end."""
    results: list[RequestResult | None] = [None] * len(requests)
    pending = iter(range(len(requests)))  # shared by the workers: one event loop, no locking needed

    async def worker() -> None:
        for i in pending:
            results[i] = await stream_one(client, model, requests[i])
            on_done()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(clients, len(requests)))))
    return [r for r in results if r is not None], time.perf_counter() - started


def _client(base_url: str) -> Any:
    try:  # openai and tqdm are the bench extra's (pagedkv[bench]), imported where used
        from openai import AsyncOpenAI
    except ImportError:  # a test extra, not a runtime dependency of the stack
        raise click.ClickException("pagedkv bench serve needs the openai package: pip install openai") from None

    # No retries: a retried request would hide an error and distort its latency.
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def _bar(desc: str, total: int) -> Any:
    from tqdm import tqdm  # the bench extra's, as openai

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=True)


async def _served_model(client: Any) -> str:
    import openai  # the bench extra's (see _client)

    try:
        models = (await client.models.list()).data
    except openai.OpenAIError as exc:
        raise click.ClickException(f"GET /v1/models at {client.base_url} failed: {exc}") from None
    if not models:
        raise click.ClickException("GET /v1/models lists no model")
    return models[0].id


async def _warm_up(client: Any, model: str, seed: int, clients: int) -> None:
    """The warm-up requests; any failure stops the bench here, before minutes of requests that would fail too."""
    results, _ = await run_requests(client, model, make_warmup(seed), clients)
    failed = next((r.error for r in results if r.error is not None), None)
    if failed is not None:
        raise click.ClickException(f"a warm-up request failed: {failed}")


async def measure_load(
    base_url: str, model: str | None, requests: Sequence[ServeRequest], clients: int, seed: int
) -> tuple[str, Summary]:
    """Part 1 against the stack at `base_url` (model from /v1/models unless given): the model and the figures."""
    async with _client(base_url) as client:
        model = model or await _served_model(client)
        await _warm_up(client, model, seed, clients)
        with _bar("load", len(requests)) as bar:
            results, seconds = await run_requests(client, model, requests, clients, lambda: bar.update(1))
    return model, summarize(results, seconds)


async def measure_routing(
    base_url: str, model: str, workload: PrefixWorkload, clients: int, seed: int, policy: str
) -> Summary:
    """Part 2 against one fresh stack: warm-up, the leaders to the end, then the followers (measured)."""
    async with _client(base_url) as client:
        await _warm_up(client, model, seed, clients)
        with _bar(policy, len(workload.leaders) + len(workload.followers)) as bar:
            # Every leader ends before any follower starts: the same starting state for both policies, and no
            # race between a prefix being computed and its followers arriving.
            leaders, _ = await run_requests(client, model, workload.leaders, clients, lambda: bar.update(1))
            followers, seconds = await run_requests(client, model, workload.followers, clients, lambda: bar.update(1))
    summary = summarize(followers, seconds)
    # A failed leader leaves its group uncached under either policy: it counts as an error of the run.
    leader_errors = [r.error for r in leaders if r.error is not None]
    return dataclasses.replace(
        summary,
        errors=summary.errors + len(leader_errors),
        first_error=summary.first_error or (leader_errors[0] if leader_errors else None),
    )


# ------------------------------------------------------------------------------------------------- stacks


@dataclass(frozen=True)
class StackOptions:
    model_dir: Path | None
    executors: int
    device: str
    kv_cache_memory: str | None


@contextlib.contextmanager
def own_stack(options: StackOptions, routing: str) -> Iterator[LocalStack]:
    """A fresh LocalStack without persistence (runs share no prefix index); a failed start is a ClickException."""
    click.echo(f"starting a stack: {options.executors} executors on {options.device}, {routing} routing", err=True)
    try:
        with LocalStack(
            model_dir=options.model_dir,
            executors=options.executors,
            device=options.device,
            port=0,
            routing=routing,
            kv_cache_memory=options.kv_cache_memory,
            persistence=False,
            gateway_args=["--report-cached-tokens"],  # the prefix hit rate is what this bench compares
        ) as stack:
            yield stack
    except StackFailed as exc:
        raise click.ClickException(f"the {routing} stack failed: {exc}") from exc


def _base_url(url: str) -> str:
    """The OpenAI base URL (ending in /v1) of a stack's URL, given with or without /v1."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


# ------------------------------------------------------------------------------------------------- output


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Lines of a plain text table: the first column left-aligned, the others right-aligned."""
    return table_lines(columns, [[_cell(v) for v in row] for row in rows])


def _load_table(s: Summary) -> list[str]:
    columns = [
        "requests",
        "errors",
        "seconds",
        "req/s",
        "output tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "cached",
        "short outputs",
    ]
    return table(
        columns,
        [
            [
                s.requests,
                s.errors,
                s.seconds,
                s.requests_per_s,
                s.output_tok_s,
                s.ttft_p50_ms,
                s.ttft_p99_ms,
                s.itl_p50_ms,
                s.itl_p99_ms,
                f"{s.cached_fraction:.1%}",
                s.short_outputs,
            ]
        ],
    )


def _routing_table(prefix: Summary, rr: Summary, ratios: dict[str, float | None]) -> list[str]:
    columns = ["routing", "followers", "errors", "TTFT p50 ms", "TTFT p99 ms", "cached fraction", "seconds"]
    rows = [
        [name, s.requests, s.errors, s.ttft_p50_ms, s.ttft_p99_ms, f"{s.cached_fraction:.1%}", s.seconds]
        for name, s in (("prefix", prefix), ("round-robin", rr))
    ]
    cached = ratios["routing_cached_fraction_ratio"]
    rows.append(
        [
            "ratio",
            "",
            "",
            _ratio_cell(ratios["routing_ttft_p50_ratio"], "rr/prefix"),
            _ratio_cell(ratios["routing_ttft_p99_ratio"], "rr/prefix"),
            _ratio_cell(cached, "prefix/rr"),
            "",
        ]
    )
    return table(columns, rows)


def _ratio_cell(value: float | None, what: str) -> str:
    return "-" if value is None else f"{value:.2f}x {what}"


def routing_ratios(prefix: Summary, rr: Summary) -> dict[str, float | None]:
    """TTFT round-robin / prefix (above 1: prefix routing is faster), cached fraction prefix / round-robin."""
    return {
        "routing_ttft_p50_ratio": ratio(rr.ttft_p50_ms, prefix.ttft_p50_ms),
        "routing_ttft_p99_ratio": ratio(rr.ttft_p99_ms, prefix.ttft_p99_ms),
        "routing_cached_fraction_ratio": ratio(prefix.cached_fraction, rr.cached_fraction),
    }


# ------------------------------------------------------------------------------------------------- command


@click.command(
    "serve",
    help=f"""Streaming OpenAI clients against a whole stack (gateway, executors, blockd), and prefix routing
    against round-robin.

    Serving load: --requests completions, --clients at a time, prompts of random token ids with lengths uniform
    in --prompt-range, max_tokens uniform in --output-range, ignore_eos; against --url or a stack started here.
    Reports requests/s, output tokens/s, TTFT and inter-token latency (p50, p99) and errors.

    Routing (unless --skip-routing; always on stacks started here): --prefix-groups groups of --group-size requests
    sharing a prefix of --prefix-tokens plus their own --suffix-tokens, against a fresh prefix-routed stack and
    then a fresh round-robin one: the first request of every group runs first, then the rest in shuffled order;
    TTFT and the cached fraction of the rest, and the ratios.

    Progress goes to stderr; the last line of stdout is one JSON object. --quick: {QUICK_CLIENTS} clients,
    {QUICK_REQUESTS} requests, prompts {QUICK_PROMPT_RANGE[0]}-{QUICK_PROMPT_RANGE[1]}, outputs
    {QUICK_OUTPUT_RANGE[0]}-{QUICK_OUTPUT_RANGE[1]}, {QUICK_PREFIX_GROUPS} groups of {QUICK_GROUP_SIZE}, prefix
    {QUICK_PREFIX_TOKENS}, suffix {QUICK_SUFFIX_TOKENS}, routing output {QUICK_ROUTING_OUTPUT} (options given
    explicitly win).""",
)
@click.option(
    "--url",
    default=None,
    help="Measure the serving load against the stack running at this URL "
    "(http://127.0.0.1:8000); default: start one here.",
)
@click.option(
    "--executors",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Executors of each stack started here.",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint directory of the stacks started here (default: the generated default model).",
)
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Where the executors of the stacks started here run.",
)
@click.option(
    "--kv-cache-memory",
    default=None,
    help="KV cache of each executor started here (256MiB; binary units). Default: the executor's.",
)
@click.option(
    "--clients",
    type=click.IntRange(min=1),
    default=DEFAULT_CLIENTS,
    show_default=True,
    help="Requests in flight at once.",
)
@requests_option(DEFAULT_REQUESTS, "Requests of the serving load.")
@length_range_option("--prompt-range", DEFAULT_PROMPT_RANGE, "MIN MAX prompt length in tokens (uniform).")
@length_range_option(
    "--output-range", DEFAULT_OUTPUT_RANGE, "MIN MAX max_tokens (uniform); ignore_eos makes it the output length."
)
@click.option(
    "--prefix-groups",
    type=click.IntRange(1, TOKEN_IDS[1] - TOKEN_IDS[0]),
    default=DEFAULT_PREFIX_GROUPS,
    show_default=True,
    help="Routing: groups sharing a prefix.",
)
@click.option(
    "--group-size",
    type=click.IntRange(2, TOKEN_IDS[1] - TOKEN_IDS[0]),
    default=DEFAULT_GROUP_SIZE,
    show_default=True,
    help="Routing: requests per group (the first one warms the prefix up).",
)
@click.option(
    "--prefix-tokens",
    type=click.IntRange(min=1),
    default=DEFAULT_PREFIX_TOKENS,
    show_default=True,
    help="Routing: length of each group's shared prefix.",
)
@click.option(
    "--suffix-tokens",
    type=click.IntRange(min=1),
    default=DEFAULT_SUFFIX_TOKENS,
    show_default=True,
    help="Routing: length of each request's own suffix.",
)
@click.option(
    "--routing-output",
    type=click.IntRange(min=1),
    default=DEFAULT_ROUTING_OUTPUT,
    show_default=True,
    help="Routing: max_tokens of every request.",
)
@click.option("--skip-routing", is_flag=True, help="Measure the serving load only.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every length and token id.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the JSON object to this file.",
)
@click.option("--quick", is_flag=True, help="A small run for tests (see above).")
@click.pass_context
def bench_serve(
    ctx: click.Context,
    url: str | None,
    executors: int,
    model_dir: Path | None,
    device: str,
    kv_cache_memory: str | None,
    clients: int,
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    prefix_groups: int,
    group_size: int,
    prefix_tokens: int,
    suffix_tokens: int,
    routing_output: int,
    skip_routing: bool,
    seed: int,
    json_path: Path | None,
    quick: bool,
) -> None:
    if quick:
        clients = unless_given(ctx, clients, "clients", QUICK_CLIENTS)
        num_requests = unless_given(ctx, num_requests, "num_requests", QUICK_REQUESTS)
        prompt_range = unless_given(ctx, prompt_range, "prompt_range", QUICK_PROMPT_RANGE)
        output_range = unless_given(ctx, output_range, "output_range", QUICK_OUTPUT_RANGE)
        prefix_groups = unless_given(ctx, prefix_groups, "prefix_groups", QUICK_PREFIX_GROUPS)
        group_size = unless_given(ctx, group_size, "group_size", QUICK_GROUP_SIZE)
        prefix_tokens = unless_given(ctx, prefix_tokens, "prefix_tokens", QUICK_PREFIX_TOKENS)
        suffix_tokens = unless_given(ctx, suffix_tokens, "suffix_tokens", QUICK_SUFFIX_TOKENS)
        routing_output = unless_given(ctx, routing_output, "routing_output", QUICK_ROUTING_OUTPUT)
    if kv_cache_memory is not None:
        try:
            parse_size(kv_cache_memory)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="'--kv-cache-memory'") from None
    options = StackOptions(model_dir, executors, device, kv_cache_memory)
    echo = click.echo

    requests = make_load_workload(num_requests, prompt_range, output_range, seed)
    echo(
        f"load:     {num_requests} requests, {clients} clients, seed {seed}; prompt uniform {prompt_range[0]}-"
        f"{prompt_range[1]} tokens, output {output_range[0]}-{output_range[1]} (ignore_eos, "
        f"{sum(r.max_tokens for r in requests):,} in all); "
        + (f"against {url}" if url else f"own stack of {executors} executors on {device}")
    )
    if url:
        model, load = asyncio.run(measure_load(_base_url(url), None, requests, clients, seed))
    else:
        with own_stack(options, "prefix") as stack:
            model, load = asyncio.run(measure_load(stack.base_url, stack.model_name, requests, clients, seed))
    echo(f"model:    {model}")
    echo("")
    for line in _load_table(load):
        echo(line)
    if load.first_error:
        echo(f"first error: {load.first_error}")
    figures: dict[str, Any] = load.figures("load_")

    if not skip_routing:
        figures.update(
            _routing_part(
                options, prefix_groups, group_size, prefix_tokens, suffix_tokens, routing_output, clients, seed
            )
        )
    figures.update(
        {
            "url": url,
            "model": model,
            "executors": None if url else executors,
            "routing_executors": executors,
            "device": device,
            "kv_cache_memory": kv_cache_memory,
            "clients": clients,
            "requests": num_requests,
            "prompt_range": list(prompt_range),
            "output_range": list(output_range),
            "skip_routing": skip_routing,
            "prefix_groups": prefix_groups,
            "group_size": group_size,
            "prefix_tokens": prefix_tokens,
            "suffix_tokens": suffix_tokens,
            "routing_output": routing_output,
            "seed": seed,
            "quick": quick,
            "cpu_count": os.cpu_count(),
        }
    )
    line = json.dumps(figures)
    if json_path is not None:
        json_path.write_text(line + "\n", "utf-8")
    echo(line)


def _routing_part(
    options: StackOptions,
    groups: int,
    group_size: int,
    prefix_tokens: int,
    suffix_tokens: int,
    output_tokens: int,
    clients: int,
    seed: int,
) -> dict[str, Any]:
    """Part 2: the same prefix workload on a fresh stack per policy; prints the table, returns the figures."""
    echo = click.echo
    workload = make_prefix_workload(groups, group_size, prefix_tokens, suffix_tokens, output_tokens, seed)
    echo("")
    echo(
        f"routing:  {groups} groups x {group_size} requests, prefix {prefix_tokens} + suffix {suffix_tokens} "
        f"tokens, {output_tokens} output; {clients} clients; fresh stacks of {options.executors} executors"
    )
    if options.executors < 2:
        click.echo("warning: with 1 executor both policies send everything to it", err=True)
    summaries: dict[str, Summary] = {}
    for policy in COMPARED_POLICIES:
        with own_stack(options, policy) as stack:
            summaries[policy] = asyncio.run(
                measure_routing(stack.base_url, stack.model_name, workload, clients, seed, policy)
            )
    prefix, rr = summaries["prefix"], summaries["round-robin"]
    ratios = routing_ratios(prefix, rr)
    echo("")
    for line in _routing_table(prefix, rr, ratios):
        echo(line)
    for policy, s in summaries.items():
        if s.first_error:
            echo(f"first error ({policy}): {s.first_error}")
    echo(
        f"measured: the {len(workload.followers)} followers (the leaders ran first, unmeasured); the cached "
        f"fraction is at most prefix / prompt = {prefix_tokens / (prefix_tokens + suffix_tokens):.1%} (less "
        "when the prefix does not fill whole KV blocks)"
    )
    return {**prefix.figures("prefix_routed_"), **rr.figures("round_robin_"), **ratios}


__all__ = [
    "PrefixWorkload",
    "RequestResult",
    "ServeRequest",
    "Summary",
    "bench_serve",
    "make_load_workload",
    "make_prefix_workload",
    "percentile",
    "routing_ratios",
    "run_requests",
    "stream_one",
    "summarize",
]
