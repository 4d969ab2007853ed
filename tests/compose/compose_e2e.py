"""`make compose-test`: the compose stack, built and run for real on this host's Docker engine, without GPUs.

    python -m tests.compose.compose_e2e [--keep-image]

Makes the stack's secrets (compose/make-secrets.sh: CURVE keys, an API key, the deployment secret, Redis'
password), builds the CPU image (compose/docker-compose.yml + compose/docker-compose.cpu.yml), brings the stack up
with a generated model and waits for every healthcheck; sends completions through the published port with the
`openai` client and the API key, and shows that a request without it, or with a wrong one, gets 401, that
blockd-cli without keys is never answered and that Redis wants its password; SIGKILLs blockd's process and shows
that `restart: unless-stopped` brings it back and that the same requests give the same greedy outputs; starts a
third executor with one command and sees the gateway take it into rotation; then `down -v`, whatever happened.

Not part of `make test`: it needs a Docker engine with Compose >= 2.24 and builds an image (minutes). Where the
Docker Hub or the default package index cannot be reached, the variables set by ../shared/tools/docker-here
are used when present: PAGEDKV_BASE_IMAGE (base image), PAGEDKV_REDIS_IMAGE (Redis image) and
PAGEDKV_PIP_FIND_LINKS (a page of wheels with the CPU torch, served on this host: the build then runs on the
host network). Exit status 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.support import waiting

ROOT = Path(__file__).resolve().parents[2]
FILES = ["-f", str(ROOT / "compose" / "docker-compose.yml"), "-f", str(ROOT / "compose" / "docker-compose.cpu.yml")]
PROJECT = "pagedkv-e2e"
MODEL_NAME = "tiny-compose"
PROMPTS = ["The quick brown fox", "Once upon a time", "pagedkv serves", "1 2 3 4"]
MAX_TOKENS = 12
# Variables the compose files read that this script sets itself; anything else they read keeps its default,
# whatever the calling shell has (a stray TORCH or GATEWAY_PORT there must not change the test).
SET_HERE = (
    "MODEL_DIR",
    "GATEWAY_PORT",
    "SERVED_MODEL_NAME",
    "BASE_IMAGE",
    "REDIS_IMAGE",
    "BUILD_NETWORK",
    "BUILD_PIP_FIND_LINKS",
    "BUILD_PIP_INDEX_URL",
    "BUILD_PIP_EXTRA_INDEX_URL",
    "CPU_KV_CACHE_MEMORY",
    "CPU_THREADS_PER_EXECUTOR",
    "TORCH",
    "ROUTING",
    "LOG_LEVEL",
    "SECRETS_DIR",
)

_started = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - _started:6.1f}s] {message}", flush=True)


class Failed(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failed(message)


class Compose:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def run(self, *args: str, profile: str | None = None, capture: bool = False, timeout: float = 900) -> str:
        command = self.command(*args, profile=profile)
        say("$ " + " ".join(["docker", "compose", *(["--profile", profile] if profile else []), *args]))
        result = subprocess.run(
            command, env=self.env, text=True, timeout=timeout, capture_output=capture, check=False, cwd=ROOT
        )
        if result.returncode != 0:
            raise Failed(
                f"docker compose {' '.join(args)} exited with {result.returncode}"
                + (f"\n{result.stdout}\n{result.stderr}" if capture else "")
            )
        return result.stdout if capture else ""

    def command(self, *args: str, profile: str | None = None) -> list[str]:
        return ["docker", "compose", "-p", PROJECT, *FILES, *(["--profile", profile] if profile else []), *args]

    def container(self, service: str) -> str:
        ids = self.run("ps", "-q", service, capture=True).split()
        check(len(ids) == 1, f"expected one container for {service}, found {ids}")
        return ids[0]

    def ps(self) -> list[dict[str, Any]]:
        out = self.run("ps", "--all", "--format", "json", capture=True).strip()
        if out.startswith("["):  # older compose: one array
            return json.loads(out)
        return [json.loads(line) for line in out.splitlines() if line.strip()]


def inspect(container: str, template: str) -> str:
    return subprocess.run(
        ["docker", "inspect", "-f", template, container], text=True, capture_output=True, check=True
    ).stdout.strip()


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, interval_s: float = 1.0) -> Any:
    """tests.support.waiting's, a probe that raises counting as not yet (a container still starting), and Failed."""
    try:
        return waiting.wait_for(
            probe, timeout_s, interval_s, what, retry_on=(httpx.HTTPError, subprocess.CalledProcessError, ValueError)
        )
    except AssertionError as exc:
        raise Failed(str(exc)) from None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def generated_model() -> Iterator[Path]:
    from pagedkv.tools.model_gen import write_model
    from tests.support.models import TINY

    root = Path(tempfile.mkdtemp(prefix="pagedkv-compose-e2e-"))
    try:
        model = write_model(root / MODEL_NAME, arch="llama", quiet=True, **TINY)
        # The containers run as uid 1000: the checkpoint must be readable by anyone.
        for path in [root, *root.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        yield model
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def generated_secrets() -> Iterator[Path]:
    """compose/make-secrets.sh into a temporary directory, with this environment's `pagedkv`."""
    root = Path(tempfile.mkdtemp(prefix="pagedkv-compose-secrets-"))
    pagedkv = shutil.which("pagedkv") or str(Path(sys.executable).parent / "pagedkv")
    try:
        subprocess.run(
            ["sh", str(ROOT / "compose" / "make-secrets.sh"), str(root / "secrets")],
            env={**os.environ, "PAGEDKV": pagedkv},
            check=True,
            capture_output=True,
            text=True,
        )
        yield root / "secrets"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def health(base: str) -> dict[str, Any]:
    response = httpx.get(f"{base}/health", timeout=5)
    return response.json()


def healthy_executors(base: str) -> list[str]:
    return [e["pool_id"] for e in health(base)["executors"] if e["healthy"]]


def completions(client: Any) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        texts.append(response.choices[0].text)
    return texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep-image", action="store_true", help="keep pagedkv:cpu after the run (faster reruns)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the stack to turn healthy")
    args = parser.parse_args()

    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        print('compose-test: no Docker engine answers here (eval "$(../shared/tools/docker-here)" first)')
        return 2
    version = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True)
    if version.returncode != 0:
        print("compose-test: `docker compose` (v2) is not installed")
        return 2
    say(f"docker {inspect_version()}, compose {version.stdout.strip()}")

    from openai import OpenAI

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in SET_HERE}
    # Round-robin routing: each round of prompts lands on other executors than the last, so equal outputs across
    # rounds mean equal outputs across executors (prefix routing would send a prompt back where it is cached).
    env.update(GATEWAY_PORT=str(port), SERVED_MODEL_NAME=MODEL_NAME, CPU_KV_CACHE_MEMORY="64MiB", ROUTING="round-robin")
    env["CPU_THREADS_PER_EXECUTOR"] = "1"
    if os.environ.get("PAGEDKV_BASE_IMAGE"):
        env["BASE_IMAGE"] = os.environ["PAGEDKV_BASE_IMAGE"]
    if os.environ.get("PAGEDKV_REDIS_IMAGE"):
        env["REDIS_IMAGE"] = os.environ["PAGEDKV_REDIS_IMAGE"]
    if os.environ.get("PAGEDKV_PIP_FIND_LINKS"):
        env["BUILD_PIP_FIND_LINKS"] = os.environ["PAGEDKV_PIP_FIND_LINKS"]
        env["BUILD_NETWORK"] = "host"  # the page is served on this host's loopback
    compose = Compose(env)
    base = f"http://127.0.0.1:{port}"

    with generated_model() as model, generated_secrets() as secrets:
        env["MODEL_DIR"] = str(model)
        env["SECRETS_DIR"] = str(secrets)
        api_key = (secrets / "api-keys").read_text().split()[0]
        say(f"model {model}; gateway on {base}; base image {env.get('BASE_IMAGE', 'the default')}")
        made = ", ".join(sorted(p.name for p in secrets.iterdir()))
        say(f"secrets made by compose/make-secrets.sh in {secrets}: {made}")
        try:
            client = OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=60)
            run_steps(compose, base, client, args)
        except Failed as exc:
            say(f"FAILED: {exc}")
            with contextlib.suppress(Failed, subprocess.TimeoutExpired):
                compose.run("ps", "--all")
                compose.run("logs", "--tail", "30")
            return 1
        finally:
            compose.run("down", "-v", "--remove-orphans", profile="executor-2", timeout=300)
            if not args.keep_image:
                subprocess.run(["docker", "image", "rm", "-f", "pagedkv:cpu"], capture_output=True)
    say("compose-test passed")
    return 0


def inspect_version() -> str:
    return subprocess.run(
        ["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True
    ).stdout.strip()


def run_steps(compose: Compose, base: str, client: Any, args: argparse.Namespace) -> None:
    # 1. Build the image once (every pagedkv service runs it), then bring the stack up and wait for every
    # healthcheck: `up --wait` returns only when each service with one reports healthy.
    compose.run("build", "blockd")
    compose.run("up", "-d", "--wait", "--wait-timeout", str(int(args.timeout)))
    services = {c["Service"]: c for c in compose.ps()}
    for name, container in sorted(services.items()):
        say(f"  {name:<11} {container['State']:<8} {container.get('Health') or '-'}")
    check(
        set(services) == {"redis", "blockd", "executor-0", "executor-1", "gateway"},
        f"services up: {sorted(services)}",
    )
    unhealthy = [n for n, c in services.items() if c["State"] != "running" or c.get("Health") != "healthy"]
    check(not unhealthy, f"not healthy: {unhealthy}")
    pools = wait_for("both executors in the gateway's rotation", lambda: len(healthy_executors(base)) == 2, 120)
    check(pools, "executors not in rotation")

    # 2. Nothing answers without its key: the API (401 in OpenAI's shape; /health stays open), blockd (a client
    # without CURVE keys never completes the handshake), Redis (NOAUTH).
    refused = httpx.post(
        f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}, timeout=10
    )
    say(f"  POST /v1/completions without an API key -> {refused.status_code} {refused.json()}")
    check(refused.status_code == 401, f"no API key: {refused.status_code}")
    check(refused.json()["error"]["code"] == "invalid_api_key", f"no API key: {refused.text}")
    import openai

    wrong = client.with_options(api_key="sk-wrong")
    try:
        wrong.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    except openai.AuthenticationError as exc:
        say(f"  the openai client with a wrong API key -> {exc.status_code} ({type(exc).__name__})")
    else:
        raise Failed("a wrong API key was accepted")
    check(httpx.get(f"{base}/health", timeout=5).status_code == 200, "/health is not open")
    say("  GET /health without an API key -> 200 (open by default)")
    unkeyed = subprocess.run(
        [*compose.command("exec", "-T", "-e", "PAGEDKV_KEYS=", "blockd"), "blockd-cli", "--timeout", "3", "stats"],
        env=compose.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    say(f"  blockd-cli without keys -> exit {unkeyed.returncode}: {(unkeyed.stderr or unkeyed.stdout).strip()[-120:]}")
    check(unkeyed.returncode != 0, "blockd answered a client without keys")
    noauth = compose.run("exec", "-T", "redis", "redis-cli", "ping", capture=True)
    say(f"  redis-cli ping without the password -> {noauth.strip()}")
    check("NOAUTH" in noauth, f"redis answered without its password: {noauth!r}")

    # 3. Completions through the published port with the OpenAI client and the API key, twice: greedy outputs
    # repeat.
    models = [m.id for m in client.models.list().data]
    check(MODEL_NAME in models, f"/v1/models lists {models}")
    first = completions(client)
    for prompt, text in zip(PROMPTS, first):
        say(f"  {prompt!r} -> {text!r}")
    check(all(first), "an empty completion")
    check(completions(client) == first, "greedy outputs changed between two identical rounds")
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8, temperature=0
    )
    say(f"  chat -> {chat.choices[0].message.content!r} ({chat.usage.completion_tokens} tokens)")
    stats_before = compose.run("exec", "-T", "blockd", "blockd-cli", "stats", capture=True)
    say("  blockd-cli stats:\n" + "\n".join("    " + line for line in stats_before.strip().splitlines()))

    # 4. blockd crashes: SIGKILL its process (PID 1 of the container) from the host, as the kernel's OOM killer
    # or a segfault would end it. `restart: unless-stopped` restarts it. (`docker kill` is not a crash to
    # Docker: it counts as a deliberate stop and no restart policy restarts it; step 5 shows that too.)
    blockd = compose.container("blockd")
    pid, restarts = int(inspect(blockd, "{{.State.Pid}}")), int(inspect(blockd, "{{.RestartCount}}"))
    say(f"SIGKILL blockd's process (host pid {pid}); restarts so far: {restarts}")
    os.kill(pid, 9)
    wait_for(
        "Docker to restart blockd",
        lambda: (
            int(inspect(blockd, "{{.RestartCount}}")) > restarts and inspect(blockd, "{{.State.Running}}") == "true"
        ),
        60,
        0.5,
    )
    say(f"  blockd restarted by its restart policy: RestartCount {inspect(blockd, '{{.RestartCount}}')}")
    wait_for("blockd healthy again", lambda: inspect(blockd, "{{.State.Health.Status}}") == "healthy", 120)
    wait_for(
        "both executors re-registered at blockd", lambda: pools_at_blockd(compose) >= {"executor-0", "executor-1"}, 120
    )
    after = completions(client)
    check(after == first, f"greedy outputs differ after blockd's restart: {first} != {after}")
    say("  the same greedy outputs after blockd's restart")

    # 5. `docker kill` (SIGKILL through the engine): the container stays down, as Docker documents for a manual
    # stop (restart policies skip it); `up -d` brings it back. (While blockd is down, requests wait for it: it is
    # the only allocator of KV blocks.)
    say(f"docker kill {blockd[:12]} (blockd)")
    subprocess.run(["docker", "kill", blockd], check=True, capture_output=True)
    wait_for("blockd to exit", lambda: inspect(blockd, "{{.State.Status}}") == "exited", 30, 0.5)
    # That Docker does NOT restart it only shows by watching it stay down for a while.
    try:
        waiting.holds_throughout(lambda: inspect(blockd, "{{.State.Status}}") == "exited", 5, 0.5, "blockd down")
    except AssertionError as exc:
        raise Failed(f"blockd is {inspect(blockd, '{{.State.Status}}')!r} after docker kill: {exc}") from None
    say("  for 5 s blockd stayed exited: Docker applies no restart policy after `docker kill`")
    compose.run("up", "-d", "--wait", "blockd")
    wait_for(
        "both executors re-registered at blockd", lambda: pools_at_blockd(compose) >= {"executor-0", "executor-1"}, 120
    )
    check(completions(client) == first, "greedy outputs differ after blockd came back")
    say("  blockd back after `up -d`; the same greedy outputs")

    # 6. A third executor with one command: the gateway already lists executor-2 and takes it into rotation.
    compose.run("up", "-d", "--wait", "executor-2", profile="executor-2")
    wait_for("three executors in the gateway's rotation", lambda: len(healthy_executors(base)) == 3, 120)
    say(f"  gateway rotation: {sorted(healthy_executors(base))}")
    check(pools_at_blockd(compose) >= {"executor-0", "executor-1", "executor-2"}, "executor-2 not registered at blockd")
    for _ in range(3):  # 12 requests round-robin over three executors: executor-2 serves 4 of them
        third = completions(client)
        check(third == first, f"greedy outputs differ with three executors: {first} != {third}")
    used = blocks_used_at_blockd(compose)
    say(f"  KV blocks ever used per pool: {used}")
    check(used.get("executor-2", 0) > 0, "executor-2 served no request")
    say("  executor-2 serves requests too; the same greedy outputs with three executors")


def blocks_used_at_blockd(compose: Compose) -> dict[str, int]:
    data = json.loads(compose.run("exec", "-T", "blockd", "blockd-cli", "stats", "--json", capture=True))
    return {p["pool_id"]: p["blocks_total"] - p["blocks_never_used"] for p in data["pools"]}


def pools_at_blockd(compose: Compose) -> set[str]:
    out = compose.run("exec", "-T", "blockd", "blockd-cli", "pools", "--json", capture=True)
    data = json.loads(out)
    pools = data["pools"] if isinstance(data, dict) else data
    return {p["pool_id"] for p in pools}


if __name__ == "__main__":
    sys.exit(main())
