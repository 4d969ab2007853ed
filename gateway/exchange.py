"""One HTTP request's exchange with the executors: its prompts submitted as generations, and their events
turned into the response, streamed (server-sent events) or collected into one body.

Nothing is sent to the client before the first event of the generation is in: until then a failure can still be
answered with a status code (400, 429, 503) in OpenAI's error shape. After it, a stream ends with an error event.
A client that goes away mid-request aborts its generations, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway import errors, responses
from gateway.api import _Common
from gateway.errors import APIError
from gateway.generation import ChoiceEvent, Generation, GenerationFailed, Restarted
from gateway.state import Gateway

log = structlog.get_logger("gateway")
T = TypeVar("T")


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


class Exchange:
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

    def echoed(self, position: int) -> str:
        """The prompt's text, as echo puts it before the completion: as given, or decoded from token ids."""
        prompt = self.body.prompts()[position]  # type: ignore[attr-defined]
        return prompt if isinstance(prompt, str) else self.gateway.tokenizer.decode(prompt)

    @property
    def echo(self) -> bool:
        return self.kind == "completion" and getattr(self.body, "echo", False)

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
            text = event.text
            if self.echo and index not in offsets:  # the choice's first chunk (echo with logprobs: not streamed)
                text = self.echoed(position) + text
                offsets[index] = 0
            logprobs = None
            if self.logprobs is not None:
                accumulated = responses.CompletionLogprobs()
                accumulated.add(self.gateway.tokenizer, event.logprobs, offsets.get(index, 0))
                logprobs = accumulated.body()
            offsets[index] = offsets.get(index, 0) + len(text)
            return responses.sse(responses.completion_chunk(self.envelope, index, text, logprobs, event.finish_reason))
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
        prompt_k = self.body.prompt_logprobs  # vLLM's prompt_logprobs (not echo's)
        if self.kind == "completion":
            if self.echo:
                self._echo(texts, completion_logprobs)
            choices = [
                {
                    "index": i,
                    "text": texts[i],
                    "finish_reason": finish[i],
                    "logprobs": completion_logprobs[i].body() if self.logprobs is not None else None,
                }
                for i in range(count)
            ]
            if prompt_k is not None:
                for i, choice in enumerate(choices):
                    entries = self.generations[i // self.n].prompt_logprobs
                    choice["prompt_logprobs"] = responses.prompt_logprobs(self.gateway.tokenizer, entries, prompt_k)
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
        body = responses.chat_body(self.envelope, choices, usage)
        if prompt_k is not None:  # vLLM's chat responses carry them once, beside the choices
            entries = self.generations[0].prompt_logprobs
            body["prompt_logprobs"] = responses.prompt_logprobs(self.gateway.tokenizer, entries, prompt_k)
        return body

    def _echo(self, texts: list[str], logprobs: list[responses.CompletionLogprobs]) -> None:
        """echo: each choice's text starts with its prompt's, and its logprobs with the prompt tokens'."""
        tokenizer = self.gateway.tokenizer
        for i in range(len(texts)):
            generation = self.generations[i // self.n]
            prompt = self.echoed(i // self.n)
            texts[i] = prompt + texts[i]
            if self.logprobs is not None:
                echoed = responses.CompletionLogprobs()
                echoed.add_prompt(tokenizer, generation.prompt, generation.prompt_logprobs or [], self.logprobs)
                generated = logprobs[i]
                echoed.tokens += generated.tokens
                echoed.token_logprobs += generated.token_logprobs
                echoed.top_logprobs += generated.top_logprobs
                echoed.text_offset += [offset + len(prompt) for offset in generated.text_offset]
                logprobs[i] = echoed


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


async def respond(
    gateway: Gateway,
    request: Request,
    kind: str,
    body: _Common,
    prompts: list[list[int]],
    max_tokens: list[int],
    logprobs: int | None,
) -> Response:
    """Run a checked request's prompts (each with its max_tokens) as generations, holding a queue slot while
    they run, and answer: a stream of events, or one body once every choice is done."""
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
    exchange = Exchange(gateway, kind, body, generations, logprobs)
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
