"""OpenAI's Responses API (/v1/responses) with `client.responses` of the official `openai` SDK against a real
stack: the chat endpoint's greedy text for the same conversation (text or items input, instructions), semantic
stream events, function tools, structured output (text.format), previous_response_id on the bounded store,
store: false, retrieval and deletion; bad input is a 400 in OpenAI's shape that changes nothing. The store's
bounds (count, bytes, least recently used out) are checked on their own."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from gateway.response_store import ResponseStore
from pagedkv.serve import LocalStack
from tests.support.gateway import local_stack, tiny_model, wait_until_no_live_blocks

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]},
}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": WEATHER["parameters"], "description": WEATHER["description"]},
}
ITEMS = [
    {"role": "user", "content": "Weather in Bern?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Bern"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
    {"role": "user", "content": [{"type": "input_text", "text": "Thanks."}]},
]
CHAT_ITEMS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Bern?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "user", "content": "Thanks."},
]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    model_dir = tiny_model(tmp_path_factory.mktemp("responses-model"), "tiny", max_position=2048)
    with local_stack(model_dir, tmp_path_factory.mktemp("responses-logs"), executors=1) as running:
        yield running


@pytest.fixture
def client(stack: LocalStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c
    wait_until_no_live_blocks(stack)


def test_text_and_items_match_chat(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny", instructions="Be brief.", input="Hello there", max_output_tokens=10, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=10,
        temperature=0,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens

    items = client.responses.create(
        model="tiny", instructions="Be brief.", input=ITEMS, tools=[WEATHER], tool_choice="none", max_output_tokens=8
    )
    reference = client.chat.completions.create(
        model="tiny", messages=CHAT_ITEMS, tools=[CHAT_WEATHER], tool_choice="none", max_tokens=8
    )
    assert items.usage.input_tokens == reference.usage.prompt_tokens


def test_stream_sends_semantic_events(client: openai.OpenAI) -> None:
    asked = dict(model="tiny", input="Tell me a story", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**asked)
    events = list(client.responses.create(**asked, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == whole.output_text == final.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == deltas


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_tools(client: openai.OpenAI, tool_choice: object) -> None:
    asked = dict(model="tiny", input="Weather in Bern?", tools=[WEATHER], tool_choice=tool_choice, temperature=0)
    response = client.responses.create(**asked, max_output_tokens=120)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(**asked, max_output_tokens=120, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    items = client.responses.input_items.list(response.id)
    assert [item.type for item in items.data] == ["message"] and items.data[0].content[0].text == "Weather in Bern?"
    if isinstance(tool_choice, dict):  # a named function's arguments stream as they are written
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        assert deltas == call.arguments
    # the call's result goes back as an item, after the stored conversation
    follow = client.responses.create(
        model="tiny",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
    )
    assert follow.previous_response_id == response.id and follow.status in ("completed", "incomplete")


def test_structured_output_text_format(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny",
        input="A person as JSON",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        max_output_tokens=200,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_previous_response_store_retrieval_and_deletion(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=6, temperature=0)
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, input="And then?", max_output_tokens=6, temperature=0
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"},
        ],
        max_tokens=6,
        temperature=0,
    )
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    fetched = client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="tiny", previous_response_id=first.id, input="x", max_output_tokens=2)
    assert info.value.body["param"] == "previous_response_id"
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [(item.type, item.role, item.content[0].text) for item in listed.data] == [("message", "user", "And then?")]
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "frequency_penalty": 1}, "frequency_penalty"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "temperature": 3}, "temperature"),
    ],
)
def test_bad_requests_are_400_in_openai_shape_and_change_nothing(stack: LocalStack, body: dict, param: str) -> None:
    store = httpx.post(f"{stack.base_url}/responses", json={"input": "x", "max_output_tokens": 1}, timeout=60).json()
    answer = httpx.post(f"{stack.base_url}/responses", json={"model": "tiny", **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    assert httpx.get(f"{stack.base_url}/responses/{store['id']}", timeout=60).json()["id"] == store["id"]


def test_store_is_bounded_by_count_and_bytes_least_recently_used_out() -> None:
    store = ResponseStore(max_responses=2, max_bytes=400)
    for name in ("a", "b"):
        assert store.put({"id": name, "output": []}, [], [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put({"id": "c", "output": []}, [], [])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    big = {"id": "d", "output": ["x" * 360]}  # with either of the others, over 400 bytes
    assert store.put(big, [], [])
    assert len(store) == 1 and store.get("d") is not None and store.bytes <= 400
    assert not store.put({"id": "e", "output": ["x" * 500]}, [], []) and store.get("d") is not None
    assert store.delete("d") and store.bytes == 0 and not store.delete("d")


def test_items_conversion_and_error_event_without_a_stack() -> None:
    from gateway.errors import APIError
    from gateway.responses_api import ResponsesRequest
    from gateway.responses_endpoint import Responses

    body = ResponsesRequest.model_validate({"input": ITEMS, "instructions": "Be brief.", "tools": [WEATHER]})
    chat = body.chat([], body.input_messages(), "none")
    assert [m.for_template()["role"] for m in chat.messages] == [m["role"] for m in CHAT_ITEMS]
    assert chat.messages[2].tool_calls[0].id == "call_1" and chat.tool_choice == "none"
    endpoint = Responses(chat, None, "none", body, [], ResponseStore())  # type: ignore[arg-type]
    first, second = (endpoint.frame({"type": "response.in_progress"}) for _ in range(2))
    assert first.startswith("event: response.in_progress\n") and '"sequence_number":1' in second
    error = endpoint.frame(endpoint.error(APIError(502, "lost", type="server_error", code="executor_lost")))
    assert json.loads(error.split("data: ")[1]) == {
        "type": "error",
        "code": "executor_lost",
        "message": "lost",
        "param": None,
        "sequence_number": 2,
    }
