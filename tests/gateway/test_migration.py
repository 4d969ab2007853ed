"""Request migration: a generation whose executor is killed (SIGKILL) mid-stream goes on on the other executor from
its prompt plus the tokens already sent, and the client sees one uninterrupted answer: transformers' greedy text,
one finish, usage and logprobs of the whole completion. Real processes throughout (blockd, two executors, a
gateway); the continuation's params are checked on their own first."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from executor.params import GrammarSpec, SamplingParams
from gateway import migration
from pagedkv.serve import LocalStack
from tests.support.gateway import health, local_stack, metric, reference_text, tiny_model, wait_for

PROMPT = list(range(30, 50))
LONG = 300  # tokens: the stream runs on well after the kill


# ---------------------------------------------------------------------------------------------- the params


def test_a_continuation_asks_for_what_is_left_of_one_choice() -> None:
    params = SamplingParams(max_tokens=10, n=3, min_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=1)
    continued = migration.continuation(params, 2, [7, 8, 9], migration=1)
    assert continued is not None
    assert (continued.n, continued.max_tokens, continued.min_tokens) == (1, 7, 1)
    assert continued.logprobs == 2 and continued.prompt_logprobs is None  # logprobs go on; prompt's were sent
    assert continued.seed is None  # greedy: nothing to seed
    assert migration.continuation(params, 0, list(range(10)), migration=1) is None  # only its finish was lost


def test_a_seeded_continuation_is_reproducible_and_its_own() -> None:
    params = SamplingParams(max_tokens=10, n=2, seed=5, temperature=0.8)
    first = migration.continuation(params, 1, [1, 2], migration=1)
    again = migration.continuation(params, 1, [1, 2], migration=1)
    other = migration.continuation(params, 0, [1, 2], migration=1)
    assert first is not None and again is not None and other is not None
    assert first.seed == again.seed != other.seed
    assert first.validate(512) is None  # a seed the executor takes (64 bits, signed)


@pytest.mark.parametrize(
    ("params", "why"),
    [
        (SamplingParams(structured=GrammarSpec(kind="regex", source="a+")), "structured output"),
        (SamplingParams(presence_penalty=0.5), "penalties"),
        (SamplingParams(frequency_penalty=-0.5), "penalties"),
        (SamplingParams(bad_words_token_ids=((3, 4),)), "bad_words"),
    ],
)
def test_what_the_output_alone_decides_refuses_migration(params: SamplingParams, why: str) -> None:
    assert why in (migration.refusal(params) or "")


def test_what_the_prompt_carries_over_migrates() -> None:
    params = SamplingParams(repetition_penalty=1.2, bad_words_token_ids=((3,),), stop_token_ids=(5,), min_tokens=2)
    assert migration.refusal(params) is None


# ---------------------------------------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("migration-model"), "tiny-migration")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> str:
    return reference_text(model_dir, PROMPT, LONG)[0]


@pytest.fixture
def stack(model_dir: Path, tmp_path: Path) -> Iterator[LocalStack]:
    with local_stack(
        model_dir, tmp_path / "logs", routing="round-robin", gateway_args=["--executor-timeout", "2"]
    ) as running:
        yield running


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def _other(serving: str) -> str:
    return ({"executor-0", "executor-1"} - {serving}).pop()


def test_a_stream_goes_on_when_its_executor_is_killed(stack: LocalStack, reference: str) -> None:
    response = _client(stack).completions.with_raw_response.create(
        model=stack.model_name,
        prompt=PROMPT,
        max_tokens=LONG,
        temperature=0,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    serving = response.headers["x-pagedkv-executor"]
    chunks = iter(response.parse())
    first = next(chunks)  # text has reached the client: the stream cannot start over
    stack.kill(serving)
    rest = list(chunks)
    choices = [c.choices[0] for c in [first, *rest] if c.choices]
    assert "".join(c.text for c in choices) == reference  # transformers' greedy text, nothing lost or twice
    assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]
    assert sum(len(c.logprobs.tokens) for c in choices if c.logprobs) == LONG
    usage = rest[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), LONG)
    assert metric(stack.url, "pagedkv_gateway_migrations_total") == 1
    assert metric(stack.url, "pagedkv_gateway_retried_requests_total") == 0
    assert {e["pool_id"] for e in health(stack.url)["executors"] if e["healthy"]} == {_other(serving)}


def test_a_whole_response_goes_on_when_its_executor_is_killed(stack: LocalStack, reference: str) -> None:
    client = _client(stack)
    ask = dict(model=stack.model_name, prompt=PROMPT, max_tokens=LONG, temperature=0, extra_body={"ignore_eos": True})
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(client.completions.create(**ask)))  # type: ignore[call-overload]
    worker.start()
    # Tokens have come back: what it has continues elsewhere (before any, it would simply be submitted again).
    wait_for(
        lambda: metric(stack.url, "pagedkv_gateway_generated_tokens_total") > 0 or None,
        timeout_s=60,
        interval_s=0.02,
        what="the first tokens",
    )
    (serving,) = [e["pool_id"] for e in health(stack.url)["executors"] if e["in_flight"]]
    stack.kill(serving)
    worker.join(timeout=120)
    (whole,) = result
    assert isinstance(whole, openai.types.Completion)
    assert whole.choices[0].text == reference and whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == LONG
    assert metric(stack.url, "pagedkv_gateway_migrations_total") == 1
    assert metric(stack.url, "pagedkv_gateway_retried_requests_total") == 0  # continued, not started over


def test_each_chat_choice_goes_on_with_its_own_tokens_up_to_its_stop_string(stack: LocalStack) -> None:
    client = _client(stack)
    ask = dict(
        model=stack.model_name,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=LONG,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    uninterrupted = client.chat.completions.create(**ask).choices[0].message.content  # type: ignore[call-overload]
    assert uninterrupted
    # A stop string first found late in the answer: well after the kill.
    at = next(
        k
        for k in range(2 * len(uninterrupted) // 3, len(uninterrupted) - 4)
        if uninterrupted.find(uninterrupted[k : k + 4]) == k
    )
    stop = uninterrupted[at : at + 4]
    response = client.chat.completions.with_raw_response.create(
        **ask, n=2, stop=[stop], logprobs=True, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    serving = response.headers["x-pagedkv-executor"]
    chunks = iter(response.parse())
    seen = [next(chunks)]
    while not any(c.choices and c.choices[0].delta.content for c in seen):
        seen.append(next(chunks))
    stack.kill(serving)
    seen += list(chunks)
    text = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    for chunk in seen:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert text == {0: uninterrupted[:at], 1: uninterrupted[:at]}
    assert finishes == {0: ["stop"], 1: ["stop"]}
    assert metric(stack.url, "pagedkv_gateway_migrations_total") == 1
