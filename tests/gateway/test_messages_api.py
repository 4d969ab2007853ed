"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the official `anthropic` SDK, unchanged,
against a real stack with an API key: the same greedy text as the chat endpoint given the same conversation,
streamed in Anthropic's event sequence, stop reasons (end_turn, max_tokens, stop_sequence, tool_use), usage, forced
tool use with tool_use / tool_result blocks in the history, x-api-key, and errors in Anthropic's shape that leave
the stack as it was."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from pagedkv.serve import LocalStack
from tests.support.gateway import local_stack, tiny_model, wait_until_no_live_blocks

KEY = "sk-messages"
# The SDK has no sampling arguments any more (the API still takes temperature, top_p and top_k): sent as extra_body
GREEDY = {"temperature": 0}
GREEDY_TOP_K = {"temperature": 0, "top_p": 0.9, "top_k": 1}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Bern?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Bern"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21 C"}]},
            {"type": "text", "text": "Thanks."},
        ],
    },
]
# The same conversation as chat messages, as gateway.messages_api makes them.
CHAT_HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Bern?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
    {"role": "user", "content": "Thanks."},
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": WEATHER["name"],
            "parameters": WEATHER["input_schema"],
            "description": WEATHER["description"],
        },
    }
]


def blocks(message: object) -> list[tuple]:
    """A message's content blocks, whatever classes the SDK parsed them into (streamed ones are subclasses)."""
    return [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in message.content]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    model_dir: Path = tiny_model(tmp_path_factory.mktemp("messages-model"), "tiny", max_position=2048)
    logs = tmp_path_factory.mktemp("messages-logs")
    with local_stack(model_dir, logs, executors=1, gateway_args=["--api-key", KEY]) as running:
        yield running


@pytest.fixture
def client(stack: LocalStack) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=stack.url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c
    wait_until_no_live_blocks(stack)


@pytest.fixture
def chat(stack: LocalStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def test_text_matches_chat_whole_and_streamed(client: anthropic.Anthropic, chat: openai.OpenAI) -> None:
    system = [{"type": "text", "text": "Be"}, {"type": "text", "text": " brief."}]
    message = client.messages.create(
        model="tiny", max_tokens=12, system=system, messages=HISTORY, tools=[WEATHER], extra_body=GREEDY_TOP_K
    )
    reference = chat.chat.completions.create(
        model="tiny",
        max_tokens=12,
        messages=CHAT_HISTORY,
        tools=CHAT_TOOLS,
        tool_choice="none",
        temperature=0,
    )
    text = reference.choices[0].message.content
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == (["text"] if text else [])
    assert (message.content[0].text if text else "") == text
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[reference.choices[0].finish_reason]
    assert message.usage.input_tokens == reference.usage.prompt_tokens
    assert message.usage.output_tokens == reference.usage.completion_tokens
    counted = client.messages.count_tokens(model="tiny", system=system, messages=HISTORY, tools=[WEATHER])
    assert counted.input_tokens == reference.usage.prompt_tokens

    with client.messages.stream(
        model="tiny", max_tokens=12, system="Be brief.", messages=HISTORY, tools=[WEATHER], extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    if text:
        assert kinds[1:4] == ["content_block_start", "content_block_delta", "text"]
        assert kinds[-3] == "content_block_stop"
    assert blocks(final) == blocks(message) and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens


def test_max_tokens_and_stop_sequences(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": "Count: one two three"}]
    long = client.messages.create(model="tiny", max_tokens=24, messages=messages, extra_body=GREEDY)
    assert long.stop_reason == "max_tokens" and long.usage.output_tokens == 24
    text = long.content[0].text
    stop = text.strip()[4:7]
    assert stop and stop in text
    cut = client.messages.create(
        model="tiny", max_tokens=24, messages=messages, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    with client.messages.stream(
        model="tiny", max_tokens=24, messages=messages, extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == stop
    assert blocks(streamed) == blocks(cut)


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_whole_and_streamed(client: anthropic.Anthropic, tool_choice: dict) -> None:
    asked = dict(
        model="tiny",
        max_tokens=120,
        messages=[{"role": "user", "content": "Weather in Bern?"}],
        tools=[WEATHER],
        tool_choice=tool_choice,
        extra_body=GREEDY,
    )
    message = client.messages.create(**asked)
    assert message.stop_reason == "tool_use"
    (use,) = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with client.messages.stream(**asked) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [block.type for block in starts] == ["tool_use"] and starts[0].name == "get_weather"
    if tool_choice["type"] == "tool":  # a named tool's arguments stream as they are written
        assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert final.stop_reason == "tool_use" and final.content[0].input == use.input


def test_x_api_key_and_errors_in_anthropic_shape(stack: LocalStack, client: anthropic.Anthropic) -> None:
    url = f"{stack.url}/v1/messages"
    good = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    assert httpx.post(url, json=good, headers=headers, timeout=60).status_code == 200
    with (
        anthropic.Anthropic(base_url=stack.url, api_key="wrong", max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError) as info,
    ):
        wrong.messages.create(**good)
    assert info.value.status_code == 401 and info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "authentication_error"
    bad_bodies = [
        {**good, "temperature": 1.5},
        {k: v for k, v in good.items() if k != "max_tokens"},
        {**good, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {**good, "frequency_penalty": 1},
        {**good, "tool_choice": {"type": "any"}},
        {**good, "messages": [{"role": "system", "content": "x"}]},
        {**good, "model": "another"},
        {**good, "thinking": {"type": "enabled", "budget_tokens": 1024}},
    ]
    for body in bad_bodies:
        answer = httpx.post(url, json=body, headers=headers, timeout=60)
        assert answer.status_code in (400, 404), (body, answer.text)
        error = answer.json()
        assert error["type"] == "error" and error["error"]["message"], error
        assert error["error"]["type"] == ("not_found_error" if answer.status_code == 404 else "invalid_request_error")
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}], extra_body={"top_p": 0}
        )
    assert bad.value.body["type"] == "error" and "top_p" in bad.value.body["error"]["message"]
    version = httpx.post(url, json=good, headers={**headers, "anthropic-version": "latest"}, timeout=60)
    assert version.status_code == 400 and "anthropic-version" in version.json()["error"]["message"]
    # the stack is as it was: the same request still answers
    again = client.messages.create(**good)
    assert again.usage.output_tokens >= 1
    assert json.loads(again.model_dump_json())["type"] == "message"


def test_conversion_and_stream_framing_without_a_stack() -> None:
    from gateway.errors import APIError, anthropic_body
    from gateway.generation import ChoiceEvent
    from gateway.messages import Messages
    from gateway.messages_api import MessagesRequest

    body = MessagesRequest.model_validate(
        {"max_tokens": 5, "system": "Be brief.", "messages": HISTORY, "tools": [WEATHER], "stop_sequences": ["x"]}
    )
    chat = body.chat("hermes")
    assert [m.for_template() for m in chat.messages] == [
        {
            **m,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": {"city": "Bern"}}} for c in m["tool_calls"]
            ],
        }
        if "tool_calls" in m
        else m
        for m in CHAT_HISTORY
    ]
    assert chat.tool_choice == "auto" and chat.stop == ["x"] and body.chat("none").tool_choice == "none"
    endpoint = Messages(chat, None, "hermes", 7)  # type: ignore[arg-type]  # no logprobs: no tokenizer needed
    streamed = endpoint.streamed(None, 0, 0)  # type: ignore[arg-type]
    events = streamed.chunk(ChoiceEvent(0, "hi"), None) + streamed.chunk(  # type: ignore[operator]
        ChoiceEvent(0, "", finish_reason="stop", stop_string="x"), None
    )
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert endpoint.stream_end == ("stop_sequence", "x")
    error = endpoint.frame(endpoint.error(APIError(502, "lost", type="server_error")))
    assert error.startswith("event: error\ndata: ") and json.loads(error.split("data: ")[1]) == anthropic_body(
        APIError(502, "lost", type="server_error")
    )
    assert anthropic_body(APIError(502, "lost", type="server_error"))["error"]["type"] == "api_error"
