"""How a chat choice's text is answered: as content; as tool calls a parser finds in it (tool_choice 'auto'); or
as the call(s) a forced tool_choice (a named function, or 'required') constrained it to. One rule per request,
chosen from its body by `output_rule`; it makes a whole choice's message, and each streamed choice's deltas.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from gateway.api import ChatCompletionRequest
from gateway.generation import ChoiceEvent
from gateway.tool_calls import ToolCall, make_parser

Message = tuple[dict[str, Any], str | None]  # a message or a delta, and the choice's finish reason


class ChoiceDeltas(ABC):
    """One streamed choice's deltas, event by event."""

    @abstractmethod
    def delta(self, event: ChoiceEvent) -> Message: ...


class OutputRule(ABC):
    """What a request's choices answer with; the state a streamed choice needs is its `deltas`' own."""

    @abstractmethod
    def message(self, text: str, finish_reason: str | None) -> Message:
        """A whole choice's message (and finish reason) from its text."""

    @abstractmethod
    def deltas(self) -> ChoiceDeltas:
        """The deltas of one more streamed choice."""


def output_rule(body: ChatCompletionRequest, tool_call_parser: str) -> OutputRule:
    """The request's rule; `tool_call_parser`: the gateway's parser, for tool_choice 'auto'."""
    if body.named_tool is not None:
        return NamedToolCall(body.named_tool)
    if body.forces_tool_call:
        return RequiredToolCalls(body.parallel_tool_calls)
    if body.parses_tool_calls:
        return ParsedToolCalls(tool_call_parser, body.parallel_tool_calls)
    return Text()


class Text(OutputRule, ChoiceDeltas):
    """The text is the content."""

    def message(self, text: str, finish_reason: str | None) -> Message:
        return {"role": "assistant", "content": text}, finish_reason

    def deltas(self) -> ChoiceDeltas:
        return self  # nothing to hold per choice

    def delta(self, event: ChoiceEvent) -> Message:
        return ({"content": event.text} if event.text else {}), event.finish_reason


def _called(finish_reason: str | None) -> str | None:
    """A choice that ends with tool calls finishes with "tool_calls" unless it was cut short."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ParsedToolCalls(OutputRule):
    """Tool calls looked for in the text by the model family's parser; the text around them is content."""

    def __init__(self, parser: str, parallel: bool) -> None:
        self.parser = parser
        self.parallel = parallel  # False: the first call only

    def message(self, text: str, finish_reason: str | None) -> Message:
        parser = make_parser(self.parser)
        found = parser.feed(text)
        found.merge(parser.finish())
        calls = found.calls
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        if not self.parallel:
            calls = calls[:1]
        message = {"role": "assistant", "content": found.content or None, "tool_calls": [c.body() for c in calls]}
        return message, _called(finish_reason)

    def deltas(self) -> ChoiceDeltas:
        return _ParsedDeltas(self)


class _ParsedDeltas(ChoiceDeltas):
    """Content as it is ruled out of being a call; `tool_calls` entries as OpenAI streams them: a call's index,
    id, type and name once, then fragments of its arguments."""

    def __init__(self, rule: ParsedToolCalls) -> None:
        self.parser = make_parser(rule.parser)
        self.parallel = rule.parallel
        self.numbers: dict[str, int] = {}  # call id -> its index in this choice's tool calls

    def delta(self, event: ChoiceEvent) -> Message:
        found = self.parser.feed(event.text)
        if event.finish_reason is not None:
            found.merge(self.parser.finish())
        delta: dict[str, Any] = {"content": found.content} if found.content else {}
        numbers = self.numbers
        entries: dict[str, dict[str, Any]] = {}
        for call in found.calls:
            if not self.parallel and numbers:
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
        called = bool(numbers)  # numbers name only calls sent
        return delta, _called(event.finish_reason) if called else event.finish_reason


class NamedToolCall(OutputRule):
    """tool_choice names a function: the text is its arguments (finish reason as it is: vLLM's "stop")."""

    def __init__(self, name: str) -> None:
        self.name = name

    def message(self, text: str, finish_reason: str | None) -> Message:
        call = ToolCall(self.name, text)
        return {"role": "assistant", "content": None, "tool_calls": [call.body()]}, finish_reason

    def deltas(self) -> ChoiceDeltas:
        return _NamedDeltas(self.name)


class _NamedDeltas(ChoiceDeltas):
    """The call's id, type and name in the first chunk, then its arguments as they are generated."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id: str | None = None

    def delta(self, event: ChoiceEvent) -> Message:
        entry: dict[str, Any] = {"index": 0, "function": {"arguments": event.text}}
        if self.id is None:
            self.id = ToolCall(self.name, "").id
            entry.update(id=self.id, type="function")
            entry["function"]["name"] = self.name
        elif not event.text:
            return {}, event.finish_reason
        return {"tool_calls": [entry]}, event.finish_reason


class RequiredToolCalls(OutputRule):
    """tool_choice 'required': the text is a JSON array of {"name", "parameters"}, which becomes the calls
    (finish reason "tool_calls"). Text that is not the array (cut short by max_tokens) is answered as text."""

    def __init__(self, parallel: bool) -> None:
        self.parallel = parallel

    def message(self, text: str, finish_reason: str | None) -> Message:
        try:
            items = json.loads(text)
            calls = [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
        except (ValueError, TypeError, KeyError):
            return {"role": "assistant", "content": text}, finish_reason
        if not self.parallel:
            calls = calls[:1]
        message = {"role": "assistant", "content": None, "tool_calls": [c.body() for c in calls]}
        return message, _called(finish_reason)

    def deltas(self) -> ChoiceDeltas:
        return _RequiredDeltas(self)


class _RequiredDeltas(ChoiceDeltas):
    """The calls whole, once the choice's JSON array is complete (its last chunk)."""

    def __init__(self, rule: RequiredToolCalls) -> None:
        self.rule = rule
        self.text = ""

    def delta(self, event: ChoiceEvent) -> Message:
        self.text += event.text
        if event.finish_reason is None:
            return {}, None
        message, finish_reason = self.rule.message(self.text, event.finish_reason)
        if "tool_calls" not in message:
            return {"content": self.text} if self.text else {}, finish_reason
        calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        return {"tool_calls": calls}, finish_reason
