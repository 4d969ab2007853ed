"""What an endpoint that generates gives the shared exchange (gateway.exchange): its request body, its route and
id, and the shape of its answer, streamed chunk by chunk or whole. One subclass per endpoint, in its own module
(gateway.completions, gateway.chat); the exchange runs any of them without asking which it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from gateway.api import GenerationRequest
from gateway.errors import APIError
from gateway.generation import ChoiceEvent, Generation, Usage
from gateway.responses import DONE, Envelope, sse, usage_chunk
from gateway.text import Tokenizer

Body = TypeVar("Body", bound=GenerationRequest)
Chunks = dict[str, Any] | list[dict[str, Any]]  # one chunk, or several (none: an empty list)


class StreamedChoice(Protocol):
    """One choice of a streamed response: its events become chunks, in order."""

    def chunk(self, event: ChoiceEvent, usage: Usage | None) -> Chunks:
        """The chunk(s) of `event` (`usage`: so far, with vLLM's continuous_usage_stats)."""
        ...


class CollectedChoice:
    """One choice of a whole response, gathered from its events; an endpoint adds its own form of logprobs."""

    def __init__(self, position: int, text: str = "") -> None:
        self.position = position  # of the prompt (the generation) it answers
        self.text = text
        self.finish_reason: str | None = None
        self.cumulative = 0.0  # logprob of the chosen tokens: what best_of ranks by
        self.stop_string: str | None = None  # the stop string that ended it, if one did

    def add(self, event: ChoiceEvent) -> None:
        self.cumulative += sum(entry.logprob for entry in event.logprobs)
        self.text += event.text
        self.finish_reason = event.finish_reason or self.finish_reason
        self.stop_string = event.stop_string or self.stop_string


Collected = TypeVar("Collected", bound=CollectedChoice)


class Endpoint(ABC, Generic[Body, Collected]):
    """One request's endpoint-specific side: built from its parsed body, it makes the chunks and the body of
    the answer. `logprobs` is what the client asked for (the executor may be asked for more); `sampled` the
    choices generated per prompt, of which `body.n` are returned (more with best_of: the most likely)."""

    route: ClassVar[str]  # the metrics' route label
    id_prefix: ClassVar[str]  # of the response's id
    chunk_object: ClassVar[str]  # the `object` of its stream chunks (the usage chunk's too)
    done: ClassVar[str | None] = DONE  # what ends its stream (None: nothing after the last chunk)
    usage_at_opening: ClassVar[bool] = False  # `opening` gets the usage so far always, not only when asked

    def __init__(self, body: Body, tokenizer: Tokenizer, logprobs: int | None, sampled: int | None = None) -> None:
        self.body = body
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.sampled = body.n if sampled is None else sampled
        self.as_ids = body.return_tokens_as_token_ids  # vLLM's return_tokens_as_token_ids

    def response_id(self, request_id: str) -> str:
        return f"{self.id_prefix}-{request_id}"

    def opening(self, envelope: Envelope, index: int, usage: Usage | None) -> Chunks | None:
        """The chunk(s) a streamed choice starts with, before any output (None: none)."""
        return None

    def closing(self, envelope: Envelope, usage: Usage) -> Chunks:
        """The chunk(s) after every choice's last: usage, if the client asked for it (stream_options)."""
        return [usage_chunk(envelope, self.chunk_object, usage)] if self.body.include_usage else []

    def frame(self, chunk: dict[str, Any]) -> str:
        """One chunk as a server-sent event."""
        return sse(chunk)

    def error(self, error: APIError) -> dict[str, Any]:
        """The chunk of an error that ends a stream, in the endpoint's API's shape."""
        return error.body()

    @abstractmethod
    def streamed(self, envelope: Envelope, position: int, index: int) -> StreamedChoice:
        """Choice `index` of the stream, answering prompt `position`."""

    @abstractmethod
    def collected(self, position: int) -> Collected:
        """A choice of the whole response answering prompt `position`, before any of its events."""

    @abstractmethod
    def whole(
        self,
        envelope: Envelope,
        choices: Sequence[Collected],
        generations: Sequence[Generation],
        usage: Usage,
    ) -> dict[str, Any]:
        """The response body of the choices returned, in order."""
