"""`pagedkv chaos`: faults and attacks against a stack of real processes, under greedy load with reference
outputs.

Redis, blockd, two CPU executors and a gateway, authenticated and supervised; kills, pauses, foreign keys and
malformed frames while clients compare every answer with the clean stack's, then the load-held phase (overload,
a stalled step), then the tiers phase: executor-0 with host and disk KV tiers alone behind the gateway, killed
during a hung write-behind, its block files damaged while it runs and while it is down, its disk full, its
directory shared with an executor of another model, then with the shared tier alone, its files damaged; then the
ranks phase: executor-1 restarted as a tensor-parallel group of two, whose worker rank is killed and paused. The
scenarios and what each must show: docs/architecture.md ("Faults and attacks").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
import msgspec
import zmq

from blockd import protocol as bp
from blockd.client import BlockdClient, BlockdUnavailable
from blockd.embedded_redis import find_redis_server
from blockd.errors import BlockdError
from common import processes
from common.auth import ClientCurve, KeySet, generate
from common.net import free_port
from common.tokens import pack_tokens
from executor import protocol as ep
from executor.client import ExecutorClient, ExecutorRejected, ExecutorUnavailable, tokens_of
from executor.kv_tiers import Dropped
from executor.parallel_runner import EX_GROUP_FAILED
from executor.params import SamplingParams
from pagedkv.bench.common import table_lines
from pagedkv.tools import chaos_tiers as ct
from pagedkv.tools.model_gen import write_model

INTRUDER = "executor-intruder"  # an any-pool executor key in the attacker's hands (the cross-pool scenario)
MODEL = dict(hidden_size=128, layers=2, heads=4, kv_heads=2, vocab_size=512, max_position=512, seed=0)
EXECUTOR_TIMEOUT_S = 2.0  # the gateway's --executor-timeout: SIGSTOPs of an executor outlast it
# The gateway's --max-queue-delay: short, so that even a short overload reaches the door's bound.
MAX_QUEUE_DELAY_S = 2.0
# Tokens each answer of the load-held scenarios holds: enough that the executors, not the HTTP clients, are what
# an overload saturates.
LOAD_MAX_TOKENS = 128
# The fault and attack scenarios under greedy load; the load-held scenarios; the KV tiers' faults under greedy load
# (executor-0 alone, with host and disk tiers); a tensor-parallel group's rank faults under greedy load (executor-1
# restarted as a group of two ranks).
PHASES = ("faults", "load", "tiers", "ranks")
OTHER = "executor-other"  # the tiers phase's executor of another model, sharing executor-0's disk directory
TP_TIMEOUT_S = 3.0  # the group's --tensor-parallel-timeout: a paused rank stops it this long after
PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time in a land far away",
    "PagedAttention keeps the KV cache in blocks",
    "A B C D E F G H I J K L M N O P",
    "The capital of France is",
    "def fibonacci(n):",
    "Redis, ZeroMQ and msgpack walk into a bar",
    "It was the best of times, it was the worst of times",
]


def _log(line: str) -> None:
    click.echo(line, err=True)


# ---------------------------------------------------------------------------------------------- services


class Service:
    """A child process started again by the supervisor whenever it exits (unless the service is retired)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.retired = False
        self.peak_rss = 0
        self.idle_rss = 0
        self.file_size_limit: int | None = None  # RLIMIT_FSIZE of its next starts (the tiers phase's full disk)

    def start(self) -> None:
        self.process = processes.start(self.argv, self.log, env=self.env, file_size_limit=self.file_size_limit)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, sig)

    def rss(self) -> int:
        if self.process is None or self.process.poll() is not None:
            return 0
        try:
            with open(f"/proc/{self.process.pid}/status") as status:
                for line in status:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def stop(self) -> None:
        self.retired = True
        if self.process is not None:
            processes.stop([self.process])  # continued first, should a scenario have left it stopped


class Stack:
    def __init__(self, root: Path, model_dir: Path, *, tiers: bool = False) -> None:
        self.root = root
        # The key set: server, gateway, operator, pool-executor-0/1; and an any-pool executor key held by the
        # attacker of the cross-pool scenario (a leaked or misissued key: fencing must still hold).
        self.keys_dir = root / "keys"
        generate(self.keys_dir, ["executor-0", "executor-1", OTHER])
        zmq.auth.create_certificates(self.keys_dir, INTRUDER)
        self.keys = KeySet(self.keys_dir)
        self.api_key = secrets.token_urlsafe(24)
        ports = [free_port() for _ in range(5)]
        self.redis_port, blockd_port, *executor_ports, self.gateway_port = ports
        self.blockd = f"tcp://127.0.0.1:{blockd_port}"
        self.executors = [f"tcp://127.0.0.1:{p}" for p in executor_ports]
        self.url = f"http://127.0.0.1:{self.gateway_port}"
        self.model_dir = model_dir
        py = sys.executable
        (root / "redis").mkdir()
        self.services: dict[str, Service] = {}
        redis_argv = [find_redis_server(), "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", ""]
        redis_argv += ["--appendonly", "no", "--dir", str(root / "redis")]
        self._add("redis", redis_argv)
        blockd_argv = [py, "-m", "blockd.main", "--endpoint", self.blockd, "--log-level", "warning"]
        blockd_argv += ["--redis-url", f"redis://127.0.0.1:{self.redis_port}/0", "--state-dir", str(root / "blockd")]
        blockd_argv += ["--keys", str(self.keys_dir)]
        self._add("blockd", blockd_argv)
        for i, endpoint in enumerate(self.executors):
            self._add(f"executor-{i}", self.executor_argv(endpoint, f"executor-{i}"), {"OMP_NUM_THREADS": "1"})
        # The tiers phase's executor of another model (its argv set then; never started before). Added now: the
        # supervisor walks the services, which must not change meanwhile.
        self._add(OTHER, [], {"OMP_NUM_THREADS": "1"})
        self.services[OTHER].retired = True
        if tiers:  # (the tiers phase alone: executor-0 starts with its tiers, executor-1 never starts)
            self.services["executor-0"].argv += ct.tier_flags(self.tier_dir)
            self.services["executor-1"].retired = True
        gateway_argv = [py, "-m", "gateway.main", "--model", str(model_dir), "--executors", ",".join(self.executors)]
        gateway_argv += ["--blockd", self.blockd, "--port", str(self.gateway_port)]
        gateway_argv += ["--executor-timeout", f"{EXECUTOR_TIMEOUT_S:g}", "--max-queue-delay", f"{MAX_QUEUE_DELAY_S:g}"]
        gateway_argv += ["--keys", str(self.keys_dir), "--api-key", self.api_key]
        self._add("gateway", [*gateway_argv, "--log-level", "warning"])
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)

    @property
    def tier_dir(self) -> Path:
        """executor-0's disk tier in the tiers phase."""
        return self.root / "kv-0"

    @property
    def shared_dir(self) -> Path:
        """The shared tier's volume in the tiers phase."""
        return self.root / "shared-kv"

    def executor_argv(self, endpoint: str, pool_id: str, model_dir: Path | None = None) -> list[str]:
        model = model_dir or self.model_dir
        argv = [sys.executable, "-m", "executor.main", "--model", str(model), "--device", "cpu"]
        argv += ["--blockd", self.blockd, "--bind", endpoint, "--pool-id", pool_id, "--kv-cache-memory", "8MiB"]
        argv += ["--keys", str(self.keys_dir)]
        return [*argv, "--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--log-level", "warning"]

    def _add(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.services[name] = Service(name, argv, self.root / f"{name}.log", env)

    def curve(self, name: str) -> ClientCurve:
        """A client's keys from the stack's key set: operator, gateway, pool-executor-N, or the intruder's."""
        return self.keys.client(name)

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def start(self, timeout_s: float) -> None:
        for service in self.services.values():
            if not service.retired:
                service.start()
        self._supervisor.start()
        self.wait_healthy(timeout_s)

    def _supervise(self) -> None:
        while not self._stop.wait(0.2):
            for service in self.services.values():
                if service.retired or service.process is None:
                    continue
                if service.process.poll() is not None:
                    service.restarts += 1
                    service.start()
                service.peak_rss = max(service.peak_rss, service.rss())

    def healthy(self) -> bool:
        try:
            body = httpx.get(f"{self.url}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        serving = {e for i, e in enumerate(self.executors) if not self.services[f"executor-{i}"].retired}
        return body.get("status") == "ok" and all(e["healthy"] for e in body["executors"] if e["endpoint"] in serving)

    def wait_healthy(self, timeout_s: float) -> float:
        started = time.monotonic()
        try:
            processes.wait_until(lambda: self.healthy() or None, timeout_s)
        except processes.NotReady:
            raise click.ClickException(
                f"the stack did not become healthy in {timeout_s:g} s; logs in {self.root}"
            ) from None
        return time.monotonic() - started

    def stop(self) -> None:
        self._stop.set()
        for name in ("gateway", OTHER, "executor-0", "executor-1", "blockd", "redis"):
            self.services[name].stop()


# ---------------------------------------------------------------------------------------------- load


@dataclass
class Tally:
    requests: int = 0
    ok: int = 0
    wrong: int = 0
    # A stream that had sent text when it broke: allowed where the gateway itself went (its kill), never where an
    # executor was killed (the stream goes on on another: request migration).
    cut_after_text: int = 0
    refused: Counter[str] = field(default_factory=Counter)  # answered with a clear error: status code
    unclear: int = 0  # an error without OpenAI's error shape
    transport: int = 0  # no answer at all (the gateway was down)
    wrong_examples: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def failed(self) -> int:
        return self.requests - self.ok - self.wrong


def _ask(
    url: str, prompt: str | list[int], max_tokens: int, stream: bool, headers: dict[str, str], timeout: float = 60
) -> tuple[str, str]:
    """(outcome, text): outcome is ok, cut (a stream broke after text), refused:<status>, unclear, transport."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    try:
        if not stream:
            response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=timeout)
            if response.status_code != 200:
                return _refusal(response), ""
            return "ok", response.json()["choices"][0]["text"]
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=timeout) as response:
            if response.status_code != 200:
                response.read()
                return _refusal(response), ""
            reader = StreamReader()
            for chunk in response.iter_bytes():
                if reader.feed(chunk):
                    break
            return reader.result()
    except (httpx.HTTPError, ValueError, KeyError):
        return "transport", ""


class StreamReader:
    """A streamed completion's server-sent events into (outcome, text) as `_ask` gives. Fed raw bytes and split on
    newlines only, as SSE says: text may hold U+2028 or U+0085, which a split into str lines (httpx's iter_lines)
    takes for line ends, cutting an event's JSON."""

    def __init__(self) -> None:
        self.text = ""
        self.outcome: str | None = None
        self._pending = b""

    def feed(self, chunk: bytes) -> bool:
        """Reads what arrived; True once the stream has ended ([DONE], or an error event)."""
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        return any(self._line(line.rstrip(b"\r").decode()) for line in lines)

    def _line(self, line: str) -> bool:
        if self.outcome is not None:
            return True
        if not line.startswith("data: "):
            return False
        data = line[6:]
        if data == "[DONE]":
            self.outcome = "ok"
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            self.outcome = "cut" if self.text else "refused:stream"
            return True
        self.text += chunk["choices"][0]["text"]
        return False

    def result(self) -> tuple[str, str]:
        return self.outcome or ("cut" if self.text else "transport"), self.text


def _refusal(response: httpx.Response) -> str:
    try:
        error = response.json()["error"]
        return f"refused:{response.status_code}" if error.get("message") else "unclear"
    except (ValueError, KeyError, TypeError):
        return "unclear"


class Load:
    def __init__(
        self,
        url: str,
        references: dict[str, str],
        max_tokens: int,
        clients: int,
        headers: dict[str, str],
        tally: Tally | None = None,  # counted on from an earlier load's
        bodies: dict[str, list[int]] | None = None,  # what is sent for each reference's name (token prompts)
    ) -> None:
        self.url = url
        self.headers = headers
        self.references = references
        self.bodies = bodies or {}
        self.max_tokens = max_tokens
        self.tally = tally if tally is not None else Tally()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)

    def record(self, prompt: str, outcome: str, text: str, reference: str) -> None:
        """One answer into the tally: right, wrong (against the clean stack's `reference`), cut or refused."""
        tally = self.tally
        with tally.lock:
            tally.requests += 1
            if outcome == "ok" and text == reference:
                tally.ok += 1
            elif outcome == "ok":
                tally.wrong += 1
                if len(tally.wrong_examples) < 5:
                    tally.wrong_examples.append(f"{prompt!r}: {text!r} != {reference!r}")
            elif outcome == "cut":
                tally.cut_after_text += 1
            elif outcome == "unclear":
                tally.unclear += 1
            elif outcome == "transport":
                tally.transport += 1
            else:
                tally.refused[outcome.split(":", 1)[1]] += 1

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        prompts = list(self.references)
        while not self._stop.is_set():
            prompt = rng.choice(prompts)
            body = self.bodies.get(prompt, prompt)
            outcome, text = _ask(self.url, body, self.max_tokens, rng.random() < 0.5, self.headers)
            self.record(prompt, outcome, text, self.references[prompt])
            if outcome == "transport":
                time.sleep(0.2)  # the gateway is down: do not spin


# ---------------------------------------------------------------------------------------------- scenarios


@dataclass
class Findings:
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    slowest_blockd_reply_s: float = 0.0
    blockd_frames: int = 0
    blockd_unanswered: int = 0
    executor_frames: int = 0
    battery: Counter[str] = field(default_factory=Counter)
    battery_unclear: int = 0
    # Attacks (requests and frames sent by a scenario, not by the load): how many, how many were refused with a
    # clear error, how many got no answer (what a peer without keys must get).
    attacks: int = 0
    refused: int = 0
    unanswered: int = 0

    def problem(self, line: str) -> None:
        self.problems.append(line)
        _log(f"  PROBLEM: {line}")


def _pause(stack: Stack, name: str, seconds: float) -> None:
    service = stack.services[name]
    service.signal(signal.SIGSTOP)
    time.sleep(seconds)
    service.signal(signal.SIGCONT)


def _kill9(stack: Stack, name: str) -> None:
    stack.services[name].signal(signal.SIGKILL)
    time.sleep(0.5)


def _kill9_mid_stream(stack: Stack, name: str, load: Load, references: dict[str, str], findings: Findings) -> None:
    """kill -9 an executor while a greedy stream it serves has shown text (the gateway's x-pagedkv-executor says
    which serves it): the stream must go on on the other executor (request migration) and end whole and right,
    as the load's streams cut by the kill must. Each try salts its cache (`cache_salt`), so no executor holds its
    prefix and the router spreads the tries over both."""
    prompts = sorted(references, key=lambda p: -len(references[p]))[:3]  # the longest answers: time for the kill
    for attempt in range(40):
        prompt = prompts[attempt % len(prompts)]
        body = {"prompt": prompt, "max_tokens": LOAD_MAX_TOKENS, "temperature": 0, "stream": True}
        body["cache_salt"] = secrets.token_hex(8)
        url, headers = f"{stack.url}/v1/completions", stack.auth_headers
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as response:
            if response.status_code != 200 or response.headers.get("x-pagedkv-executor") != name:
                continue
            reader, chunks = StreamReader(), response.iter_bytes()
            ended = False
            for chunk in chunks:
                ended = reader.feed(chunk)
                if ended or reader.text:
                    break
            if ended or not reader.text:
                continue  # over before the kill: try again
            stack.services[name].signal(signal.SIGKILL)
            for chunk in chunks:
                if reader.feed(chunk):
                    break
        outcome, text = reader.result()
        load.record(prompt, outcome, text, references[prompt])
        right = "right" if outcome == "ok" and text == references[prompt] else f"{outcome}, not right"
        findings.notes.append(
            f"kill -9 {name} mid-stream: the stream went on ({right}); the gateway counts "
            f"{_gateway_metric(stack, 'pagedkv_gateway_migrations_total'):g} migrations"
        )
        time.sleep(0.5)
        return
    raise RuntimeError(f"no stream was served by {name} in 40 tries: the kill mid-stream did not run")


def _gateway_metric(stack: Stack, name: str) -> float:
    """An unlabelled metric of the gateway's /metrics (0 if absent: the gateway was restarted since)."""
    text = httpx.get(f"{stack.url}/metrics", headers=stack.auth_headers, timeout=10).text
    return next((float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


def _worker_rank(pid: int) -> int | None:
    """The worker rank (executor.parallel_worker) that the group's rank 0 at `pid` started, if any."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    for child in map(int, children):
        with contextlib.suppress(OSError):
            if b"executor.parallel_worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
    return None


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _rank_fault(stack: Stack, findings: Findings, sig: signal.Signals) -> None:
    """SIGKILL or SIGSTOP executor-1's worker rank: the whole group must stop (rank 0 exits 70; the supervisor
    starts it again, which registers the pool under a new epoch), its pool's blocks come back by the lease, the
    gateway sends elsewhere meanwhile, and the rank does not outlive its group."""
    service = stack.services["executor-1"]
    process = service.process
    worker = _worker_rank(service.pid) if process is not None else None
    if process is None or worker is None:
        findings.problem("executor-1 has no worker rank to fault (is it a tensor-parallel group?)")
        return
    what = "killed" if sig == signal.SIGKILL else "paused"
    os.kill(worker, sig)
    code: int | None = None
    try:
        code = process.wait(timeout=4 * TP_TIMEOUT_S + 10)
    except subprocess.TimeoutExpired:
        findings.problem(f"executor-1 kept serving {4 * TP_TIMEOUT_S + 10:g} s after its rank 1 was {what}")
    finally:
        if sig == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
    findings.notes.append(f"rank 1 of executor-1 {what}: the group exited with {code}")
    if code is not None and code != EX_GROUP_FAILED:
        findings.problem(f"executor-1 exited with {code} after its rank 1 was {what}, not {EX_GROUP_FAILED}")
    deadline = time.monotonic() + 10
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not _gone(worker):
        findings.problem(f"rank 1 (pid {worker}) outlived its group by 10 s")


def _duplicate_pool(stack: Stack, findings: Findings) -> None:
    argv = stack.executor_argv(f"tcp://127.0.0.1:{free_port()}", "executor-0")
    log = stack.root / "duplicate.log"
    process = processes.start(argv, log, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        code = process.wait(timeout=120)
        findings.notes.append(f"duplicated pool id: the second executor exited with {code}")
        if code == 0:
            findings.problem("the executor with a duplicated --pool-id exited 0")
    except subprocess.TimeoutExpired:
        findings.problem("an executor with a duplicated --pool-id kept running for 120 s")
    finally:
        processes.stop([process])


def _blockd_call(socket: zmq.Socket, frame: bytes, timeout_s: float = 5.0) -> tuple[float, bytes | None]:
    started = time.monotonic()
    socket.send(frame)
    if socket.poll(int(timeout_s * 1000)):
        return time.monotonic() - started, socket.recv()
    return time.monotonic() - started, None


def _dealer(context: zmq.Context, endpoint: str, curve: ClientCurve | None) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(socket)
    socket.connect(endpoint)
    return socket


def _blockd_refusal(reply: bytes | None) -> str | None:
    """The error code of a blockd reply that refused (None: no reply, not a refusal, or no clear error)."""
    if reply is None:
        return None
    try:
        decoded = msgspec.msgpack.decode(reply)
    except msgspec.DecodeError:
        return None
    if not isinstance(decoded, dict) or decoded.get("ok"):
        return None
    error = decoded.get("error")
    if isinstance(error, dict) and error.get("code") and error.get("message"):
        return str(error["code"])
    return None


def _cross_pool(stack: Stack, findings: Findings) -> None:
    """Changes to executor-0's pool from a foreign DEALER with a guessed epoch, holding executor-1's key (refused:
    forbidden) or an any-pool executor key (refused: stale_epoch, or the pool is held by a live executor)."""
    context = zmq.Context()
    try:
        attempts: list[bp.Request] = [
            bp.Step(v=bp.PROTOCOL_VERSION, id=1, pool_id="executor-0", epoch=12345, ops=[bp.Free(seq_id="victim")]),
            bp.Step(
                v=bp.PROTOCOL_VERSION,
                id=2,
                pool_id="executor-0",
                epoch=0,
                ops=[
                    bp.Admit(seq_id="planted", tokens=pack_tokens(range(64))),
                    bp.Commit(seq_id="planted", num_computed_tokens=64),
                ],
            ),
            bp.Unregister(v=bp.PROTOCOL_VERSION, id=3, pool_id="executor-0", epoch=-1),
            bp.Heartbeat(v=bp.PROTOCOL_VERSION, id=4, pool_id="executor-0", epoch=2**62),
            bp.ResetPrefixCache(v=bp.PROTOCOL_VERSION, id=5, pool_id="executor-0", epoch=7),
            bp.Register(
                v=bp.PROTOCOL_VERSION, id=6, pool_id="executor-0", num_blocks=64, block_size=16, model_id="m", epoch=99
            ),
        ]
        for key in ("pool-executor-1", INTRUDER):
            socket = _dealer(context, stack.blockd, stack.curve(key))
            try:
                for request in attempts:
                    elapsed, reply = _blockd_call(socket, bp.encode(request))
                    findings.slowest_blockd_reply_s = max(findings.slowest_blockd_reply_s, elapsed)
                    findings.attacks += 1
                    code = _blockd_refusal(reply)
                    if code is None:
                        findings.unanswered += reply is None
                        findings.problem(f"cross-pool {type(request).__name__} ({key}) was not refused: {reply!r}")
                    else:
                        findings.refused += 1
                        findings.battery[f"cross-pool {key} {code}"] += 1
                        if key != INTRUDER and code != "forbidden":
                            findings.problem(f"cross-pool {type(request).__name__} with {key}'s key: {code}")
            finally:
                socket.close()
    finally:
        context.term()


PLANTED = "keyless-planted"  # the sequence a peer without keys tries to admit into executor-0's pool


def _blockd_snapshot(stack: Stack) -> tuple[Any, ...]:
    """What a peer without keys must not change: the pools (ids, epochs' fingerprints, sizes), dormant pools, and
    the sequence it tried to plant (absent)."""
    with BlockdClient(stack.blockd, timeout_s=5, curve=stack.curve("operator")) as client:
        pools = sorted((p.pool_id, p.epoch_fingerprint, p.num_blocks, p.block_size) for p in client.pools().pools)
        stats = client.stats()
        try:
            planted: Any = client.sequence(PLANTED, "executor-0")
        except BlockdError as exc:
            planted = f"absent ({exc.code})"
        return pools, stats.totals.pools, stats.totals.blocks_total, sorted(stats.dormant_pools), planted


def _keyless_blockd_frames(rng: random.Random, count: int) -> list[bytes]:
    tokens = pack_tokens(range(64))
    requests: list[bp.Request] = [
        bp.Step(
            v=bp.PROTOCOL_VERSION, id=1, pool_id="executor-0", epoch=0, ops=[bp.Admit(seq_id=PLANTED, tokens=tokens)]
        ),
        bp.Step(
            v=bp.PROTOCOL_VERSION,
            id=2,
            pool_id="executor-0",
            epoch=0,
            ops=[bp.Commit(seq_id=PLANTED, num_computed_tokens=64)],
        ),
        bp.Step(v=bp.PROTOCOL_VERSION, id=3, pool_id="executor-1", epoch=0, ops=[bp.Free(seq_id="victim")]),
        bp.Register(
            v=bp.PROTOCOL_VERSION, id=4, pool_id="keyless-pool", num_blocks=64, block_size=16, model_id="m", epoch=1
        ),
        bp.Unregister(v=bp.PROTOCOL_VERSION, id=5, pool_id="executor-1", epoch=0),
        bp.ResetPrefixCache(v=bp.PROTOCOL_VERSION, id=6, pool_id="executor-0"),
        bp.Lookup(v=bp.PROTOCOL_VERSION, id=7, tokens=tokens),
        bp.Stats(v=bp.PROTOCOL_VERSION, id=8),
        bp.Pools(v=bp.PROTOCOL_VERSION, id=9),
        bp.Check(v=bp.PROTOCOL_VERSION, id=10),
    ]
    frames = [bp.encode(r) for r in requests]
    return frames + [_bad_blockd_frame(rng, i) for i in range(count) if i % 80 != 5]  # no 4 MB lookups here


def _keyless_executor_frames(rng: random.Random, count: int) -> list[bytes]:
    messages: list[ep.Message] = [
        ep.Submit(request_id="keyless-0", prompt=pack_tokens(range(10)), params=SamplingParams(max_tokens=4)),
        ep.Abort(request_id="keyless-0"),
        ep.GetLoad(),
        ep.GetInfo(),
    ]
    return [ep.encode(m) for m in messages] + [_bad_executor_frame(rng, i) for i in range(count)]


def _keyless_peers(stack: Stack, findings: Findings, frames: int, wait_s: float) -> None:
    """Peers without keys (no CURVE at all), with a stranger's keypair (zmq.curve_keypair()), and with a key of a
    role the service does not admit (an executor's key at an executor) send valid-looking requests and malformed
    frames to blockd and to each executor: the handshake never completes, so no answer comes and nothing changes.
    Then keys of the wrong role, which do complete it: a gateway's and an operator's acting as an executor at
    blockd, an operator's submitting to an executor (refused: forbidden). And HTTP clients without or with a wrong
    API key (401)."""
    rng = random.Random(13)
    before = _blockd_snapshot(stack)
    server = stack.keys.client("gateway").server
    stranger_public, stranger_secret = zmq.curve_keypair()
    strangers: dict[str, ClientCurve | None] = {
        "no keys": None,
        "a stranger's keys": ClientCurve(stranger_public, stranger_secret, server),
    }
    targets = [("blockd", stack.blockd, _keyless_blockd_frames(rng, frames))]
    targets += [(f"executor-{i}", e, _keyless_executor_frames(rng, frames)) for i, e in enumerate(stack.executors)]
    context = zmq.Context()
    sockets: dict[zmq.Socket, str] = {}
    try:
        for target, endpoint, payload in targets:
            peers = dict(strangers)
            if target != "blockd":
                peers["pool-executor-0's key"] = stack.curve("pool-executor-0")  # executors admit no executor key
            for who, curve in peers.items():
                socket = _dealer(context, endpoint, curve)
                socket.setsockopt(zmq.SNDHWM, len(payload) + 10)
                sockets[socket] = f"{who} -> {target}"
                for frame in payload:
                    findings.attacks += 1
                    with contextlib.suppress(zmq.Again):  # not even queued: unanswered all the same
                        socket.send(frame, zmq.NOBLOCK)
        poller = zmq.Poller()
        for socket in sockets:
            poller.register(socket, zmq.POLLIN)
        answered: Counter[str] = Counter()
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            for socket, _ in poller.poll(int(left * 1000) + 1):
                while socket.poll(0):
                    socket.recv()
                    answered[sockets[socket]] += 1
        sent = sum(len(p) for _, _, p in targets) * len(strangers) + sum(len(p) for _, _, p in targets[1:])
        findings.unanswered += sent - sum(answered.values())
        for peer, count in answered.items():
            findings.problem(f"a peer without valid keys got {count} answers: {peer}")
        findings.notes.append(
            f"peers without keys: {sent} frames to blockd and the executors, {sum(answered.values())} answered"
        )

        def forbidden(who: str, socket: zmq.Socket, frame: bytes, executor: bool) -> None:
            findings.attacks += 1
            _, reply = _blockd_call(socket, frame)
            if executor:
                message = ep.decode_outbound(reply) if reply is not None else None
                code = message.code if isinstance(message, ep.Rejected) and message.message else None
            else:
                code = _blockd_refusal(reply)
            findings.unanswered += reply is None
            if code == "forbidden":
                findings.refused += 1
                findings.battery[f"{who}: forbidden"] += 1
            else:
                findings.problem(f"{who}: not refused as forbidden ({code}, {reply!r})")

        as_executor: list[bp.Request] = [
            bp.Step(
                v=bp.PROTOCOL_VERSION,
                id=1,
                pool_id="executor-0",
                epoch=0,
                ops=[bp.Admit(seq_id=PLANTED, tokens=pack_tokens([1]))],
            ),
            bp.Register(
                v=bp.PROTOCOL_VERSION, id=2, pool_id="executor-0", num_blocks=64, block_size=16, model_id="m", epoch=5
            ),
            bp.Heartbeat(v=bp.PROTOCOL_VERSION, id=3, pool_id="executor-0", epoch=0),
            bp.Unregister(v=bp.PROTOCOL_VERSION, id=4, pool_id="executor-1", epoch=0),
            bp.ResetPrefixCache(v=bp.PROTOCOL_VERSION, id=5, pool_id="executor-0", epoch=0),
        ]
        for key in ("gateway", "operator"):
            socket = _dealer(context, stack.blockd, stack.curve(key))
            sockets[socket] = key
            for request in as_executor:
                if key == "operator" and isinstance(request, bp.ResetPrefixCache):
                    continue  # an operator may reset a pool's prefix cache (blockd-cli); the epoch still fences it
                forbidden(f"{key} key {type(request).__name__} at blockd", socket, bp.encode(request), False)
        for i, endpoint in enumerate(stack.executors):
            socket = _dealer(context, endpoint, stack.curve("operator"))
            sockets[socket] = "operator"
            submit = ep.Submit(request_id=f"operator-{i}", prompt=pack_tokens(range(10)), params=SamplingParams())
            forbidden(f"operator key submit at executor-{i}", socket, ep.encode(submit), True)
    finally:
        for socket in sockets:
            socket.close()
        context.term()

    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    for who, headers in (("no API key", {}), ("a wrong API key", {"Authorization": "Bearer not-the-key"})):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            findings.attacks += 1
            try:
                response = httpx.request(
                    method, f"{stack.url}{path}", json=body if method == "POST" else None, headers=headers, timeout=30
                )
            except httpx.HTTPError as exc:
                findings.problem(f"HTTP with {who}: no answer ({exc!r})")
                continue
            if _refusal(response) == "refused:401":
                findings.refused += 1
                findings.battery[f"HTTP {who} -> 401"] += 1
            else:
                findings.problem(f"HTTP {method} {path} with {who}: {response.status_code} {response.text[:200]!r}")

    after = _blockd_snapshot(stack)
    if after != before:
        findings.problem(f"blockd changed under peers without keys: {before} -> {after}")
    if not str(after[-1]).startswith("absent"):
        findings.problem(f"the sequence a peer without keys tried to plant exists: {after[-1]}")


def _bad_blockd_frame(rng: random.Random, i: int) -> bytes:
    kind = i % 8
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 300))
    if kind == 1:
        valid = bp.encode(bp.Lookup(v=bp.PROTOCOL_VERSION, id=i, tokens=pack_tokens(range(rng.randrange(1, 200)))))
        return valid[: rng.randrange(0, len(valid))]
    if kind == 2:  # wrong shapes
        shapes: list[Any] = [
            [1, 2, 3],
            {"op": "step", "v": 1, "id": i, "pool_id": "executor-0", "epoch": 1, "ops": "nope"},
            {"op": "lookup", "v": "1", "id": i, "tokens": 5},
            {"op": "register", "v": 1, "id": i},
            {"op": "no_such_op", "v": 1, "id": i},
            "just a string",
            {"op": None},
        ]
        return msgspec.msgpack.encode(rng.choice(shapes))
    if kind == 3:  # huge and negative numbers
        number = rng.choice([2**64 - 1, -(2**63), -1, 2**63, 10**18])
        return msgspec.msgpack.encode(
            {"op": rng.choice(["stats", "seq", "lookup", "heartbeat"]), "v": 1, "id": number, "pool_id": "x"}
            | {"epoch": number, "seq_id": "s", "tokens": b""}
        )
    if kind == 4:  # oversized registers
        return msgspec.msgpack.encode(
            {
                "op": "register",
                "v": 1,
                "id": i,
                "pool_id": f"attacker-{i}",
                "num_blocks": rng.choice([10**7, 2**31 - 1, 2**40, -5]),
                "block_size": rng.choice([1, 0, 4096, 3]),
                "model_id": "m",
                "epoch": i,
            }
        )
    if kind == 5 and i % 80 == 5:  # an oversized lookup (a million tokens), now and then
        return bp.encode(bp.Lookup(v=bp.PROTOCOL_VERSION, id=i, tokens=rng.randbytes(4_000_000)))
    if kind == 6:
        return bp.encode(bp.Lookup(v=2, id=i, tokens=b"\x01\x00\x00\x00"))
    return msgspec.msgpack.encode({"op": "step", "v": 1, "id": i, "pool_id": "executor-1", "epoch": i, "ops": []})


def _malformed_blockd(stack: Stack, findings: Findings, count: int) -> None:
    rng = random.Random(11)
    context = zmq.Context()
    curve = stack.curve(INTRUDER)  # a key that passes the handshake, so every frame reaches the decoder
    socket = _dealer(context, stack.blockd, curve)
    try:
        for i in range(count):
            elapsed, reply = _blockd_call(socket, _bad_blockd_frame(rng, i), timeout_s=3)
            findings.blockd_frames += 1
            findings.attacks += 1
            findings.refused += _blockd_refusal(reply) is not None
            findings.slowest_blockd_reply_s = max(findings.slowest_blockd_reply_s, elapsed)
            if reply is None:
                findings.blockd_unanswered += 1
                findings.unanswered += 1
                socket.close()
                socket = _dealer(context, stack.blockd, curve)  # a frame over the limit cuts the connection
    finally:
        socket.close()
        context.term()
    if findings.blockd_unanswered:
        findings.notes.append(f"blockd left {findings.blockd_unanswered} of {count} malformed frames unanswered")


def _bad_executor_frame(rng: random.Random, i: int) -> bytes:
    kind = i % 6
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 300))
    if kind == 1:
        valid = ep.encode(ep.Submit(request_id=f"x{i}", prompt=pack_tokens(range(10)), params=SamplingParams()))
        return valid[: rng.randrange(0, len(valid))]
    if kind == 2:
        return msgspec.msgpack.encode(rng.choice([[1], {"type": "submit"}, {"type": "abort", "request_id": 5}, 7]))
    if kind == 3:  # prompts past the context, token ids past the vocabulary, absurd sampling
        tokens = [rng.choice([0, 2**32 - 1, 511]) for _ in range(rng.choice([1, 600, 5000]))]
        return ep.encode(ep.Submit(request_id=f"y{i}", prompt=pack_tokens(tokens), params=SamplingParams(max_tokens=1)))
    if kind == 4:
        return ep.encode(ep.Abort(request_id=f"not-mine-{i}"))
    return msgspec.msgpack.encode({"type": "submit", "request_id": "z", "prompt": b"\x00\x01\x02", "params": {}})


def _malformed_executors(stack: Stack, findings: Findings, count: int) -> None:
    rng = random.Random(12)
    context = zmq.Context()
    try:
        for endpoint in stack.executors:
            socket = _dealer(context, endpoint, stack.curve("gateway"))  # the key that may submit

            def drain(socket: zmq.Socket, wait_ms: int) -> None:
                while socket.poll(wait_ms):
                    if isinstance(ep.decode_outbound(socket.recv()), ep.Rejected):
                        findings.refused += 1

            for i in range(count):
                socket.send(_bad_executor_frame(rng, i))
                findings.executor_frames += 1
                findings.attacks += 1
                if i % 200 == 199:  # read what came back, so neither side's queue fills
                    drain(socket, 50)
            drain(socket, 200)
            socket.close()
    finally:
        context.term()


def _gateway_battery(stack: Stack, findings: Findings, prompts: int, disconnects: int) -> None:
    url = stack.url
    auth = stack.auth_headers

    def check(name: str, response: httpx.Response, expected: set[int]) -> None:
        outcome = _refusal(response)
        findings.battery[f"{name} -> {response.status_code}"] += 1
        findings.attacks += 1
        if response.status_code not in expected or outcome == "unclear":
            findings.battery_unclear += 1
            findings.problem(f"gateway battery {name}: {response.status_code} {response.text[:200]!r}")
        else:
            findings.refused += 1

    def post(path: str, content: bytes, content_type: str = "application/json") -> httpx.Response:
        headers = {"Content-Type": content_type, **auth}
        return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=120)

    try:
        check("10 MB body", post("/v1/completions", b'{"prompt": "' + b"a" * 10_000_000 + b'"}'), {413})
        check("100k-deep JSON", post("/v1/completions", b"[" * 100_000 + b"]" * 100_000), {400})
        check("text/plain", post("/v1/completions", b'{"prompt": "hi"}', "text/plain"), {415})
        for wrong in ({"prompt": 5}, {"prompt": "x", "max_tokens": "many"}, {"messages": "hi"}, {"prompt": [[-1]]}):
            path = "/v1/chat/completions" if "messages" in wrong else "/v1/completions"
            check("wrong types", httpx.post(f"{url}{path}", json=wrong, headers=auth, timeout=30), {400})
        started = time.monotonic()
        many = httpx.post(f"{url}/v1/completions", json={"prompt": ["hi"] * prompts}, headers=auth, timeout=120)
        check(f"{prompts} prompts", many, {400, 429})
        findings.notes.append(f"{prompts} prompts answered {many.status_code} in {time.monotonic() - started:.2f} s")
    except httpx.HTTPError as exc:
        findings.problem(f"gateway battery: no answer ({exc!r})")

    def disconnecting(i: int) -> None:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 64, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=60) as response:
                for _ in response.iter_lines():
                    break  # gone after the first chunk
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=disconnecting, args=(i,)) for i in range(disconnects)]
    for batch in range(0, len(threads), 50):
        for thread in threads[batch : batch + 50]:
            thread.start()
        for thread in threads[batch : batch + 50]:
            thread.join(timeout=120)
    findings.battery[f"clients gone mid-stream x{disconnects}"] += 1
    findings.attacks += disconnects


# ---------------------------------------------------------------------------------------------- load held

SATURATING_CLIENTS = 16  # both executors' --max-num-seqs: every slot of the stack busy
OVERLOAD_FACTOR = 3.0
STALLED_STEP = 3  # the step of the restarted executor-0 that is stalled (one with requests in it)
LOAD_CLIENT_TIMEOUT_S = 300.0  # an accepted request is never failed for being slow: its client waits


@dataclass
class Outcomes:
    """What the clients of a load scenario got. A 429 is a refusal before the request started, allowed and counted
    apart; any other outcome but a right answer (an error status, a stream cut or ended by an error, no answer) is
    a failed request, which the scenario must not have."""

    requests: int = 0
    ok: int = 0
    wrong: int = 0
    refused_429: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    wrong_examples: list[str] = field(default_factory=list)

    def add(self, prompt: str, outcome: str, text: str, reference: str) -> None:
        self.requests += 1
        if outcome == "ok" and text == reference:
            self.ok += 1
        elif outcome == "ok":
            self.wrong += 1
            if len(self.wrong_examples) < 5:
                self.wrong_examples.append(f"{prompt!r}: {text!r} != {reference!r}")
        elif outcome == "refused:429":
            self.refused_429 += 1
        else:
            self.failed[outcome] += 1


async def _ask_async(client: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> tuple[str, str]:
    """`_ask` on an event loop, so that one thread can keep hundreds of requests in flight."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    try:
        if not stream:
            response = await client.post("/v1/completions", json=body)
            if response.status_code != 200:
                return _refusal(response), ""
            return "ok", response.json()["choices"][0]["text"]
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return _refusal(response), ""
            reader = StreamReader()
            async for chunk in response.aiter_bytes():
                if reader.feed(chunk):
                    break
            return reader.result()
    except (httpx.HTTPError, ValueError, KeyError):
        return "transport", ""


class LoadClients:
    """Greedy requests for the reference prompts from one event loop: closed-loop clients (each asks again once
    answered) or open-loop Poisson arrivals (each request on its own, however many are in flight)."""

    def __init__(self, stack: Stack, references: dict[str, str], max_tokens: int, seed: int) -> None:
        self.url = stack.url
        self.headers = stack.auth_headers
        self.references = references
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.outcomes = Outcomes()

    def _client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=LOAD_CLIENT_TIMEOUT_S, limits=limits)

    async def _one(self, client: httpx.AsyncClient) -> None:
        prompt = self.rng.choice(list(self.references))
        outcome, text = await _ask_async(client, prompt, self.max_tokens, self.rng.random() < 0.5)
        self.outcomes.add(prompt, outcome, text, self.references[prompt])

    def closed_loop(self, clients: int, seconds: float) -> float:
        """`clients` clients for `seconds`; the right answers per second they got (the stack's capacity when the
        clients fill every slot)."""

        async def run() -> float:
            loop = asyncio.get_running_loop()
            started = loop.time()
            ok_before = self.outcomes.ok

            async def client_loop(client: httpx.AsyncClient) -> None:
                while loop.time() - started < seconds:
                    await self._one(client)

            async with self._client() as client:
                await asyncio.gather(*(client_loop(client) for _ in range(clients)))
            return (self.outcomes.ok - ok_before) / max(loop.time() - started, 1e-9)

        return asyncio.run(run())

    def open_loop(self, rate: float, seconds: float) -> int:
        """Poisson arrivals at `rate` per second for `seconds`, then every request answered; how many were sent."""

        async def run() -> int:
            loop = asyncio.get_running_loop()
            started = loop.time()
            tasks: list[asyncio.Task[None]] = []
            async with self._client() as client:
                due = started
                while due - started < seconds:
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    tasks.append(asyncio.create_task(self._one(client)))
                    due += self.rng.expovariate(rate)
                await asyncio.gather(*tasks)
            return len(tasks)

        return asyncio.run(run())


@dataclass
class LoadScenario:
    name: str
    seconds: float
    load: str  # what the clients did
    outcomes: Outcomes
    leaked_blocks: int
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what the scenario itself saw go wrong

    def row(self) -> list[str]:
        o = self.outcomes
        failed = sum(o.failed.values())
        return [
            self.name,
            f"{self.seconds:.1f}",
            self.load,
            str(o.requests),
            str(o.requests - o.refused_429),
            str(failed),
            str(o.refused_429),
            str(o.wrong),
            str(self.leaked_blocks),
        ]

    def as_json(self) -> dict[str, Any]:
        o = self.outcomes
        return {
            "seconds": round(self.seconds, 1),
            "load": self.load,
            "requests": o.requests,
            "accepted": o.requests - o.refused_429,
            "ok": o.ok,
            "accepted_failed": sum(o.failed.values()),
            "failed_by_outcome": dict(o.failed),
            "refused_429": o.refused_429,
            "wrong_outputs": o.wrong,
            "wrong_examples": o.wrong_examples,
            "leaked_blocks": self.leaked_blocks,
            "notes": self.notes,
        }

    def judge(self, findings: Findings) -> None:
        o = self.outcomes
        if o.failed:
            findings.problem(f"{self.name}: {sum(o.failed.values())} requests failed ({dict(o.failed)})")
        if o.wrong:
            findings.problem(f"{self.name}: {o.wrong} wrong outputs, e.g. {o.wrong_examples[0]}")
        if self.leaked_blocks:
            findings.problem(f"{self.name}: {self.leaked_blocks} blocks still held once the load drained")
        if not o.ok:
            findings.problem(f"{self.name}: no request was answered")
        for problem in self.problems:
            findings.problem(f"{self.name}: {problem}")


class GatewayWatch:
    """The gateway's /health read twice a second from a thread of its own: the most requests it held in flight at
    once, and the longest wait it estimated for a new request (queued tokens over measured tokens per second, the
    shortest over its executors: what its door compares with --max-queue-delay)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.peak_in_flight = 0
        self.peak_wait_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> GatewayWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            try:
                executors = httpx.get(f"{self.url}/health", timeout=2).json()["executors"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue
            self.peak_in_flight = max(self.peak_in_flight, sum(e["in_flight"] or 0 for e in executors))
            waits = [e["queued_tokens"] / e["tokens_per_s"] for e in executors if e.get("tokens_per_s")]
            if waits and len(waits) == len(executors):
                self.peak_wait_s = max(self.peak_wait_s, min(waits))


def _overload(stack: Stack, references: dict[str, str], max_tokens: int, seconds: float) -> LoadScenario:
    """Capacity first (right answers per second with every slot busy), then Poisson arrivals at 3x it for
    `seconds`: the queue grows past --max-queue-delay, so new requests must get 429 at the door, and every one
    let in must complete, right."""
    started = time.monotonic()
    clients = LoadClients(stack, references, max_tokens, seed=26)
    capacity = clients.closed_loop(SATURATING_CLIENTS, max(3.0, min(10.0, seconds / 4)))
    rate = OVERLOAD_FACTOR * max(capacity, 0.5)
    with GatewayWatch(stack.url) as watch:
        sent = clients.open_loop(rate, seconds)
    leaked, _ = _drained(stack.blockd, stack.curve("operator"), timeout_s=60)
    load = f"{rate:.1f} req/s ({OVERLOAD_FACTOR:g}x {capacity:.1f})"
    scenario = LoadScenario(f"overload {OVERLOAD_FACTOR:g}x for {seconds:g} s", 0.0, load, clients.outcomes, leaked)
    scenario.notes.append(
        f"overload: capacity {capacity:.1f} req/s with {SATURATING_CLIENTS} clients, then {sent} arrivals at "
        f"{rate:.1f} req/s for {seconds:g} s; at the gateway at most {watch.peak_in_flight} in flight, an estimated "
        f"wait of at most {watch.peak_wait_s:.1f} s (--max-queue-delay {MAX_QUEUE_DELAY_S:g})"
    )
    scenario.seconds = time.monotonic() - started
    return scenario


def _log_since(path: Path, offset: int) -> str:
    with open(path, "rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _restart(stack: Stack, name: str, argv: list[str]) -> None:
    """`name` stopped and started again by the supervisor with `argv`, back in the gateway's rotation."""
    service = stack.services[name]
    old = service.process
    assert old is not None
    service.argv = argv
    service.signal(signal.SIGTERM)
    processes.wait_until(lambda: (old.poll() is not None and service.process is not old) or None, 120)
    endpoint = stack.executors[int(name.rsplit("-", 1)[1])]

    def gateway_saw_it_go() -> bool | None:
        try:
            executors = httpx.get(f"{stack.url}/health", timeout=2).json()["executors"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return any(e["endpoint"] == endpoint and not e["healthy"] for e in executors) or None

    with contextlib.suppress(processes.NotReady):  # it may be back already: then it was seen going
        processes.wait_until(gateway_saw_it_go, 30)
    stack.wait_healthy(180)


def _stalled_step(stack: Stack, references: dict[str, str], max_tokens: int) -> LoadScenario:
    """executor-0 restarted with one step stalled for 2x the gateway's --executor-timeout, under every slot busy:
    its liveness beacon must keep it in rotation, and no stream on it may fail."""
    started = time.monotonic()
    stall_s = 2 * EXECUTOR_TIMEOUT_S
    service = stack.services["executor-0"]
    plain = service.argv
    executor_mark = service.log.stat().st_size
    _restart(stack, "executor-0", [*plain, "--fault-stall-step", f"{STALLED_STEP}:{stall_s:g}"])
    service.argv = plain  # armed for this start only
    gateway_log = stack.services["gateway"].log
    gateway_mark = gateway_log.stat().st_size
    clients = LoadClients(stack, references, max_tokens, seed=27)
    clients.closed_loop(SATURATING_CLIENTS, stall_s + 6.0)
    leaked, _ = _drained(stack.blockd, stack.curve("operator"), timeout_s=60)
    load = f"{SATURATING_CLIENTS} clients, step {STALLED_STEP} +{stall_s:g} s"
    scenario = LoadScenario(f"step stalled {stall_s:g} s (2x timeout)", 0.0, load, clients.outcomes, leaked)
    stalled = "fault_step_stalled" in _log_since(service.log, executor_mark)
    lost = _log_since(gateway_log, gateway_mark).count("executor_out_of_rotation")
    scenario.notes.append(
        f"stalled step: executor-0's step {STALLED_STEP} {'stalled' if stalled else 'NEVER stalled'} for "
        f"{stall_s:g} s (--executor-timeout {EXECUTOR_TIMEOUT_S:g}); the gateway took an executor out of rotation "
        f"{lost} times meanwhile"
    )
    if not stalled:
        scenario.problems.append(f"executor-0 never ran its step {STALLED_STEP} (no stall to survive)")
    if lost:
        scenario.problems.append(f"the gateway took an executor out of rotation {lost} times")
    scenario.seconds = time.monotonic() - started
    return scenario


# ---------------------------------------------------------------------------------------------- tiers


@dataclass
class TierScenario:
    """One tiers scenario: the load's requests and wrong outputs meanwhile, and what was injected and counted."""

    name: str
    seconds: float = 0.0
    requests: int = 0
    wrong: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def row(self) -> list[str]:
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items())
        return [self.name, f"{self.seconds:.1f}", str(self.requests), str(self.wrong), counts]

    def as_json(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 1), "requests": self.requests, "wrong": self.wrong, **self.counts}


class TiersPhase:
    """executor-0 with host and disk tiers, alone behind the gateway, under greedy load of token prompts whose
    blocks it demotes to disk and loads back; each scenario injects a fault of the disk tier and reads what the
    executor counted (`LoadReport.tiers`). A count short of what was injected is a problem."""

    def __init__(self, stack: Stack, findings: Findings, tally: Tally, clients: int, max_tokens: int) -> None:
        self.stack = stack
        self.findings = findings
        self.tally = tally
        self.clients = clients
        self.max_tokens = max_tokens
        self.disk = stack.tier_dir
        self.endpoint = stack.executors[0]
        self.curve = stack.curve("gateway")
        vocab = MODEL["vocab_size"]
        self.prompts = ct.token_prompts("tier", 10, seed=22, vocab_size=vocab)  # the load's: 40 blocks
        self.fresh = ct.token_prompts("fresh", 8, seed=23, vocab_size=vocab)  # asked to make blocks to write
        self.bodies = {**self.prompts, **self.fresh}
        self.references: dict[str, str] = {}
        self.model_id = ""
        self.load: Load | None = None

    # ------------------------------------------------------------------------------------ helpers

    def report(self, endpoint: str | None = None, timeout_s: float = 60) -> dict[str, int]:
        endpoint = endpoint or self.endpoint
        report = processes.wait_until(lambda: ct.tier_report(endpoint, self.curve), timeout_s)
        return report

    def wait_count(self, key: str, at_least: int, timeout_s: float = 30, endpoint: str | None = None) -> dict[str, int]:
        """The executor's tier report once `key` reached `at_least` (or the last one, after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            report = self.report(endpoint)
            if report.get(key, 0) >= at_least or time.monotonic() > deadline:
                return report
            time.sleep(0.2)

    def ask(self, name: str) -> None:
        """One greedy request (not streamed) for `name`, held to its reference like the load's."""
        assert self.load is not None
        outcome, text = _ask(self.stack.url, self.bodies[name], self.max_tokens, False, self.stack.auth_headers)
        self.load.record(name, outcome, text, self.references[name])

    def off_device(self, count: int, timeout_s: float = 15, *, shared: bool = False) -> list[str]:
        """Up to `count` load prompts whose first block is on disk (or on the shared volume) and not on
        executor-0's device (blockd's lookup's device hits): their next admission loads that block from its
        file."""
        deadline = time.monotonic() + timeout_s
        found: list[str] = []
        with BlockdClient(self.stack.blockd, timeout_s=5, curve=self.curve) as client:
            while len(found) < count and time.monotonic() < deadline:
                for name, tokens in self.prompts.items():
                    first = self.first_file(tokens, shared=shared)
                    if name in found or first is None or not first.exists():
                        continue
                    if client.lookup(tokens).get("executor-0", 0) == 0:
                        found.append(name)
                        if len(found) == count:
                            break
                time.sleep(0.1)
        return found

    def first_file(self, tokens: list[int], *, shared: bool = False) -> Path | None:
        """The file of a prompt's first block on disk, or on the shared volume."""
        first = ct.block_hashes(self.model_id, tokens)[0]
        return ct.shared_file(self.stack.shared_dir, first) if shared else ct.block_file(self.disk, first)

    def check(self, scenario: TierScenario, what: str, ok: bool) -> None:
        if not ok:
            self.findings.problem(f"tiers, {scenario.name}: {what}")

    # ------------------------------------------------------------------------------------ the phase

    def run(self) -> list[TierScenario]:
        stack = self.stack
        executor = stack.services["executor-0"]
        plain, log = list(executor.argv), executor.log
        alone = "--disk-kv-dir" in executor.argv  # the stack started for this phase alone
        if not alone:
            stack.services["executor-1"].stop()  # retired: the gateway sends everything to executor-0
            _restart(stack, "executor-0", [*executor.argv, *ct.tier_flags(self.disk)])
        with BlockdClient(stack.blockd, timeout_s=5, curve=stack.curve("operator")) as client:
            self.model_id = next(p.model_id for p in client.pools().pools if p.pool_id == "executor-0")
        for name, tokens in self.bodies.items():
            outcome, text = _ask(stack.url, tokens, self.max_tokens, False, stack.auth_headers)
            if outcome != "ok":
                raise click.ClickException(f"the stack with tiers did not answer {name}: {outcome}")
            self.references[name] = text
        # The load asks the load prompts only (the fresh ones are asked apart, when a scenario wants blocks written).
        load_references = {name: self.references[name] for name in self.prompts}
        self.load = Load(
            stack.url, load_references, self.max_tokens, self.clients, stack.auth_headers, self.tally, self.prompts
        )
        self.load.start()
        scenarios: list[TierScenario] = []
        try:
            warm = self.wait_count("written", 8, timeout_s=60)
            self.check(
                TierScenario("warm-up"), f"only {warm.get('written', 0)} blocks written in 60 s", warm["written"] >= 8
            )
            for name, action in (
                ("kill -9 in a hung write-behind, files damaged while down", self.kill_during_write_behind),
                ("block files damaged while it runs", self.damage_while_running),
                (f"a full disk (RLIMIT_FSIZE {ct.FULL_DISK_BYTES // 1024} KiB from the restart on)", self.full_disk),
                ("the directory shared with another model, its file copied in", self.another_model),
                ("the shared tier: files damaged and deleted while it runs, kill -9", self.shared_tier),
            ):
                _log(f"chaos: tiers: {name}")
                scenario = TierScenario(name)
                requests, wrong, started = self.tally.requests, self.tally.wrong, time.monotonic()
                try:
                    action(scenario)
                except Exception as exc:  # a scenario that cannot run is a finding, not the end of the run
                    self.findings.problem(f"tiers, {name}: {exc!r}")
                scenario.seconds = time.monotonic() - started
                scenario.requests, scenario.wrong = self.tally.requests - requests, self.tally.wrong - wrong
                self.check(scenario, f"{scenario.wrong} wrong outputs", scenario.wrong == 0)
                scenarios.append(scenario)
        finally:
            self.load.stop()
            stack.services[OTHER].stop()
            executor.file_size_limit, executor.log = None, log
        if not alone:  # executor-0 without tiers again, executor-1 back, for the phases after
            executor.argv = plain
            _restart(stack, "executor-0", plain)
            stack.services["executor-1"].retired = False
            stack.wait_healthy(180)
        return scenarios

    def kill_during_write_behind(self, scenario: TierScenario) -> None:
        """The fresh prompts' blocks would be written to files whose temporary names are FIFOs: the writer hangs on
        the first, as on a stalled disk, and the writes after it queue (loads of them read the queued bytes).
        Then kill -9, damage surviving files while the executor is down, and restart it on the same directory (on a
        full disk: the next scenarios'): the temporary files are dropped (truncated), the damaged ones too
        (truncated, corrupt), the rest hit again."""
        stack, executor = self.stack, self.stack.services["executor-0"]
        hashes = [h for tokens in self.fresh.values() for h in ct.block_hashes(self.model_id, tokens)]
        scenario.counts["hung_writes_set"] = ct.hang_writes(self.disk, hashes)
        for name in self.fresh:
            self.ask(name)
        queued = self.wait_count("pending_writes", 4)["pending_writes"]
        scenario.counts["writes_queued_at_kill"] = queued
        self.check(scenario, f"only {queued} writes queued behind the hung one", queued >= 4)
        executor.retired = True  # (the supervisor waits: the directory is damaged while it is down)
        process = executor.process
        assert process is not None
        executor.signal(signal.SIGKILL)
        process.wait(timeout=30)
        temps = len(ct.temp_files(self.disk))
        survivors = ct.block_files(self.disk)
        damaged = survivors[: 2 * len(ct.DAMAGE)]
        for i, path in enumerate(damaged):
            ct.damage(path, ct.DAMAGE[i % len(ct.DAMAGE)])
        truncated = sum(1 for i in range(len(damaged)) if ct.DAMAGE[i % len(ct.DAMAGE)] == "truncated")
        # Back on a full disk (the full-disk scenario's: every write fails; reads, which these scenarios check, work).
        executor.file_size_limit = ct.FULL_DISK_BYTES
        executor.log = self.stack.root / "executor-0-full-disk.log"  # (its usual log may be past the limit)
        executor.retired = False
        stack.wait_healthy(180)
        scan = self.report()
        loads = self.wait_count("loads_disk", 1)["loads_disk"]
        scenario.counts |= {
            "temp_files_left": temps,
            "files_damaged_down": len(damaged),
            "disk_held_after": scan["disk_held"],
            "dropped_truncated": scan["dropped_truncated"],
            "dropped_corrupt": scan["dropped_corrupt"],
            "loads_disk_after": loads,
        }
        self.check(scenario, "no temporary file left by the kill", temps > 0)
        want = temps + truncated
        self.check(
            scenario, f"{scan['dropped_truncated']} truncated drops, {want} due", scan["dropped_truncated"] >= want
        )
        corrupt = len(damaged) - truncated
        self.check(
            scenario, f"{scan['dropped_corrupt']} corrupt drops, {corrupt} due", scan["dropped_corrupt"] >= corrupt
        )
        self.check(scenario, "temporary files left after the restart", not ct.temp_files(self.disk))
        self.check(scenario, "no surviving block loaded after the restart", loads >= 1)

    def damage_while_running(self, scenario: TierScenario) -> None:
        """The first block file of load prompts off the device damaged (one of each kind) while the executor runs,
        then those prompts asked: each load finds the damage, drops the file and computes the block instead."""
        before = self.report()
        victims = self.off_device(len(ct.DAMAGE))
        for name, how in zip(victims, ct.DAMAGE, strict=False):
            ct.damage(ct.block_file(self.disk, ct.block_hashes(self.model_id, self.prompts[name])[0]), how)
        for name in victims:
            self.ask(name)
        truncated = int("truncated" in ct.DAMAGE[: len(victims)])
        due = {"dropped_truncated": truncated, "dropped_corrupt": len(victims) - truncated}
        after = before
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            after = self.report()
            if all(after[k] - before[k] >= n for k, n in due.items()):
                break
            time.sleep(0.2)
        scenario.counts["files_damaged"] = len(victims)
        for key in due:
            scenario.counts[key] = after[key] - before[key]
        self.check(scenario, "no block file off the device to damage", bool(victims))
        for key, n in due.items():
            self.check(scenario, f"{scenario.counts[key]} {key} of {n} damaged", scenario.counts[key] >= n)

    def full_disk(self, scenario: TierScenario) -> None:
        """executor-0 came back from the kill with RLIMIT_FSIZE below a block file's size (SIGXFSZ ignored): every
        block write fails with EFBIG, as on a full disk (reads, the scenarios before, are unaffected). The fresh
        prompts' blocks, which no file holds, are written: each failure is counted, leaves no partial file, and
        blockd hears of it (no load of a block never written, so no drop counted); serving goes on."""
        before = self.report()
        ok = self.tally.ok
        for name in self.fresh:
            self.ask(name)
        report = self.wait_count("write_failures", before["write_failures"] + 4)
        for name in self.fresh:  # their blocks again: on the device, on the host or computed, never from a file
            self.ask(name)
        report = self.report()
        deadline = time.monotonic() + 20
        while report["pending_writes"] and time.monotonic() < deadline:  # a write still trying has its temp file
            time.sleep(0.2)
            report = self.report()
        partial = len(ct.temp_files(self.disk))
        dropped = [f"dropped_{r.value}" for r in Dropped]
        scenario.counts |= {
            "write_failures": report["write_failures"] - before["write_failures"],
            "written": report["written"] - before["written"],
            "partial_files_left": partial,
            "dropped": sum(report[k] - before[k] for k in dropped),
            "answered_meanwhile": self.tally.ok - ok,
        }
        self.check(scenario, "no write failed", scenario.counts["write_failures"] >= 1)
        self.check(scenario, f"{partial} partial files left by failed writes", partial == 0)
        self.check(
            scenario, "failed writes counted as drops (loads of blocks never written)", not scenario.counts["dropped"]
        )
        self.check(scenario, "nothing answered while the disk was full", scenario.counts["answered_meanwhile"] > 0)

    def another_model(self, scenario: TierScenario) -> None:
        """An executor of another model (same shapes, other weights) started on executor-0's directory and kept
        busy beside it: its start finds executor-0's files foreign and leaves them (every one still there, and
        executor-0 loads on), it writes and loads its own; one of its files copied over one of executor-0's is
        dropped at executor-0's load of it. Both answer right throughout."""
        stack = self.stack
        other_model = write_model(
            stack.root / "tiny-chaos-other", arch="llama", quiet=True, dtype="float32", **{**MODEL, "seed": 1}
        )
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        other = stack.services[OTHER]
        other.argv = [*stack.executor_argv(endpoint, OTHER, other_model), *ct.tier_flags(self.disk)]
        ours = ct.block_files(self.disk)
        before = self.report()
        other.retired = False
        other.start()
        prompts = ct.token_prompts("other", 8, seed=24, vocab_size=MODEL["vocab_size"])
        stop = threading.Event()
        traffic = threading.Thread(target=self._other_traffic, args=(endpoint, prompts, stop), daemon=True)
        first = self.report(endpoint, timeout_s=180)
        gone = [p for p in ours if not p.exists()]
        traffic.start()
        try:
            written = self.wait_count("written", 4, endpoint=endpoint)
            theirs = [p for p in ct.block_files(self.disk) if p not in ours]
            victims = self.off_device(1)
            if victims and theirs:
                own = ct.block_file(self.disk, ct.block_hashes(self.model_id, self.prompts[victims[0]])[0])
                own.write_bytes(theirs[0].read_bytes())
                self.ask(victims[0])
            loaded = self.wait_count("dropped_foreign", before["dropped_foreign"] + len(victims))
            other_after = self.wait_count("loads_disk", 1, endpoint=endpoint)
        finally:
            stop.set()
            traffic.join(timeout=60)
        scenario.counts |= {
            "other_files": len(theirs),
            "other_written": written["written"],
            "other_dropped_foreign_at_start": first["dropped_foreign"],
            "own_files_gone_at_its_start": len(gone),
            "dropped_foreign_at_load": loaded["dropped_foreign"] - before["dropped_foreign"],
            "own_dropped_truncated": loaded["dropped_truncated"] - before["dropped_truncated"],
            "other_loads_disk": other_after["loads_disk"],
        }
        self.check(scenario, "the other model wrote no file", bool(theirs))
        self.check(
            scenario, "the other's start found none of executor-0's files foreign", first["dropped_foreign"] >= 1
        )
        self.check(scenario, f"the other's start deleted {len(gone)} of executor-0's files", not gone)
        self.check(
            scenario,
            "the other's file under executor-0's name was not dropped",
            scenario.counts["dropped_foreign_at_load"] >= 1,
        )
        self.check(scenario, "the other executor loaded none of its files", other_after["loads_disk"] >= 1)

    def shared_tier(self, scenario: TierScenario) -> None:
        """executor-0 restarted with the shared tier alone (no host or disk tier, no file size limit): every block
        it commits is written to the volume behind, and what its device evicts is loaded back from there. The
        first file of load prompts off the device truncated, flipped in the payload and in the header, and one
        deleted (as another deployment's discard would) while it runs: each load drops it and computes the
        block instead. Then kill -9 mid-load and a restart on the same volume: the surviving files hit again."""
        stack, executor = self.stack, self.stack.services["executor-0"]
        executor.file_size_limit = None
        executor.log = stack.root / "executor-0-shared.log"
        flags = ct.tier_flags(self.disk)
        argv = executor.argv[: -len(flags)] if executor.argv[-len(flags) :] == flags else list(executor.argv)
        argv = [*argv, *ct.shared_flags(stack.shared_dir)]
        _restart(stack, "executor-0", argv)
        self.wait_count("shared_written", 12, timeout_s=60)
        before = self.report()
        kinds = (*ct.DAMAGE, "deleted")
        victims = self.off_device(len(kinds), shared=True)
        for name, how in zip(victims, kinds, strict=False):
            path = self.first_file(self.prompts[name], shared=True)
            if path is None:
                continue
            if how == "deleted":
                path.unlink(missing_ok=True)
            else:
                ct.damage(path, how)
        for name in victims:
            self.ask(name)
        damaged = kinds[: len(victims)]
        due = {
            "shared_dropped_truncated": sum(how in ("truncated", "deleted") for how in damaged),
            "shared_dropped_corrupt": sum(how in ("payload", "header") for how in damaged),
        }
        after = before
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            after = self.report()
            if all(after.get(k, 0) - before.get(k, 0) >= n for k, n in due.items()):
                break
            time.sleep(0.2)
        scenario.counts["files_damaged"] = len(victims)
        for key in due:
            scenario.counts[key] = after.get(key, 0) - before.get(key, 0)
        scenario.counts["shared_written"] = after.get("shared_written", 0)
        self.check(scenario, "no shared file off the device to damage", len(victims) == len(kinds))
        for key, n in due.items():
            self.check(scenario, f"{scenario.counts[key]} {key} of {n} damaged", scenario.counts[key] >= n)
        process = executor.process
        assert process is not None
        executor.signal(signal.SIGKILL)  # (the supervisor starts it again with the same flags)
        process.wait(timeout=30)
        stack.wait_healthy(180)
        loads = self.wait_count("shared_loads", 1, timeout_s=60)["shared_loads"]
        scenario.counts["shared_loads_after_restart"] = loads
        self.check(scenario, "no block loaded from the volume after the restart", loads >= 1)

    def _other_traffic(self, endpoint: str, prompts: dict[str, list[int]], stop: threading.Event) -> None:
        """Greedy requests to the other model's executor (outside the gateway, which serves executor-0's model),
        held to its first answer for each prompt, computed on a cold cache."""
        assert self.load is not None
        greedy = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        references: dict[str, str] = {}
        rng = random.Random(25)
        with ExecutorClient(endpoint, timeout_s=30, curve=self.curve) as client:
            while not stop.is_set():
                name = rng.choice(list(prompts))
                try:
                    (deltas,) = client.generate(prompts[name], greedy)
                except (ExecutorUnavailable, ExecutorRejected):
                    self.load.record(name, "transport", "", "")
                    continue
                text = " ".join(map(str, tokens_of(deltas)))
                self.load.record(name, "ok", text, references.setdefault(name, text))


# ---------------------------------------------------------------------------------------------- the run


def _references(url: str, max_tokens: int, headers: dict[str, str]) -> dict[str, str]:
    references = {}
    for prompt in PROMPTS:
        outcome, text = _ask(url, prompt, max_tokens, False, headers)
        if outcome != "ok":
            raise click.ClickException(f"the clean stack did not answer {prompt!r}: {outcome}")
        again = _ask(url, prompt, max_tokens, True, headers)
        if again != ("ok", text):
            raise click.ClickException(f"the clean stack answered {prompt!r} twice differently: {again}")
        references[prompt] = text
    return references


def _blockd_state(endpoint: str, curve: ClientCurve) -> tuple[int, list[str]]:
    with BlockdClient(endpoint, timeout_s=5, curve=curve) as client:
        held = sum(p.blocks_in_use for p in client.stats().pools)
        return held, client.check()


def _drained(endpoint: str, curve: ClientCurve, timeout_s: float) -> tuple[int, list[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            held, problems = _blockd_state(endpoint, curve)
        except BlockdUnavailable:
            held, problems = -1, ["blockd did not answer"]
        if held == 0 or time.monotonic() > deadline:
            return held, problems
        time.sleep(0.5)


def _scenarios(
    stack: Stack, findings: Findings, quick: bool, load: Load, long_references: dict[str, str]
) -> list[tuple[str, Callable[[], None]]]:
    frames = 2_000 if quick else 100_000
    scenarios: list[tuple[str, Callable[[], None]]] = []
    for name in ("executor-0", "executor-1", "blockd", "redis", "gateway"):
        if name.startswith("executor"):  # while a stream it serves has shown text: that stream must go on
            kill = functools.partial(_kill9_mid_stream, stack, name, load, long_references, findings)
        else:
            kill = functools.partial(_kill9, stack, name)
        scenarios.append((f"kill -9 {name}", kill))
        pause = 3.0 if name.startswith("executor") else 2.0  # executors: past the gateway's 2 s silence
        scenarios.append((f"SIGSTOP {name} {pause:g} s", lambda name=name, pause=pause: _pause(stack, name, pause)))
    scenarios += [
        ("duplicated pool id", lambda: _duplicate_pool(stack, findings)),
        ("cross-pool step", lambda: _cross_pool(stack, findings)),
        ("peer without keys", lambda: _keyless_peers(stack, findings, 200 if quick else 2_000, 2.0 if quick else 5.0)),
        (f"{frames} malformed frames to blockd", lambda: _malformed_blockd(stack, findings, frames)),
        (f"{frames} malformed frames to each executor", lambda: _malformed_executors(stack, findings, frames)),
        (
            "gateway battery",
            lambda: _gateway_battery(stack, findings, 100_000, 50 if quick else 1_000),
        ),
    ]
    return scenarios


def _as_group(stack: Stack) -> None:
    """executor-1 restarted as a tensor-parallel group of two (it stays one for the rest of the run): its answers
    are then held to the references the clean stack's single-device executors gave."""
    service = stack.services["executor-1"]
    group = ["--tensor-parallel-size", "2", "--tensor-parallel-timeout", f"{TP_TIMEOUT_S:g}"]
    _restart(stack, "executor-1", [*service.argv, *group])


def _rank_scenarios(stack: Stack, findings: Findings) -> list[tuple[str, Callable[[], None]]]:
    return [
        ("executor-1 restarted as a tensor-parallel group of 2", lambda: _as_group(stack)),
        ("kill -9 executor-1's rank 1", lambda: _rank_fault(stack, findings, signal.SIGKILL)),
        (f"SIGSTOP executor-1's rank 1 (> {TP_TIMEOUT_S:g} s)", lambda: _rank_fault(stack, findings, signal.SIGSTOP)),
    ]


def _fault_phase(
    stack: Stack, load: Load, findings: Findings, quick: bool, scenarios: list[tuple[str, Callable[[], None]]]
) -> list[list[str]]:
    """Scenarios one after the other under the greedy load (started already); a row per scenario. A kill -9 of an
    executor must cut no stream: each goes on on the other executor."""
    rows: list[list[str]] = []
    for name, action in scenarios:
        before, failed_before, cut_before = load.tally.requests, load.tally.failed, load.tally.cut_after_text
        attacks, refused, unanswered = findings.attacks, findings.refused, findings.unanswered
        t0 = time.monotonic()
        _log(f"chaos: {name}")
        try:
            action()
        except Exception as exc:  # a scenario that cannot run is a finding, not the end of the run
            findings.problem(f"{name}: {exc!r}")
        try:
            recovered = stack.wait_healthy(timeout_s=180)
        except click.ClickException as exc:
            findings.problem(f"after {name}: {exc.message}")
            recovered = float("nan")
        time.sleep(1.0 if quick else 5.0)  # some load on the recovered stack
        cut = load.tally.cut_after_text - cut_before
        if cut and name.startswith("kill -9 executor"):
            findings.problem(f"{name}: {cut} streams cut after text (they must go on on the other executor)")
        rows.append(
            [
                name,
                f"{time.monotonic() - t0:.1f}",
                f"{recovered:.1f}",
                str(load.tally.requests - before),
                str(load.tally.failed - failed_before),
                str(cut),
                str(findings.attacks - attacks),
                str(findings.refused - refused),
                str(findings.unanswered - unanswered),
            ]
        )
    return rows


def _load_phase(
    stack: Stack, references: dict[str, str], findings: Findings, max_tokens: int, overload_s: float
) -> list[LoadScenario]:
    """The load-held scenarios, each alone on the stack (its own clients, no other load), so that blocks still held
    once it drained are its leak."""
    scenarios: list[LoadScenario] = []
    actions: list[tuple[str, Callable[[], LoadScenario]]] = [
        ("overload", lambda: _overload(stack, references, max_tokens, overload_s)),
        ("stalled step", lambda: _stalled_step(stack, references, max_tokens)),
    ]
    for name, action in actions:
        _log(f"chaos: {name}")
        try:
            scenario = action()
        except Exception as exc:  # a scenario that cannot run is a finding, not the end of the run
            findings.problem(f"{name}: {exc!r}")
            continue
        scenario.judge(findings)
        findings.notes.extend(scenario.notes)
        scenarios.append(scenario)
        try:
            stack.wait_healthy(timeout_s=180)
        except click.ClickException as exc:
            findings.problem(f"after {name}: {exc.message}")
    return scenarios


def run_chaos(
    root: Path, *, quick: bool, clients: int, max_tokens: int, phases: tuple[str, ...] = PHASES, overload_s: float = 60
) -> dict[str, Any]:
    started = time.monotonic()
    model_dir = write_model(root / "tiny-chaos", arch="llama", quiet=True, dtype="float32", **MODEL)
    stack = Stack(root, model_dir, tiers=phases == ("tiers",))
    findings = Findings()
    tally, scenario_rows, load_scenarios = Tally(), [], []
    tier_scenarios: list[TierScenario] = []
    executors = sum(not stack.services[f"executor-{i}"].retired for i in range(2))
    _log(f"chaos: starting redis, blockd, {executors} executors and a gateway; logs in {root}")
    try:
        stack.start(timeout_s=300)
        # (the tiers phase has prompts and references of its own)
        others = phases != ("tiers",)
        references = _references(stack.url, max_tokens, stack.auth_headers) if others else {}
        # Long answers: the load-held scenarios' and the streams an executor is killed under.
        long_references = _references(stack.url, LOAD_MAX_TOKENS, stack.auth_headers) if others else {}
        time.sleep(1.0)
        for service in stack.services.values():
            service.idle_rss = service.rss()
            service.peak_rss = service.idle_rss
        # The phases in this order: the ranks phase last, as executor-1 stays a group once it is one.
        for phase in PHASES:
            if phase not in phases:
                continue
            if phase == "tiers":
                tier_scenarios = TiersPhase(stack, findings, tally, clients, max_tokens).run()
                continue
            if phase == "load":
                load_scenarios = _load_phase(stack, long_references, findings, LOAD_MAX_TOKENS, overload_s)
                continue
            load = Load(stack.url, references, max_tokens, clients, stack.auth_headers, tally)
            load.start()
            time.sleep(2.0)
            scenarios = (
                _scenarios(stack, findings, quick, load, long_references)
                if phase == "faults"
                else _rank_scenarios(stack, findings)
            )
            scenario_rows += _fault_phase(stack, load, findings, quick, scenarios)
            load.stop()
        leaked, check = _drained(stack.blockd, stack.curve("operator"), timeout_s=60)
        for service in stack.services.values():
            service.peak_rss = max(service.peak_rss, service.rss())
        restarts = {name: s.restarts for name, s in stack.services.items()}
        rss = {
            name: {"idle_mib": round(s.idle_rss / 2**20, 1), "peak_mib": round(s.peak_rss / 2**20, 1)}
            for name, s in stack.services.items()
        }
    finally:
        stack.stop()
    over_rss = [n for n, r in rss.items() if r["idle_mib"] and r["peak_mib"] > 2 * r["idle_mib"]]
    result: dict[str, Any] = {
        "quick": quick,
        "seconds": round(time.monotonic() - started, 1),
        "requests": tally.requests,
        "ok": tally.ok,
        "failed": tally.failed,
        "wrong_outputs": tally.wrong,
        "cut_after_text": tally.cut_after_text,
        "cut_after_text_by_scenario": {row[0]: int(row[5]) for row in scenario_rows},
        "refused": dict(tally.refused),
        "unclear_errors": tally.unclear + findings.battery_unclear,
        "transport_errors": tally.transport,
        "leaked_blocks": leaked,
        "check": check if check else "ok",
        "slowest_blockd_reply_s": round(findings.slowest_blockd_reply_s, 4),
        "blockd_frames": findings.blockd_frames,
        "blockd_unanswered": findings.blockd_unanswered,
        "executor_frames": findings.executor_frames,
        "attacks": findings.attacks,
        "attacks_refused": findings.refused,
        "attacks_unanswered": findings.unanswered,
        "rss": rss,
        "over_2x_idle_rss": over_rss,
        "restarts": restarts,
        "battery": dict(findings.battery),
        "notes": findings.notes,
        "problems": findings.problems,
        "wrong_examples": tally.wrong_examples,
        "load_scenarios": {scenario.name: scenario.as_json() for scenario in load_scenarios},
        "tier_scenarios": {scenario.name: scenario.as_json() for scenario in tier_scenarios},
    }
    _print_tables(result, scenario_rows, [s.row() for s in load_scenarios], [s.row() for s in tier_scenarios])
    return result


def _print_tables(
    result: dict[str, Any], scenario_rows: list[list[str]], load_rows: list[list[str]], tier_rows: list[list[str]]
) -> None:
    if scenario_rows:
        click.echo("")
        columns = ["scenario", "seconds", "recovered in s", "requests", "failed", "cut after text", "attacks"]
        columns += ["refused", "no answer"]
        for line in table_lines(columns, scenario_rows):
            click.echo(line)
    if load_rows:
        click.echo("")
        columns = ["load scenario", "seconds", "load", "requests", "accepted", "accepted failed", "refused 429"]
        for line in table_lines([*columns, "wrong outputs", "leaked blocks"], load_rows):
            click.echo(line)
    if tier_rows:
        click.echo("")
        columns = ["tiers scenario", "seconds", "requests", "wrong outputs", "injected and counted"]
        for line in table_lines(columns, tier_rows):
            click.echo(line)
    click.echo("")
    rows = [
        ["requests", str(result["requests"])],
        [
            "failed",
            f"{result['failed']} (cut after text {result['cut_after_text']}, "
            f"refused {sum(result['refused'].values())}, no answer {result['transport_errors']})",
        ],
        ["wrong outputs", str(result["wrong_outputs"])],
        ["leaked blocks", str(result["leaked_blocks"])],
        ["check", result["check"] if isinstance(result["check"], str) else "; ".join(result["check"])],
        [
            "slowest blockd reply",
            f"{result['slowest_blockd_reply_s'] * 1000:.1f} ms over {result['blockd_frames']} malformed frames",
        ],
        ["unclear errors", str(result["unclear_errors"])],
    ]
    for name, rss in result["rss"].items():
        rows.append([f"RSS {name}", f"{rss['idle_mib']} MiB idle, {rss['peak_mib']} MiB peak"])
    for line in table_lines(["figure", "value"], rows):
        click.echo(line)
    for line in result["notes"] + [f"PROBLEM: {p}" for p in result["problems"]]:
        click.echo(line)
    click.echo(json.dumps(result, sort_keys=True))


@click.command()
@click.option("--quick", is_flag=True, help="Fewer malformed frames (2,000) and disconnecting clients (50).")
@click.option("--clients", type=click.IntRange(1, 64), default=4, help="Concurrent greedy clients.")
@click.option("--max-tokens", type=click.IntRange(1, 64), default=8, help="Tokens each greedy answer holds.")
@click.option(
    "--only",
    type=click.Choice(PHASES),
    default=None,
    help="Run one phase: faults (kills, pauses, attacks under greedy load), load (overload at 3x capacity, a "
    "step stalled for 2x the gateway's executor timeout) or ranks (executor-1 restarted as a tensor-parallel group "
    "of 2, its worker rank killed and paused under greedy load) or tiers (executor-0 alone with host and disk KV "
    "tiers: kill -9 during a hung write-behind, block files truncated and corrupted, a full disk, another model's "
    "files and a directory shared with it; then the shared tier alone, its files damaged and deleted, kill -9). "
    "Default: all four.",
)
@click.option(
    "--overload-seconds",
    type=click.FloatRange(min=1),
    default=60.0,
    show_default=True,
    help="How long the overload scenario keeps arrivals at 3x the measured capacity.",
)
@click.option(
    "--keep",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the logs and state in this directory (default: a temporary one, removed after).",
)
def chaos(
    quick: bool, clients: int, max_tokens: int, only: str | None, overload_seconds: float, keep: Path | None
) -> None:
    """Faults and attacks against a stack of real processes under greedy load; a table, then one JSON line.

    Exits 1 when an aim is missed: a wrong output, a leaked block, a failed check, a problem found."""
    options: dict[str, Any] = dict(quick=quick, clients=clients, max_tokens=max_tokens, overload_s=overload_seconds)
    options["phases"] = (only,) if only else PHASES
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        result = run_chaos(keep, **options)
    else:
        with tempfile.TemporaryDirectory(prefix="pagedkv-chaos-") as root:
            result = run_chaos(Path(root), **options)
    missed = result["wrong_outputs"] or result["leaked_blocks"] or result["check"] != "ok" or result["problems"]
    sys.exit(1 if missed else 0)
