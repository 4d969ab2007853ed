"""`pagedkv bench tiers` on vLLM: `vllm serve` (the CPU build, started as `pagedkv bench peer --serve` starts it)
with its prefix caching, and optionally its CPU offloading (`--kv-offloading-size`), driven with the same
conversations over its OpenAI completions endpoint: token-id prompts, streamed, the answer's token ids and the
cached prompt tokens (`--enable-prompt-tokens-details`) read from the stream.
"""

from __future__ import annotations

import http.client
import json
import queue
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.net import free_port
from pagedkv.bench.peer_serve import VLLM_CLI, ServerFailed, ServeSetup, vllm_server
from pagedkv.bench.tiers_workload import BackendError, ConfigResult, Event, Workload, converse, warm_up

READY_TIMEOUT_S = 600.0  # vLLM's start on a busy 2-core machine: a minute or more, compiled longer
REQUEST_TIMEOUT_S = 600.0
MAX_RESPONSE_LINE = 1 << 20  # one SSE line of a completion chunk is far smaller; a bigger one is a broken peer
#: A raised exception's line in vLLM's log, its process and level prefix optional (a warning that quotes an error
#: mid-line is not one).
_RAISED = re.compile(r"^(?:\(\w+ pid=\d+\) ERROR [^\]]*\] )?([A-Za-z_.]*(?:Error|Exception): .+)$")


@dataclass(frozen=True)
class VllmSettings:
    python: Path
    cli: Path = VLLM_CLI
    eager: bool = False
    bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, None: vLLM's default


class VllmBackend:
    """One thread per request in flight, each streaming one completion; their events on one queue."""

    def __init__(self, port: int, model_name: str) -> None:
        self.port, self.model_name = port, model_name
        self.events: queue.Queue[Event] = queue.Queue()

    def submit(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        body = {
            "model": self.model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        threading.Thread(target=self._stream, args=(request_id, body), daemon=True).start()

    def receive(self) -> Event:
        try:
            return self.events.get(timeout=REQUEST_TIMEOUT_S)
        except queue.Empty:
            raise BackendError(f"vLLM sent nothing for {REQUEST_TIMEOUT_S:g} s") from None

    def _stream(self, request_id: str, body: dict[str, Any]) -> None:
        try:
            finish, cached = self._read(request_id, body)
        except Exception as exc:  # anything the stream does wrong ends this request, reported to the driver
            finish, cached = f"error ({type(exc).__name__}: {exc})", 0
        self.events.put(Event(request_id, [], finish, cached))

    def _read(self, request_id: str, body: dict[str, Any]) -> tuple[str, int]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise BackendError(f"HTTP {response.status}: {response.read(500)!r}")
            finish, cached = "no finish reason", 0
            while raw := response.readline(MAX_RESPONSE_LINE):
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices") or []:
                    if choice.get("token_ids"):
                        self.events.put(Event(request_id, [int(t) for t in choice["token_ids"]]))
                    if choice.get("finish_reason"):
                        finish = str(choice["finish_reason"])
                usage = chunk.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or cached)
            return finish, cached
        finally:
            conn.close()


def server_argv_extra(workload: Workload, offload_bytes: int | None) -> list[str]:
    """What the tiers workload adds to the peer bench's `vllm serve`: pagedkv's block size, a context that holds
    the longest conversation, the cached tokens in the usage, and the CPU offloading buffer (GiB) if asked."""
    extra = [
        "--block-size",
        str(workload.block_size),
        "--max-model-len",
        str(-(-workload.longest_tokens // workload.block_size) * workload.block_size),
        "--enable-prompt-tokens-details",
    ]
    if offload_bytes:
        extra += ["--kv-offloading-size", f"{offload_bytes / (1 << 30):.6f}", "--kv-offloading-backend", "native"]
    return extra


def run_vllm(
    config: str,
    model: Path,
    settings: VllmSettings,
    workload: Workload,
    kv_bytes: int,
    offload_bytes: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    work_dir: Path,
    progress: Callable[[str], None],
) -> ConfigResult:
    """One `vllm serve` over the workload: started, warmed up, conversed with, stopped."""
    setup = ServeSetup(
        model_dir=model,
        model_name=model.name,
        kv_cache_bytes=kv_bytes,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=workload.block_size,
        vllm_python=settings.python,
        vllm_cli=settings.cli,
        vllm_bind=settings.bind,
        vllm_eager=settings.eager,
        pagedkv_threads=None,
    )
    port = free_port()
    slug = config.replace("+", "-")
    server = vllm_server(setup, port, work_dir / f"{slug}.log", work_dir)
    extra = server_argv_extra(workload, offload_bytes)
    server.argv += extra
    result = ConfigResult(config, "vllm", extra[extra.index("--enable-prompt-tokens-details") + 1 :])
    try:
        with server.running(READY_TIMEOUT_S, progress) as ready_s:
            progress(f"  {server.label} ready in {ready_s:.0f} s")
            backend = VllmBackend(port, setup.model_name)
            warm_up(backend, workload.block_size)
            started = time.perf_counter()
            result.turns = converse(backend, workload, progress)
            result.wall_s = time.perf_counter() - started
    except ServerFailed as exc:
        cause = root_cause(server.log)
        raise ServerFailed(f"{cause} (its log: {server.log})" if cause else exc.message) from None
    return result


def root_cause(log: Path) -> str | None:
    """The first exception a failed vLLM logged (the end of its log is the API server's "see root cause above")."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if match := _RAISED.match(line.strip()):
            return match.group(1)
    return None
