"""langchain-openai against pagedkv serve, as its users write it: bind_tools with each tool_choice, and
with_structured_output for json_schema, json_mode and function_calling.

Usage: python langchain_check.py [BASE_URL] [MODEL]   (default http://127.0.0.1:8011/v1, default-llama)
Prints each case's answer or exception; exits 0 when all succeeded (tests/gateway/test_langchain.py runs it).
"""

from __future__ import annotations

import json
import sys
import traceback

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

BASE_URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8011/v1"
MODEL = sys.argv[2] if len(sys.argv) > 2 else "default-llama"


class Person(BaseModel):
    """A person."""

    # bounded, so that a random-weight model's output ends within max_tokens (an unbounded string runs on)
    name: str = Field(description="the person's name", max_length=16)
    age: int = Field(description="the person's age in years", ge=0, le=150)


class City(BaseModel):
    city: str = Field(description="the city", max_length=24)  # bounded, as Person's name is


@tool(args_schema=City)
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


def llm(**kwargs) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=BASE_URL, api_key="x", model=MODEL, max_tokens=256, temperature=0, max_retries=0, **kwargs
    )


def called(result) -> bool:
    return bool(result.tool_calls)


def parsed(result) -> bool:
    return result["parsed"] is not None and result["parsing_error"] is None


def json_object(result) -> bool:
    """json_mode asks for any JSON object: whether a random-weight model's fits the schema is chance."""
    try:
        return isinstance(json.loads(result["raw"].content), dict)
    except ValueError:
        return False


def show(name: str, fn, succeeded=lambda result: True) -> bool:
    """Run one case and print what came back or the exception (type, status, body); it succeeded when it ran and
    `succeeded` holds (a forced tool call came back as a call, a structured output parsed into the schema)."""
    print(f"=== {name}")
    try:
        result = fn()
    except Exception as exc:
        status = getattr(exc, "status_code", None)
        body = getattr(exc, "body", None)
        print(f"EXCEPTION {type(exc).__module__}.{type(exc).__name__} status={status}")
        print(f"  message: {str(exc)[:600]}")
        if body is not None:
            print(f"  body: {json.dumps(body)[:600]}")
        traceback.print_exc(limit=2, file=sys.stdout)
        return False
    if isinstance(result, dict) and "raw" in result:  # include_raw=True
        raw = result["raw"]
        print(f"raw.content: {raw.content!r}"[:400])
        print(f"raw.tool_calls: {getattr(raw, 'tool_calls', None)}"[:400])
        print(f"raw.response_metadata.finish_reason: {raw.response_metadata.get('finish_reason')}")
        print(f"parsed: {result['parsed']!r}"[:400])
        print(f"parsing_error: {result['parsing_error']!r}"[:400])
    else:
        print(f"content: {getattr(result, 'content', result)!r}"[:400])
        print(f"tool_calls: {getattr(result, 'tool_calls', None)}"[:400])
        meta = getattr(result, "response_metadata", {}) or {}
        print(f"finish_reason: {meta.get('finish_reason')}")
    ok = succeeded(result)
    print("succeeded" if ok else "FAILED")
    return ok


results = {
    "bind_tools.invoke": show(
        "bind_tools([get_weather]).invoke",
        lambda: llm().bind_tools([get_weather]).invoke("What is the weather in Paris?"),
    ),
    "bind_tools(tool_choice='any').invoke": show(
        "bind_tools([get_weather], tool_choice='any').invoke",
        lambda: llm().bind_tools([get_weather], tool_choice="any").invoke("What is the weather in Paris?"),
        called,
    ),
    "bind_tools(tool_choice='get_weather').invoke": show(
        "bind_tools([get_weather], tool_choice='get_weather').invoke",
        lambda: llm().bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?"),
        called,
    ),
}
PROMPT = "Extract the person as JSON with keys name and age: Alice is 30 years old."
for method in ("json_schema", "json_mode", "function_calling"):
    results[f"with_structured_output({method})"] = show(
        f"with_structured_output(Person, method={method!r}, include_raw=True).invoke",
        lambda method=method: llm().with_structured_output(Person, method=method, include_raw=True).invoke(PROMPT),
        json_object if method == "json_mode" else parsed,
    )
print("=== summary")
for name, ok in results.items():
    print(f"{name}: {'succeeded' if ok else 'failed'}")
sys.exit(0 if all(results.values()) else 1)
