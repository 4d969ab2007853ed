"""/v1/chat/completions' side of the exchange: each choice a message (its text, or the tool calls in it: see
gateway.chat_output), streamed as deltas after a first chunk with the assistant's role; logprobs per token with
their bytes; vLLM's prompt_logprobs once, beside the choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from executor import protocol as ep
from gateway.api import ChatCompletionRequest
from gateway.chat_output import ChoiceDeltas, output_rule
from gateway.endpoint import CollectedChoice, Endpoint, StreamedChoice
from gateway.generation import ChoiceEvent, Generation, Usage
from gateway.responses import Envelope, prompt_logprobs, token_label, usage_body
from gateway.text import Tokenizer


class ChatChoice(CollectedChoice):
    def __init__(self, endpoint: ChatCompletions, position: int) -> None:
        super().__init__(position)
        self.endpoint = endpoint
        self.logprobs: list[dict[str, Any]] = []

    def add(self, event: ChoiceEvent) -> None:
        self.logprobs += self.endpoint.logprobs_of(event.logprobs) or []
        super().add(event)


class ChatCompletions(Endpoint[ChatCompletionRequest, ChatChoice]):
    route = "/v1/chat/completions"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, body: ChatCompletionRequest, tokenizer: Tokenizer, tool_call_parser: str) -> None:
        super().__init__(body, tokenizer, body.logprobs_k)
        self.output = output_rule(body, tool_call_parser)

    def opening(self, envelope: Envelope, index: int, usage: Usage | None) -> dict[str, Any]:
        return chat_chunk(envelope, index, {"role": "assistant", "content": ""}, None, None, usage)

    def streamed(self, envelope: Envelope, position: int, index: int) -> StreamedChoice:
        return _StreamedChat(self, envelope, index)

    def collected(self, position: int) -> ChatChoice:
        return ChatChoice(self, position)

    def logprobs_of(self, entries: Sequence[ep.TokenLogprob]) -> list[dict[str, Any]] | None:
        """Some tokens' logprobs in the chat format (None: not asked for)."""
        if self.logprobs is None:
            return None
        return chat_logprobs(self.tokenizer, entries, self.logprobs, self.as_ids)

    def whole(
        self, envelope: Envelope, choices: Sequence[ChatChoice], generations: Sequence[Generation], usage: Usage
    ) -> dict[str, Any]:
        answers = []
        for i, choice in enumerate(choices):
            message, finish_reason = self.output.message(choice.text, choice.finish_reason)
            answers.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": finish_reason,
                    "logprobs": {"content": choice.logprobs} if self.logprobs is not None else None,
                }
            )
        body = chat_body(envelope, answers, usage)
        k = self.body.prompt_logprobs
        if k is not None:  # vLLM's chat responses carry them once, beside the choices
            body["prompt_logprobs"] = prompt_logprobs(self.tokenizer, generations[0].prompt_logprobs, k, self.as_ids)
        return body


class _StreamedChat:
    def __init__(self, endpoint: ChatCompletions, envelope: Envelope, index: int) -> None:
        self.endpoint = endpoint
        self.envelope = envelope
        self.index = index
        self.deltas: ChoiceDeltas = endpoint.output.deltas()

    def chunk(self, event: ChoiceEvent, usage: Usage | None) -> dict[str, Any]:
        delta, finish_reason = self.deltas.delta(event)
        logprobs = self.endpoint.logprobs_of(event.logprobs)
        return chat_chunk(self.envelope, self.index, delta, logprobs, finish_reason, usage)


def chat_logprobs(
    tokenizer: Tokenizer, entries: Sequence[ep.TokenLogprob], top: int, as_ids: bool = False
) -> list[dict[str, Any]]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_label(tokenizer, token_id, as_ids),
            "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id)),
        }

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top[:top]]} for e in entries]


def chat_chunk(
    env: Envelope,
    index: int,
    delta: dict[str, Any],
    logprobs: list[dict[str, Any]] | None,
    finish_reason: str | None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    chunk = {
        "id": env.id,
        "object": ChatCompletions.chunk_object,
        "created": env.created,
        "model": env.model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else {"content": logprobs},
                "finish_reason": finish_reason,
            }
        ],
    }
    if usage is not None:  # vLLM's continuous_usage_stats
        chunk["usage"] = usage_body(usage)
    return chunk


def chat_body(env: Envelope, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return {
        "id": env.id,
        "object": "chat.completion",
        "created": env.created,
        "model": env.model,
        "choices": choices,
        "usage": usage_body(usage),
    }
