"""One HTTP request's exchange with the executors: its prompts submitted as generations, and their events
turned into the response, streamed (server-sent events) or collected into one body.

Nothing is sent to the client before the first event of the generation is in: until then a failure can still be
answered with a status code (400, 429, 503) in OpenAI's error shape. After it, a stream ends with an error event.
A client that goes away mid-request aborts its generations, which frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
import structlog
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from executor.params import SamplingParams
from gateway import errors, responses
from gateway.api import _Common
from gateway.errors import APIError
from gateway.generation import ChoiceEvent, Generation, GenerationFailed, Restarted, Usage
from gateway.state import Gateway
from gateway.tool_calls import ToolCall, ToolParser, make_parser

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
        self,
        gateway: Gateway,
        kind: str,
        body: _Common,
        generations: list[Generation],
        logprobs: int | None,
        echo: Sequence[str] | None = None,
    ) -> None:
        self.gateway = gateway
        self.kind = kind  # "completion" | "chat"
        self.body = body
        self.generations = generations
        self.logprobs = logprobs  # what the client asked for (the executor may have been asked for more)
        self.n = body.n  # choices returned per prompt
        self.sampled = getattr(body, "sampled_choices", body.n)  # choices generated per prompt (best_of)
        self.echo = echo  # per prompt: its text, put before each of its choices' text
        self.as_ids = body.return_tokens_as_token_ids
        self.continuous_usage = body.continuous_usage
        # tool calls looked for in the output (chat, tools given, tool_choice 'auto'): the parser's name
        self.tool_parser = gateway.tool_call_parser if getattr(body, "parses_tool_calls", False) else None
        self.parallel_tool_calls = getattr(body, "parallel_tool_calls", True)
        # tool_choice 'required' or a named function: the output is the call(s) as JSON (structured output)
        self.forced = getattr(body, "forces_tool_call", False)
        self.named_tool: str | None = getattr(body, "named_tool", None)
        self._forced_text: dict[int, str] = {}
        self._forced_ids: dict[int, str] = {}
        self._parsers: dict[int, ToolParser] = {}
        self._calls_sent: dict[int, int] = {}
        self._call_numbers: dict[int, dict[str, int]] = {}
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
        return position * self.sampled + event.index

    def usage_so_far(self) -> Usage | None:
        return responses.total_usage([g.usage for g in self.generations]) if self.continuous_usage else None

    # -------------------------------------------------------------------------------- streaming

    async def stream(self, first: tuple[int, ChoiceEvent], release: contextlib.ExitStack) -> AsyncIterator[str]:
        with release:
            status = "200"
            offsets: dict[int, int] = {}
            try:
                if self.kind == "chat":
                    for index in range(len(self.generations) * self.n):
                        yield responses.sse(
                            responses.chat_chunk(
                                self.envelope,
                                index,
                                {"role": "assistant", "content": ""},
                                None,
                                None,
                                self.usage_so_far(),
                            )
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
            if self.echo is not None and index not in offsets:  # the choice's first chunk: the prompt first
                text = self.echo[position] + text
            logprobs = None
            if self.logprobs is not None:
                accumulated = responses.CompletionLogprobs()
                accumulated.add(self.gateway.tokenizer, event.logprobs, offsets.get(index, 0), self.as_ids)
                logprobs = accumulated.body()
            offsets[index] = offsets.get(index, 0) + len(text)
            return responses.sse(
                responses.completion_chunk(
                    self.envelope, index, text, logprobs, event.finish_reason, self.usage_so_far()
                )
            )
        finish_reason = event.finish_reason
        if self.forced:
            delta, finish_reason = self._forced_delta(index, event)
        elif self.tool_parser is None:
            delta: dict[str, Any] = {"content": event.text} if event.text else {}
        else:
            delta, finish_reason = self._tool_delta(index, event)
        logprobs_list = None
        if self.logprobs is not None:
            logprobs_list = responses.chat_logprobs(self.gateway.tokenizer, event.logprobs, self.logprobs, self.as_ids)
        return responses.sse(
            responses.chat_chunk(self.envelope, index, delta, logprobs_list, finish_reason, self.usage_so_far())
        )

    def _tool_delta(self, index: int, event: ChoiceEvent) -> tuple[dict[str, Any], str | None]:
        """A chunk's delta when tool calls are parsed: content as it is ruled out of being a call; `tool_calls`
        entries as OpenAI streams them: a call's index, id, type and name once, then fragments of its arguments."""
        assert self.tool_parser is not None
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = make_parser(self.tool_parser)
        found = parser.feed(event.text)
        if event.finish_reason is not None:
            found.merge(parser.finish())
        delta: dict[str, Any] = {"content": found.content} if found.content else {}
        numbers = self._call_numbers.setdefault(index, {})  # call id -> its index in this choice's tool calls
        entries: dict[str, dict[str, Any]] = {}
        for call in found.calls:
            if not self.parallel_tool_calls and numbers:
                continue  # one call only: the first
            numbers[call.id] = len(numbers)
            entries[call.id] = {
                "index": numbers[call.id],
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": ""},
            }
        for call, fragment in found.fragments:
            if call.id not in numbers:
                continue
            entry = entries.setdefault(call.id, {"index": numbers[call.id], "function": {"arguments": ""}})
            entry["function"]["arguments"] += fragment
        if entries:
            delta["tool_calls"] = list(entries.values())
            self._calls_sent[index] = len(numbers)
        finish_reason = event.finish_reason
        if finish_reason == "stop" and self._calls_sent.get(index):
            finish_reason = "tool_calls"
        return delta, finish_reason

    def _forced_delta(self, index: int, event: ChoiceEvent) -> tuple[dict[str, Any], str | None]:
        """A chunk's delta under a forced tool call. Named: the call's id, type and name in the first chunk, then
        its arguments as they are generated. 'required': the calls whole, once the choice's JSON array is
        complete (its last chunk)."""
        if self.named_tool is not None:
            entry: dict[str, Any] = {"index": 0, "function": {"arguments": event.text}}
            if index not in self._forced_ids:
                self._forced_ids[index] = ToolCall(self.named_tool, "").id
                entry.update(id=self._forced_ids[index], type="function")
                entry["function"]["name"] = self.named_tool
            elif not event.text:
                return {}, event.finish_reason
            return {"tool_calls": [entry]}, event.finish_reason
        text = self._forced_text[index] = self._forced_text.get(index, "") + event.text
        if event.finish_reason is None:
            return {}, None
        message, finish_reason = self._message(text, event.finish_reason)
        if "tool_calls" not in message:
            return {"content": text} if text else {}, finish_reason
        calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        return {"tool_calls": calls}, finish_reason

    def _forced_message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """tool_choice named or 'required', as vLLM answers it: a named call's arguments are the output
        (finish reason as it is: "stop"); 'required''s JSON array becomes its calls (finish reason "tool_calls").
        Output that is not the array (cut short by max_tokens) is answered as text."""
        if self.named_tool is not None:
            call = ToolCall(self.named_tool, text)
            return {"role": "assistant", "content": None, "tool_calls": [call.body()]}, finish_reason
        try:
            items = json.loads(text)
            calls = [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
        except (ValueError, TypeError, KeyError):
            return {"role": "assistant", "content": text}, finish_reason
        if not self.parallel_tool_calls:
            calls = calls[:1]
        message = {"role": "assistant", "content": None, "tool_calls": [c.body() for c in calls]}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message (and finish reason): its text, or the tool calls found in it."""
        if self.forced:
            return self._forced_message(text, finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.tool_parser is None:
            return message, finish_reason
        parser = make_parser(self.tool_parser)
        found = parser.feed(text)
        found.merge(parser.finish())
        calls = found.calls
        if not calls:
            return message, finish_reason
        if not self.parallel_tool_calls:
            calls = calls[:1]
        content = found.content
        message = {"role": "assistant", "content": content or None, "tool_calls": [c.body() for c in calls]}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason

    # -------------------------------------------------------------------------------- whole responses

    async def collect(self, first: tuple[int, ChoiceEvent]) -> dict[str, Any]:
        count = len(self.generations) * self.sampled
        start = [self.echo[i // self.sampled] if self.echo is not None else "" for i in range(count)]
        texts = list(start)
        finish: list[str | None] = [None] * count
        cumulative = [0.0] * count  # of the chosen tokens: what best_of ranks by
        completion_logprobs = [responses.CompletionLogprobs() for _ in range(count)]
        chat_logprobs: list[list[dict[str, Any]]] = [[] for _ in range(count)]
        tokenizer = self.gateway.tokenizer

        def take(position: int, event: ChoiceEvent | Restarted) -> None:
            if isinstance(event, Restarted):  # its executor was lost: its choices start over
                for index in range(position * self.sampled, (position + 1) * self.sampled):
                    texts[index], finish[index], cumulative[index] = start[index], None, 0.0
                    completion_logprobs[index] = responses.CompletionLogprobs()
                    chat_logprobs[index] = []
                return
            index = self.choice_index(position, event)
            cumulative[index] += sum(entry.logprob for entry in event.logprobs)
            if self.logprobs is not None and self.kind == "completion":
                completion_logprobs[index].add(tokenizer, event.logprobs, len(texts[index]), self.as_ids)
            elif self.logprobs is not None:
                chat_logprobs[index] += responses.chat_logprobs(tokenizer, event.logprobs, self.logprobs, self.as_ids)
            texts[index] += event.text
            finish[index] = event.finish_reason or finish[index]

        take(*first)
        async for position, event in self.events:
            take(position, event)
        usage = responses.total_usage([g.usage for g in self.generations])
        kept = self._best(cumulative)
        prompt_k = self.body.prompt_logprobs  # vLLM's prompt_logprobs (echo's are in the choices' logprobs)
        if self.kind == "completion":
            if self.echo is not None and self.logprobs is not None:
                self._echo_logprobs(kept, completion_logprobs)
            choices = [
                {
                    "index": i,
                    "text": texts[c],
                    "finish_reason": finish[c],
                    "logprobs": completion_logprobs[c].body() if self.logprobs is not None else None,
                }
                for i, c in enumerate(kept)
            ]
            if prompt_k is not None:
                for c, choice in zip(kept, choices, strict=True):
                    entries = self.generations[c // self.sampled].prompt_logprobs
                    choice["prompt_logprobs"] = responses.prompt_logprobs(tokenizer, entries, prompt_k, self.as_ids)
            return responses.completion_body(self.envelope, choices, usage)
        choices = []
        for i, c in enumerate(kept):
            message, finish_reason = self._message(texts[c], finish[c])
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": finish_reason,
                    "logprobs": {"content": chat_logprobs[c]} if self.logprobs is not None else None,
                }
            )
        body = responses.chat_body(self.envelope, choices, usage)
        if prompt_k is not None:  # vLLM's chat responses carry them once, beside the choices
            entries = self.generations[0].prompt_logprobs
            body["prompt_logprobs"] = responses.prompt_logprobs(tokenizer, entries, prompt_k, self.as_ids)
        return body

    def _echo_logprobs(self, kept: list[int], logprobs: list[responses.CompletionLogprobs]) -> None:
        """echo with logprobs: each returned choice's logprobs start with its prompt tokens' (the first one null),
        scored by the executor; the generated tokens' offsets already count the echoed text."""
        tokenizer = self.gateway.tokenizer
        for c in kept:
            generation = self.generations[c // self.sampled]
            echoed = responses.CompletionLogprobs()
            echoed.add_prompt(
                tokenizer, generation.prompt, generation.prompt_logprobs or [], self.logprobs or 0, self.as_ids
            )
            generated = logprobs[c]
            echoed.tokens += generated.tokens
            echoed.token_logprobs += generated.token_logprobs
            echoed.top_logprobs += generated.top_logprobs
            echoed.text_offset += generated.text_offset
            logprobs[c] = echoed

    def _best(self, cumulative: list[float]) -> list[int]:
        """The choices returned, in order: all of them; or with best_of, per prompt the n of highest
        cumulative logprob, best first."""
        if self.sampled == self.n:
            return list(range(len(cumulative)))
        kept: list[int] = []
        for position in range(len(self.generations)):
            own = range(position * self.sampled, (position + 1) * self.sampled)
            kept += sorted(own, key=lambda c: -cumulative[c])[: self.n]
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
    kind: str,
    body: _Common,
    prompts: list[list[int]],
    max_tokens: list[int],
    logprobs: int | None,
    admission: contextlib.ExitStack | None = None,
    echo: Sequence[str] | None = None,
) -> Response:
    """Run a checked request's prompts (each with its max_tokens) as generations, holding their places in the
    queue while they run (`admission`, taken by the caller before tokenizing; taken here if not given), and
    answer: a stream of events, or one body once every choice is done. `echo`: each prompt's text, which its
    choices' text starts with."""
    if admission is None:
        admission = contextlib.ExitStack()
        admission.enter_context(gateway.admitted(len(prompts) * body.n))
    arrival = time.monotonic()
    request_id = uuid.uuid4().hex
    sampled = getattr(body, "sampled_choices", body.n)

    def params(limit: int) -> SamplingParams:
        params = body.sampling(limit, logprobs, gateway.tokenizer)
        if sampled != body.n:  # best_of: sample more, rank them by the chosen tokens' logprobs
            params = msgspec.structs.replace(params, n=sampled, logprobs=logprobs or 0)
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
    exchange = Exchange(gateway, kind, body, generations, logprobs, echo)
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


def echo_only(gateway: Gateway, body: _Common, prompts: list[list[int]], echo: Sequence[str]) -> Response:
    """`echo` with `max_tokens: 0`: each choice is its prompt's text, nothing is generated."""
    envelope = responses.Envelope(f"cmpl-{uuid.uuid4().hex}", int(time.time()), gateway.model_name)
    usage = Usage(prompt_tokens=sum(len(p) for p in prompts), report_cached=False)  # nothing ran: nothing cached
    indices = [(p, p * body.n + j) for p in range(len(prompts)) for j in range(body.n)]
    gateway.metrics.requests.labels(route="/v1/completions", status="200").inc()
    if not body.stream:
        choices = [{"index": i, "text": echo[p], "finish_reason": "length", "logprobs": None} for p, i in indices]
        return JSONResponse(responses.completion_body(envelope, choices, usage))

    async def chunks() -> AsyncIterator[str]:
        for p, i in indices:
            running = usage if body.continuous_usage else None
            yield responses.sse(responses.completion_chunk(envelope, i, echo[p], None, "length", running))
        if body.include_usage:
            yield responses.sse(responses.usage_chunk(envelope, "text_completion", usage))
        yield responses.DONE

    return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
