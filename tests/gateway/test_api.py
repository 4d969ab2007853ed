"""gateway.api (request bodies: validation, prompts, sampling) and the shapes of responses: gateway.responses
(SSE, usage), gateway.completions and gateway.chat (their bodies, chunks and logprobs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from executor import protocol as ep
from executor.params import MAX_LOGPROBS, SamplingParams
from gateway import completions, responses
from gateway.api import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    require_json_object,
    validation_message,
)
from gateway.chat import chat_body, chat_chunk, chat_logprobs
from gateway.errors import APIError, invalid_request
from gateway.generation import Usage
from gateway.text import Tokenizer
from pagedkv.tools.model_gen import write_model
from tests.support.models import TINY

HI = [{"role": "user", "content": "hi"}]


def refusal(model: type[BaseModel], body: dict[str, Any]) -> tuple[str, str | None]:
    """validation_message for a body that must not validate."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_message(info.value.errors())


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": HI, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hello", **fields}


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "model, body", [(CompletionRequest, completion(frobnicate=1)), (ChatCompletionRequest, chat(frobnicate=True))]
)
def test_unknown_field_is_named(model: type[BaseModel], body: dict[str, Any]) -> None:
    assert refusal(model, body) == ("Unrecognized request argument supplied: frobnicate", "frobnicate")


def test_unknown_nested_field_is_named_with_its_path() -> None:
    message, param = refusal(
        CompletionRequest, completion(stream=True, stream_options={"include_usage": True, "bogus": 1})
    )
    assert (message, param) == ("Unrecognized request argument supplied: stream_options.bogus", "stream_options.bogus")
    message, param = refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "extra": 1}]})
    assert param == "messages.0.extra" and message.startswith("Unrecognized request argument supplied")


def test_missing_messages() -> None:
    assert refusal(ChatCompletionRequest, {"model": "m"}) == ("Missing required parameter: messages", "messages")
    assert refusal(CompletionRequest, {"model": "m"}) == ("Missing required parameter: prompt", "prompt")
    message, param = refusal(ChatCompletionRequest, {"messages": []})
    assert param == "messages" and message.startswith("messages: ")


@pytest.mark.parametrize("temperature", [-0.1, 2.01, 5])
def test_temperature_out_of_range(temperature: float) -> None:
    message, param = refusal(ChatCompletionRequest, chat(temperature=temperature))
    assert param == "temperature"
    assert message.startswith("temperature: "), message


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("n", 0),
        ("n", 65),
        ("top_k", -1),
        ("max_tokens", -1),
        ("prompt_logprobs", MAX_LOGPROBS + 1),
        ("seed", 2**63),
        ("logprobs", MAX_LOGPROBS + 1),
    ],
)
def test_out_of_range_fields_are_named(field: str, value: Any) -> None:
    message, param = refusal(CompletionRequest, completion(**{field: value}))
    assert param == field and message.startswith(f"{field}: "), (message, param)


def test_union_members_do_not_show_up_as_parameters() -> None:
    _, param = refusal(CompletionRequest, {"prompt": 5})
    assert param == "prompt", "'str' / 'list[int]' name types, not parameters"
    _, param = refusal(ChatCompletionRequest, {"messages": [{"role": "user", "content": 7}]})
    assert param == "messages.0.content"


def test_validation_message_drops_body_and_value_error_prefix() -> None:
    errors = [{"type": "value_error", "loc": ("body", "stop"), "msg": "Value error, too many"}]
    assert validation_message(errors) == ("stop: too many", "stop")
    assert validation_message([{"type": "value_error", "loc": (), "msg": "Value error, no"}]) == ("no", None)


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_openai_penalties_are_accepted_in_their_range(field: str) -> None:
    for model, body in ((ChatCompletionRequest, chat), (CompletionRequest, completion)):
        assert getattr(model.model_validate(body(**{field: -2.0})), field) == -2.0
        assert getattr(model.model_validate(body(**{field: 1.5})), field) == 1.5
        for value in (2.01, -3, float("nan")):
            message, param = refusal(model, body(**{field: value}))
            assert param == field and message.startswith(f"{field}: "), (message, param)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
        ({"logit_bias": {"42": -100.5}}, "logit_bias"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"42": "x"}}, "logit_bias.42"),
        ({"bad_words": ["ok", "  "]}, "bad_words"),
        ({"bad_words": ["w"] * 65}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, "x"]}, "allowed_token_ids.1"),
        ({"priority": 2**63}, "priority"),
        ({"request_id": "x" * 201}, "request_id"),
        (
            {"stream_options": {"continuous_usage_stats": "often"}, "stream": True},
            "stream_options.continuous_usage_stats",
        ),
    ],
)
def test_bad_sampling_extensions_are_named(fields: dict[str, Any], param: str) -> None:
    for model, body in ((ChatCompletionRequest, chat), (CompletionRequest, completion)):
        message, named = refusal(model, body(**fields))
        assert named == param, (fields, message, named)


def test_vllm_extensions_are_accepted_on_both_endpoints() -> None:
    fields = dict(
        repetition_penalty=1.0,
        min_p=0.0,
        min_tokens=0,
        bad_words=[],
        priority=0,
        request_id="abc-123",
        logit_bias={},
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    for model, body in ((ChatCompletionRequest, chat), (CompletionRequest, completion)):
        parsed = model.model_validate(body(**fields))
        assert parsed.stream_options is not None and parsed.stream_options.continuous_usage_stats
        assert parsed.sampling(16, None) == SamplingParams(max_tokens=16), "neutral values ask the sampler nothing"


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "needs tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": {"name": "g"}}},
            "not among the tools: 'g'",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot be combined with response_format",
        ),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
        ({"top_logprobs": 3}, "top_logprobs requires logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options is only allowed with stream"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, f"at most {MAX_STOP_STRINGS}"),
    ],
)
def test_unsupported_chat_settings_are_refused(fields: dict[str, Any], words: str) -> None:
    message, _ = refusal(ChatCompletionRequest, chat(**fields))
    assert words in message, message


def test_forced_tool_choice_is_a_json_schema_constraint_as_vllm_builds_it() -> None:
    import jsonschema

    defs = {"Unit": {"enum": ["C", "F"]}}
    weather = {"type": "object", "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "$defs": defs}
    tools = [
        {"type": "function", "function": {"name": "weather", "parameters": weather}},
        {"type": "function", "function": {"name": "now"}},
    ]
    named = ChatCompletionRequest.model_validate(chat(tools=tools, tool_choice={"function": {"name": "now"}}))
    spec = named.sampling(16, None).structured
    assert spec is not None and spec.kind == "json" and spec.param == "tool_choice"
    assert json.loads(spec.source) == {"type": "object", "properties": {}}  # the function's parameters
    for parallel in (True, False):
        body = ChatCompletionRequest.model_validate(
            chat(tools=tools, tool_choice="required", parallel_tool_calls=parallel)
        )
        spec = body.sampling(16, None).structured
        assert spec is not None
        schema = json.loads(spec.source)
        assert schema["$defs"] == defs and '"$defs":' not in json.dumps(schema["items"])  # gathered at the top
        one = [{"name": "weather", "parameters": {"unit": "C"}}]
        two = [*one, {"name": "now", "parameters": {}}]
        jsonschema.validate(one, schema)
        for wrong in ([], [{"name": "later", "parameters": {}}], [{"name": "weather", "parameters": {"unit": "K"}}]):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(wrong, schema)
        if parallel:
            jsonschema.validate(two, schema)
        else:
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(two, schema)


def test_neutral_values_of_unsupported_settings_are_accepted() -> None:
    body = ChatCompletionRequest.model_validate(
        chat(tools=[], tool_choice="none", response_format={"type": "text"}, stop=["x"] * MAX_STOP_STRINGS)
    )
    assert len(body.stop_strings()) == MAX_STOP_STRINGS
    assert CompletionRequest.model_validate(completion(n=2, best_of=2)).n == 2


@pytest.mark.parametrize("fields, words", [({"suffix": "end"}, "suffix")])
def test_unsupported_completion_settings_are_refused(fields: dict[str, Any], words: str) -> None:
    message, param = refusal(CompletionRequest, completion(**fields))
    assert words in message and "not supported" in message
    assert param == words


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"echo": True, "logprobs": 1, "stream": True}, "echo", "not available when stream is true"),
        ({"echo": True, "logprobs": 1, "max_tokens": 0, "best_of": 2}, "n", "needs n = 1"),
        ({"max_tokens": 0}, "max_tokens", "only allowed with echo"),
        ({"n": 3, "best_of": 2}, "best_of", "at least n"),
        ({"best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "at least 1"),
    ],
)
def test_echo_best_of_and_truncation_limits(fields: dict[str, Any], param: str, words: str) -> None:
    message, named = refusal(CompletionRequest, completion(**fields))
    assert words in message and named == param, message


def test_echo_best_of_and_truncation_accepted() -> None:
    body = CompletionRequest.model_validate(completion(echo=True, max_tokens=0, best_of=3, truncate_prompt_tokens=2))
    assert body.sampled_choices == 3 and body.n == 1
    assert body.truncate([1, 2, 3, 4], 100) == [3, 4]
    assert body.truncate([1], 100) == [1]
    everything = CompletionRequest.model_validate(completion(truncate_prompt_tokens=-1))
    assert everything.truncate([1, 2, 3, 4], 3) == [2, 3, 4]
    assert everything.add_special_tokens and not ChatCompletionRequest.model_validate(chat()).add_special_tokens


def test_max_tokens_0_only_with_echo_and_prompt_logprobs_not_streamed() -> None:
    body = CompletionRequest.model_validate(completion(max_tokens=0, echo=True, logprobs=2, prompt_logprobs=1))
    assert body.sampling(0, 2).prompt_logprobs == 2  # echo's logprobs score the prompt too
    assert CompletionRequest.model_validate(completion(prompt_logprobs=3)).sampling(5, None).prompt_logprobs == 3
    assert CompletionRequest.model_validate(completion(echo=True)).sampling(5, None).prompt_logprobs is None
    for fields, param in (
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": True, "logprobs": 0, "n": 2}, "n"),  # scored by the executor: n = 1
        ({"max_tokens": 0, "echo": True, "prompt_logprobs": 0, "n": 2}, "n"),
        ({"stream": True, "prompt_logprobs": 0}, "prompt_logprobs"),
        ({"stream": True, "echo": True, "logprobs": 0}, "echo"),
    ):
        assert refusal(CompletionRequest, completion(**fields))[1] == param, fields
    echo_only = CompletionRequest.model_validate(completion(max_tokens=0, echo=True, n=2))  # the gateway answers
    assert echo_only.gateway_only and echo_only.sampling(0, None).prompt_logprobs is None
    scored = CompletionRequest.model_validate(completion(max_tokens=0, echo=True, logprobs=0))
    assert not scored.gateway_only and scored.sampling(0, 0).prompt_logprobs == 0
    assert refusal(ChatCompletionRequest, chat(stream=True, prompt_logprobs=0))[1] == "prompt_logprobs"


def test_stream_options_with_stream() -> None:
    body = ChatCompletionRequest.model_validate(chat(stream=True, stream_options={"include_usage": True}))
    assert body.include_usage
    assert not ChatCompletionRequest.model_validate(chat(stream=True)).include_usage


def test_require_json_object() -> None:
    assert require_json_object({"a": 1}) == {"a": 1}
    for body in ([1], "x", None, 3):
        with pytest.raises(APIError) as info:
            require_json_object(body)
        assert info.value.status == 400 and info.value.type == "invalid_request_error"


# ------------------------------------------------------------------------------------------------ prompts


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", ["hello"]),
        ("", [""]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ([], []),
    ],
)
def test_prompts(prompt: Any, expected: list[Any]) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == expected


def test_mixed_prompt_list_is_refused() -> None:
    _, param = refusal(CompletionRequest, {"prompt": [1, "a"]})
    assert param is not None and param.startswith("prompt")


def test_stop_strings() -> None:
    assert CompletionRequest.model_validate(completion()).stop_strings() == []
    assert CompletionRequest.model_validate(completion(stop="\n")).stop_strings() == ["\n"]
    assert CompletionRequest.model_validate(completion(stop=["a", "b"])).stop_strings() == ["a", "b"]


def test_chat_message_for_template() -> None:
    parts = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]}
    )
    assert parts.for_template() == {"role": "user", "content": "Hello, world"}
    dev = ChatMessage.model_validate({"role": "developer", "content": "Be brief.", "name": "ops"})
    assert dev.for_template() == {"role": "system", "content": "Be brief.", "name": "ops"}
    empty = ChatMessage.model_validate({"role": "assistant", "content": None})
    assert empty.for_template() == {"role": "assistant", "content": ""}
    assert "name" not in ChatMessage(role="user", content="x", name="").for_template()


# ------------------------------------------------------------------------------------------------ sampling


def test_completion_sampling_maps_every_field() -> None:
    body = CompletionRequest.model_validate(
        completion(
            max_tokens=7,
            temperature=0.3,
            top_p=0.9,
            top_k=40,
            seed=123,
            n=3,
            stop_token_ids=[5, 6],
            ignore_eos=True,
            logprobs=2,
        )
    )
    params = body.sampling(body.max_tokens or 0, body.logprobs)
    assert params == SamplingParams(
        max_tokens=7,
        temperature=0.3,
        top_p=0.9,
        top_k=40,
        seed=123,
        n=3,
        stop_token_ids=(5, 6),
        ignore_eos=True,
        logprobs=2,
    )
    assert params.validate(vocab_size=512) is None


def test_sampling_defaults() -> None:
    body = CompletionRequest.model_validate(completion())
    assert body.max_tokens == 16, "OpenAI's default for completions"
    params = body.sampling(16, None)
    assert params == SamplingParams(max_tokens=16)
    assert params.stop_token_ids == () and params.logprobs is None and params.seed is None


def test_chat_token_limit_prefers_max_completion_tokens() -> None:
    assert ChatCompletionRequest.model_validate(chat()).token_limit is None
    assert ChatCompletionRequest.model_validate(chat(max_tokens=5)).token_limit == 5
    assert ChatCompletionRequest.model_validate(chat(max_completion_tokens=9)).token_limit == 9
    assert ChatCompletionRequest.model_validate(chat(max_tokens=5, max_completion_tokens=9)).token_limit == 9


def test_chat_logprobs_k_and_sampling() -> None:
    assert ChatCompletionRequest.model_validate(chat()).logprobs_k is None
    assert ChatCompletionRequest.model_validate(chat(logprobs=True)).logprobs_k == 0
    body = ChatCompletionRequest.model_validate(chat(logprobs=True, top_logprobs=4, temperature=0, seed=-1, n=2))
    assert body.logprobs_k == 4
    params = body.sampling(body.token_limit or 32, body.logprobs_k)
    assert params == SamplingParams(max_tokens=32, temperature=0.0, seed=-1, n=2, logprobs=4)


# ------------------------------------------------------------------------------------------------ responses


def test_usage_body() -> None:
    assert responses.usage_body(Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=8)) == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    total = responses.total_usage([Usage(3, 1, 0), Usage(5, 2, 4)])
    assert total == Usage(8, 3, 4)
    assert responses.total_usage([]) == Usage()


def test_sse_framing() -> None:
    frame = responses.sse({"text": "日本 é", "n": 1})
    assert frame == 'data: {"text":"日本 é","n":1}\n\n', "compact JSON, UTF-8 as is, a blank line after"
    assert json.loads(frame.removeprefix("data: ")) == {"text": "日本 é", "n": 1}
    assert responses.sse({"text": "a\nb"}).count("\n") == 2, "newlines inside strings are escaped by JSON"
    assert responses.DONE == "data: [DONE]\n\n"
    event = responses.error_event(invalid_request("bad", param="stop"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:]) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "stop", "code": None}
    }


ENV = responses.Envelope(id="cmpl-1", created=1700000000, model="tiny")


def test_completion_chunk_and_body() -> None:
    chunk = completions.completion_chunk(ENV, 1, "hi", None, "stop")
    assert chunk == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [{"index": 1, "text": "hi", "logprobs": None, "finish_reason": "stop"}],
    }
    body = completions.completion_body(ENV, chunk["choices"], Usage(2, 1, 0))
    assert body["object"] == "text_completion" and body["usage"]["total_tokens"] == 3
    usage = responses.usage_chunk(ENV, "text_completion", Usage(2, 1, 0))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1


def test_chat_chunk_and_body() -> None:
    chunk = chat_chunk(ENV, 0, {"content": "x"}, None, None)
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"] == [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}]
    with_lp = chat_chunk(ENV, 0, {}, [{"token": "x"}], "length")
    assert with_lp["choices"][0]["logprobs"] == {"content": [{"token": "x"}]}
    body = chat_body(ENV, [], Usage(1, 1, 1))
    assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    model_dir: Path = write_model(tmp_path_factory.mktemp("api-model") / "m", arch="llama", quiet=True, **TINY)
    return Tokenizer(model_dir)


def test_completion_logprobs_text_offset_accumulates(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello world, again")
    texts = [tokenizer.token_text(i) for i in ids]
    assert "".join(texts) == "hello world, again"
    logprobs = completions.CompletionLogprobs()
    half = len(ids) // 2
    logprobs.add(tokenizer, [ep.TokenLogprob(i, -0.5, [(i, -0.5), (0, -3.0)]) for i in ids[:half]], offset=0)
    offset = sum(len(t) for t in texts[:half])
    logprobs.add(tokenizer, [ep.TokenLogprob(i, -1.0, []) for i in ids[half:]], offset=offset)
    body = logprobs.body()
    assert body["tokens"] == texts
    starts = [sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    assert body["text_offset"] == starts, "each token's offset is where its text starts in the completion"
    assert body["token_logprobs"] == [-0.5] * half + [-1.0] * (len(ids) - half)
    assert body["top_logprobs"][0] == {texts[0]: -0.5, "<|begin_of_text|>": -3.0}
    assert body["top_logprobs"][-1] == {}


def test_completion_logprobs_offsets_of_a_split_character_wait_for_the_whole_character(tokenizer: Tokenizer) -> None:
    text = "é日!"
    ids = tokenizer.encode(text)
    logprobs = completions.CompletionLogprobs()
    logprobs.add(tokenizer, [ep.TokenLogprob(i, -0.5, []) for i in ids], offset=0)
    offsets = logprobs.body()["text_offset"]
    assert len(ids) > len(text), "the characters are split across byte tokens"
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] == len(text) - 1
    assert set(offsets) <= set(range(len(text)))


def test_chat_logprobs(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("é!")
    entries = [ep.TokenLogprob(i, -0.25, [(i, -0.25), (2, -1.0), (3, -2.0)]) for i in ids]
    out = chat_logprobs(tokenizer, entries, top=2)
    assert len(out) == len(ids)
    assert b"".join(bytes(e["bytes"]) for e in out) == "é!".encode(), "bytes add up to the text, split or not"
    assert all(len(e["top_logprobs"]) == 2 for e in out), "only the `top` best alternatives"
    assert out[0]["top_logprobs"][1] == {"token": "<|im_start|>", "logprob": -1.0, "bytes": list(b"<|im_start|>")}
    assert out[-1]["token"] == "!" and out[-1]["logprob"] == -0.25
    assert chat_logprobs(tokenizer, entries, top=0)[0]["top_logprobs"] == []


# ------------------------------------------------------------------------------------------------ logits processing


def test_processing_fields_map_to_sampling_params(tokenizer: Tokenizer) -> None:
    fields = dict(
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        min_p=0.05,
        min_tokens=3,
        logit_bias={"42": 5.0, "7": -100},
        allowed_token_ids=[1, 2, 3],
        max_tokens=10,
    )
    for model, body in ((ChatCompletionRequest, chat), (CompletionRequest, completion)):
        params = model.model_validate(body(**fields)).sampling(10, None, tokenizer)
        assert params == SamplingParams(
            max_tokens=10,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            repetition_penalty=1.2,
            min_p=0.05,
            min_tokens=3,
            logit_bias=((42, 5.0), (7, -100.0)),
            allowed_token_ids=(1, 2, 3),
        )
        assert params.validate(tokenizer.vocab_size) is None


def test_bad_words_become_token_sequences_with_and_without_a_leading_space(tokenizer: Tokenizer) -> None:
    body = CompletionRequest.model_validate(completion(bad_words=["hello world", " again"]))
    params = body.sampling(16, None, tokenizer)
    expected = []
    for text in ("hello world", " hello world", "again", " again"):
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if ids not in expected:
            expected.append(ids)
    assert list(params.bad_words_token_ids) == expected
    assert params.validate(tokenizer.vocab_size) is None
    assert body.sampling(16, None, tokenizer).bad_words_token_ids is params.bad_words_token_ids  # tokenized once
    with pytest.raises(ValueError):
        CompletionRequest.model_validate(completion(bad_words=["x"])).sampling(16, None)


def test_long_bad_words_are_refused(tokenizer: Tokenizer) -> None:
    body = ChatCompletionRequest.model_validate(chat(bad_words=["a b c d e f g h " * 20]))
    with pytest.raises(APIError) as info:
        body.sampling(16, None, tokenizer)
    assert info.value.status == 400 and info.value.param == "bad_words"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logit_bias": {"512": 1.0}}, "logit_bias"),
        ({"logit_bias": {"-1": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0, "05": 2.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, 100000]}, "allowed_token_ids"),
        ({"min_tokens": 20}, "min_tokens"),  # more than the completion's limit, found when the limit is known
    ],
)
def test_token_ids_are_checked_against_the_vocabulary(tokenizer: Tokenizer, fields: dict[str, Any], param: str) -> None:
    body = ChatCompletionRequest.model_validate(chat(**fields))
    with pytest.raises(APIError) as info:
        body.sampling(16, None, tokenizer)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_image_content_is_refused_by_name() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    message, param = refusal(ChatCompletionRequest, chat(messages=[{"role": "user", "content": [image]}]))
    assert "image_url" in message and "not supported" in message and param == "messages"


def test_continuous_usage_needs_include_usage_as_in_vllm() -> None:
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert ChatCompletionRequest.model_validate(chat(stream=True, stream_options=both)).continuous_usage
    alone = {"continuous_usage_stats": True}
    assert not ChatCompletionRequest.model_validate(chat(stream=True, stream_options=alone)).continuous_usage
