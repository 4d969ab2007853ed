"""Logits processing through the whole stack with the official `openai` client (OpenAI's fields as the SDK sends
them, vLLM's in `extra_body`), against transformers' own processors or the sampler tests' per-row reference,
applied step by step to transformers' logits of the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers

from executor.params import SamplingParams
from gateway.api import CompletionRequest
from gateway.text import Tokenizer
from pagedkv.serve import LocalStack
from tests.executor.harness import hf_model, reference_run
from tests.support.gateway import local_stack, tiny_model, wait_until_no_live_blocks
from tests.support.sampling import reference_processing

MAX_TOKENS = 12
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("sampling-model"), "tiny-chat")


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with local_stack(model_dir, tmp_path_factory.mktemp("sampling-logs"), executors=1) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture
def client(stack: LocalStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    wait_until_no_live_blocks(stack)


class Reference(transformers.LogitsProcessor):
    def __init__(self, params: SamplingParams, prompt_len: int) -> None:
        self.params, self.prompt_len = params, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        row = reference_processing(scores[0], self.params, input_ids[0].tolist(), self.prompt_len, ())
        return row.unsqueeze(0)  # type: ignore[return-value]


def hf_processed(model_dir: Path, prompt: list[int], n: int, processor: Any) -> list[int]:
    """n greedy tokens (end-of-sequence included) of transformers' logits passed through `processor`."""
    tokens = list(prompt)
    model = hf_model(model_dir)
    with reference_run():
        for _ in range(n):
            ids = torch.tensor([tokens])
            scores = processor(ids, model(ids).logits[:, -1].float())
            tokens.append(int(scores[0].argmax()))
    return tokens[len(prompt) :]


def text_of(tokenizer: Tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_repetition_penalty_matches_transformers(client, stack, model_dir, tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    plain = hf_processed(model_dir, prompt, MAX_TOKENS, lambda ids, scores: scores)
    changed = 0
    for penalty in (3.0, 0.4):
        processor = transformers.RepetitionPenaltyLogitsProcessor(penalty)
        expected = hf_processed(model_dir, prompt, MAX_TOKENS, processor)
        changed += expected != plain
        result = client.completions.create(
            model=stack.model_name,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True, "repetition_penalty": penalty},
        )
        assert result.choices[0].text == text_of(tokenizer, expected), penalty
    assert changed, "neither penalty changed the output: a weak test"


def test_openai_penalties_and_logit_bias_in_chat_match_the_reference(client, stack, model_dir, tokenizer) -> None:
    messages = [{"role": "user", "content": "Say something, then say it again."}]
    prompt = tokenizer.encode_chat(messages)
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=0.8, logit_bias=((100, 8.0), (7, -100.0)))
    expected = hf_processed(model_dir, prompt, MAX_TOKENS, Reference(params, len(prompt)))
    stream = client.chat.completions.create(
        model=stack.model_name,
        messages=messages,
        temperature=0,
        max_tokens=MAX_TOKENS,
        presence_penalty=1.0,
        frequency_penalty=0.8,
        logit_bias={"100": 8, "7": -100},
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text_of(tokenizer, expected)
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_bad_words_min_p_min_tokens_and_allowed_token_ids_through_the_api(client, stack, model_dir, tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    plain = hf_processed(model_dir, prompt, MAX_TOKENS, lambda ids, scores: scores)
    word = tokenizer.decode(plain[2:4]).strip() or tokenizer.decode(plain[:1]).strip()
    body = CompletionRequest.model_validate({"prompt": PROMPT, "bad_words": [word]})
    params = SamplingParams(bad_words_token_ids=body.bad_words_token_ids(tokenizer))
    expected = hf_processed(model_dir, prompt, MAX_TOKENS, Reference(params, len(prompt)))
    assert expected != plain
    result = client.completions.create(
        model=stack.model_name,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "bad_words": [word], "min_p": 0.1},  # min_p leaves greedy as it is
    )
    assert result.choices[0].text == text_of(tokenizer, expected)

    eos = tokenizer.backend.token_to_id(tokenizer.special_tokens["eos_token"])
    result = client.completions.create(
        model=stack.model_name,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 5},
    )
    assert result.choices[0].finish_reason == "stop" and result.usage.completion_tokens == 6

    allowed = tuple(sorted(set(plain[1:4]) | {100, 200}))
    expected = hf_processed(
        model_dir, prompt, MAX_TOKENS, Reference(SamplingParams(allowed_token_ids=allowed), len(prompt))
    )
    assert expected != plain
    result = client.completions.create(
        model=stack.model_name,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True, "allowed_token_ids": list(allowed), "priority": 0, "request_id": "mine"},
    )
    assert result.choices[0].text == text_of(tokenizer, expected)


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/completions", {"suffix": "the end"}, "suffix"),
        ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
        ("/v1/chat/completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
        ("/v1/chat/completions", {"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ("/v1/completions", {"priority": 5}, "priority"),
    ],
)
def test_refusals_name_the_parameter(stack, path: str, fields: dict[str, Any], param: str) -> None:
    body = {"model": stack.model_name, **fields}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    response = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
