"""One HTTP request's exchange with the executors, whatever its endpoint: its prompts submitted as generations,
their events merged, and made into the response the endpoint (gateway.endpoint) shapes, streamed (server-sent
events) or collected into one body; usage, best_of's ranking and the request metrics.

Nothing is sent to the client before the first event of the generation is in: until then a failure can still be
answered with a status code in OpenAI's error shape (gateway.errors). After it, a stream ends with an error event.
A client that goes away mid-request aborts its generations, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from executor.params import SamplingParams
from gateway import errors
from gateway.endpoint import Chunks, Endpoint, StreamedChoice
from gateway.errors import APIError
from gateway.generation import ChoiceEvent, Generation, GenerationFailed, Restarted, Usage
from gateway.responses import Envelope, total_usage
from gateway.state import Gateway

log = structlog.get_logger("gateway")
T = TypeVar("T")
AnyEndpoint = Endpoint[Any, Any]  # whichever endpoint: the exchange never asks


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
    """One HTTP request's generations, and their events made into the endpoint's response."""

    def __init__(self, gateway: Gateway, endpoint: AnyEndpoint, generations: list[Generation]) -> None:
        self.gateway = gateway
        self.endpoint = endpoint
        self.body = endpoint.body
        self.generations = generations
        self.envelope = Envelope(endpoint.response_id(generations[0].request_id), int(time.time()), gateway.model_name)
        self.events = _merged(generations)

    def headers(self) -> dict[str, str]:
        return {
            "x-request-id": self.generations[0].request_id,
            "x-pagedkv-executor": ",".join(g.executor or "" for g in self.generations),
        }

    def count(self, status: str) -> None:
        self.gateway.metrics.requests.labels(route=self.endpoint.route, status=status).inc()

    def choice_index(self, position: int, event: ChoiceEvent) -> int:
        return position * self.endpoint.sampled + event.index

    def usage(self) -> Usage:
        return total_usage([g.usage for g in self.generations])

    def usage_so_far(self) -> Usage | None:
        """In every chunk with vLLM's continuous_usage_stats."""
        return self.usage() if self.body.continuous_usage else None

    async def stream(self, first: tuple[int, ChoiceEvent], release: contextlib.ExitStack) -> AsyncIterator[str]:
        endpoint = self.endpoint
        with release:
            status = "200"
            streamed: dict[int, StreamedChoice] = {}
            try:
                opened = self.usage() if endpoint.usage_at_opening else self.usage_so_far()
                for index in range(len(self.generations) * self.body.n):
                    opening = endpoint.opening(self.envelope, index, opened)
                    if opening is not None:
                        yield self._frames(opening)
                yield self._chunk(*first, streamed)
                async for position, event in self.events:
                    assert isinstance(event, ChoiceEvent)  # a stream is not replayable: never Restarted
                    yield self._chunk(position, event, streamed)
                yield self._frames(endpoint.closing(self.envelope, self.usage()))
            except (GenerationFailed, APIError) as exc:
                status = "error"
                error = (
                    exc
                    if isinstance(exc, APIError)
                    else errors.APIError(502, str(exc), type="server_error", code="executor_lost")
                )
                log.warning("stream_failed", request_id=self.envelope.id, error=error.message)
                yield endpoint.frame(endpoint.error(error))
            except asyncio.CancelledError:
                status = "client_disconnected"
                raise
            finally:
                self.count(status)
                await self.events.aclose()
            if endpoint.done is not None:
                yield endpoint.done

    def _frames(self, chunks: Chunks) -> str:
        return "".join(map(self.endpoint.frame, chunks if isinstance(chunks, list) else [chunks]))

    def _chunk(self, position: int, event: ChoiceEvent, streamed: dict[int, StreamedChoice]) -> str:
        index = self.choice_index(position, event)
        choice = streamed.get(index)
        if choice is None:
            choice = streamed[index] = self.endpoint.streamed(self.envelope, position, index)
        return self._frames(choice.chunk(event, self.usage_so_far()))

    async def collect(self, first: tuple[int, ChoiceEvent]) -> dict[str, Any]:
        endpoint, sampled = self.endpoint, self.endpoint.sampled
        choices = [endpoint.collected(c // sampled) for c in range(len(self.generations) * sampled)]

        def take(position: int, event: ChoiceEvent | Restarted) -> None:
            if isinstance(event, Restarted):  # its executor was lost: its choices start over
                for c in range(position * sampled, (position + 1) * sampled):
                    choices[c] = endpoint.collected(position)
                return
            choices[self.choice_index(position, event)].add(event)

        take(*first)
        async for position, event in self.events:
            take(position, event)
        kept = [choices[c] for c in self._best([choice.cumulative for choice in choices])]
        return endpoint.whole(self.envelope, kept, self.generations, self.usage())

    def _best(self, cumulative: list[float]) -> list[int]:
        """The choices returned, in order: all of them; or with best_of, per prompt the n of highest
        cumulative logprob, best first."""
        sampled, n = self.endpoint.sampled, self.body.n
        if sampled == n:
            return list(range(len(cumulative)))
        kept: list[int] = []
        for position in range(len(self.generations)):
            own = range(position * sampled, (position + 1) * sampled)
            kept += sorted(own, key=lambda c: -cumulative[c])[:n]
        return kept


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
    endpoint: AnyEndpoint,
    prompts: list[list[int]],
    max_tokens: list[int],
    admission: contextlib.ExitStack | None = None,
) -> Response:
    """Run a checked request's prompts (each with its max_tokens) as generations, holding their places in the
    queue while they run (`admission`, taken by the caller before tokenizing; taken here if not given), and
    answer as `endpoint` shapes it: a stream of events, or one body once every choice is done."""
    body = endpoint.body
    if admission is None:
        admission = contextlib.ExitStack()
        admission.enter_context(gateway.admitted(len(prompts) * body.n))
    arrival = time.monotonic()
    request_id = uuid.uuid4().hex

    def params(limit: int) -> SamplingParams:
        params = body.sampling(limit, endpoint.logprobs, gateway.tokenizer)
        if endpoint.sampled != body.n:  # best_of: sample more, rank them by the chosen tokens' logprobs
            params = msgspec.structs.replace(params, n=endpoint.sampled, logprobs=endpoint.logprobs or 0)
        return params

    output = body.output_options()
    generations = [
        gateway.generation(
            request_id if len(prompts) == 1 else f"{request_id}-{i}",
            prompt,
            params(limit),
            body.stop_strings(),
            arrival,
            replayable=not body.stream,
            output=output,
            cache_salt=body.cache_salt,
        )
        for i, (prompt, limit) in enumerate(zip(prompts, max_tokens, strict=False))
    ]
    exchange = Exchange(gateway, endpoint, generations)
    release = admission
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
        exchange.count("client_disconnected")
        return Response(status_code=499)
    except StopAsyncIteration:
        raise errors.internal("the generation ended without output") from None
    except GenerationFailed as exc:
        raise errors.APIError(502, str(exc), type="server_error", code="executor_lost") from None
    finally:
        if not handed_over:
            release.close()
            await exchange.events.aclose()
    exchange.count("200")
    return JSONResponse(result, headers=exchange.headers())
