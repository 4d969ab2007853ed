"""/v1/messages' side of the exchange (Anthropic's Messages API): a chat choice's message (gateway.chat_output:
its text, or its tool calls) as content blocks, `text` and `tool_use`; the stop reason in Anthropic's words; and
the stream as Anthropic's events: message_start, ping, then per block content_block_start, its deltas
(text_delta, input_json_delta) and content_block_stop, then message_delta (stop reason, output tokens) and
message_stop. Each event is a server-sent event named by its type; nothing follows message_stop.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gateway.api import ChatCompletionRequest
from gateway.chat_output import ChoiceDeltas, output_rule
from gateway.endpoint import Chunks, CollectedChoice, Endpoint, StreamedChoice
from gateway.errors import APIError, anthropic_body
from gateway.generation import ChoiceEvent, Generation, Usage
from gateway.responses import Envelope
from gateway.text import Tokenizer


def anthropic_event(payload: dict[str, Any]) -> str:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {payload['type']}\ndata: {data}\n\n"


def message_usage(usage: Usage) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are those not read from the cache. The prefix cache is automatic, so
    nothing is written to it at the client's request (`cache_creation_input_tokens` 0); the hit is reported only
    where cached tokens are (a request with a cache salt, or --report-cached-tokens), else input is the prompt."""
    if not usage.report_cached:
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def stop_reason(finish_reason: str | None, stop_string: str | None, called: bool) -> str:
    if finish_reason == "length":
        return "max_tokens"
    if called or finish_reason == "tool_calls":
        return "tool_use"
    return "stop_sequence" if stop_string is not None else "end_turn"


def _input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Messages(Endpoint[ChatCompletionRequest, CollectedChoice]):
    route = "/v1/messages"
    id_prefix = "msg"
    chunk_object = "message"
    done = None  # message_stop ends the stream
    usage_at_opening = True  # message_start's usage carries the prefix hit

    def __init__(self, body: ChatCompletionRequest, tokenizer: Tokenizer, tool_call_parser: str, prompt: int) -> None:
        super().__init__(body, tokenizer, None)
        self.output = output_rule(body, tool_call_parser)
        self.prompt_tokens = prompt
        self.stream_end: tuple[str, str | None] = ("end_turn", None)  # the streamed choice's stop reason, sequence

    def response_id(self, request_id: str) -> str:
        return f"msg_{request_id}"

    def frame(self, chunk: dict[str, Any]) -> str:
        return anthropic_event(chunk)

    def error(self, error: APIError) -> dict[str, Any]:
        return anthropic_body(error)

    def message(self, envelope: Envelope, content: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        return {
            "id": envelope.id,
            "type": "message",
            "role": "assistant",
            "model": envelope.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": message_usage(usage),
        }

    def opening(self, envelope: Envelope, index: int, usage: Usage | None) -> Chunks:
        # (usage: the first event's, which carries the prefix hit; no output counted yet)
        opened = Usage(prompt_tokens=self.prompt_tokens)
        if usage is not None:
            opened = Usage(usage.prompt_tokens, 0, usage.cached_tokens, usage.report_cached)
        start = self.message(envelope, [], opened)
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def streamed(self, envelope: Envelope, position: int, index: int) -> StreamedChoice:
        return _StreamedMessage(self)

    def collected(self, position: int) -> CollectedChoice:
        return CollectedChoice(position)

    def closing(self, envelope: Envelope, usage: Usage) -> Chunks:
        reason, sequence = self.stream_end
        return [
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": usage.completion_tokens},
            },
            {"type": "message_stop"},
        ]

    def whole(
        self, envelope: Envelope, choices: Sequence[CollectedChoice], generations: Sequence[Generation], usage: Usage
    ) -> dict[str, Any]:
        (choice,) = choices
        message, finish_reason = self.output.message(choice.text, choice.finish_reason)
        content: list[dict[str, Any]] = []
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        called = False
        for call in message.get("tool_calls") or ():
            function = call["function"]
            arguments = _input(function["arguments"])
            if arguments is None:  # cut short (max_tokens): what was written is shown as text
                content.append({"type": "text", "text": function["arguments"]})
                continue
            called = True
            content.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments})
        body = self.message(envelope, content, usage)
        body["stop_reason"] = stop_reason(finish_reason, choice.stop_string, called)
        body["stop_sequence"] = choice.stop_string if body["stop_reason"] == "stop_sequence" else None
        return body


class _StreamedMessage:
    """The choice's chat deltas as content blocks: text runs and tool calls, each opened, filled and closed."""

    def __init__(self, endpoint: Messages) -> None:
        self.endpoint = endpoint
        self.deltas: ChoiceDeltas = endpoint.output.deltas()
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the kind of the block being written: "text", "tool_use"
        self.called = False

    def _start(self, block: dict[str, Any], out: list[dict[str, Any]]) -> None:
        self._stop(out)
        out.append({"type": "content_block_start", "index": self.blocks, "content_block": block})
        self.blocks += 1
        self.open = block["type"]

    def _stop(self, out: list[dict[str, Any]]) -> None:
        if self.open is not None:
            out.append({"type": "content_block_stop", "index": self.blocks - 1})
            self.open = None

    def _delta(self, delta: dict[str, Any], out: list[dict[str, Any]]) -> None:
        out.append({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})

    def chunk(self, event: ChoiceEvent, usage: Usage | None) -> Chunks:
        delta, finish_reason = self.deltas.delta(event)
        out: list[dict[str, Any]] = []
        if delta.get("content"):
            if self.open != "text":
                self._start({"type": "text", "text": ""}, out)
            self._delta({"type": "text_delta", "text": delta["content"]}, out)
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if "id" in call:
                self.called = True
                self._start({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}, out)
            if function.get("arguments"):
                self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}, out)
        if finish_reason is not None:
            self._stop(out)
            reason = stop_reason(finish_reason, event.stop_string, self.called)
            self.endpoint.stream_end = (reason, event.stop_string if reason == "stop_sequence" else None)
        return out
