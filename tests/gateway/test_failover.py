"""Executors that stop answering or die, a full queue, and no executor at all: real processes throughout."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.net import free_ports
from pagedkv.serve import LocalStack
from tests.support.gateway import (
    GatewayProcess,
    executor_state,
    health,
    healthy_pools,
    local_stack,
    metric,
    tiny_model,
    wait_for,
    wait_until_no_live_blocks,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("failover-model"), "tiny-failover")


@pytest.fixture
def stack(model_dir: Path, tmp_path: Path) -> Iterator[LocalStack]:
    # A short silence limit, so that a frozen executor leaves the rotation quickly.
    with local_stack(
        model_dir, tmp_path / "logs", routing="round-robin", gateway_args=["--executor-timeout", "2"]
    ) as running:
        yield running


def test_a_silent_executor_leaves_the_rotation_and_rejoins(stack: LocalStack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    frozen = stack.processes["executor-1"]
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        wait_for(
            lambda: healthy_pools(stack.url) == {"executor-0"}, timeout_s=15, what="executor-1 to leave the rotation"
        )
        for _ in range(4):  # round-robin would alternate; only executor-0 is in rotation
            response = client.completions.with_raw_response.create(model=stack.model_name, prompt="hello", max_tokens=3)
            assert response.headers["x-pagedkv-executor"] == "executor-0"
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    wait_for(
        lambda: healthy_pools(stack.url) == {"executor-0", "executor-1"}, timeout_s=15, what="executor-1 to rejoin"
    )
    served_by = {
        client.completions.with_raw_response.create(model=stack.model_name, prompt="hi", max_tokens=2).headers[
            "x-pagedkv-executor"
        ]
        for _ in range(4)
    }
    assert served_by == {"executor-0", "executor-1"}
    wait_until_no_live_blocks(stack)


def test_requests_that_streamed_nothing_are_retried_when_their_executor_dies(stack: LocalStack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    victim = stack.processes["executor-1"]
    os.kill(victim.pid, signal.SIGSTOP)  # connected but mute: requests sent to it get nothing back
    results: list[object] = [None] * 4

    def ask(i: int) -> None:
        try:
            results[i] = client.completions.create(
                model=stack.model_name, prompt=[10 + i, 11, 12], max_tokens=4, extra_body={"ignore_eos": True}
            )
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    # Round-robin sends about half of them to the frozen executor: it must hold one when it dies.
    wait_for(
        lambda: executor_state(stack.url, "executor-1")["in_flight"] >= 1,
        timeout_s=10,
        what="a request to be sent to the frozen executor",
    )
    os.kill(victim.pid, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=60)
    assert all(isinstance(r, openai.types.Completion) for r in results), results
    assert all(r.usage.completion_tokens == 4 for r in results)
    assert metric(stack.url, "pagedkv_gateway_retried_requests_total") >= 1
    assert healthy_pools(stack.url) == {"executor-0"}
    wait_until_no_live_blocks(stack, pools={"executor-0"})  # the dead one's blocks wait for its lease to expire


def test_a_whole_response_survives_its_executor_dying_mid_generation(stack: LocalStack) -> None:
    """Nothing of a non-streamed response has reached the client yet: it goes on elsewhere from the tokens it
    has (gateway/migration.py), or, killed before its first token, starts over."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    ask = {
        "model": stack.model_name,
        "prompt": list(range(40, 60)),
        "max_tokens": 450,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(client.completions.create(**ask)))
    worker.start()

    def holder() -> str | None:
        # The gateway's own count of what it sent each executor: current at once, where `running` (from the
        # executors' load reports) can lag behind a generation this short (450 tokens of a tiny model).
        busy = [e["pool_id"] for e in health(stack.url)["executors"] if e["in_flight"]]
        return busy[0] if busy else None

    victim = wait_for(holder, timeout_s=30, what="the request to be sent to an executor")
    stack.kill(victim)
    worker.join(timeout=120)
    (survived,) = result
    assert survived.usage.completion_tokens == 450
    assert survived.choices[0].finish_reason == "length"
    assert survived.choices[0].text == client.completions.create(**ask).choices[0].text  # greedy: same text
    moved = metric(stack.url, "pagedkv_gateway_retried_requests_total")
    assert moved + metric(stack.url, "pagedkv_gateway_migrations_total") >= 1


def test_a_stream_that_cannot_migrate_ends_with_an_error_event(stack: LocalStack) -> None:
    """Output penalties count the output only: continued from a prompt holding it, they would count other tokens,
    so such a stream is not continued elsewhere (gateway/migration.py) and ends with a clear error."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    response = client.completions.with_raw_response.create(
        model=stack.model_name,
        prompt=list(range(30, 90)),
        max_tokens=450,
        stream=True,
        presence_penalty=0.5,
        extra_body={"ignore_eos": True},
    )
    serving = response.headers["x-pagedkv-executor"]
    stream = response.parse()
    chunks = iter(stream)
    next(chunks)
    stack.kill(serving)
    with pytest.raises(openai.APIError) as raised:
        for _ in chunks:
            pass
    assert "lost" in str(raised.value) and "cannot continue elsewhere: presence or frequency" in str(raised.value)
    assert 'pagedkv_gateway_failed_migrations_total{reason="refused"} 1.0' in httpx.get(f"{stack.url}/metrics").text
    survivor = ({"executor-0", "executor-1"} - {serving}).pop()
    result = client.completions.with_raw_response.create(model=stack.model_name, prompt="still here?", max_tokens=3)
    assert result.headers["x-pagedkv-executor"] == survivor
    wait_until_no_live_blocks(stack, pools={survivor})


# ---------------------------------------------------------------------------------------------- gateways


def test_a_full_queue_answers_429(stack: LocalStack, model_dir: Path, tmp_path: Path) -> None:
    gateway = GatewayProcess(
        model_dir,
        stack.executor_endpoints,
        stack.blockd_endpoint,
        tmp_path / "gw.log",
        "--max-queued-sequences",
        "1",
        "--executor-timeout",
        "60",
        keys_dir=stack.keys_dir,
    )
    executors = [stack.processes[name].pid for name in ("executor-0", "executor-1")]
    body = {"model": stack.model_name, "prompt": "x", "max_tokens": 2}
    try:
        gateway.wait_listening()
        wait_for(lambda: health(gateway.url)["status"] == "ok", timeout_s=30, what="executors in rotation")
        for pid in executors:
            os.kill(pid, signal.SIGSTOP)  # the first request stays in flight until they go on
        first: list[httpx.Response] = []
        waiting = threading.Thread(
            target=lambda: first.append(httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60))
        )
        waiting.start()
        wait_for(lambda: health(gateway.url)["in_flight"] == 1, timeout_s=10, what="the first request to be in flight")
        second = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
        assert second.status_code == 429
        assert second.json()["error"]["type"] == "rate_limit_error"
        for pid in executors:
            os.kill(pid, signal.SIGCONT)
        waiting.join(timeout=30)
        assert first and first[0].status_code == 200  # the queued request was not lost
        assert httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        for pid in executors:
            os.kill(pid, signal.SIGCONT)
        gateway.stop()
    wait_until_no_live_blocks(stack)


def test_no_executor_answers_503_and_health_says_so(model_dir: Path, tmp_path: Path) -> None:
    nowhere = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    gateway = GatewayProcess(model_dir, nowhere, "tcp://127.0.0.1:1", tmp_path / "gw.log")
    try:
        gateway.wait_listening()
        response = httpx.post(
            f"{gateway.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30
        )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_executor_available"
        state = httpx.get(f"{gateway.url}/health", timeout=10)
        assert state.status_code == 503 and state.json()["status"] == "unavailable"
        assert [e["healthy"] for e in state.json()["executors"]] == [False, False]
    finally:
        gateway.stop()


def test_executors_serving_another_model_are_refused(stack: LocalStack, tmp_path: Path) -> None:
    """A gateway whose tokenizer is not the executors' model would send them token ids that mean other words."""
    other = tiny_model(tmp_path, "other-model", vocab_size=1024)
    gateway = GatewayProcess(
        other, stack.executor_endpoints, stack.blockd_endpoint, tmp_path / "gw.log", keys_dir=stack.keys_dir
    )
    try:
        gateway.wait_listening()
        wait_for(
            lambda: all(e["refused"] for e in health(gateway.url)["executors"]), timeout_s=30, what="both to be refused"
        )
        state = httpx.get(f"{gateway.url}/health", timeout=10)
        assert state.status_code == 503 and "vocabulary of 512 tokens" in state.json()["reason"]
        response = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert response.status_code == 503 and "another model" in response.json()["error"]["message"]
    finally:
        gateway.stop()
    # The stack's own gateway, with the right tokenizer, is not affected.
    assert health(stack.url)["status"] == "ok"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_its_first_token_aborts_its_request(stack: LocalStack, stream: bool) -> None:
    executors = [stack.processes[name].pid for name in ("executor-0", "executor-1")]
    body = {"model": stack.model_name, "prompt": [5, 6, 7], "max_tokens": 200, "stream": stream, "ignore_eos": True}
    for pid in executors:
        os.kill(pid, signal.SIGSTOP)  # the request waits for its first token
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{stack.url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.5))
        wait_for(
            lambda: health(stack.url)["in_flight"] == 0, timeout_s=1.0, what="the gateway to let go of the request"
        )
    finally:
        for pid in executors:
            os.kill(pid, signal.SIGCONT)
    wait_until_no_live_blocks(stack)  # the executor saw the abort with (or right after) the request
    wait_for(
        lambda: all(e["running"] == 0 for e in health(stack.url)["executors"]), timeout_s=5, what="nothing running"
    )
