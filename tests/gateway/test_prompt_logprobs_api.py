"""Prompt logprobs through the whole stack with the official `openai` client: OpenAI's echo + logprobs with
max_tokens 0 (lm-eval's loglikelihood request) and vLLM's `prompt_logprobs` (in `extra_body`), against
transformers' log-softmax of the same prompt. The prompt is sent twice: the second time its blocks are cached,
yet it is scored whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from gateway.text import Tokenizer
from pagedkv.serve import LocalStack
from tests.executor.harness import hf_model, reference_run
from tests.support.gateway import local_stack, tiny_model, wait_until_no_live_blocks

TOL = 2e-3
PROMPT = "The quick brown fox jumps over the lazy dog, and then the dog sleeps in the warm afternoon sun"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("plp-model"), "tiny-chat")


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with local_stack(model_dir, tmp_path_factory.mktemp("plp-logs"), executors=1) as running:
        yield running


@pytest.fixture
def client(stack: LocalStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    wait_until_no_live_blocks(stack)


def reference(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with reference_run():
        logits = hf_model(model_dir)(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_echo_logprobs_max_tokens_0_is_lm_evals_loglikelihood(client, model_dir: Path):
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode(PROMPT)
    ref = reference(model_dir, ids)
    for _ in range(2):  # the second time the prompt's blocks are cached
        out = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
        (choice,) = out.choices
        assert choice.text == PROMPT
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for i, value in enumerate(lp.token_logprobs[1:], 1):
            assert abs(value - ref[i - 1, ids[i]].item()) <= TOL, f"token {i}"
            ((_, best),) = lp.top_logprobs[i].items()
            assert abs(best - ref[i - 1].max().item()) <= TOL
    # token ids in, and a completion after the prompt: the prompt's entries, then the generated ones.
    out = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=3, echo=True, logprobs=0, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + out.usage.completion_tokens
    assert out.choices[0].text.startswith(tokenizer.decode(ids))
    assert all(abs(v - ref[i - 1, ids[i]].item()) <= TOL for i, v in enumerate(lp.token_logprobs[1 : len(ids)], 1))


def test_vllm_prompt_logprobs_on_completions_and_chat(client, model_dir: Path):
    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.encode(PROMPT)
    ref = reference(model_dir, ids)
    out = client.completions.create(
        model="tiny-chat", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    scored = out.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for i, position in enumerate(scored[1:], 1):
        assert str(ids[i]) in position
        assert abs(position[str(ids[i])]["logprob"] - ref[i - 1, ids[i]].item()) <= TOL
        top = sorted(position.values(), key=lambda e: e["rank"])[:2]
        assert [e["rank"] for e in top] == [1, 2]
        values = ref[i - 1].topk(2).values.tolist()
        assert all(abs(e["logprob"] - v) <= TOL for e, v in zip(top, values, strict=True))
    messages = [{"role": "user", "content": "hello there"}]
    chat_ids = tokenizer.encode_chat(messages)
    chat = client.chat.completions.create(
        model="tiny-chat", messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    scored = chat.model_extra["prompt_logprobs"]
    chat_ref = reference(model_dir, chat_ids)
    assert len(scored) == len(chat_ids)
    assert all(
        abs(p[str(chat_ids[i])]["logprob"] - chat_ref[i - 1, chat_ids[i]].item()) <= TOL
        for i, p in enumerate(scored[1:], 1)
    )


def test_refusals(client):
    for kwargs in (
        {"max_tokens": 0},  # without echo
        {"max_tokens": 0, "echo": True, "logprobs": 1, "n": 2},  # the prompt scored once: n = 1
        {"stream": True, "extra_body": {"prompt_logprobs": 1}},
        {"stream": True, "echo": True, "logprobs": 1},
        {"extra_body": {"prompt_logprobs": 21}},
    ):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny-chat", prompt=PROMPT, **kwargs)
    # echo alone with max_tokens 0 is answered by the gateway, any n (nothing to score)
    only = client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=0, echo=True, n=2)
    assert [c.text for c in only.choices] == [PROMPT, PROMPT] and only.choices[0].logprobs is None


def test_streamed_echo_starts_with_the_prompt(client):
    chunks = list(client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=3, echo=True, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    zero = list(client.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in zero if c.choices) == PROMPT
