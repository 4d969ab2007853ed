"""The gateway's state: its configuration and what every route shares (the tokenizer, the executor links,
the router, the metrics, the bound on generations in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import structlog
import zmq.asyncio

from common.auth import ClientCurve
from executor.params import SamplingParams
from executor.protocol import Info as ExecutorInfo
from gateway import errors
from gateway.admission import DEFAULT_MAX_QUEUE_DELAY_S, Door
from gateway.executors import ExecutorLink
from gateway.generation import Generation, OutputOptions
from gateway.metrics import GatewayMetrics
from gateway.migration import DEFAULT_MAX_MIGRATIONS
from gateway.routing import PrefixLookup, Router
from gateway.text import Tokenizer
from gateway.tool_calls import detect_parser

T = TypeVar("T")
log = structlog.get_logger("gateway")


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: Path
    executors: Sequence[str]
    blockd_endpoint: str
    routing: str = "prefix"
    load_slack: int = 8
    served_model_name: str | None = None
    max_queued_sequences: int = 512  # a request's prompts x n, waiting or generating
    executor_timeout_s: float = 5.0
    max_migrations: int = DEFAULT_MAX_MIGRATIONS  # per generation: continuations on another executor mid-stream
    max_queue_delay_s: float | None = DEFAULT_MAX_QUEUE_DELAY_S  # past it, new requests get 429 (None: no bound)
    max_body_bytes: int = 4 * 1024 * 1024
    tokenizer_threads: int = 2
    tool_call_parser: str = "auto"  # gateway.tool_calls.TOOL_CALL_PARSERS
    curve: ClientCurve | None = None  # the gateway's keys for CURVE-serving blockd and executors (common.auth)
    api_keys: tuple[str, ...] = ()  # Authorization: Bearer keys the HTTP API accepts; none: open
    protect_health: bool = False  # /health needs an API key too
    protect_metrics: bool = False  # /metrics needs an API key too
    report_cached_tokens: bool = False  # usage.prompt_tokens_details.cached_tokens without a cache_salt


class Gateway:
    """What the routes share: the tokenizer, the executor links, the router, the metrics, the queue bound."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.model_dir)
        self.model_name = config.served_model_name or Path(config.model_dir).resolve().name
        self.created = int(time.time())
        self.context = zmq.asyncio.Context()
        self.links = [
            ExecutorLink(
                e, self.context, timeout_s=config.executor_timeout_s, compatible=self._compatible, curve=config.curve
            )
            for e in config.executors
        ]
        self.lookup = PrefixLookup(config.blockd_endpoint, curve=config.curve) if config.routing == "prefix" else None
        self.router = Router(self.links, config.routing, self.lookup, config.load_slack)
        self.in_flight = 0  # generations admitted (a request's prompts x n), bounded by max_queued_sequences
        # Tokenizing and chat templating run here, off the event loop: a huge prompt must not stall the links'
        # health checks or other requests. Admission comes first, so at most max_queued_sequences wait for it.
        self.text_pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="gateway-text")
        self.tool_call_parser = self._tool_call_parser(config.tool_call_parser)
        self.door = Door(self.router.healthy, config.max_queue_delay_s)
        self.metrics = GatewayMetrics(self.links, lambda: self.in_flight, self.model_name, self.door)

    def _tool_call_parser(self, name: str) -> str:
        """The parser of tool calls in this model's output: as configured, or ("auto") by its chat template."""
        if name != "auto":
            return name
        templates = self.tokenizer.chat_templates
        return detect_parser(templates.get("tool_use") or templates.get("default"))

    def _compatible(self, info: ExecutorInfo) -> str | None:
        """Why this gateway must not use an executor: token ids from this tokenizer would mean other words there."""
        if self.tokenizer.vocab_size > info.vocab_size:
            return (
                f"it serves {info.model_id} with a vocabulary of {info.vocab_size} tokens, but this gateway's "
                f"tokenizer ({self.config.model_dir}) has {self.tokenizer.vocab_size}: another model"
            )
        return None

    async def start(self) -> None:
        for link in self.links:
            link.start()
        log.info(
            "gateway_started",
            model=self.model_name,
            executors=list(self.config.executors),
            routing=self.config.routing,
            blockd=self.config.blockd_endpoint,
        )

    async def stop(self) -> None:
        for link in self.links:
            await link.close()
        if self.lookup is not None:
            self.lookup.close()
        self.context.term()
        self.text_pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, work: Callable[..., T], *args: object) -> T:
        """`work(*args)` on the text pool, so the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, work, *args)

    @property
    def max_model_len(self) -> int | None:
        lengths = [link.info.max_model_len for link in self.links if link.healthy and link.info]
        return min(lengths) if lengths else None

    def why_unavailable(self) -> str:
        refused = [f"{link.endpoint} is refused: {link.refused}" for link in self.links if link.refused]
        return "; ".join(refused) if refused else "every executor is out of rotation"

    @contextlib.contextmanager
    def admitted(self, generations: int = 1) -> Iterator[None]:
        """A place in the queue for a request of `generations` generations (its prompts x n), taken before any
        work is done for it: 429 while the queue is full or the executors' queued work would keep it waiting past
        --max-queue-delay (with Retry-After), 400 if the request alone exceeds the queue."""
        limit = self.config.max_queued_sequences
        if generations > limit:
            raise errors.invalid_request(
                f"This request asks for {generations} generations (prompts x n); this gateway holds at most "
                f"{limit} in flight (--max-queued-sequences). Split it into smaller requests.",
                param="prompt",
                code="too_many_generations",
            )
        if self.in_flight + generations > limit:
            self.metrics.refused.labels(reason="queue_full").inc()
            log.info("request_refused", reason="queue_full", in_flight=self.in_flight, limit=limit)
            raise errors.queue_full(limit)
        refusal = self.door.check()
        if refusal is not None:
            bound = self.door.max_queue_delay_s or 0.0
            self.metrics.refused.labels(reason="overloaded").inc()
            log.info(
                "request_refused",
                reason="overloaded",
                estimated_wait_s=round(refusal.wait_s, 1),
                max_queue_delay_s=bound,
                retry_after_s=refusal.retry_after_s,
                in_flight=self.in_flight,
            )
            raise errors.overloaded(refusal.wait_s, bound, refusal.retry_after_s)
        self.in_flight += generations
        try:
            yield
        finally:
            self.in_flight -= generations

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise errors.model_not_found(name, self.model_name)

    def generation(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        stops: list[str],
        arrival: float,
        replayable: bool,
        output: OutputOptions | None = None,
        cache_salt: str | None = None,
    ) -> Generation:
        return Generation(
            request_id=request_id,
            prompt=prompt,
            params=params,
            stops=stops,
            router=self.router,
            tokenizer=self.tokenizer,
            metrics=self.metrics,
            arrival=arrival,
            replayable=replayable,
            output=output,
            cache_salt=cache_salt,
            report_cached_tokens=self.config.report_cached_tokens or cache_salt is not None,
            max_migrations=self.config.max_migrations,
        )
