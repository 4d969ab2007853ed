"""Tool-call parsers: what they find in a model's output, whole or streamed in pieces of any size."""

from __future__ import annotations

import json

import pytest

from gateway.tool_calls import HermesParser, Llama3JsonParser, ToolParser, detect_parser, make_parser
from tests.support.tools import HISTORY, TOOLS, hf_messages


def run(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    """Content and calls (name, parsed arguments) found in `pieces`; the arguments' fragments must add up."""
    content, calls, arguments = "", [], {}
    deltas = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    for delta in deltas:
        content += delta.content
        calls += delta.calls
        for call, fragment in delta.fragments:
            assert call in calls, "a fragment of a call not announced yet"
            arguments[call.id] = arguments.get(call.id, "") + fragment
    assert all(arguments.get(c.id, "") == c.arguments for c in calls)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


HERMES_CASES = [
    ("Hello there.", "Hello there.", []),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris", "unit": "C"})],
    ),
    (
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"y": "é<"}}\n</tool_call>\n',
        "Let me check.",
        [("a", {"x": 1}), ("b", {"y": "é<"})],
    ),
    ('<tool_call>{"name": "open", "arguments": {}}', "", [("open", {})]),  # the end tag never came
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ("a < b <tool and <tool_cal", "a < b <tool and <tool_cal", []),
    ('<tool_call>{"name": "s", "arguments": "{\\"q\\": 2}"}</tool_call>', "", [("s", {"q": 2})]),
    ("  spaced  ", "  spaced  ", []),
    (
        '<tool_call> {"name": "n\\u00e9", "parameters": {"s": "}} </tool_call", "n": {"a": [1, {"b": 2}]} } }\n'
        "</tool_call>",
        "",
        [("né", {"s": "}} </tool_call", "n": {"a": [1, {"b": 2}]}})],
    ),
    ('<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>', "", [("late", {"x": 1})]),
]


@pytest.mark.parametrize(("output", "content", "calls"), HERMES_CASES)
def test_hermes_whole_and_split_at_every_boundary(output: str, content: str, calls: list) -> None:
    assert run(HermesParser(), [output]) == (content, calls)
    for cut in range(len(output) + 1):
        assert run(HermesParser(), [output[:cut], output[cut:]]) == (content, calls), cut
    assert run(HermesParser(), list(output)) == (content, calls)


LLAMA_CASES = [
    ("The answer is 4.", "The answer is 4.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    (
        '  <|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"k": [1]}}',
        "",
        [("f", {}), ("g", {"k": [1]})],
    ),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "f", "parameters": {"x": 1}', '{"name": "f", "parameters": {"x": 1}', []),
    ("<|python", "<|python", []),
    ("\n\n", "\n\n", []),
]


@pytest.mark.parametrize(("output", "content", "calls"), LLAMA_CASES)
def test_llama3_json_whole_and_split_at_every_boundary(output: str, content: str, calls: list) -> None:
    assert run(Llama3JsonParser(), [output]) == (content, calls)
    for cut in range(len(output) + 1):
        assert run(Llama3JsonParser(), [output[:cut], output[cut:]]) == (content, calls), cut
    assert run(Llama3JsonParser(), list(output)) == (content, calls)


def test_arguments_stream_as_the_model_writes_them() -> None:
    parser = HermesParser()
    first = parser.feed('Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first.content == "Hi" and [c.name for c in first.calls] == ["get_weather"]
    assert "".join(f for _, f in first.fragments) == '{"city": "Pa'
    more = parser.feed('ris"}')
    assert "".join(f for _, f in more.fragments) == 'ris"', "the brace may still be the call's own"
    more = parser.feed("}\n</tool")
    assert "".join(f for _, f in more.fragments) == "}", "the second brace is the call's own: the first is not"
    last = parser.feed("_call>")
    assert not last and first.calls[0].arguments == '{"city": "Paris"}'


def test_content_streams_before_the_output_ends() -> None:
    parser = HermesParser()
    assert parser.feed("Hello <tool").content == "Hello"
    assert parser.feed("box> more").content == " <toolbox> more"
    llama = Llama3JsonParser()
    assert llama.feed(" Sure").content == " Sure" and llama.feed("!").content == "!"


def test_call_ids_are_unique_and_bodies_in_openais_shape() -> None:
    parser = HermesParser()
    delta = parser.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "a"}</tool_call>')
    first, second = delta.calls
    assert first.id != second.id
    assert first.body() == {"id": first.id, "type": "function", "function": {"name": "a", "arguments": "{}"}}


def test_detect_parser_by_template() -> None:
    assert detect_parser("... <tool_call>\\n{{ tool_call | tojson }} ...") == "hermes"
    assert detect_parser("{{- '<|python_tag|>' }}") == "llama3_json"
    assert detect_parser("{{ messages }}") == "none" and detect_parser(None) == "none"
    assert isinstance(make_parser("hermes"), HermesParser)
    with pytest.raises(ValueError):
        make_parser("none")


# ---------------------------------------------------------------------------------------------- rendering


def test_tools_and_tool_history_render_as_the_templates_own_rendering(tmp_path) -> None:
    from transformers import AutoTokenizer

    from gateway.api import ChatCompletionRequest, chat_tools
    from gateway.text import Tokenizer
    from tests.support.gateway import tiny_model

    model_dir = tiny_model(tmp_path, "tiny-tools")
    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    ours = Tokenizer(model_dir)
    messages = [m.for_template() for m in body.messages]
    for tools in (TOOLS, None):
        rendered = ours.render_chat(messages, True, chat_tools(body.tools) if tools else None)
        expected = hf.apply_chat_template(hf_messages(), tools=tools, add_generation_prompt=True, tokenize=False)
        assert rendered == expected
    assert "<tool_call>" in rendered and "<tool_response>" in rendered and "get_weather" in rendered
    assert detect_parser(ours.chat_templates["default"]) == "hermes"


# ---------------------------------------------------------------------------------------------- in responses

CALLING = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


def endpoint(parallel: bool = True):
    from gateway.api import ChatCompletionRequest
    from gateway.chat import ChatCompletions

    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "parallel_tool_calls": parallel}
    )
    return ChatCompletions(body, None, "hermes")  # type: ignore[arg-type]  # no logprobs: no tokenizer needed


@pytest.mark.parametrize("size", [1, 3, 7, len(CALLING)])
def test_streamed_tool_call_deltas_in_openais_shape(size: int) -> None:
    from gateway.generation import ChoiceEvent
    from gateway.responses import Envelope

    streamed = endpoint().streamed(Envelope("chatcmpl-r", 0, "m"), 0, 0)
    pieces = [CALLING[i : i + size] for i in range(0, len(CALLING), size)]
    chunks = []
    for number, piece in enumerate(pieces):
        finish = "stop" if number == len(pieces) - 1 else None
        chunks.append(streamed.chunk(ChoiceEvent(0, piece, [], finish), None))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Checking."
    entries = [entry for d in deltas for entry in d.get("tool_calls", [])]
    calls = [entry for entry in entries if "id" in entry]  # announcements; then fragments of the arguments
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [
        (0, "function", "get_weather"),
        (1, "function", "now"),
    ]
    arguments = ["".join(e["function"]["arguments"] for e in entries if e["index"] == i) for i in (0, 1)]
    assert [json.loads(a) for a in arguments] == [{"city": "Zürich"}, {}] and calls[0]["id"]
    if size == 1:  # streamed as written: many fragments
        assert sum(1 for e in entries if e["index"] == 0) > 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the openai SDK reads them
    from openai.types.chat import ChatCompletionChunk

    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    names = [t.function.name for c in parsed for t in c.choices[0].delta.tool_calls or () if t.id]
    assert names == ["get_weather", "now"]


def test_whole_message_with_tool_calls() -> None:
    message, finish = endpoint().output.message(CALLING, "stop")
    assert finish == "tool_calls" and message["content"] == "Checking."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "now"]
    from openai.types.chat import ChatCompletionMessage

    sdk = ChatCompletionMessage.model_validate(message)
    assert sdk.tool_calls and json.loads(sdk.tool_calls[0].function.arguments) == {"city": "Zürich"}
    single, _ = endpoint(parallel=False).output.message(CALLING, "stop")
    assert [c["function"]["name"] for c in single["tool_calls"]] == ["get_weather"]
    plain, finish = endpoint().output.message("just text ", "length")
    assert plain == {"role": "assistant", "content": "just text "} and finish == "length"


def forced(tool_choice: object, parallel: bool = True):
    from gateway.api import ChatCompletionRequest
    from gateway.chat_output import output_rule

    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "parallel_tool_calls": parallel,
        }
    )
    return output_rule(body, "hermes")


def streamed_deltas(rule, text: str, size: int, finish: str) -> list[tuple[dict, str | None]]:
    from gateway.generation import ChoiceEvent

    deltas = rule.deltas()
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        deltas.delta(ChoiceEvent(0, piece, [], finish if k == len(pieces) - 1 else None))
        for k, piece in enumerate(pieces)
    ]


def test_a_named_tool_choice_streams_its_call_then_its_arguments() -> None:
    rule = forced({"type": "function", "function": {"name": "get_weather"}})
    arguments = '{"city": "Zürich"}'
    message, finish = rule.message(arguments, "stop")
    assert finish == "stop" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", arguments)
    ]
    deltas = streamed_deltas(rule, arguments, 4, "stop")
    entries = [entry for delta, _ in deltas for entry in delta["tool_calls"]]
    assert entries[0]["id"] and entries[0]["function"]["name"] == "get_weather"
    assert all("id" not in entry for entry in entries[1:]), "the call is announced once"
    assert "".join(e["function"]["arguments"] for e in entries) == arguments and deltas[-1][1] == "stop"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_come_whole_once_the_array_is_complete(parallel: bool) -> None:
    rule = forced("required", parallel)
    array = json.dumps([{"name": "get_weather", "parameters": {"city": "Z"}}, {"name": "now", "parameters": {}}])
    deltas = streamed_deltas(rule, array, 6, "stop")
    assert all(delta == ({}, None) for delta in deltas[:-1]), "nothing before the array is whole"
    last, finish = deltas[-1]
    names = [c["function"]["name"] for c in last["tool_calls"]]
    assert names == (["get_weather", "now"] if parallel else ["get_weather"]) and finish == "tool_calls"
    assert [c["index"] for c in last["tool_calls"]] == list(range(len(names)))
    cut = '[{"name": "get_w'  # max_tokens reached inside the array: answered as the text it is
    assert rule.message(cut, "length") == ({"role": "assistant", "content": cut}, "length")
    assert streamed_deltas(rule, cut, 5, "length")[-1] == ({"content": cut}, "length")
