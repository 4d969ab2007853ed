"""What the gateway tests share: the tiny model and the stacks of real processes they run on, a second gateway
process, what blockd and the gateway report, transformers' reference text, and polling for a condition.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import httpx

from common import processes
from common.net import free_ports
from pagedkv.serve import LocalStack
from pagedkv.tools.model_gen import write_model
from tests.support.models import TINY
from tests.support.waiting import wait_for as wait_for  # re-exported: the gateway tests poll with it

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- models and stacks


def tiny_model(root: Path, name: str, **overrides: Any) -> Path:
    """A tiny llama checkpoint in root/name (overrides: write_model options, such as another vocab_size)."""
    return write_model(root / name, arch="llama", quiet=True, **{**TINY, **overrides})


def local_stack(model_dir: Path, log_dir: Path, **options: Any) -> LocalStack:
    """blockd, two executors (8 MiB of KV cache each) and a gateway on a free port, without persistence; use
    it as a context manager. `options` override LocalStack's (routing=..., gateway_args=[...])."""
    settings: dict[str, Any] = dict(
        executors=2, port=0, kv_cache_memory="8MiB", persistence=False, log_dir=log_dir, progress=None
    )
    return LocalStack(model_dir=model_dir, **{**settings, **options})


class GatewayProcess:
    """A gateway process of its own (`python -m gateway.main`), for instance in front of a stack's executors."""

    def __init__(
        self, model_dir: Path, executors: list[str], blockd: str, log: Path, *extra: str, keys_dir: Path | None = None
    ) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_KEYS"}
        if keys_dir is not None:  # a stack's key set (LocalStack.keys_dir): the gateway's key
            env["PAGEDKV_KEYS"] = str(keys_dir)
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process = processes.start(
            [
                sys.executable,
                "-m",
                "gateway.main",
                "--model",
                str(model_dir),
                "--executors",
                ",".join(executors),
                "--blockd",
                blockd,
                "--port",
                str(self.port),
                *extra,
            ],
            log,
            env=env,
        )

    def wait_listening(self) -> None:
        def alive() -> None:
            assert self.process.poll() is None, f"the gateway exited:\n{processes.tail(self.log)}"

        def answers() -> bool | None:
            try:
                httpx.get(f"{self.url}/health", timeout=2)
                return True
            except httpx.TransportError:
                return None

        processes.wait_until(answers, 60, check=alive)

    def stop(self) -> None:
        processes.stop([self.process])


# ---------------------------------------------------------------------------------------------- what they report


def health(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/health", timeout=10).json()


def healthy_pools(url: str) -> set[str]:
    return {e["pool_id"] for e in health(url)["executors"] if e["healthy"]}


def executor_state(url: str, pool_id: str) -> dict[str, Any]:
    """The gateway's view of one executor (its /health entry): healthy, in_flight, running, ..."""
    (entry,) = [e for e in health(url)["executors"] if e["pool_id"] == pool_id]
    return entry


def metric(url: str, name: str) -> float:
    """An unlabelled metric's value on the gateway's /metrics (0 if absent)."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def stack_env(stack: LocalStack) -> dict[str, str]:
    """The environment for a CLI aimed at the stack (its keys, if it has any)."""
    env = {k: v for k, v in os.environ.items() if k != "PAGEDKV_KEYS"}
    if stack.keys_dir is not None:
        env["PAGEDKV_KEYS"] = str(stack.keys_dir)
    return env


def blockd_stats(stack: LocalStack) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "blockd.admin", "--endpoint", stack.blockd_endpoint, "stats", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env=stack_env(stack),
    )
    return json.loads(out.stdout)


def blocks_in_use(stack: LocalStack) -> dict[str, int]:
    return {p["pool_id"]: p["blocks_in_use"] for p in blockd_stats(stack)["pools"]}


def wait_until_no_live_blocks(stack: LocalStack, timeout_s: float = 15.0, pools: set[str] | None = None) -> None:
    """Until no live sequence holds a block (in `pools`, or in any pool)."""
    held: dict[str, int] = {}

    def none_held() -> bool:
        held.clear()
        held.update({k: v for k, v in blocks_in_use(stack).items() if v and (pools is None or k in pools)})
        return not held

    try:
        wait_for(none_held, timeout_s, 0.2, "no live blocks")
    except AssertionError:
        raise AssertionError(f"blocks still held by live sequences: {held}") from None


# ---------------------------------------------------------------------------------------------- references


@cache
def hf_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def reference_text(model_dir: Path, prompt: list[int], n: int) -> tuple[str, list[int]]:
    """transformers' greedy continuation of `prompt` (n tokens, EOS ignored) and its text: what the stack must
    answer at temperature 0."""
    from tests.executor.harness import hf_greedy_ignoring_eos

    tokens = hf_greedy_ignoring_eos(model_dir, prompt, n)
    return continuation_text(model_dir, prompt, tokens), tokens


def continuation_text(model_dir: Path, prompt: list[int], tokens: list[int]) -> str:
    """What `tokens` add to the decoded `prompt` (transformers' decode of both, less its decode of the prompt):
    the text streamed after a prompt, which differs from decoding the tokens alone where the prompt ends inside
    a character that the tokens complete. That character, U+FFFD at the prompt's end, stays the prompt's (as
    gateway.text.Detokenizer releases it)."""
    tokenizer = hf_tokenizer(model_dir)
    before = tokenizer.decode(prompt, skip_special_tokens=True)
    whole = tokenizer.decode(prompt + tokens, skip_special_tokens=True)
    completed = before.endswith("\ufffd") and whole.startswith(before[:-1]) and len(whole) >= len(before)
    assert whole.startswith(before) or completed, "the continuation rewrites the prompt's text"
    return whole[len(before) :]
