"""Anthropic's Messages API as this gateway accepts it (/v1/messages, /v1/messages/count_tokens): the request
bodies, validated, and made into the chat request the rest of the gateway runs (gateway.api's
ChatCompletionRequest), so that the chat template, tool calls and forced tool grammars are the chat endpoint's.

A system prompt (a string or text blocks) becomes the system message; text blocks are joined; an assistant's
`tool_use` blocks become its tool calls and a user's `tool_result` blocks tool messages (before the user's text).
`tools` (name, description, input_schema) become functions; `tool_choice` auto / any / tool / none map to
auto / required / a named function / none (`disable_parallel_tool_use`: parallel_tool_calls false).
Unknown fields are refused, as on the OpenAI routes; `metadata` and `cache_control` are accepted and ignored
(they change nothing generated); images, documents and extended thinking are refused.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.api import ChatCompletionRequest, ParamError, chat_request
from gateway.errors import invalid_request

ANTHROPIC_MAX_STOP_SEQUENCES = 16


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here: nothing to mark


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text


Block = TextBlock | ToolUseBlock | ToolResultBlock
_KNOWN_BLOCKS = ("text", "tool_use", "tool_result")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _supported_blocks(cls, value: Any) -> Any:
        content = value.get("content") if isinstance(value, dict) else None
        if isinstance(content, list):
            for block in content:
                kind = block.get("type") if isinstance(block, dict) else None
                if kind not in _KNOWN_BLOCKS:
                    raise ParamError(
                        "messages",
                        f"content blocks of type {kind!r} are not supported by pagedkv (text, tool_use and "
                        "tool_result only: no images, documents or thinking)",
                    )
        return value

    def blocks(self) -> list[Block]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content

    def for_chat(self) -> list[dict[str, Any]]:
        """This message as chat messages: a user's tool results first (tool messages), then its text; an
        assistant's text with its tool calls."""
        blocks = self.blocks()
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if self.role == "assistant":
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise invalid_request("tool_result blocks belong in user messages", param="messages")
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = calls
            return [message]
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            raise invalid_request("tool_use blocks belong in assistant messages", param="messages")
        out: list[dict[str, Any]] = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in blocks
            if isinstance(b, ToolResultBlock)
        ]
        if text or not out:
            out.append({"role": "user", "content": text})
        return out


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None

    def for_chat(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ParamError("tool_choice", "tool_choice.name is required with type 'tool', and only then")
        return self


class Thinking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["disabled"]  # extended thinking is not offered


class MessagesPrompt(BaseModel):
    """What makes the prompt: the body of /v1/messages/count_tokens, and the core of /v1/messages."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages += message.for_chat()
        return messages

    def chat_prompt(self) -> ChatCompletionRequest:
        """A chat request with this prompt (its messages and tools), to count its tokens."""
        fields: dict[str, Any] = {"model": self.model, "messages": self.chat_messages()}
        tools = self.chat_tools().get("tools")
        if tools:
            fields["tools"] = tools
        return chat_request(fields)

    def chat_tools(self) -> dict[str, Any]:
        """The chat request's tools and tool_choice; `auto` only where a parser can find the calls."""
        if not self.tools:
            if self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
                raise invalid_request("tool_choice 'any' or 'tool' needs tools", param="tool_choice")
            return {}
        choice = self.tool_choice.type if self.tool_choice is not None else "auto"
        fields: dict[str, Any] = {"tools": [tool.for_chat() for tool in self.tools]}
        if choice == "any":
            fields["tool_choice"] = "required"
        elif choice == "tool":
            assert self.tool_choice is not None
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        else:
            fields["tool_choice"] = choice
        if self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
        return fields


class MessagesRequest(MessagesPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=ANTHROPIC_MAX_STOP_SEQUENCES)
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id: nothing here depends on it
    service_tier: Literal["auto", "standard_only"] | None = None

    def chat(self, tool_call_parser: str) -> ChatCompletionRequest:
        """The chat request that generates this message; `tool_call_parser` the gateway's (tool_choice auto
        without one answers text: the tools are still in the prompt). Raises APIError (400)."""
        tools = self.chat_tools()
        if tools.get("tool_choice") == "auto" and tool_call_parser == "none":
            tools["tool_choice"] = "none"
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": self.chat_messages(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": self.stream,
            **tools,
        }
        if self.stop_sequences:
            fields["stop"] = self.stop_sequences
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        if self.top_k is not None:
            fields["top_k"] = self.top_k
        return chat_request(fields)
