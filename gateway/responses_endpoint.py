"""/v1/responses' side of the exchange (OpenAI's Responses API): a chat choice's message (gateway.chat_output) as
output items, a `message` with its `output_text` and a `function_call` per tool call; the response object, kept
in the store (gateway.response_store) unless `store` is false; and the stream as semantic events, each a
server-sent event named by its type with a sequence number: response.created, response.in_progress, per item
response.output_item.added, (a message's) response.content_part.added, response.output_text.delta ...
response.output_text.done, response.content_part.done, (a call's) response.function_call_arguments.delta ...
.done, response.output_item.done; then response.completed (response.incomplete when max_output_tokens cut it).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from gateway.api import ChatCompletionRequest
from gateway.chat_output import ChoiceDeltas, output_rule
from gateway.endpoint import Chunks, CollectedChoice, Endpoint, StreamedChoice
from gateway.errors import APIError
from gateway.generation import ChoiceEvent, Generation, Usage
from gateway.response_store import ResponseStore
from gateway.responses import Envelope
from gateway.responses_api import ResponsesRequest
from gateway.text import Tokenizer


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [text_part(text)] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens if usage.report_cached else 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def as_chat_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant's chat message, for the conversation that follows it."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


class Responses(Endpoint[ChatCompletionRequest, CollectedChoice]):
    route = "/v1/responses"
    id_prefix = "resp"
    chunk_object = "response"
    done = None  # response.completed ends the stream

    def __init__(
        self,
        chat: ChatCompletionRequest,
        tokenizer: Tokenizer,
        tool_call_parser: str,
        request: ResponsesRequest,
        conversation: list[dict[str, Any]],
        store: ResponseStore,
    ) -> None:
        super().__init__(chat, tokenizer, None)
        self.output = output_rule(chat, tool_call_parser)
        self.request = request
        self.conversation = conversation  # the history and this input, as chat messages
        self.store = store
        self.sequence = 0
        self.streamed_items: list[dict[str, Any]] = []
        self.finish_reason: str | None = None

    def response_id(self, request_id: str) -> str:
        return f"resp_{request_id}"

    def frame(self, chunk: dict[str, Any]) -> str:
        chunk["sequence_number"] = self.sequence
        self.sequence += 1
        data = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
        return f"event: {chunk['type']}\ndata: {data}\n\n"

    def error(self, error: APIError) -> dict[str, Any]:
        return {"type": "error", "code": error.code, "message": error.message, "param": error.param}

    def response(
        self, envelope: Envelope, output: list[dict[str, Any]], finish_reason: str | None, usage: Usage | None
    ) -> dict[str, Any]:
        """The response object; `usage` None: still in progress."""
        incomplete = finish_reason == "length"
        status = "in_progress" if usage is None else ("incomplete" if incomplete else "completed")
        return {
            "id": envelope.id,
            "object": "response",
            "created_at": envelope.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete and usage is not None else None,
            "model": envelope.model,
            "output": output,
            "usage": None if usage is None else response_usage(usage),
            **self.request.echo(),
        }

    def finished(self, envelope: Envelope, output: list[dict[str, Any]], finish: str | None, usage: Usage) -> Any:
        body = self.response(envelope, output, finish, usage)
        if self.request.store:
            self.store.put(body, [*self.conversation, as_chat_message(output)], self.request.input_items())
        return body

    def opening(self, envelope: Envelope, index: int, usage: Usage | None) -> Chunks:
        start = self.response(envelope, [], None, None)
        return [{"type": "response.created", "response": start}, {"type": "response.in_progress", "response": start}]

    def streamed(self, envelope: Envelope, position: int, index: int) -> StreamedChoice:
        return _StreamedResponse(self)

    def collected(self, position: int) -> CollectedChoice:
        return CollectedChoice(position)

    def closing(self, envelope: Envelope, usage: Usage) -> Chunks:
        body = self.finished(envelope, self.streamed_items, self.finish_reason, usage)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [{"type": kind, "response": body}]

    def whole(
        self, envelope: Envelope, choices: Sequence[CollectedChoice], generations: Sequence[Generation], usage: Usage
    ) -> dict[str, Any]:
        (choice,) = choices
        message, finish_reason = self.output.message(choice.text, choice.finish_reason)
        output = []
        if message.get("content"):
            output.append(message_item(_item_id("msg"), message["content"], "completed"))
        for call in message.get("tool_calls") or ():
            function = call["function"]
            output.append(call_item(_item_id("fc"), call["id"], function["name"], function["arguments"], "completed"))
        return self.finished(envelope, output, finish_reason, usage)


class _StreamedResponse:
    """The choice's chat deltas as output items: a message's text, then tool calls, each added, filled, done."""

    def __init__(self, endpoint: Responses) -> None:
        self.endpoint = endpoint
        self.deltas: ChoiceDeltas = endpoint.output.deltas()
        self.items = endpoint.streamed_items  # the items done, as the final response lists them
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""  # of the open message

    def _close(self, out: list[dict[str, Any]]) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": len(self.items)}
        if item["type"] == "message":
            part = text_part(self.text)
            out.append(
                {"type": "response.output_text.done", **where, "content_index": 0, "text": self.text, "logprobs": []}
            )
            out.append({"type": "response.content_part.done", **where, "content_index": 0, "part": part})
            item = message_item(item["id"], self.text, "completed")
        else:
            out.append({"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]})
            item = {**item, "status": "completed"}
        out.append({"type": "response.output_item.done", "output_index": len(self.items), "item": item})
        self.items.append(item)

    def _add(self, item: dict[str, Any], out: list[dict[str, Any]]) -> None:
        self._close(out)
        self.open = item
        out.append({"type": "response.output_item.added", "output_index": len(self.items), "item": dict(item)})

    def chunk(self, event: ChoiceEvent, usage: Usage | None) -> Chunks:
        delta, finish_reason = self.deltas.delta(event)
        out: list[dict[str, Any]] = []
        text = delta.get("content")
        if text:
            if self.open is None or self.open["type"] != "message":
                self._add(message_item(_item_id("msg"), "", "in_progress"), out)
                self.text = ""
                assert self.open is not None
                where = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
                out.append({"type": "response.content_part.added", **where, "part": text_part("")})
            assert self.open is not None
            self.text += text
            where = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
            out.append({"type": "response.output_text.delta", **where, "delta": text, "logprobs": []})
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if "id" in call:
                self._add(call_item(_item_id("fc"), call["id"], function["name"], "", "in_progress"), out)
            arguments = function.get("arguments")
            if arguments and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += arguments
                where = {"item_id": self.open["id"], "output_index": len(self.items)}
                out.append({"type": "response.function_call_arguments.delta", **where, "delta": arguments})
        if finish_reason is not None:
            self._close(out)
            self.endpoint.finish_reason = finish_reason
        return out
