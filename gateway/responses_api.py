"""OpenAI's Responses API as this gateway accepts it (/v1/responses): the request body, validated, and made into
the chat request the rest of the gateway runs (gateway.api's ChatCompletionRequest).

`input` is a string (one user message) or items: messages (role user / assistant / system / developer, content a
string or input_text / output_text parts), `function_call` and `function_call_output` items (what a previous
response's output and the caller's tool results are); `instructions` become the system message (never carried
over from a previous response, as OpenAI's); `previous_response_id` puts the stored conversation before `input`.
Function tools (name, description, parameters), `tool_choice` (none / auto / required / {"type": "function",
"name"}), `text.format` (text, json_object, json_schema: the chat endpoint's response_format) and
`max_output_tokens`, `temperature`, `top_p`. Unknown fields and other tool types are refused.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.api import ChatCompletionRequest, ParamError, chat_request
from gateway.errors import invalid_request

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def for_chat(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters or {"type": "object"}}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None

    def response_format(self) -> dict[str, Any]:
        """As the chat endpoint's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        if self.schema_ is None:
            raise invalid_request("text.format.schema is required with type json_schema", param="text.format.schema")
        body: dict[str, Any] = {"name": self.name or "output", "schema": self.schema_}
        if self.strict is not None:
            body["strict"] = self.strict
        return {"type": "json_schema", "json_schema": body}


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint for reasoning models: nothing here


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{where}.content must be a string or a list of parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid_request(
                f"{where}.content parts must be input_text or output_text with text (pagedkv serves text only), "
                f"got {kind!r}",
                param="input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid_request(f"{where}.{key} must be a string", param="input")
    return value


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls join one assistant message's tool calls."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise invalid_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param="input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant":
                last["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, where)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        elif kind == "reasoning":
            continue  # a reasoning model's notes: nothing a chat template shows
        else:
            raise invalid_request(f"{where}.type {kind!r} is not supported by pagedkv", param="input")
    return messages


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = Field(default=None, max_length=0)  # nothing extra to include
    service_tier: Literal["auto", "default"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _tool_types(cls, value: Any) -> Any:
        tools = value.get("tools") if isinstance(value, dict) else None
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ParamError("tools", f"tools of type {kind!r} are not supported by pagedkv (function tools only)")
        return value

    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input as chat messages (without instructions or the previous conversation)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise invalid_request("input must not be empty", param="input")
        return chat_messages(self.input)

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as the items retrieval lists: each with an id and a status, a message's content
        as parts."""
        given = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        items = []
        for item in given:
            kind = item.get("type", "message")
            item = {**item, "type": kind, "status": item.get("status", "completed")}
            if kind == "message" and isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}.get(kind, "item")
            item.setdefault("id", f"{prefix}_{uuid.uuid4().hex}")
            items.append(item)
        return items

    def chat(
        self, history: list[dict[str, Any]], new: list[dict[str, Any]], tool_call_parser: str
    ) -> ChatCompletionRequest:
        """The chat request that answers: instructions, the `history` (of previous_response_id), the `new`
        input; tool_choice auto answers text where the gateway has no tool-call parser."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history + new
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        if self.tools:
            fields["tools"] = [tool.for_chat() for tool in self.tools]
            choice = self.tool_choice or "auto"
            if isinstance(choice, FunctionChoice):
                choice = {"type": "function", "function": {"name": choice.name}}
            elif choice == "auto" and tool_call_parser == "none":
                choice = "none"
            fields["tool_choice"] = choice
        elif self.tool_choice not in (None, "none", "auto"):
            raise invalid_request("tool_choice 'required' or a function needs tools", param="tool_choice")
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.response_format()
        return chat_request(fields)

    def echo(self) -> dict[str, Any]:
        """The request's settings, as a response repeats them."""
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text is not None else {}
        return {
            "instructions": self.instructions,
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or ()],
            "tool_choice": (
                self.tool_choice.model_dump() if isinstance(self.tool_choice, FunctionChoice) else self.tool_choice
            )
            or "auto",
            "parallel_tool_calls": self.parallel_tool_calls,
            "text": {"format": {"type": "text"}, **text},
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "metadata": self.metadata or {},
            "user": self.user,
            "truncation": "disabled",
        }
