"""Beam search through a real stack (blockd, an executor, the gateway as processes) with the `openai` client
(vLLM's fields in `extra_body`): the texts are transformers' generate(num_beams=k) beams, and what beam search
cannot be combined with is refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from executor.params import SamplingParams
from gateway.text import Tokenizer
from pagedkv.serve import LocalStack
from tests.executor.harness import hf_beams, random_prompts
from tests.support.gateway import hf_tokenizer, local_stack, tiny_model, wait_until_no_live_blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("beam-model"), "tiny-beam")


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with local_stack(model_dir, tmp_path_factory.mktemp("beam-logs"), executors=1) as running:
        yield running


@pytest.fixture
def client(stack: LocalStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    wait_until_no_live_blocks(stack)


def test_completions_beam_search_returns_transformers_beams(client, stack, model_dir) -> None:
    (prompt,) = random_prompts([12], vocab=256, seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, n=2, beam_width=4, length_penalty=0.5, early_stopping=True)
    answer = client.completions.create(
        model=stack.model_name,
        prompt=prompt,
        max_tokens=params.max_tokens,
        n=params.n,
        best_of=params.beam_width,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True},
    )
    decode = hf_tokenizer(model_dir).decode
    beams = hf_beams(model_dir, prompt, params)
    assert [c.text for c in answer.choices] == [decode(b, skip_special_tokens=True) for b in beams]
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.usage.completion_tokens == sum(len(b) for b in beams)


def test_chat_beam_search_takes_n_as_its_width(client, stack, model_dir) -> None:
    answer = client.chat.completions.create(
        model=stack.model_name,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=8,
        n=3,
        extra_body={"use_beam_search": True, "early_stopping": "never"},
    )
    prompt = Tokenizer(model_dir).encode_chat([{"role": "user", "content": "Hello there"}])
    beams = hf_beams(
        model_dir, prompt, SamplingParams(max_tokens=8, temperature=0.0, n=3, beam_width=3, early_stopping="never")
    )
    decode = hf_tokenizer(model_dir).decode
    assert [c.message.content for c in answer.choices] == [decode(b, skip_special_tokens=True) for b in beams]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"temperature": 0.7}, "temperature", "deterministic"),
        ({"stream": True}, "stream", "stream must be false"),
        ({"best_of": 1, "n": 2}, "best_of", "at least n"),
        ({"stop": ["x"]}, "stop", "stop strings"),
        ({"extra_body": {"use_beam_search": True, "guided_json": {"type": "object"}}}, "response_format", "structured"),
        ({"logprobs": 2}, "logprobs", "logprobs"),
        ({"extra_body": {"use_beam_search": True, "early_stopping": "sometimes"}}, "early_stopping", "never"),
        ({"extra_body": {"use_beam_search": True, "repetition_penalty": 1.2}}, None, "logits processing"),
    ],
)
def test_what_beam_search_cannot_take_is_refused(client, stack, fields, param, words) -> None:
    body = {"model": stack.model_name, "prompt": [1, 2, 3], "max_tokens": 4, "best_of": 2, **fields}
    body.setdefault("extra_body", {"use_beam_search": True})
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**body)
    error = refused.value.body
    assert words in error["message"], error
    if param is not None:
        assert error["param"] == param, error
