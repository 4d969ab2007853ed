"""Authentication and isolation at the gateway, against a real stack (blockd, an executor, the gateway) started
by LocalStack with its own CURVE key set and two API keys: the `openai` client gets 401 without or with a wrong
API key and 200 with either right one; /health and /metrics stay open unless closed; the executor answers no
peer without a key; `cache_salt` keeps prefixes apart and `cached_tokens` is shown only to requests with a salt.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.auth import KeySet, generate
from common.net import free_port
from executor import protocol as ep
from executor.client import ExecutorClient, ExecutorUnavailable
from gateway import responses
from gateway.auth import read_api_keys
from gateway.generation import Usage
from pagedkv.serve import LocalStack
from tests.support.gateway import GatewayProcess, local_stack, tiny_model, wait_until_no_live_blocks

KEYS = ("key-one", "key-two")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("auth-model"), "tiny-chat")


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    args = [a for key in KEYS for a in ("--api-key", key)]
    with local_stack(model_dir, tmp_path_factory.mktemp("auth-logs"), executors=1, gateway_args=args) as running:
        yield running


def client_with(stack: LocalStack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=60)


def test_the_api_needs_one_of_its_keys(stack: LocalStack) -> None:
    for wrong in ("", "key-three", "key-one "[:-2]):
        with client_with(stack, wrong or "none") as client, pytest.raises(openai.AuthenticationError) as info:
            client.completions.create(model=stack.model_name, prompt="hi", max_tokens=2)
        assert info.value.status_code == 401
        assert info.value.body["code"] == "invalid_api_key" and info.value.body["type"] == "invalid_request_error"
    no_header = httpx.post(f"{stack.base_url}/completions", json={"prompt": "hi", "max_tokens": 2})
    assert no_header.status_code == 401 and no_header.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{stack.base_url}/models").status_code == 401
    for key in KEYS:
        with client_with(stack, key) as client:
            done = client.completions.with_raw_response.create(model=stack.model_name, prompt="hi", max_tokens=2)
            assert done.status_code == 200 and done.parse().usage.completion_tokens == 2
            assert client.models.list().data[0].id == stack.model_name
    # Open by default: health checks and scrapers need no key.
    assert httpx.get(f"{stack.url}/health").status_code == 200
    assert httpx.get(f"{stack.url}/metrics").status_code == 200
    wait_until_no_live_blocks(stack)


def test_health_and_metrics_can_be_closed(stack: LocalStack, model_dir: Path, tmp_path: Path) -> None:
    gateway = GatewayProcess(
        model_dir,
        stack.executor_endpoints,
        stack.blockd_endpoint,
        tmp_path / "gw.log",
        "--api-key",
        "only",
        "--protect-health",
        "--protect-metrics",
        keys_dir=stack.keys_dir,
    )
    try:
        gateway.wait_listening()
        for path in ("/health", "/metrics", "/v1/models"):
            assert httpx.get(gateway.url + path).status_code == 401, path
            answer = httpx.get(gateway.url + path, headers={"Authorization": "Bearer only"})
            assert answer.status_code in (200, 503), path  # 503: /health before it reached the executor
    finally:
        gateway.stop()


def test_cache_salts_keep_prefixes_apart_and_cached_tokens_hidden_without_one(stack: LocalStack) -> None:
    shared = list(range(300, 300 + 80))  # five full blocks of 16

    def cached(suffix: list[int], salt: str | None) -> int | None:
        extra = {"cache_salt": salt} if salt else None
        with client_with(stack, KEYS[0]) as client:
            usage = client.completions.create(
                model=stack.model_name, prompt=shared + suffix, max_tokens=1, temperature=0, extra_body=extra
            ).usage
        details = usage.prompt_tokens_details
        return None if details is None else details.cached_tokens

    assert cached([1], "tenant-a") == 0
    assert cached([2], "tenant-a") >= 64, "the same salt shares its prefixes"
    assert cached([3], "tenant-b") == 0, "another salt does not see them"
    assert cached([4], "tenant-b") >= 64
    # Without a salt: nothing of the salted prefixes, and cached_tokens is not reported at all (an oracle).
    assert cached([5], None) is None
    assert cached([6], None) is None
    with client_with(stack, KEYS[0]) as client, pytest.raises(openai.BadRequestError):
        client.completions.create(model=stack.model_name, prompt="x", max_tokens=1, extra_body={"cache_salt": ""})
    wait_until_no_live_blocks(stack)


def test_the_executor_answers_only_known_keys_each_in_its_role(stack: LocalStack, tmp_path: Path) -> None:
    assert stack.keys_dir is not None
    keys = KeySet(stack.keys_dir)
    endpoint = stack.executor_endpoints[0]
    generate(tmp_path / "strangers")
    for curve in (None, KeySet(tmp_path / "strangers").client("gateway")):
        with ExecutorClient(endpoint, timeout_s=1.0, curve=curve) as outsider, pytest.raises(ExecutorUnavailable):
            outsider.info()
    # An operator may ask, not submit; an executor's key is no client of executors at all.
    with ExecutorClient(endpoint, timeout_s=10, curve=keys.client("operator")) as operator:
        assert operator.info().pool_id == "executor-0"
        operator.submit("op-1", [1, 2, 3])
        reply = operator.receive()
        assert type(reply) is ep.Rejected and reply.code == "forbidden" and reply.request_id == "op-1"
    with (
        ExecutorClient(endpoint, timeout_s=1.0, curve=keys.client("pool-executor-0")) as executor,
        pytest.raises(ExecutorUnavailable),
    ):
        executor.info()
    with ExecutorClient(endpoint, timeout_s=30, curve=keys.client("gateway")) as gateway:
        (deltas,) = gateway.generate([5, 6, 7, 8])
        assert deltas[-1].finish_reason in ("stop", "length")
    assert stack.processes["executor-0"].poll() is None
    wait_until_no_live_blocks(stack)


# ---------------------------------------------------------------------------------------------- without a stack


def test_api_keys_come_from_flags_the_environment_and_files(tmp_path: Path) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# the team's keys\nfile-key\n\n  spaced-key  \nflag-key\n")
    keys = read_api_keys(["flag-key", ""], " env-a, env-b ,", [key_file])
    assert keys == ("flag-key", "env-a", "env-b", "file-key", "spaced-key")
    assert read_api_keys([], None, []) == ()


def test_usage_hides_cached_tokens_unless_reported() -> None:
    assert "prompt_tokens_details" not in responses.usage_body(Usage(10, 2, 8, report_cached=False))
    assert responses.usage_body(Usage(10, 2, 8))["prompt_tokens_details"] == {"cached_tokens": 8}
    hidden = responses.total_usage([Usage(3, 1, 0), Usage(5, 2, 4, report_cached=False)])
    assert not hidden.report_cached


@pytest.mark.parametrize(
    "command",
    [
        ["executor.main", "--bind", "tcp://0.0.0.0:{port}"],
        ["gateway.main", "--host", "0.0.0.0", "--port", "{port}"],
    ],
)
def test_beyond_loopback_without_keys_a_service_refuses_to_start(command: list[str]) -> None:
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("PAGEDKV_KEYS", "PAGEDKV_GATEWAY_API_KEY")}
    env["PYTHONPATH"] = str(REPO)
    args = [sys.executable, "-m", *(a.format(port=port) for a in command)]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "beyond loopback" in done.stderr and "--insecure" in done.stderr
