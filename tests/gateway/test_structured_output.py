"""Structured output through the whole stack with the official `openai` client: OpenAI's `response_format` as the
SDK sends it, vLLM's `structured_outputs` and `guided_*` in `extra_body`. Greedy output of the random-weight tiny
model under each constraint parses and validates (jsonschema); constraints that do not compile are a 400 that
names the parameter."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from pagedkv.serve import LocalStack
from tests.support.gateway import local_stack, tiny_model, wait_until_no_live_blocks

MAX_TOKENS = 400
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    model_dir = tiny_model(tmp_path_factory.mktemp("structured-model"), "tiny")
    with local_stack(model_dir, tmp_path_factory.mktemp("structured-logs"), executors=1) as running:
        yield running


@pytest.fixture
def client(stack: LocalStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c
    wait_until_no_live_blocks(stack)


def test_chat_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)

    # Any JSON object: nothing bounds its strings, which a random-weight model ends only by chance; this prompt's
    # greedy output is one that closes (compact JSON, the default) well within max_tokens.
    streamed = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A JSON object, please."}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert isinstance(json.loads(text), dict)


def test_completions_with_vllm_fields(client: openai.OpenAI) -> None:
    def complete(**extra: object) -> tuple[str, str | None]:
        response = client.completions.create(
            model="tiny", prompt="Answer:", max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        return response.choices[0].text, response.choices[0].finish_reason

    text, reason = complete(structured_outputs={"json": PERSON, "disable_any_whitespace": True})
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    text, reason = complete(guided_json=json.dumps(PERSON))
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    text, reason = complete(structured_outputs={"regex": r"\d{3}-[A-Z]{2}"})
    assert reason == "stop" and re.fullmatch(r"\d{3}-[A-Z]{2}", text)
    text, reason = complete(guided_choice=["north", "south", "east west"])
    assert reason == "stop" and text in ("north", "south", "east west")
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    text, reason = complete(guided_grammar=grammar)
    assert reason == "stop" and re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
        ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
    ],
)
def test_invalid_constraints_are_a_400_naming_the_parameter(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, **kwargs)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
