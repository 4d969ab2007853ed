"""The gateway's HTTP app: OpenAI's completions, chat completions and models routes, health and metrics.

A request is tokenized and checked here (model, parameters, context length), then each of its prompts becomes a
`Generation`. Nothing is sent to the client before the first event of the generation is in: until then a
failure can still be answered with a status code (400, 429, 503) in OpenAI's error shape. After it, a stream
ends with an error event. A client that goes away mid-request aborts its generations, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog
import uvicorn
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from executor.params import SamplingParams
from executor.protocol import Info as ExecutorInfo
from gateway import errors, responses
from gateway.api import ChatCompletionRequest, CompletionRequest, _Common, require_json_object, validation_message
from gateway.errors import APIError
from gateway.executors import ExecutorLink
from gateway.generation import ChoiceEvent, Generation, GenerationFailed, Restarted
from gateway.metrics import GatewayMetrics
from gateway.routing import PrefixLookup, Router
from gateway.text import PromptError, Tokenizer

log = structlog.get_logger("gateway")
T = TypeVar("T")


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: Path
    executors: Sequence[str]
    blockd_endpoint: str
    routing: str = "prefix"
    load_slack: int = 8
    served_model_name: str | None = None
    max_queue: int = 512
    executor_timeout_s: float = 5.0


class Gateway:
    """What the routes share: the tokenizer, the executor links, the router, the metrics, the queue bound."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.model_dir)
        self.model_name = config.served_model_name or Path(config.model_dir).resolve().name
        self.created = int(time.time())
        self.context = zmq.asyncio.Context()
        self.links = [
            ExecutorLink(e, self.context, timeout_s=config.executor_timeout_s, compatible=self._compatible)
            for e in config.executors
        ]
        self.lookup = PrefixLookup(config.blockd_endpoint) if config.routing == "prefix" else None
        self.router = Router(self.links, config.routing, self.lookup, config.load_slack)
        self.in_flight = 0
        self.metrics = GatewayMetrics(self.links, lambda: self.in_flight)

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

    @property
    def max_model_len(self) -> int | None:
        lengths = [link.info.max_model_len for link in self.links if link.healthy and link.info]
        return min(lengths) if lengths else None

    def why_unavailable(self) -> str:
        refused = [f"{link.endpoint} is refused: {link.refused}" for link in self.links if link.refused]
        return "; ".join(refused) if refused else "every executor is out of rotation"

    @contextlib.contextmanager
    def admitted(self):
        if self.in_flight >= self.config.max_queue:
            raise errors.queue_full(self.config.max_queue)
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

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
        )


# -------------------------------------------------------------------------------------------------- requests


def _token_limit(gateway: Gateway, prompt: list[int], asked: int | None, param: str) -> int:
    """max_tokens for this prompt: what was asked, if it fits in the context; all the room left if not asked."""
    limit = gateway.max_model_len
    if limit is None:
        raise errors.no_executor(gateway.why_unavailable())
    if not prompt:
        raise errors.invalid_request("The prompt is empty.", param=param)
    room = limit - len(prompt)
    if asked is None:
        if room < 1:
            raise errors.context_length_exceeded(
                f"This model's maximum context length is {limit} tokens. However, your {param} has "
                f"{len(prompt)} tokens, leaving no room for the completion.",
                param,
            )
        return room
    if asked > room:
        raise errors.context_length_exceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt) + asked} tokens ({len(prompt)} in the {param}, {asked} for the completion). Please "
            "reduce the length of the prompt or the completion.",
            param,
        )
    return asked


def _check_token_ids(gateway: Gateway, tokens: list[int]) -> list[int]:
    vocab = gateway.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise errors.invalid_request(f"prompt token ids must be in [0, {vocab}).", param="prompt")
    return tokens


def _check_stop_token_ids(gateway: Gateway, body: _Common) -> None:
    vocab = gateway.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
        raise errors.invalid_request(f"stop_token_ids must be token ids in [0, {vocab}).", param="stop_token_ids")


async def _parse(request: Request, model: type[_Common]) -> Any:
    try:
        raw = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise errors.invalid_request("The request body is not valid JSON.") from None
    try:
        return model.model_validate(require_json_object(raw))
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise errors.invalid_request(message, param=param) from None


async def _merged(generations: Sequence[Generation]) -> AsyncIterator[tuple[int, ChoiceEvent | Restarted]]:
    """The events of several generations as they come, tagged with the generation's position."""
    if len(generations) == 1:
        async with contextlib.aclosing(generations[0].events()) as events:  # closed (aborting) even if we are
            async for event in events:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, ChoiceEvent | Restarted | BaseException | None]] = asyncio.Queue()

    async def pump(position: int, generation: Generation) -> None:
        try:
            async for event in generation.events():
                await queue.put((position, event))
            await queue.put((position, None))
        except BaseException as exc:
            await queue.put((position, exc))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            position, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()  # the body is read: the next message is the disconnect
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; or, if the client disconnects first, `work` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


class _Exchange:
    """One HTTP request's generations and how their events become a response."""

    def __init__(
        self, gateway: Gateway, kind: str, body: _Common, generations: list[Generation], logprobs: int | None
    ) -> None:
        self.gateway = gateway
        self.kind = kind  # "completion" | "chat"
        self.body = body
        self.generations = generations
        self.logprobs = logprobs
        self.n = body.n
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        self.envelope = responses.Envelope(
            f"{prefix}-{generations[0].request_id}", int(time.time()), gateway.model_name
        )
        self.events = _merged(generations)
        self.route = "/v1/completions" if kind == "completion" else "/v1/chat/completions"

    def headers(self) -> dict[str, str]:
        return {
            "x-request-id": self.generations[0].request_id,
            "x-pagedkv-executor": ",".join(g.executor or "" for g in self.generations),
        }

    def choice_index(self, position: int, event: ChoiceEvent) -> int:
        return position * self.n + event.index

    # -------------------------------------------------------------------------------- streaming

    async def stream(self, first: tuple[int, ChoiceEvent], release: contextlib.ExitStack) -> AsyncIterator[str]:
        with release:
            status = "200"
            offsets: dict[int, int] = {}
            try:
                if self.kind == "chat":
                    for index in range(len(self.generations) * self.n):
                        yield responses.sse(
                            responses.chat_chunk(self.envelope, index, {"role": "assistant", "content": ""}, None, None)
                        )
                yield self._chunk(*first, offsets)
                async for position, event in self.events:
                    yield self._chunk(position, event, offsets)
                if self.body.include_usage:
                    usage = responses.total_usage([g.usage for g in self.generations])
                    object_name = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
                    yield responses.sse(responses.usage_chunk(self.envelope, object_name, usage))
            except (GenerationFailed, APIError) as exc:
                status = "error"
                error = (
                    exc
                    if isinstance(exc, APIError)
                    else errors.APIError(502, str(exc), type="server_error", code="executor_lost")
                )
                log.warning("stream_failed", request_id=self.envelope.id, error=error.message)
                yield responses.error_event(error)
            except asyncio.CancelledError:
                status = "client_disconnected"
                raise
            finally:
                self.gateway.metrics.requests.labels(route=self.route, status=status).inc()
                await self.events.aclose()
            yield responses.DONE

    def _chunk(self, position: int, event: ChoiceEvent, offsets: dict[int, int]) -> str:
        index = self.choice_index(position, event)
        if self.kind == "completion":
            logprobs = None
            if self.logprobs is not None:
                accumulated = responses.CompletionLogprobs()
                accumulated.add(self.gateway.tokenizer, event.logprobs, offsets.get(index, 0))
                logprobs = accumulated.body()
            offsets[index] = offsets.get(index, 0) + len(event.text)
            return responses.sse(
                responses.completion_chunk(self.envelope, index, event.text, logprobs, event.finish_reason)
            )
        delta = {"content": event.text} if event.text else {}
        logprobs_list = None
        if self.logprobs is not None:
            logprobs_list = responses.chat_logprobs(self.gateway.tokenizer, event.logprobs, self.logprobs)
        return responses.sse(responses.chat_chunk(self.envelope, index, delta, logprobs_list, event.finish_reason))

    # -------------------------------------------------------------------------------- whole responses

    async def collect(self, first: tuple[int, ChoiceEvent]) -> dict[str, Any]:
        count = len(self.generations) * self.n
        texts = [""] * count
        finish: list[str | None] = [None] * count
        completion_logprobs = [responses.CompletionLogprobs() for _ in range(count)]
        chat_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(count)]

        def take(position: int, event: ChoiceEvent | Restarted) -> None:
            if isinstance(event, Restarted):  # its executor was lost: its choices start over
                for index in range(position * self.n, (position + 1) * self.n):
                    texts[index], finish[index] = "", None
                    completion_logprobs[index] = responses.CompletionLogprobs()
                    chat_logprobs[index] = []
                return
            index = self.choice_index(position, event)
            if self.logprobs is not None and self.kind == "completion":
                completion_logprobs[index].add(self.gateway.tokenizer, event.logprobs, len(texts[index]))
            elif self.logprobs is not None:
                chat_logprobs[index] += responses.chat_logprobs(self.gateway.tokenizer, event.logprobs, self.logprobs)
            texts[index] += event.text
            finish[index] = event.finish_reason or finish[index]

        take(*first)
        async for position, event in self.events:
            take(position, event)
        usage = responses.total_usage([g.usage for g in self.generations])
        if self.kind == "completion":
            choices = [
                {
                    "index": i,
                    "text": texts[i],
                    "finish_reason": finish[i],
                    "logprobs": completion_logprobs[i].body() if self.logprobs is not None else None,
                }
                for i in range(count)
            ]
            return responses.completion_body(self.envelope, choices, usage)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": texts[i]},
                "finish_reason": finish[i],
                "logprobs": {"content": chat_logprobs[i]} if self.logprobs is not None else None,
            }
            for i in range(count)
        ]
        return responses.chat_body(self.envelope, choices, usage)


class _EventStream(StreamingResponse):
    """A streaming response that aborts its generations and leaves the queue even if its body never starts
    (a client gone before the first byte): the body's own cleanup would never run then."""

    def __init__(
        self,
        content: AsyncIterator[str],
        *,
        cleanup: Callable[[], Awaitable[None]],
        release: contextlib.ExitStack,
        **kwargs: Any,
    ) -> None:
        super().__init__(content, **kwargs)
        self._cleanup = cleanup
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()
            self._release.close()


async def _respond(
    gateway: Gateway,
    request: Request,
    kind: str,
    body: _Common,
    prompts: list[list[int]],
    max_tokens: list[int],
    logprobs: int | None,
) -> Response:
    arrival = time.monotonic()
    request_id = uuid.uuid4().hex
    generations = [
        gateway.generation(
            request_id if len(prompts) == 1 else f"{request_id}-{i}",
            prompt,
            body.sampling(limit, logprobs, gateway.tokenizer),
            body.stop_strings(),
            arrival,
            replayable=not body.stream,
        )
        for i, (prompt, limit) in enumerate(zip(prompts, max_tokens, strict=False))
    ]
    exchange = _Exchange(gateway, kind, body, generations, logprobs)
    release = contextlib.ExitStack()
    release.enter_context(gateway.admitted())
    handed_over = False  # to the streaming response, which then releases the queue slot and the generations
    try:  # errors before the first event still get a status code
        first = await _unless_disconnected(request, anext(exchange.events))
        if body.stream:
            response = _EventStream(
                exchange.stream(first, release),
                cleanup=exchange.events.aclose,
                release=release,
                media_type="text/event-stream",
                headers={**exchange.headers(), "Cache-Control": "no-cache"},
            )
            handed_over = True
            return response
        result = await _unless_disconnected(request, exchange.collect(first))
    except ClientGone:  # its generations were cancelled, which aborted them at the executors
        gateway.metrics.requests.labels(route=exchange.route, status="client_disconnected").inc()
        return Response(status_code=499)
    except StopAsyncIteration:
        raise errors.internal("the generation ended without output") from None
    except GenerationFailed as exc:
        raise errors.APIError(502, str(exc), type="server_error", code="executor_lost") from None
    finally:
        if not handed_over:
            release.close()
            await exchange.events.aclose()
    gateway.metrics.requests.labels(route=exchange.route, status="200").inc()
    return JSONResponse(result, headers=exchange.headers())


# -------------------------------------------------------------------------------------------------- the app


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="pagedkv gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path.startswith("/v1/"):
            gateway.metrics.requests.labels(route=request.url.path, status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = errors.not_found(request.url.path)
        else:
            error = APIError(exc.status_code, str(exc.detail), type="invalid_request_error")
        return JSONResponse(error.body(), status_code=error.status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await _parse(request, CompletionRequest)
        gateway.check_model(body.model)
        _check_stop_token_ids(gateway, body)
        prompts = []
        for prompt in body.prompts():
            tokens = gateway.tokenizer.encode(prompt) if isinstance(prompt, str) else _check_token_ids(gateway, prompt)
            prompts.append(tokens)
        if not prompts:
            raise errors.invalid_request("The prompt is empty.", param="prompt")
        limits = [_token_limit(gateway, p, body.max_tokens, "prompt") for p in prompts]
        return await _respond(gateway, request, "completion", body, prompts, limits, body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        gateway.check_model(body.model)
        _check_stop_token_ids(gateway, body)
        try:
            prompt = gateway.tokenizer.encode_chat(
                [m.for_template() for m in body.messages], body.add_generation_prompt
            )
        except PromptError as exc:
            raise errors.invalid_request(str(exc), param="messages") from None
        limit = _token_limit(gateway, prompt, body.token_limit, "messages")
        return await _respond(gateway, request, "chat", body, [prompt], [limit], body.logprobs_k)

    def model_card() -> dict[str, Any]:
        return {
            "id": gateway.model_name,
            "object": "model",
            "created": gateway.created,
            "owned_by": "pagedkv",
            "max_model_len": gateway.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        gateway.check_model(name)
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = any(link.healthy for link in gateway.links)
        body = {
            "status": "ok" if healthy else "unavailable",
            "model": gateway.model_name,
            "routing": config.routing,
            "in_flight": gateway.in_flight,
            "prefix_lookup": None if gateway.lookup is None else gateway.lookup.reachable,
            "executors": [link.describe() for link in gateway.links],
        }
        if not healthy:
            body["reason"] = gateway.why_unavailable()
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_gateway(config: GatewayConfig, *, host: str, port: int, log_level: str = "info") -> None:
    """Serve until SIGINT or SIGTERM (requests in flight get a few seconds to finish)."""
    app = create_app(config)
    listener = socket.create_server((host, port), reuse_port=False)  # bound here, so port 0 can be reported
    bound_port = listener.getsockname()[1]
    log.info("gateway_listening", url=f"http://{host}:{bound_port}", model=app.state.gateway.model_name)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning" if log_level == "info" else log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
        )
    )
    server.run(sockets=[listener])
