"""Anthropic's cache usage on /v1/messages with the official `anthropic` SDK against a real stack that reports
cached tokens (--report-cached-tokens): the second request with the same long system prompt reads its prefix
from the cache (`cache_read_input_tokens`), its `input_tokens` are the rest, whole and streamed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest

from pagedkv.serve import LocalStack
from tests.support.gateway import local_stack, tiny_model, wait_until_no_live_blocks

SYSTEM = "You answer questions about the weather in European cities, briefly and politely. " * 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    model: Path = tiny_model(tmp_path_factory.mktemp("messages-cache-model"), "tiny-messages-cache")
    logs = tmp_path_factory.mktemp("messages-cache-logs")
    with local_stack(model, logs, executors=1, gateway_args=["--report-cached-tokens"]) as running:
        yield running


@pytest.fixture
def client(stack: LocalStack) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    wait_until_no_live_blocks(stack)


def _ask(client: anthropic.Anthropic, stack: LocalStack, question: str) -> tuple[anthropic.types.Usage, int]:
    """The usage of a message with the long system prompt, and its prompt's length (count_tokens)."""
    asked = {"model": stack.model_name, "system": SYSTEM, "messages": [{"role": "user", "content": question}]}
    message = client.messages.create(**asked, max_tokens=4, extra_body={"temperature": 0})
    return message.usage, client.messages.count_tokens(**asked).input_tokens


def test_cache_read_input_tokens_report_the_prefix_hit(client, stack) -> None:
    first, prompt = _ask(client, stack, "Bern?")
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens == 0
    assert first.input_tokens == prompt
    second, prompt = _ask(client, stack, "Oslo?")
    assert second.cache_read_input_tokens > 0, second
    assert second.cache_read_input_tokens % 16 == 0  # whole blocks of the shared system prompt
    assert second.input_tokens + second.cache_read_input_tokens == prompt  # the rest is computed
    assert second.cache_creation_input_tokens == 0

    with client.messages.stream(
        model=stack.model_name,
        system=SYSTEM,
        messages=[{"role": "user", "content": "Rome?"}],
        max_tokens=4,
        extra_body={"temperature": 0},
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.cache_read_input_tokens == second.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens == second.cache_read_input_tokens
    assert final.usage.input_tokens == start.message.usage.input_tokens > 0
    assert final.usage.output_tokens >= 1
