"""Speculative decoding through a whole stack (blockd, two executors started with vLLM's `--speculative-config`,
the gateway, as processes; the `openai` client): greedy answers, streamed and whole, concurrent, are
transformers' token for token, and the gateway's vLLM metrics count the drafts proposed and accepted.

The model is the repeating stand-in of `pagedkv bench speculative` (its attention output zeroed: greedy text
follows earlier text, as a copying model's does), so the n-gram lookup's drafts are accepted, not only tried.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from pagedkv.bench.spec_workload import repeat_prompt, write_repeating_model
from pagedkv.serve import LocalStack
from tests.support.gateway import local_stack, reference_text, wait_for, wait_until_no_live_blocks
from tests.support.models import TINY

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
ANSWER = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repeating_model(tmp_path_factory.mktemp("spec-api") / "tiny-spec", arch="llama", **TINY)


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with local_stack(
        model_dir, tmp_path_factory.mktemp("spec-api-logs"), executor_args=["--speculative-config", NGRAM]
    ) as running:
        yield running


def _spec_metric(url: str, name: str) -> float:
    """A vLLM speculative-decoding counter on the gateway's /metrics, summed over its labels."""
    pattern = re.compile(rf"^{re.escape(name)}_total(\{{[^}}]*\}})? (\S+)$")
    return sum(
        float(m.group(2))
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
        if (m := pattern.match(line))
    )


def _documents(model_dir: Path, count: int) -> list[list[int]]:
    """The model's own greedy text from different starts, and its first tokens again: the answer repeats it."""
    return [repeat_prompt(reference_text(model_dir, [40 + 7 * i, 90 + i], 40)[1]) for i in range(count)]


def test_greedy_answers_with_speculation_are_transformers_and_drafts_are_accepted(
    stack: LocalStack, model_dir: Path
) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    prompts = _documents(model_dir, 4)
    wants = [reference_text(model_dir, p, ANSWER)[0] for p in prompts]
    proposed, accepted = (_spec_metric(stack.url, f"vllm:spec_decode_num_{k}_tokens") for k in ("draft", "accepted"))

    def whole(prompt: list[int]) -> str:
        completion = client.completions.create(
            model=stack.model_name, prompt=prompt, max_tokens=ANSWER, temperature=0, extra_body={"ignore_eos": True}
        )
        return completion.choices[0].text

    with ThreadPoolExecutor(4) as pool:  # concurrent: drafts verified in batched steps
        assert list(pool.map(whole, prompts)) == wants
    stream = client.completions.create(
        model=stack.model_name,
        prompt=prompts[0],
        max_tokens=ANSWER,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == wants[0]

    def grown() -> tuple[float, float] | None:  # (the gateway's figures are the executors' last load reports)
        drafts = _spec_metric(stack.url, "vllm:spec_decode_num_draft_tokens") - proposed
        kept = _spec_metric(stack.url, "vllm:spec_decode_num_accepted_tokens") - accepted
        return (drafts, kept) if drafts > 0 and kept > 0 else None

    drafts, kept = wait_for(grown, timeout_s=30, what="the executors' reports of their drafts")
    assert kept > drafts / 2, (drafts, kept)  # a repeating model's drafts are mostly right
    wait_until_no_live_blocks(stack)  # rejected drafts' slots given back
