"""Structured output as the API asks for it: OpenAI's `response_format` (`json_object`, `json_schema`) and
vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, on completions and chat completions alike.

The gateway checks their shape and hands the executor a compact `GrammarSpec` (kind and source text); whether a
schema, regex or grammar is valid is decided where it is compiled, in the executor (xgrammar imports torch, which
the gateway never does), whose refusal comes back as a 400 that names the parameter.

JSON output is compact by default (no whitespace but the ", " and ": " separators): a model free to put any
whitespace between elements, as a weak one will, can fill max_tokens with blanks and never close the object.
`structured_outputs.any_whitespace: true` (or vLLM's `disable_any_whitespace: false`) allows runs of whitespace,
bounded by the executor (executor.structured.MAX_WHITESPACE). Tool calls forced by tool_choice are compact too.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from executor.params import MAX_GRAMMAR_CHARS, GrammarSpec
from gateway.errors import invalid_request

_STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's other keys of structured_outputs that pagedkv takes: xgrammar is its only backend (nothing to fall back
# from) and its JSON schemas are strict already (no properties beyond those listed, unless the schema says so).
_STRUCTURED_OUTPUTS_FLAGS = (
    "any_whitespace",
    "disable_any_whitespace",
    "disable_fallback",
    "disable_additional_properties",
)


class StructuredOutputFields(BaseModel):
    """The request fields that constrain the output; `grammar_spec` turns them into the executor's spec."""

    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def _guided(self) -> tuple[tuple[str, str, Any], ...]:
        """vLLM's older fields: each one's name, the kind of constraint it asks for, and its value."""
        return (
            ("guided_json", "json", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        )

    def constraint_fields(self) -> list[str]:
        """The fields given that constrain the output (response_format 'text' does not), in the order they are
        checked."""
        fields = [("response_format", self.response_format), ("structured_outputs", self.structured_outputs)]
        given = [name for name, value in fields + [(n, v) for n, _, v in self._guided()] if value is not None]
        if self.response_format is not None and self.response_format.get("type") == "text":
            given.remove("response_format")
        return given

    def grammar_spec(self) -> GrammarSpec | None:
        """The constraint asked for (None: free text); raises APIError (400, naming the parameter) if it is
        malformed, or if more than one parameter constrains the output."""
        specs: list[GrammarSpec] = []
        if self.response_format is not None:
            spec = _response_format(self.response_format)
            if spec is not None:
                specs.append(spec)
        if self.structured_outputs is not None:
            specs.append(_structured_outputs(self.structured_outputs))
        for name, kind, value in self._guided():
            if value is not None:
                specs.append(_spec(kind, value, name))
        if len(specs) > 1:
            raise invalid_request(
                "Only one structured output constraint is allowed per request, got "
                + ", ".join(spec.param for spec in specs),
                param=specs[1].param,
            )
        return specs[0] if specs else None


def _response_format(value: dict[str, Any]) -> GrammarSpec | None:
    kind = value.get("type")
    if kind == "text":
        _only_keys(value, ("type",), "response_format")
        return None
    if kind == "json_object":
        _only_keys(value, ("type",), "response_format")
        return GrammarSpec("json_object", any_whitespace=False, param="response_format")
    if kind == "json_schema":
        _only_keys(value, ("type", "json_schema"), "response_format")
        body = value.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(body, dict):
            raise invalid_request(f"{param} must be an object with the schema", param=param)
        _only_keys(body, ("name", "schema", "strict", "description"), param)
        if "name" in body and not isinstance(body["name"], str):
            raise invalid_request(f"{param}.name must be a string", param=f"{param}.name")
        if body.get("strict") is not None and not isinstance(body["strict"], bool):
            raise invalid_request(f"{param}.strict must be a boolean", param=f"{param}.strict")
        if body.get("schema") is None:
            raise invalid_request(f"{param}.schema is required: the JSON schema to follow", param=f"{param}.schema")
        return _spec("json", body["schema"], f"{param}.schema")
    if kind is None:
        raise invalid_request("response_format.type is required", param="response_format.type")
    raise invalid_request(
        f"response_format.type must be one of text, json_object, json_schema, got {kind!r}",
        param="response_format.type",
    )


def _structured_outputs(value: dict[str, Any]) -> GrammarSpec:
    _only_keys(value, (*_STRUCTURED_OUTPUTS_KINDS, *_STRUCTURED_OUTPUTS_FLAGS), "structured_outputs")
    for flag in _STRUCTURED_OUTPUTS_FLAGS:
        if flag in value and not isinstance(value[flag], bool):
            raise invalid_request(f"structured_outputs.{flag} must be a boolean", param=f"structured_outputs.{flag}")
    kinds = [k for k in _STRUCTURED_OUTPUTS_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid_request(
            "structured_outputs must set exactly one of "
            + ", ".join(_STRUCTURED_OUTPUTS_KINDS)
            + (f", got {', '.join(kinds)}" if kinds else ""),
            param="structured_outputs",
        )
    (kind,) = kinds
    any_whitespace = _any_whitespace(value)
    if kind == "json_object":
        if value["json_object"] is not True:
            raise invalid_request("structured_outputs.json_object must be true", param="structured_outputs.json_object")
        return GrammarSpec("json_object", any_whitespace=any_whitespace, param="structured_outputs.json_object")
    return _spec(kind, value[kind], f"structured_outputs.{kind}", any_whitespace)


def _any_whitespace(value: dict[str, Any]) -> bool:
    """Whether structured_outputs allows whitespace runs: `any_whitespace`, or vLLM's `disable_any_whitespace`
    (the opposite); compact when neither is given."""
    allowed, disabled = value.get("any_whitespace"), value.get("disable_any_whitespace")
    if allowed is not None and disabled is not None and allowed == disabled:
        raise invalid_request(
            "structured_outputs.any_whitespace and disable_any_whitespace contradict each other: give one",
            param="structured_outputs.any_whitespace",
        )
    if allowed is not None:
        return bool(allowed)
    return disabled is False


def _spec(kind: str, value: Any, param: str, any_whitespace: bool = False) -> GrammarSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise invalid_request(f"{param} is not valid JSON: {exc}", param=param) from None
        if not isinstance(value, dict):
            raise invalid_request(f"{param} must be a JSON schema (an object)", param=param)
        source = json.dumps(value, separators=(",", ":"), ensure_ascii=False)  # key order kept: it is the output's
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid_request(f"{param} must be a non-empty list of strings", param=param)
        source = json.dumps(value, ensure_ascii=False)
    else:  # regex, grammar
        if not isinstance(value, str) or not value:
            raise invalid_request(f"{param} must be a non-empty string", param=param)
        source = value
    if len(source) > MAX_GRAMMAR_CHARS:
        raise invalid_request(f"{param} is over {MAX_GRAMMAR_CHARS} characters", param=param)
    return GrammarSpec(kind, source, any_whitespace=any_whitespace, param=param)


def _only_keys(value: dict[str, Any], allowed: tuple[str, ...], param: str) -> None:
    unknown = [key for key in value if key not in allowed]
    if unknown:
        raise invalid_request(f"{param}.{unknown[0]} is not supported by pagedkv", param=f"{param}.{unknown[0]}")
