"""Tool calls in a model's output, found as text streams in by a parser for the model family's format
(`hermes`, `llama3_json`; `auto` picks by the chat template). A parser turns a choice's text increments into
`ToolDelta`s: content to show, calls announced (id and name), and fragments of their arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway import TOOL_CALL_PARSERS

__all__ = [
    "TOOL_CALL_PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "ToolCall",
    "ToolDelta",
    "detect_parser",
    "make_parser",
]


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)  # newly announced (their arguments so far included)
    fragments: list[tuple[ToolCall, str]] = field(default_factory=list)  # more arguments text of announced calls

    def __bool__(self) -> bool:
        return bool(self.content or self.calls or self.fragments)

    def merge(self, other: ToolDelta) -> None:
        self.content += other.content
        self.calls += other.calls
        self.fragments += other.fragments


def _call(value: Any, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a parsed JSON value: an object with a string name and object arguments, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = next((value[key] for key in arguments_keys if key in value), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolParser:
    """One choice's parser. `feed` text as it comes, then `finish` once.

    What is fed in pieces gives the same result as what is fed at once, whatever the pieces. Text that may still
    turn out to be part of a call is held back; text that turns out not to be one (a malformed call) is released
    as content at the end, as the model wrote it.
    """

    def feed(self, text: str) -> ToolDelta:
        raise NotImplementedError

    def finish(self) -> ToolDelta:
        raise NotImplementedError


# The head of a call whose arguments can stream: its name first, then an arguments object.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_TAIL = re.compile(r"\s*\}?\s*$")  # what may still be the end of the call after its arguments


class HermesParser(ToolParser):
    """Hermes, Qwen 2.5 / 3 and the models trained on their format: each call is
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text around the calls is content.

    Calls whose JSON starts with the name and then an arguments object are announced as soon as their name is
    in, and their arguments stream as the model writes them (as it wrote them; all but what may still be the
    call's closing brace). Other calls are announced once complete, their arguments parsed and written anew."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""  # not yet released: a possible start tag, or a call being written
        self._inside = False
        self._blank = ""  # whitespace at the end of the content so far: dropped if a call follows it
        self._call: ToolCall | None = None  # the call being streamed
        self._arguments_at = 0  # where its arguments start in the buffer
        self.calls = 0

    def _stream(self, out: ToolDelta, body: str) -> bool:
        """The call being written (`body`: its text so far): announced once its head is in, then its arguments
        so far are sent. False if it has no such head (it is parsed once complete)."""
        if self._call is None:
            head = _HEAD.match(body)
            if head is None:
                return False
            try:
                name = json.loads(f'"{head.group(1)}"')
            except json.JSONDecodeError:
                return False
            self._call = ToolCall(name, "")
            self._arguments_at = head.end()
            self.calls += 1
            out.calls.append(self._call)
        arguments = body[self._arguments_at : len(body) - _partial_suffix(body, self.END)]
        tail = _TAIL.search(arguments)
        if tail is not None:
            arguments = arguments[: tail.start()]
        more = arguments[len(self._call.arguments) :]
        if more:
            self._call.arguments += more
            out.fragments.append((self._call, more))
        return True

    def _content(self, out: ToolDelta, text: str) -> None:
        """Content, but blanks that end it are held: they are the gap before a call, or the end after one."""
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body) :]
        out.content += body

    def feed(self, text: str) -> ToolDelta:
        self._buffer += text
        out = ToolDelta()
        while True:
            if not self._inside:
                at = self._buffer.find(self.START)
                if at < 0:
                    keep = _partial_suffix(self._buffer, self.START)
                    self._content(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                self._content(out, self._buffer[:at])
                self._buffer = self._buffer[at:]
                self._blank = ""  # the gap before a call
                self._inside = True
            end = self._buffer.find(self.END)
            if end < 0:
                self._stream(out, self._buffer[len(self.START) :])
                return out
            raw = self._buffer[: end + len(self.END)]
            self._buffer = self._buffer[end + len(self.END) :]
            self._inside = False
            self._close(out, raw[len(self.START) : -len(self.END)], raw)

    def _close(self, out: ToolDelta, body: str, raw: str) -> None:
        """A call's whole text: the rest of a streamed call's arguments, or the call parsed; or, if it is none,
        the model's text as written."""
        if self._stream(out, body):
            self._call = None
            return
        call = self._parse(body)
        if call is None:
            self._content(out, raw)
        else:
            out.calls.append(call)
            out.fragments.append((call, call.arguments))

    def finish(self) -> ToolDelta:
        raw, self._buffer = self._buffer, ""
        out = ToolDelta()
        if self._inside:  # a call the output ended in, without its end tag
            self._inside = False
            if self._stream(out, raw[len(self.START) :]):
                self._call = None
                raw = ""
            else:
                call = self._parse(raw[len(self.START) :])
                if call is not None:
                    out.calls.append(call)
                    out.fragments.append((call, call.arguments))
                    raw = ""
        self._content(out, raw)
        if not self.calls:  # no call: the content keeps its blanks
            out.content += self._blank
        self._blank = ""
        return out

    def _parse(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body.strip())
        except json.JSONDecodeError:
            return None
        call = _call(value, ("arguments", "parameters"))
        if call is not None:
            self.calls += 1
        return call


class Llama3JsonParser(ToolParser):
    """Llama 3.1 / 3.2 / 3.3: the output is either tool calls, JSON objects `{"name": ..., "parameters": {...}}`
    separated by `;`, or content, decided by its first non-blank character: `{` (or `<|python_tag|>`) means calls."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # None: undecided; "content"; "calls"

    def feed(self, text: str) -> ToolDelta:
        if self._mode == "content":
            return ToolDelta(content=text)
        self._buffer += text
        if self._mode is None:
            head = self._buffer.lstrip()
            if head.startswith("{") or head.startswith(self.TAG):
                self._mode = "calls"
            elif not head or self.TAG.startswith(head):
                return ToolDelta()  # blank so far, or maybe the tag
            else:
                self._mode = "content"
                text, self._buffer = self._buffer, ""
                return ToolDelta(content=text)
        return ToolDelta()  # calls are announced at the end: until then it may still turn out to be content

    def finish(self) -> ToolDelta:
        raw, self._buffer = self._buffer, ""
        if self._mode != "calls":
            return ToolDelta(content=raw)
        body = raw.lstrip().removeprefix(self.TAG)
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        at = 0
        while True:
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
            if at == len(body):
                break
            try:
                value, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return ToolDelta(content=raw)
            call = _call(value, ("parameters", "arguments"))
            if call is None:
                return ToolDelta(content=raw)
            calls.append(call)
        if not calls:
            return ToolDelta(content=raw)
        return ToolDelta(calls=calls, fragments=[(call, call.arguments) for call in calls])


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def detect_parser(template: str | None) -> str:
    """The parser for a chat template's tool-call format ("none" when it shows none pagedkv knows)."""
    if not template:
        return "none"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3_json"
    return "none"


def make_parser(name: str) -> ToolParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"no tool-call parser named {name!r}")
