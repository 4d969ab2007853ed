"""Tools and a tool-call history the tool-calling tests render and send."""

from __future__ import annotations

import json

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
ARGUMENTS = {"city": "Zürich"}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS, ensure_ascii=False)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def hf_messages() -> list[dict]:
    """HISTORY as transformers' templates take it (and vLLM hands it to them): the call's arguments parsed."""
    messages = json.loads(json.dumps(HISTORY))
    messages[2]["tool_calls"][0]["function"]["arguments"] = ARGUMENTS
    return messages
