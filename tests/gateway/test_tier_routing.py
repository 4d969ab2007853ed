"""Routing by every KV tier with real processes (blockd over its own redis-server, two executors with a host KV
tier and a small device KV, the gateway, the `openai` client): a conversation's prefix, evicted from its
executor's device into that executor's host tier, routes its next turn back there, where it is loaded
(`cached_tokens` from the load) and the greedy answer is transformers'.

Each executor holds 12 device blocks of 16 tokens; a turn (65 prompt tokens, 8 generated) takes 5, so four more
turns on an executor evict a conversation's first turn from its device; its blocks are then in host memory only.
At the next turn both executors are idle and hold nothing of it on their devices: routing by device hits alone
would leave each conversation to the rotation (both right one time in four).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedkv.serve import LocalStack
from tests.support.gateway import (
    blockd_stats,
    local_stack,
    metric,
    reference_text,
    tiny_model,
    wait_until_no_live_blocks,
)

BS = 16
FIRST = 4 * BS + 1  # four full blocks and a token
ANSWER = 8
EXECUTOR_ARGS = ["--block-size", str(BS), "--num-blocks", "12", "--host-kv-memory", "2MiB"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tier-routing-model"), "tiny-tier-routing")


@pytest.fixture
def stack(model_dir: Path, tmp_path: Path) -> Iterator[LocalStack]:
    with local_stack(
        model_dir,
        tmp_path / "logs",
        persistence=True,  # blockd's own redis-server, as deployed
        executor_args=EXECUTOR_ARGS,
        gateway_args=["--report-cached-tokens"],
    ) as running:
        yield running


def _complete(client: openai.OpenAI, stack: LocalStack, prompt: list[int]) -> tuple[str, str, int]:
    """(the executor that served it, its text, its cached prompt tokens) of a greedy completion."""
    raw = client.completions.with_raw_response.create(
        model=stack.model_name, prompt=prompt, max_tokens=ANSWER, temperature=0, extra_body={"ignore_eos": True}
    )
    completion = raw.parse()
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return raw.headers["x-pagedkv-executor"], completion.choices[0].text, usage.prompt_tokens_details.cached_tokens or 0


def _tier(stack: LocalStack, pool_id: str, medium: str) -> dict:
    (pool,) = [p for p in blockd_stats(stack)["pools"] if p["pool_id"] == pool_id]
    (tier,) = [t for t in pool["tiers"] if t["medium"] == medium]
    return tier


def test_a_prefix_demoted_to_the_host_tier_routes_its_next_turn_back_and_is_loaded(
    stack: LocalStack, model_dir: Path
) -> None:
    rng = random.Random(22)
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    firsts = [[rng.randrange(4, 500) for _ in range(FIRST)] for _ in range(2)]
    home: list[str] = []
    answers: list[list[int]] = []
    for prompt in firsts:
        want_text, want_tokens = reference_text(model_dir, prompt, ANSWER)
        executor, text, cached = _complete(client, stack, prompt)
        assert (text, cached) == (want_text, 0)
        home.append(executor)
        answers.append(want_tokens)
    # Other conversations' first turns, until four have run on each executor since: every block of the first two
    # is then evicted from its device (the oldest cached go first) and demoted to that executor's host tier.
    after = dict.fromkeys(home, 0)
    for _ in range(16):
        if min(after.values()) >= 4:
            break
        executor, _, _ = _complete(client, stack, [rng.randrange(4, 500) for _ in range(FIRST)])
        after[executor] = after.get(executor, 0) + 1
    assert min(after[h] for h in home) >= 4, f"the rotation never reached each executor four times: {after}"
    loads_before = {h: _tier(stack, h, "CPU")["counters"]["loads"] for h in home}
    routed_host = metric(stack.url, 'pagedkv_gateway_routed_by_tier_total{tier="host"}')

    for first, answer, executor in zip(firsts, answers, home, strict=True):
        prompt = first + answer + [rng.randrange(4, 500) for _ in range(20)]  # the history and a new message
        want_text, _ = reference_text(model_dir, prompt, ANSWER)
        served_by, text, cached = _complete(client, stack, prompt)
        assert served_by == executor, "the turn goes where its prefix is in host memory"
        assert cached == 4 * BS, "the first turn's full blocks, loaded from the host tier"
        assert text == want_text
    assert metric(stack.url, 'pagedkv_gateway_routed_by_tier_total{tier="host"}') == routed_host + 2
    for h in set(home):
        assert _tier(stack, h, "CPU")["counters"]["loads"] >= loads_before[h] + 4 * home.count(h)
    wait_until_no_live_blocks(stack)
