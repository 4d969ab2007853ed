"""A window + MoE family (gpt-oss: sinks, alternating sliding and full layers, biased clamped-SwiGLU experts, YaRN)
end to end: the official `openai` client against a real stack (blockd, two executors, the gateway as processes),
concurrent prompts longer than the window, prefix caching on. Greedy text must equal transformers' and each
token's logprob be within 2e-3 of transformers' (float32)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from executor.checkpoint import load_config
from pagedkv.serve import LocalStack
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import hf_logprobs, random_prompts
from tests.support.gateway import local_stack, reference_text, wait_until_no_live_blocks
from tests.support.models import FAMILY_SPECS, TINY

MAX_TOKENS = 10
FAMILY = "gpt_oss-w16-e4k2"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("family-api") / FAMILY, quiet=True, **{**TINY, **FAMILY_SPECS[FAMILY]})


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with local_stack(model_dir, tmp_path_factory.mktemp("family-api-logs")) as running:
        yield running


def test_concurrent_prompts_past_the_window_match_transformers(stack: LocalStack, model_dir: Path) -> None:
    window = max(w for w in load_config(model_dir).sliding_windows if w)
    shared = random_prompts([48], vocab=512, seed=41)[0]
    tails = random_prompts([9, 20, 3, 30], vocab=512, seed=42)
    prompts = [shared + tail for tail in tails]  # one prefix, so the later ones can hit the cache
    assert all(len(p) > 2 * window for p in prompts)

    def complete(prompt: list[int]):
        with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120) as client:
            return client.completions.create(
                model=stack.model_name,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True, "cache_salt": "family-api"},  # a salt: usage reports the hit
            )

    with ThreadPoolExecutor(len(prompts)) as pool:
        first = list(pool.map(complete, prompts))
    again = complete(prompts[0])  # after the wave: its prompt is in the prefix cache
    assert again.usage.prompt_tokens_details.cached_tokens >= 48
    for prompt, answer in [*zip(prompts, first, strict=True), (prompts[0], again)]:
        expected_text, expected_tokens = reference_text(model_dir, prompt, MAX_TOKENS)
        choice = answer.choices[0]
        assert choice.text == expected_text
        reference = hf_logprobs(model_dir, prompt, expected_tokens)
        for position, (token, logprob) in enumerate(zip(expected_tokens, choice.logprobs.token_logprobs, strict=True)):
            assert abs(logprob - reference[position, token].item()) < 2e-3, position
    wait_until_no_live_blocks(stack)
