"""Every supported family end to end: the official `openai` client against a real stack (blockd, an executor and
the gateway as processes) per family, concurrent prompts longer than the window, prefix caching on (a repeat
reports its cached tokens), and a chat completion through the checkpoint's chat template. Greedy text must equal
transformers' and each token's logprob be within 2e-3 of transformers' (float32)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from executor.checkpoint import load_config
from pagedkv.serve import LocalStack
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import hf_greedy_ignoring_eos, hf_logprobs, random_prompts
from tests.support.gateway import (
    continuation_text,
    hf_tokenizer,
    local_stack,
    reference_text,
    wait_until_no_live_blocks,
)
from tests.support.models import API_FAMILY_SPECS, FAMILY_SPECS, TINY

MAX_TOKENS = 8
LOGPROB_TOLERANCE = 2e-3
SHARED = 48  # tokens of prefix every prompt shares: three full blocks of 16
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colours, 42?"}]


class Family:
    def __init__(self, name: str, model_dir: Path, stack: LocalStack) -> None:
        self.name, self.model_dir, self.stack = name, model_dir, stack

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module", params=API_FAMILY_SPECS)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    """One family's checkpoint served by a stack of one executor (the stacks come one after the other)."""
    name = request.param
    model_dir = write_model(tmp_path_factory.mktemp("family-api") / name, quiet=True, **{**TINY, **FAMILY_SPECS[name]})
    with local_stack(model_dir, tmp_path_factory.mktemp(f"logs-{name}"), executors=1) as stack:
        yield Family(name, model_dir, stack)
        wait_until_no_live_blocks(stack)


def _check_logprobs(model_dir: Path, prompt: list[int], tokens: list[int], logprobs: list[float]) -> None:
    reference = hf_logprobs(model_dir, prompt, tokens)
    assert len(logprobs) == len(tokens)
    for position, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        expected = reference[position, token].item()
        assert abs(logprob - expected) < LOGPROB_TOLERANCE, (position, logprob, expected)


def test_concurrent_prompts_past_the_window_match_transformers(family: Family) -> None:
    windows = [w for w in load_config(family.model_dir).sliding_windows if w]
    shared = random_prompts([SHARED], vocab=TINY["vocab_size"], seed=41)[0]
    tails = random_prompts([9, 20, 3, 30], vocab=TINY["vocab_size"], seed=42)
    prompts = [shared + tail for tail in tails]  # one prefix, so the later ones can hit the cache
    assert all(len(p) > max(windows, default=0) for p in prompts)

    def complete(prompt: list[int]):
        with family.client() as client:
            return client.completions.create(
                model=family.stack.model_name,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True, "cache_salt": "family-api"},  # a salt: usage reports the hit
            )

    with ThreadPoolExecutor(len(prompts)) as pool:
        first = list(pool.map(complete, prompts))
    again = complete(prompts[0])  # after the wave: its prompt is in the prefix cache
    assert again.usage.prompt_tokens_details.cached_tokens >= SHARED
    # transformers' answer once per prompt: the repeat is checked against the same reference as its first run.
    references = {tuple(prompt): reference_text(family.model_dir, prompt, MAX_TOKENS) for prompt in prompts}
    for prompt, answer in [*zip(prompts, first, strict=True), (prompts[0], again)]:
        expected_text, expected_tokens = references[tuple(prompt)]
        choice = answer.choices[0]
        assert choice.text == expected_text
        _check_logprobs(family.model_dir, prompt, expected_tokens, choice.logprobs.token_logprobs)


def test_chat_completion_matches_transformers(family: Family) -> None:
    """The prompt as transformers renders and tokenizes the chat template, the reply as it decodes it."""
    hf = hf_tokenizer(family.model_dir)
    assert hf.chat_template, "every generated checkpoint ships a chat template"
    prompt = list(
        hf.apply_chat_template(CHAT, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
    )
    tokens = hf_greedy_ignoring_eos(family.model_dir, prompt, MAX_TOKENS)
    with family.client() as client:
        answer = client.chat.completions.create(
            model=family.stack.model_name,
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
    assert answer.usage.prompt_tokens == len(prompt)
    choice = answer.choices[0]
    assert choice.message.content == continuation_text(family.model_dir, prompt, tokens)
    _check_logprobs(family.model_dir, prompt, tokens, [entry.logprob for entry in choice.logprobs.content])
