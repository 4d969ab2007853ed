"""The gateway's bounds, checked before any work, against a real stack (blockd, two executors, the gateway as
processes): body size (413), JSON depth (400), content type (415), a batch counted per prompt x n against
--max-queued-sequences, huge inputs that leave the executors in rotation, and metric labels that stay few.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from pagedkv.serve import LocalStack
from tests.support.gateway import health, local_stack, tiny_model, wait_until_no_live_blocks

MAX_QUEUE = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    model_dir = tiny_model(tmp_path_factory.mktemp("bounds-model"), "tiny-bounds")
    with local_stack(
        model_dir, tmp_path_factory.mktemp("bounds-logs"), gateway_args=["--max-queued-sequences", str(MAX_QUEUE)]
    ) as running:
        yield running


def _post(stack: LocalStack, path: str, content: bytes, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", content=content, headers={"Content-Type": content_type}, timeout=60)


def _both_healthy(stack: LocalStack) -> bool:
    state = health(stack.url)
    return state["status"] == "ok" and all(e["healthy"] for e in state["executors"])


def test_a_10_mb_body_gets_413_declared_or_streamed(stack: LocalStack) -> None:
    big = b'{"prompt": "' + b"a" * 10_000_000 + b'"}'
    response = _post(stack, "/v1/completions", big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it streams in
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"a" * 100_000
        yield b'"}'

    streamed = httpx.post(
        f"{stack.url}/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}, timeout=60
    )
    assert streamed.status_code == 413
    with (
        openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60) as client,
        pytest.raises(openai.APIStatusError) as raised,
    ):
        client.completions.create(model=stack.model_name, prompt="a" * 10_000_000, max_tokens=1)
    assert raised.value.status_code == 413
    assert _both_healthy(stack)


def test_json_100k_deep_gets_400(stack: LocalStack) -> None:
    for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        response = _post(stack, "/v1/completions", deep)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
    response = _post(stack, "/v1/chat/completions", b'{"messages": ' + b"{" * 50_000 + b"}")
    assert response.status_code == 400


def test_a_body_not_declared_json_gets_415(stack: LocalStack) -> None:
    body = b'{"prompt": "hi", "max_tokens": 1}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", ""):
        response = _post(stack, "/v1/completions", body, content_type)
        assert response.status_code == 415, content_type
        assert response.json()["error"]["code"] == "unsupported_media_type"
    assert _post(stack, "/v1/completions", body, "application/json; charset=utf-8").status_code == 200


def test_a_batch_counts_per_prompt_times_n(stack: LocalStack) -> None:
    fits = httpx.post(
        f"{stack.url}/v1/completions",
        json={"prompt": ["a b", "c d"], "n": MAX_QUEUE // 2, "max_tokens": 2, "temperature": 0},
        timeout=60,
    )
    assert fits.status_code == 200 and len(fits.json()["choices"]) == MAX_QUEUE
    too_many = httpx.post(
        f"{stack.url}/v1/completions", json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2}, timeout=60
    )
    assert too_many.status_code == 400
    assert too_many.json()["error"]["code"] == "too_many_generations"
    wait_until_no_live_blocks(stack)


def test_huge_inputs_are_refused_quickly_and_executors_stay_in_rotation(stack: LocalStack) -> None:
    healths: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while True:  # a sample every 0.2 s until told to stop
            healths.append(httpx.get(f"{stack.url}/health", timeout=10).status_code)
            if stop.wait(0.2):
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        started = time.monotonic()
        prompts = httpx.post(f"{stack.url}/v1/completions", json={"prompt": ["hi"] * 100_000}, timeout=60)
        assert prompts.status_code == 400 and prompts.json()["error"]["code"] == "too_many_generations"
        assert time.monotonic() - started < 10
        # 30,000 chat messages are templated and tokenized off the event loop, then refused for their length
        messages = [{"role": "user", "content": f"message {i}"} for i in range(30_000)]
        chat = httpx.post(f"{stack.url}/v1/chat/completions", json={"messages": messages}, timeout=120)
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    finally:
        stop.set()
        watcher.join()
    assert healths and set(healths) == {200}
    assert _both_healthy(stack)
    ok = httpx.post(f"{stack.url}/v1/completions", json={"prompt": "still", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_route_labels_stay_few_whatever_the_paths(stack: LocalStack) -> None:
    for i in range(40):
        assert httpx.get(f"{stack.url}/v1/models/no-such-model-{i}", timeout=10).status_code == 404
        assert httpx.post(f"{stack.url}/v1/nowhere-{i}", json={}, timeout=10).status_code == 404
        assert _post(stack, f"/v1/completions?x={i}", b"{", "application/json").status_code == 400
    text = httpx.get(f"{stack.url}/metrics", timeout=10).text
    routes = set(re.findall(r'pagedkv_gateway_requests_total\{route="([^"]*)"', text))
    assert "/v1/models/{name:path}" in routes
    assert not any("no-such-model" in r or "nowhere" in r for r in routes)
    assert len(routes) <= 6, routes


def test_a_bad_body_limit_is_a_usage_error() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "gateway.main", "--max-body-bytes", "lots"], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "--max-body-bytes" in run.stderr
