"""Load held (issue 26), with real processes (blockd, an executor, gateways) and the `openai` client: a step
stalled on purpose for three times the gateway's silence limit fails no stream, and every output equals an
unslowed run's; a gateway whose --max-queue-delay the queued work exceeds refuses new requests at once with 429,
Retry-After and OpenAI's error shape, and still completes what it accepted."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedkv.serve import LocalStack
from tests.support.gateway import GatewayProcess, health, local_stack, tiny_model, wait_for

STALLED_STEP, STALL_S, TIMEOUT_S = 6, 3.0, 1.0
PROMPTS = [[10 + i, 20 + i, 30 + i, 40] for i in range(4)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("load-held")
    model_dir = tiny_model(root, "tiny-load")
    with local_stack(
        model_dir,
        root / "logs",
        executors=1,
        routing="round-robin",
        executor_args=["--fault-stall-step", f"{STALLED_STEP}:{STALL_S}"],
        gateway_args=["--executor-timeout", str(TIMEOUT_S)],
    ) as running:
        yield running


def events(stack: LocalStack, name: str) -> list[dict]:
    lines = stack.log_path(name).read_text(errors="replace").splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def stream_all(client: openai.OpenAI, model: str) -> list[str]:
    """The prompts streamed at once, each from its own thread; their texts (an exception fails the test)."""
    texts: list[str | BaseException] = [""] * len(PROMPTS)

    def one(i: int) -> None:
        try:
            stream = client.completions.create(
                model=model,
                prompt=PROMPTS[i],
                max_tokens=16,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            texts[i] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        except BaseException as exc:  # reported below, with the others' results
            texts[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    failed = [t for t in texts if isinstance(t, BaseException)]
    assert not failed, f"streams failed: {failed}"
    return [str(t) for t in texts]


def test_a_step_longer_than_the_silence_limit_fails_no_stream(stack: LocalStack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    slowed = stream_all(client, stack.model_name)
    stalls = [e for e in events(stack, "executor-0") if e.get("event") == "fault_step_stalled"]
    assert [e["step"] for e in stalls] == [STALLED_STEP]  # the stall did happen, during these streams
    gateway = events(stack, "gateway")
    long_steps = [e for e in gateway if e.get("event") == "executor_step_long"]
    assert long_steps and long_steps[0]["in_flight"] == len(PROMPTS)  # seen by the gateway, with the streams open
    assert not [e for e in gateway if e.get("event") in ("executor_out_of_rotation", "stream_failed")]
    unslowed = stream_all(client, stack.model_name)  # the stall is spent: the same requests at full speed
    assert slowed == unslowed
    assert all(len(text) > 0 for text in slowed)


def test_work_queued_past_the_bound_is_refused_at_the_door_with_retry_after(stack: LocalStack, tmp_path: Path) -> None:
    # A gateway of its own, whose bound any request in flight exceeds once the executor's throughput is measured.
    gateway = GatewayProcess(
        stack.model_dir,
        list(stack.executor_endpoints),
        stack.blockd_endpoint,
        tmp_path / "door.log",
        "--max-queue-delay",
        "0.001",
        keys_dir=stack.keys_dir,
    )
    try:
        gateway.wait_listening()
        wait_for(lambda: health(gateway.url)["status"] == "ok", timeout_s=30, what="the executor in rotation")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for _ in range(3):  # steps enough for the gateway to measure the executor's throughput
            client.completions.create(
                model=stack.model_name, prompt=[5, 6, 7], max_tokens=48, extra_body={"ignore_eos": True}
            )
        wait_for(
            lambda: health(gateway.url)["executors"][0]["tokens_per_s"], timeout_s=30, what="a measured throughput"
        )
        long = client.completions.create(
            model=stack.model_name, prompt=[8, 9], max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        first = next(iter(long))  # accepted and streaming: its queued tokens now hold the door shut
        refused = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": stack.model_name, "prompt": "hi", "max_tokens": 2},
            timeout=30,
        )
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
        assert set(error) == {"message", "type", "param", "code"}
        rest = "".join(chunk.choices[0].text for chunk in long if chunk.choices)  # the accepted one completes
        assert first.choices and rest
        metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
        assert 'pagedkv_gateway_refused_requests_total{reason="overloaded"} 1.0' in metrics
    finally:
        gateway.stop()
