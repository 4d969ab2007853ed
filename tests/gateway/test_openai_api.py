"""The official `openai` client against a real stack: blockd, two executors and the gateway as processes.

Outputs are checked against transformers' greedy decoding on the same weights, turned into text by the same
tokenizer. Every test leaves blockd with no block held by a live sequence.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.text import Tokenizer
from pagedkv.serve import LocalStack
from tests.support.gateway import (
    blocks_in_use,
    local_stack,
    reference_text,
    tiny_model,
    wait_for,
    wait_until_no_live_blocks,
)
from tests.support.models import TINY

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("gateway-model"), "tiny-chat")


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with local_stack(model_dir, tmp_path_factory.mktemp("gateway-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture
def client(stack: LocalStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    wait_until_no_live_blocks(stack)


PROMPT = "The quick brown fox jumps over the lazy dog"


# ---------------------------------------------------------------------------------------------- generation


def test_completion_matches_transformers_streamed_or_not(client, stack, model_dir, tokenizer) -> None:
    expected, _ = reference_text(model_dir, tokenizer.encode(PROMPT), MAX_TOKENS)
    whole = client.completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens == MAX_TOKENS

    stream = client.completions.create(
        model=stack.model_name,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    # Equal to the whole decode: had a chunk ended inside a character, both halves would read U+FFFD instead.
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_token_id_prompt_and_batched_prompts(client, stack, model_dir) -> None:
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    result = client.completions.create(
        model=stack.model_name, prompt=prompts, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in result.choices] == [0, 1]
    for choice, prompt in zip(result.choices, prompts, strict=False):
        assert choice.text == reference_text(model_dir, prompt, 4)[0]
    assert result.usage.prompt_tokens == 8 and result.usage.completion_tokens == 8


def test_chat_streams_role_then_content_and_usage(client, stack, model_dir, tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello! 日本語?"}]
    prompt = tokenizer.encode_chat(messages)
    expected, _ = reference_text(model_dir, prompt, MAX_TOKENS)
    stream = client.chat.completions.create(
        model=stack.model_name,
        messages=messages,
        temperature=0,
        max_completion_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    whole = client.chat.completions.create(
        model=stack.model_name, messages=messages, temperature=0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].message.role == "assistant"


def test_n_2_greedy_choices_are_identical_and_seeded_ones_reproducible(client, stack) -> None:
    greedy = client.completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=8, temperature=0, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text
    assert greedy.usage.completion_tokens == 16

    def sampled() -> list[str]:
        result = client.chat.completions.create(
            model=stack.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            temperature=1.0,
            n=2,
            seed=1234,
            extra_body={"ignore_eos": True},
        )
        return [c.message.content for c in result.choices]

    first = sampled()
    assert sampled() == first
    assert first[0] != first[1]


def test_stop_string_cuts_the_text_and_stops_generation(client, stack, model_dir, tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    full, _ = reference_text(model_dir, prompt, 24)
    visible = full.replace("\ufffd", "")
    stop = visible[len(visible) // 3 : len(visible) // 3 + 3]
    assert stop.strip(), f"no usable stop string in {full!r}"
    cut = full[: full.index(stop)]
    result = client.completions.create(
        model=stack.model_name,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop, "never appears \u2603"],
        extra_body={"ignore_eos": True},
    )
    assert result.choices[0].text == cut
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens < 24  # the executor was told to stop
    stream = client.completions.create(
        model=stack.model_name,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c.choices[0] for c in stream]
    assert "".join(c.text for c in chunks) == cut
    assert chunks[-1].finish_reason == "stop"


def test_stop_token_ids_end_the_choice(client, stack, model_dir, tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    _, tokens = reference_text(model_dir, prompt, 8)
    stop_id = tokens[3]
    result = client.completions.create(
        model=stack.model_name,
        prompt=prompt,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens == tokens.index(stop_id) + 1


def test_logprobs_in_both_formats(client, stack, tokenizer) -> None:
    result = client.completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=False):
        assert len(top) <= 3 and chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()))  # greedy: the chosen token is the most likely
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)

    chat = client.chat.completions.create(
        model=stack.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    assert all(
        len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        for entry in content
    )
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) for entry in content)


def test_repeated_long_prefix_is_cached_and_routed_to_its_holder(client, stack, tokenizer) -> None:
    shared = list(range(100, 100 + 160))  # ten full blocks
    salt = {"cache_salt": "prefix-test"}  # cached_tokens is reported to requests with a salt (or --report-...)
    first = client.completions.with_raw_response.create(
        model=stack.model_name, prompt=[*shared, 7, 8], max_tokens=2, temperature=0, extra_body=salt
    )
    holder = first.headers["x-pagedkv-executor"]
    assert first.parse().usage.prompt_tokens_details.cached_tokens == 0
    for suffix in ([9, 10, 11], [12], [13, 14]):
        again = client.completions.with_raw_response.create(
            model=stack.model_name, prompt=shared + suffix, max_tokens=2, temperature=0, extra_body=salt
        )
        assert again.headers["x-pagedkv-executor"] == holder
        assert again.parse().usage.prompt_tokens_details.cached_tokens >= 160
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert "pagedkv_gateway_prefix_cache_hit_rate" in metrics


# ---------------------------------------------------------------------------------------------- errors


BAD_REQUESTS = [
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "temperature": 7}, 400, "temperature", None),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    (
        "/v1/completions",
        {"model": "tiny-chat", "prompt": "x", "max_tokens": 100000},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    ("/v1/completions", {"model": "tiny-chat", "prompt": list(range(600))}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny-chat", "prompt": [1, 2, 99999]}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny-chat", "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"model": "tiny-chat", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", None),
    (
        "/v1/completions",
        {"model": "tiny-chat", "prompt": "x", "repetition_penalty": 0},
        400,
        "repetition_penalty",
        None,
    ),
    ("/v1/completions", {"model": "other-model", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"model": "tiny-chat"}, 400, "prompt", None),
    ("/v1/chat/completions", {"model": "tiny-chat", "messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"model": "tiny-chat", "messages": [{"role": "robot", "content": "x"}]}, 400, None, None),
    (
        "/v1/chat/completions",
        {"model": "tiny-chat", "messages": [{"role": "user", "content": " ".join(map(str, range(600)))}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "n": 0},
        400,
        "n",
        None,
    ),
    (
        "/v1/chat/completions",
        {"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        None,
    ),
    ("/v1/nowhere", {}, 404, None, "not_found"),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors_and_change_nothing(stack, path, body, status, param, code) -> None:
    wait_until_no_live_blocks(stack)  # an earlier test's finished requests hand their blocks back a step later
    response = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert all(v == 0 for v in blocks_in_use(stack).values())


def test_malformed_bodies_and_the_client_error_class(stack, client) -> None:
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        response = httpx.post(
            f"{stack.url}/v1/completions", content=raw, headers={"Content-Type": "application/json"}, timeout=30
        )
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert raised.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=stack.model_name, prompt="x", max_tokens=10**6)
    # still serving
    assert client.completions.create(model=stack.model_name, prompt="x", max_tokens=2).choices


def test_models_health_and_metrics(stack) -> None:
    models = httpx.get(f"{stack.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [stack.model_name]
    assert models["data"][0]["max_model_len"] == TINY["max_position"]
    health = httpx.get(f"{stack.url}/health").json()
    assert health["status"] == "ok" and all(e["healthy"] for e in health["executors"])
    metrics = httpx.get(f"{stack.url}/metrics").text
    for name in (
        "pagedkv_gateway_requests_total",
        "pagedkv_gateway_time_to_first_token_seconds_bucket",
        "pagedkv_gateway_inter_token_latency_seconds_bucket",
        "pagedkv_gateway_generated_tokens_total",
        "pagedkv_gateway_requests_in_flight",
        "pagedkv_executor_waiting_requests",
        "pagedkv_executor_preemptions_total",
        "pagedkv_gateway_prefix_cache_hit_rate",
    ):
        assert name in metrics, name


# ---------------------------------------------------------------------------------------------- disconnects


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(stack) -> None:
    body = {
        "model": stack.model_name,
        "prompt": list(range(20, 120)),
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in received)
        assert sum(blocks_in_use(stack).values()) > 0  # generating
    # The connection is closed with ~390 tokens still to go: the gateway must abort at the executor.
    wait_until_no_live_blocks(stack, timeout_s=10)
    # The load reports the gateway shows are a poll (a fraction of a second) old.
    wait_for(
        lambda: [e["running"] for e in httpx.get(f"{stack.url}/health").json()["executors"]] == [0, 0],
        timeout_s=5,
        what="both executors to report nothing running",
    )
