"""/v1/completions' side of the exchange: each choice its text (with echo, after its prompt's), logprobs in the
legacy parallel lists, best_of's extra choices sampled and the most likely returned, vLLM's prompt_logprobs per
choice; and echo with max_tokens 0, which the gateway answers alone.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from executor import protocol as ep
from gateway.api import CompletionRequest
from gateway.endpoint import CollectedChoice, Endpoint, StreamedChoice
from gateway.generation import ChoiceEvent, Generation, Usage
from gateway.responses import DONE, Envelope, prompt_logprobs, sse, token_label, usage_body, usage_chunk
from gateway.state import Gateway
from gateway.text import Tokenizer


@dataclass
class CompletionLogprobs:
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, tokenizer: Tokenizer, entries: Sequence[ep.TokenLogprob], offset: int, as_ids: bool = False) -> None:
        """Entries of tokens whose text starts at character `offset` of the choice's text (`as_ids`: tokens
        named `token_id:N`, vLLM's return_tokens_as_token_ids)."""
        pending = b""  # bytes of a character that the next tokens complete
        for entry in entries:
            self.tokens.append(token_label(tokenizer, entry.token_id, as_ids))
            self.token_logprobs.append(entry.logprob)
            self.top_logprobs.append({token_label(tokenizer, t, as_ids): lp for t, lp in entry.top})
            self.text_offset.append(offset)
            pending += tokenizer.token_bytes(entry.token_id)
            try:
                offset += len(pending.decode("utf-8"))
                pending = b""
            except UnicodeDecodeError:
                pass  # the offset moves once the character is whole

    def add_prompt(
        self,
        tokenizer: Tokenizer,
        prompt: Sequence[int],
        entries: Sequence[ep.TokenLogprob],
        top: int,
        as_ids: bool = False,
    ) -> None:
        """echo: the prompt's tokens come first, its first token with a null logprob and top_logprobs (OpenAI)."""
        start = len(self.tokens)
        self.add(tokenizer, [ep.TokenLogprob(prompt[0], 0.0, []), *entries], 0, as_ids)
        self.token_logprobs[start] = None
        self.top_logprobs[start] = None
        for i, entry in enumerate(entries, start + 1):
            self.top_logprobs[i] = {token_label(tokenizer, t, as_ids): lp for t, lp in entry.top[:top]}

    def extend(self, other: CompletionLogprobs) -> None:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


class CompletionChoice(CollectedChoice):
    def __init__(self, endpoint: Completions, position: int) -> None:
        super().__init__(position, endpoint.echo[position] if endpoint.echo is not None else "")
        self.endpoint = endpoint
        self.logprobs = CompletionLogprobs()

    def add(self, event: ChoiceEvent) -> None:
        endpoint = self.endpoint
        if endpoint.logprobs is not None:  # the offsets count the text so far (the echoed prompt too)
            self.logprobs.add(endpoint.tokenizer, event.logprobs, len(self.text), endpoint.as_ids)
        super().add(event)


class Completions(Endpoint[CompletionRequest, CompletionChoice]):
    route = "/v1/completions"
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, body: CompletionRequest, tokenizer: Tokenizer, echo: Sequence[str] | None) -> None:
        super().__init__(body, tokenizer, body.logprobs, body.sampled_choices)
        self.echo = echo  # per prompt: its text, put before each of its choices' text

    def streamed(self, envelope: Envelope, position: int, index: int) -> StreamedChoice:
        return _StreamedCompletion(self, envelope, position, index)

    def collected(self, position: int) -> CompletionChoice:
        return CompletionChoice(self, position)

    def whole(
        self,
        envelope: Envelope,
        choices: Sequence[CompletionChoice],
        generations: Sequence[Generation],
        usage: Usage,
    ) -> dict[str, Any]:
        answers = []
        for i, choice in enumerate(choices):
            generation = generations[choice.position]
            logprobs = None
            if self.logprobs is not None:
                logprobs = self._with_echo(generation, choice.logprobs).body()
            answer: dict[str, Any] = {
                "index": i,
                "text": choice.text,
                "finish_reason": choice.finish_reason,
                "logprobs": logprobs,
            }
            k = self.body.prompt_logprobs  # vLLM's (echo's are in the choices' logprobs)
            if k is not None:
                answer["prompt_logprobs"] = prompt_logprobs(self.tokenizer, generation.prompt_logprobs, k, self.as_ids)
            answers.append(answer)
        return completion_body(envelope, answers, usage)

    def _with_echo(self, generation: Generation, generated: CompletionLogprobs) -> CompletionLogprobs:
        """With echo, a choice's logprobs start with its prompt tokens' (the first one null), scored by the
        executor; the generated tokens' offsets already count the echoed text."""
        if self.echo is None:
            return generated
        echoed = CompletionLogprobs()
        echoed.add_prompt(
            self.tokenizer, generation.prompt, generation.prompt_logprobs or [], self.logprobs or 0, self.as_ids
        )
        echoed.extend(generated)
        return echoed


class _StreamedCompletion:
    def __init__(self, endpoint: Completions, envelope: Envelope, position: int, index: int) -> None:
        self.endpoint = endpoint
        self.envelope = envelope
        self.position = position
        self.index = index
        self.started = False
        self.offset = 0  # the length of the choice's text streamed so far

    def chunk(self, event: ChoiceEvent, usage: Usage | None) -> dict[str, Any]:
        endpoint = self.endpoint
        text = event.text
        if not self.started and endpoint.echo is not None:  # the choice's first chunk: the prompt first
            text = endpoint.echo[self.position] + text
        self.started = True
        logprobs = None
        if endpoint.logprobs is not None:
            accumulated = CompletionLogprobs()
            accumulated.add(endpoint.tokenizer, event.logprobs, self.offset, endpoint.as_ids)
            logprobs = accumulated.body()
        self.offset += len(text)
        return completion_chunk(self.envelope, self.index, text, logprobs, event.finish_reason, usage)


def echo_only(gateway: Gateway, body: CompletionRequest, prompts: list[list[int]], echo: Sequence[str]) -> Response:
    """`echo` with `max_tokens: 0`: each choice is its prompt's text, nothing is generated."""
    envelope = Envelope(f"{Completions.id_prefix}-{uuid.uuid4().hex}", int(time.time()), gateway.model_name)
    usage = Usage(prompt_tokens=sum(len(p) for p in prompts), report_cached=False)  # nothing ran: nothing cached
    indices = [(p, p * body.n + j) for p in range(len(prompts)) for j in range(body.n)]
    gateway.metrics.requests.labels(route=Completions.route, status="200").inc()
    if not body.stream:
        choices = [{"index": i, "text": echo[p], "finish_reason": "length", "logprobs": None} for p, i in indices]
        return JSONResponse(completion_body(envelope, choices, usage))

    async def chunks() -> AsyncIterator[str]:
        for p, i in indices:
            running = usage if body.continuous_usage else None
            yield sse(completion_chunk(envelope, i, echo[p], None, "length", running))
        if body.include_usage:
            yield sse(usage_chunk(envelope, Completions.chunk_object, usage))
        yield DONE

    return StreamingResponse(chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def completion_chunk(
    env: Envelope,
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    chunk = {
        "id": env.id,
        "object": Completions.chunk_object,
        "created": env.created,
        "model": env.model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage is not None:  # vLLM's continuous_usage_stats
        chunk["usage"] = usage_body(usage)
    return chunk


def completion_body(env: Envelope, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return {
        "id": env.id,
        "object": "text_completion",
        "created": env.created,
        "model": env.model,
        "choices": choices,
        "usage": usage_body(usage),
    }
