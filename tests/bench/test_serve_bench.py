"""`pagedkv bench serve`: its workloads, figures and output, then one small run against real stacks."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from click.testing import CliRunner, Result
from openai.types import CompletionUsage

from common.net import free_port
from pagedkv.bench import serve as bench
from pagedkv.bench.serve import (
    TOKEN_IDS,
    RequestResult,
    ServeRequest,
    Summary,
    bench_serve,
    make_load_workload,
    make_prefix_workload,
    percentile,
    routing_ratios,
    run_requests,
    stream_one,
    summarize,
)
from pagedkv.tools.model_gen import write_model
from tests.support.models import TINY

# ------------------------------------------------------------------------------------------------- workloads


def test_load_workload_is_seeded_and_in_range() -> None:
    requests = make_load_workload(200, (5, 40), (2, 9), seed=3)
    assert len(requests) == 200
    assert all(5 <= len(r.prompt) <= 40 and 2 <= r.max_tokens <= 9 for r in requests)
    assert all(TOKEN_IDS[0] <= t < TOKEN_IDS[1] for r in requests for t in r.prompt)
    assert {len(r.prompt) for r in requests} >= {5, 40}  # the whole range is drawn, ends included
    assert make_load_workload(200, (5, 40), (2, 9), seed=3) == requests
    assert make_load_workload(200, (5, 40), (2, 9), seed=4) != requests


def test_prefix_workload_groups_share_the_prefix_and_differ_after_it() -> None:
    w = make_prefix_workload(groups=5, group_size=4, prefix_tokens=48, suffix_tokens=7, output_tokens=3, seed=1)
    assert len(w.leaders) == 5 and len(w.followers) == 5 * 3 and len(w.prefixes) == 5
    assert [r.group for r in w.leaders] == list(range(5))
    for g, prefix in enumerate(w.prefixes):
        members = [w.leaders[g], *(r for r in w.followers if r.group == g)]
        assert len(members) == 4 and len(prefix) == 48
        assert all(r.prompt[:48] == prefix and len(r.prompt) == 48 + 7 and r.max_tokens == 3 for r in members)
        assert len({r.prompt[48] for r in members}) == 4  # each suffix differs from its first token on
    assert len({p[0] for p in w.prefixes}) == 5  # groups share nothing
    every = w.leaders + w.followers
    assert all(TOKEN_IDS[0] <= t < TOKEN_IDS[1] for r in every for t in r.prompt)
    assert [r.group for r in w.followers] != sorted(r.group for r in w.followers)  # shuffled across groups
    assert make_prefix_workload(5, 4, 48, 7, 3, seed=1) == w
    assert make_prefix_workload(5, 4, 48, 7, 3, seed=2) != w


# ------------------------------------------------------------------------------------------------- figures


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_summarize_known_results() -> None:
    results = [
        RequestResult(4, chunk_times=[0.1, 0.2, 0.4], prompt_tokens=10, completion_tokens=4, cached_tokens=8),
        RequestResult(2, chunk_times=[0.3, 0.35], prompt_tokens=30, completion_tokens=1, cached_tokens=0),
        RequestResult(5, chunk_times=[0.05], error="APIConnectionError: boom"),
    ]
    s = summarize(results, seconds=2.0)
    assert (s.requests, s.errors, s.completed, s.first_error) == (3, 1, 2, "APIConnectionError: boom")
    assert s.output_tokens == 5 and s.requests_per_s == 1.0 and s.output_tok_s == 2.5
    assert s.cached_fraction == pytest.approx(8 / 40)
    assert s.short_outputs == 1  # the second asked for 2, got 1
    # TTFTs 0.1 and 0.3 (the failed request's is left out); gaps 0.1, 0.2, 0.05
    assert s.ttft_p50_ms == pytest.approx(200.0) and s.ttft_p99_ms == pytest.approx(298.0)
    assert s.itl_p50_ms == pytest.approx(100.0) and s.itl_p99_ms == pytest.approx(198.0)
    figures = s.figures("x_")
    assert figures["x_cached_fraction"] == 0.2 and figures["x_errors"] == 1 and figures["x_ttft_p50_ms"] == 200.0
    assert all(k.startswith("x_") for k in figures)


def test_summary_of_nothing_has_no_latencies() -> None:
    s = summarize([], seconds=0.0)
    assert (s.requests, s.requests_per_s, s.cached_fraction, s.ttft_p50_ms, s.itl_p99_ms) == (0, 0.0, 0.0, None, None)


def test_routing_ratios() -> None:
    prefix = _summary(ttft_p50_ms=10.0, ttft_p99_ms=20.0, prompt_tokens=100, cached_tokens=80)
    rr = _summary(ttft_p50_ms=25.0, ttft_p99_ms=30.0, prompt_tokens=100, cached_tokens=40)
    assert routing_ratios(prefix, rr) == {
        "routing_ttft_p50_ratio": 2.5,
        "routing_ttft_p99_ratio": 1.5,
        "routing_cached_fraction_ratio": 2.0,
    }
    nothing_cached = _summary(ttft_p50_ms=None, ttft_p99_ms=None, prompt_tokens=100, cached_tokens=0)
    assert set(routing_ratios(prefix, nothing_cached).values()) == {None}


def _summary(**overrides: Any) -> Summary:
    values: dict[str, Any] = {
        "requests": 4,
        "completed": 4,
        "errors": 0,
        "seconds": 1.0,
        "output_tokens": 8,
        "prompt_tokens": 100,
        "cached_tokens": 0,
        "short_outputs": 0,
        "ttft_p50_ms": 10.0,
        "ttft_p99_ms": 20.0,
        "itl_p50_ms": 1.0,
        "itl_p99_ms": 2.0,
    }
    return Summary(**{**values, **overrides})


# ------------------------------------------------------------------------------- clients (a scripted server)


def _chunk(text: str) -> SimpleNamespace:
    return SimpleNamespace(choices=[SimpleNamespace(text=text)], usage=None)


def _usage_chunk(prompt: int, completion: int, cached: int | None) -> SimpleNamespace:
    details = None if cached is None else {"cached_tokens": cached}
    usage = CompletionUsage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )
    return SimpleNamespace(choices=[], usage=usage)


class ScriptedClient:
    """Stands in for AsyncOpenAI: `completions.create` streams the chunks `script(kwargs)` returns (an exception
    in them is raised there), yielding to the other streams before each, so streams overlap, and moving its clock
    (`now`, for `stream_one(clock=...)`) `step_s` on per chunk; it records every call and how many streams were
    open at once."""

    def __init__(self, script: Any, step_s: float = 0.0) -> None:
        self.script, self.step_s, self.now = script, step_s, 0.0
        self.calls: list[dict[str, Any]] = []
        self.open = self.most_open = 0
        self.completions = self

    async def create(self, **kwargs: Any) -> AsyncIterator[Any]:
        self.calls.append(kwargs)
        return self._stream(self.script(kwargs))

    async def _stream(self, chunks: list[Any]) -> AsyncIterator[Any]:
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            for chunk in chunks:
                await asyncio.sleep(0)  # a yield to the other streams, not a wait
                self.now += self.step_s
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
        finally:
            self.open -= 1


def test_stream_one_times_text_chunks_and_reads_the_final_usage() -> None:
    client = ScriptedClient(lambda kw: [_chunk("a"), _chunk(""), _chunk("bc"), _usage_chunk(12, 3, 8)], 0.01)
    result = asyncio.run(stream_one(client, "m", ServeRequest([5, 6, 7], 3), clock=lambda: client.now))
    assert result.error is None and len(result.chunk_times) == 2  # the empty chunk carries no text
    assert result.ttft == pytest.approx(0.01) and result.gaps == pytest.approx([0.02])  # "bc" two chunks after "a"
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (12, 3, 8)
    (call,) = client.calls
    assert call["prompt"] == [5, 6, 7] and call["max_tokens"] == 3 and call["stream"] is True
    assert call["stream_options"] == {"include_usage": True} and call["extra_body"] == {"ignore_eos": True}


def test_stream_one_records_failures_instead_of_raising() -> None:
    no_details = asyncio.run(
        stream_one(ScriptedClient(lambda kw: [_chunk("a"), _usage_chunk(4, 1, None)]), "m", ServeRequest([5], 1))
    )
    assert no_details.error is None and no_details.cached_tokens == 0
    broken = asyncio.run(
        stream_one(ScriptedClient(lambda kw: [_chunk("a"), openai.OpenAIError("reset")]), "m", ServeRequest([5], 4))
    )
    assert broken.error == "OpenAIError: reset" and len(broken.chunk_times) == 1
    cut = asyncio.run(stream_one(ScriptedClient(lambda kw: [_chunk("a")]), "m", ServeRequest([5], 4)))
    assert cut.error is not None and "usage" in cut.error


def test_run_requests_keeps_order_and_the_concurrency_limit() -> None:
    client = ScriptedClient(lambda kw: [_chunk("x")] * kw["max_tokens"] + [_usage_chunk(1, kw["max_tokens"], 0)])
    requests = [ServeRequest([i + 4], 1 + i % 5) for i in range(20)]
    done: list[int] = []
    results, seconds = asyncio.run(run_requests(client, "m", requests, 3, lambda: done.append(1)))
    assert [c["prompt"] for c in client.calls] == [r.prompt for r in requests]  # sent in order
    assert client.most_open == 3 and len(done) == 20 and seconds > 0
    assert [r.completion_tokens for r in results] == [r.max_tokens for r in requests]  # results in request order


# ------------------------------------------------------------------------------------- the command, stubbed


def _invoke(*args: str) -> Result:
    return CliRunner().invoke(bench_serve, list(args), catch_exceptions=False)


def test_command_prints_tables_and_ends_with_the_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started: list[str] = []

    @contextlib.contextmanager
    def fake_stack(options: bench.StackOptions, routing: str) -> Iterator[SimpleNamespace]:
        started.append(routing)
        yield SimpleNamespace(base_url=f"http://stack-{routing}/v1", model_name="tiny")

    async def fake_load(base_url: str, model: str | None, requests: list, clients: int, seed: int) -> tuple:
        assert (base_url, model, len(requests), clients) == ("http://stack-prefix/v1", "tiny", 6, 2)
        return model, _summary(requests=6, errors=1, first_error="boom")

    async def fake_routing(
        base_url: str, model: str, workload: bench.PrefixWorkload, clients: int, seed: int, policy: str
    ) -> Summary:
        assert len(workload.followers) == 3 * 2 and base_url == f"http://stack-{policy}/v1"
        cached = 90 if policy == "prefix" else 30
        return _summary(ttft_p50_ms=10.0 if policy == "prefix" else 40.0, cached_tokens=cached)

    monkeypatch.setattr(bench, "own_stack", fake_stack)
    monkeypatch.setattr(bench, "measure_load", fake_load)
    monkeypatch.setattr(bench, "measure_routing", fake_routing)
    out = tmp_path / "figures.json"
    result = _invoke(
        "--quick", "--requests", "6", "--clients", "2", "--prefix-groups", "3", "--group-size", "3", "--json", str(out)
    )
    assert result.exit_code == 0, result.output
    assert started == ["prefix", "prefix", "round-robin"]  # the load's stack, then one fresh stack per policy
    lines = result.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert json.loads(out.read_text()) == figures
    assert figures["load_errors"] == 1 and figures["load_first_error"] == "boom" and figures["model"] == "tiny"
    assert figures["prefix_routed_cached_fraction"] == 0.9 and figures["round_robin_cached_fraction"] == 0.3
    assert figures["routing_ttft_p50_ratio"] == 4.0 and figures["routing_cached_fraction_ratio"] == 3.0
    assert figures["quick"] is True and figures["prompt_range"] == list(bench.QUICK_PROMPT_RANGE)
    assert figures["requests"] == 6 and figures["prefix_tokens"] == bench.QUICK_PREFIX_TOKENS
    text = "\n".join(lines[:-1])
    assert "TTFT p50 ms" in text and "round-robin" in text and "4.00x rr/prefix" in text


def test_url_and_skip_routing_start_no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_stack(*args: Any) -> None:
        raise AssertionError("no stack should start")

    async def fake_load(base_url: str, model: str | None, requests: list, clients: int, seed: int) -> tuple:
        assert base_url == "http://127.0.0.1:9/v1" and model is None
        return "served", _summary()

    monkeypatch.setattr(bench, "own_stack", no_stack)
    monkeypatch.setattr(bench, "measure_load", fake_load)
    result = _invoke("--url", "http://127.0.0.1:9/", "--skip-routing", "--requests", "3")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["model"] == "served" and figures["url"] == "http://127.0.0.1:9/" and figures["skip_routing"]
    assert not any(k.startswith(("prefix_routed_", "round_robin_")) or k.endswith("_ratio") for k in figures)


def test_an_unreachable_url_is_a_clear_error() -> None:
    port = free_port()  # nothing listens on it
    result = _invoke("--url", f"http://127.0.0.1:{port}", "--skip-routing", "--requests", "1")
    assert result.exit_code == 1 and "GET /v1/models" in result.output, result.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--prompt-range", "64", "8"], "--prompt-range"),
        (["--output-range", "9", "2"], "--output-range"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--group-size", "1"], "--group-size"),
        (["--clients", "0"], "--clients"),
    ],
)
def test_bad_options_are_usage_errors(args: list[str], needle: str) -> None:
    result = CliRunner().invoke(bench_serve, ["--skip-routing", "--url", "http://127.0.0.1:9", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output


# ------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def bench_serve_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("bench-serve") / "tiny-llama", arch="llama", quiet=True, **TINY)


@pytest.mark.timeout(900)
def test_quick_run_against_real_stacks(bench_serve_tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    result = _invoke(
        "--quick",
        "--model",
        str(bench_serve_tiny_model),
        "--device",
        "cpu",
        "--executors",
        "2",
        "--clients",
        "4",
        "--requests",
        "8",
        "--prompt-range",
        "8",
        "64",
        "--output-range",
        "2",
        "8",
        "--prefix-groups",
        "2",
        "--group-size",
        "3",
        "--prefix-tokens",
        "64",
        "--suffix-tokens",
        "16",
        "--routing-output",
        "4",
        "--json",
        str(out),
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == figures
    asked = sum(r.max_tokens for r in make_load_workload(8, (8, 64), (2, 8), seed=0))
    assert figures["load_requests"] == 8 and figures["load_errors"] == 0
    assert figures["load_output_tokens"] == asked and figures["load_short_outputs"] == 0  # ignore_eos honoured
    assert figures["load_requests_per_s"] > 0 and figures["load_output_tok_s"] > 0
    for key in ("load_ttft_p50_ms", "load_ttft_p99_ms", "load_itl_p50_ms", "load_itl_p99_ms"):
        assert figures[key] is not None and figures[key] > 0, key
    for policy in ("prefix_routed", "round_robin"):
        assert figures[f"{policy}_requests"] == 2 * 2 and figures[f"{policy}_errors"] == 0
        assert figures[f"{policy}_ttft_p50_ms"] > 0 and figures[f"{policy}_prompt_tokens"] == 4 * 80
    assert figures["prefix_routed_cached_fraction"] > 0  # followers found their group's prefix where they were sent
    assert "routing_ttft_p50_ratio" in figures and "routing_cached_fraction_ratio" in figures
    assert "load:" in result.stderr and "prefix:" in result.stderr  # progress bars on stderr
