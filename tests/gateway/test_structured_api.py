"""How the gateway maps the structured-output fields (OpenAI's response_format, vLLM's structured_outputs and
guided_*) to the executor's GrammarSpec, and the malformed shapes it refuses itself, naming the parameter. Whether
a schema, regex or grammar compiles is the executor's to say (tests/executor/test_structured.py,
tests/serve/test_structured_output.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from executor.params import GrammarSpec
from gateway.api import ChatCompletionRequest, CompletionRequest
from gateway.errors import APIError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
COMPACT = '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}},"required":["a"]}'


def spec(model: type, **fields: Any) -> GrammarSpec | None:
    base = {"messages": [{"role": "user", "content": "hi"}]} if model is ChatCompletionRequest else {"prompt": "hi"}
    return model.model_validate({**base, **fields}).sampling(16, None).structured


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        (
            {"response_format": {"type": "json_object"}},
            GrammarSpec("json_object", any_whitespace=False, param="response_format"),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            GrammarSpec("json", COMPACT, any_whitespace=False, param="response_format.json_schema.schema"),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            GrammarSpec("json", COMPACT, any_whitespace=False, param="structured_outputs.json"),
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA, indent=2), "disable_any_whitespace": True}},
            GrammarSpec("json", COMPACT, any_whitespace=False, param="structured_outputs.json"),
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "any_whitespace": True}},
            GrammarSpec("json", COMPACT, any_whitespace=True, param="structured_outputs.json"),
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
            GrammarSpec("json_object", any_whitespace=True, param="structured_outputs.json_object"),
        ),
        (
            {"structured_outputs": {"regex": "a+"}},
            GrammarSpec("regex", "a+", any_whitespace=False, param="structured_outputs.regex"),
        ),
        (
            {"structured_outputs": {"choice": ["x", "y"]}},
            GrammarSpec("choice", '["x", "y"]', any_whitespace=False, param="structured_outputs.choice"),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            GrammarSpec("grammar", 'root ::= "a"', any_whitespace=False, param="structured_outputs.grammar"),
        ),
        (
            {"structured_outputs": {"json_object": True}},
            GrammarSpec("json_object", any_whitespace=False, param="structured_outputs.json_object"),
        ),
        ({"guided_json": SCHEMA}, GrammarSpec("json", COMPACT, any_whitespace=False, param="guided_json")),
        ({"guided_regex": "[0-9]"}, GrammarSpec("regex", "[0-9]", any_whitespace=False, param="guided_regex")),
        ({"guided_choice": ["a"]}, GrammarSpec("choice", '["a"]', any_whitespace=False, param="guided_choice")),
        (
            {"guided_grammar": 'root ::= "a"'},
            GrammarSpec("grammar", 'root ::= "a"', any_whitespace=False, param="guided_grammar"),
        ),
    ],
)
def test_fields_map_to_one_grammar_spec(model: type, fields: dict[str, Any], expected: GrammarSpec | None) -> None:
    assert spec(model, **fields) == expected


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}},
            "response_format.json_schema.extra",
        ),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}},
            "structured_outputs.disable_any_whitespace",
        ),
        (
            {"structured_outputs": {"json": {}, "any_whitespace": True, "disable_any_whitespace": True}},
            "structured_outputs.any_whitespace",
        ),
        ({"guided_json": "[1, 2]"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ],
)
def test_malformed_constraints_are_refused_naming_the_parameter(fields: dict[str, Any], param: str) -> None:
    for model in (ChatCompletionRequest, CompletionRequest):
        with pytest.raises(APIError) as info:
            spec(model, **fields)
        assert info.value.status == 400 and info.value.param == param, info.value.message


def test_spec_is_part_of_the_wire_and_checked_by_the_executor() -> None:
    from executor import protocol as ep
    from executor.params import SamplingParams

    params = SamplingParams(structured=GrammarSpec("regex", "a+", param="guided_regex"))
    message = ep.Submit(request_id="r", prompt=b"\0\0\0\0", params=params)
    assert ep.decode_inbound(ep.encode(message)) == message
    assert SamplingParams(structured=GrammarSpec("yaml", "x")).validate(512) is not None
    assert SamplingParams(structured=GrammarSpec("regex", "")).validate(512) is not None
    assert params.validate(512) is None and not params.processes_logits
