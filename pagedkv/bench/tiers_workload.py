"""`pagedkv bench tiers`' workload, the system-independent half: the conversations, the infinite cache that tells
what an unbounded prefix cache would hit, the driver that runs the turns against any system (`Backend`: pagedkv's
executor over ZeroMQ, or vLLM over HTTP), and the figures of a run.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

TOKEN_IDS = (4, 500)  # past the special tokens, below any generated model's vocabulary
BLOCK_SIZE = 32  # the default: vLLM's CPU attention takes multiples of 32 only
PROGRESS_EVERY_S = 15.0  # a long run says how far it got this often


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    history_tokens: int  # a conversation's history at its last turn (that turn's prompt)
    user_tokens: int  # each later user message
    output_tokens: int  # each answer
    clients: int
    device_fraction: float  # the device KV holds this fraction of the working set
    seed: int
    block_size: int = BLOCK_SIZE  # tokens per KV block, every system's; the infinite cache's granularity too

    @property
    def first_tokens(self) -> int:
        """The first message: what the history is before the later user messages and answers."""
        return self.history_tokens - (self.turns - 1) * (self.user_tokens + self.output_tokens)

    @property
    def longest_tokens(self) -> int:
        """The longest sequence: the last turn's prompt and its answer."""
        return self.history_tokens + self.output_tokens

    def check(self) -> None:
        """ValueError when the history cannot hold the later turns' messages and answers."""
        if self.first_tokens < 1:
            raise ValueError(
                f"--history-tokens {self.history_tokens} cannot hold {self.turns - 1} more turns of "
                f"{self.user_tokens} + {self.output_tokens} tokens after a first message; give at least "
                f"{self.history_tokens - self.first_tokens + 1}"
            )

    def working_set_blocks(self) -> int:
        """Blocks of every conversation's whole history at its end."""
        return self.conversations * -(-self.longest_tokens // self.block_size)

    def user_messages(self) -> list[list[list[int]]]:
        rng = random.Random(self.seed)
        return [
            [
                rng.choices(range(*TOKEN_IDS), k=self.first_tokens if t == 0 else self.user_tokens)
                for t in range(self.turns)
            ]
            for _ in range(self.conversations)
        ]


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ideal_cached_tokens: int
    ttft_s: float
    output: list[int]


@dataclass(frozen=True)
class Event:
    """What a system sent of one request: tokens, and at the end its finish reason and cached prompt tokens."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "length" / "stop" when done; anything else is a failure
    cached_tokens: int = 0


class BackendError(Exception):
    """A request the system refused or failed; the run stops."""


class Backend(Protocol):
    def submit(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        """Send one greedy request that ignores EOS (so it answers exactly `max_tokens`)."""
        ...

    def receive(self) -> Event:
        """The next event of any request in flight (blocking); BackendError when one failed."""
        ...


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of sorted values, nearest rank (0 for none)."""
    if not values:
        return 0.0
    rank = max(0, min(len(values) - 1, math.ceil(q / 100 * len(values)) - 1))
    return values[rank]


class InfiniteCache:
    """What a cache that never evicts would hold: every computed full block of every sequence so far."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.blocks: set[tuple[int, ...]] = set()

    def _keys(self, tokens: list[int]) -> list[tuple[int, ...]]:
        size = self.block_size
        return [tuple(tokens[: (i + 1) * size]) for i in range(len(tokens) // size)]

    def hit(self, prompt: list[int]) -> int:
        """Cached tokens an admit would find (at most all but the last prompt token's block)."""
        hits = 0
        for key in self._keys(prompt)[: (len(prompt) - 1) // self.block_size]:
            if key not in self.blocks:
                break
            hits += 1
        return hits * self.block_size

    def computed(self, tokens: list[int]) -> None:
        self.blocks.update(self._keys(tokens))


def converse(backend: Backend, workload: Workload, progress: Callable[[str], None] | None = None) -> list[Turn]:
    """Every conversation's turns, round-robin (each comes back after all the others ran: an LRU's worst case),
    `clients` in flight; each turn's prompt is the whole history so far, its answer the system's own. `progress`
    hears how far the run got every PROGRESS_EVERY_S seconds."""
    messages = workload.user_messages()
    history: list[list[int]] = [[] for _ in range(workload.conversations)]
    next_turn = [0] * workload.conversations
    ready = deque(range(workload.conversations))
    ideal = InfiniteCache(workload.block_size)
    inflight: dict[str, tuple[int, list[int], int, float, list[float], list[int]]] = {}
    turns: list[Turn] = []
    total = workload.conversations * workload.turns
    started = last_note = time.monotonic()
    while len(turns) < total:
        while ready and len(inflight) < workload.clients:
            c = ready.popleft()
            t = next_turn[c]
            prompt = history[c] + messages[c][t]
            request_id = f"c{c}t{t}"
            inflight[request_id] = (c, prompt, ideal.hit(prompt), time.perf_counter(), [], [])
            backend.submit(request_id, prompt, workload.output_tokens)
        event = backend.receive()
        if event.request_id not in inflight:
            continue
        c, prompt, ideal_hit, sent, first, output = inflight[event.request_id]
        if event.token_ids and not first:
            first.append(time.perf_counter() - sent)
        output.extend(event.token_ids)
        if event.finish_reason is None:
            continue
        del inflight[event.request_id]
        if event.finish_reason not in ("length", "stop"):
            raise BackendError(f"request {event.request_id} ended with {event.finish_reason}")
        t = next_turn[c]
        turns.append(Turn(c, t, len(prompt), event.cached_tokens, ideal_hit, first[0] if first else 0.0, output))
        ideal.computed(prompt + output[:-1])  # (the last token sampled is never computed)
        history[c] = prompt + output
        next_turn[c] += 1
        if next_turn[c] < workload.turns:
            ready.append(c)
        now = time.monotonic()
        if progress is not None and now - last_note >= PROGRESS_EVERY_S:
            last_note = now
            progress(f"  {len(turns)}/{total} turns, {now - started:.0f} s")
    return turns


@dataclass
class ConfigResult:
    """One system's pass (a pagedkv configuration, or vLLM) over the workload."""

    config: str
    system: str  # "pagedkv" or "vllm"
    flags: list[str]
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    executor_tiers: dict[str, int] = field(default_factory=dict)
    blockd_tiers: list[dict[str, Any]] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        ideal = sum(t.ideal_cached_tokens for t in self.turns)
        ttft = sorted(t.ttft_s for t in self.turns)
        revisited = sorted(t.ttft_s for t in self.turns if t.turn > 0)
        outputs = sum(len(t.output) for t in self.turns)
        return {
            "config": self.config,
            "system": self.system,
            "flags": self.flags,
            "requests": len(self.turns),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "infinite_cache_tokens": ideal,
            "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
            "infinite_cache_hit_rate": round(ideal / prompt, 4) if prompt else 0.0,
            "hit_rate_of_infinite": round(cached / ideal, 4) if ideal else 0.0,
            "ttft_p50_s": round(percentile(ttft, 50), 4),
            "ttft_p99_s": round(percentile(ttft, 99), 4),
            "revisited_ttft_p50_s": round(percentile(revisited, 50), 4),
            "revisited_ttft_p99_s": round(percentile(revisited, 99), 4),
            "output_tokens_per_s": round(outputs / self.wall_s, 2) if self.wall_s else 0.0,
            "prompt_tokens_per_s": round(prompt / self.wall_s, 2) if self.wall_s else 0.0,
            "wall_s": round(self.wall_s, 2),
            "executor_tiers": self.executor_tiers,
            "blockd_tiers": self.blockd_tiers,
        }

    def outputs(self) -> dict[tuple[int, int], list[int]]:
        return {(t.conversation, t.turn): t.output for t in self.turns}


def warm_up(backend: Backend, block_size: int) -> None:
    """First-call costs (allocations, lazy imports, compilation) out of the measured run: prompts no conversation
    shares, one at a time."""
    for i in range(2):
        backend.submit(f"warm{i}", [TOKEN_IDS[1] - 1 - i] * (3 * block_size), 2)
        while (event := backend.receive()).finish_reason is None:
            pass
        if event.finish_reason not in ("length", "stop"):
            raise BackendError(f"the warm-up request ended with {event.finish_reason}")
