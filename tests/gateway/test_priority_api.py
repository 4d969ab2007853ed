"""`priority` through a real stack whose executors run `--scheduling-policy priority` (`pagedkv serve` passes it
on), with the `openai` client: accepted, ranked, and the greedy output unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedkv.serve import LocalStack
from tests.support.gateway import local_stack, reference_text, tiny_model, wait_until_no_live_blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("priority-model"), "tiny-priority")


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    logs = tmp_path_factory.mktemp("priority-logs")
    with local_stack(model_dir, logs, executors=1, executor_args=["--scheduling-policy", "priority"]) as running:
        yield running


def test_priority_is_served_by_a_priority_stack(stack, model_dir) -> None:
    prompt = [5, 17, 33, 2, 90, 41]
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        for priority in (-3, 0, 7):
            answer = client.completions.create(
                model=stack.model_name,
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                extra_body={"priority": priority, "ignore_eos": True},
            )
            assert answer.choices[0].text == reference_text(model_dir, prompt, 8)[0], priority
    wait_until_no_live_blocks(stack)
