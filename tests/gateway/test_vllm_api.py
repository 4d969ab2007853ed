"""vLLM's additions to the OpenAI API, through a real stack (blockd, two executors, the gateway as processes)
with the `openai` client (`extra_body` for vLLM's fields): its utility routes (/tokenize, /detokenize,
/tokenizer_info, /version, /ping), its output settings, and its metric names.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.text import Tokenizer
from pagedkv.serve import LocalStack
from tests.support.gateway import (
    GatewayProcess,
    health,
    local_stack,
    reference_text,
    tiny_model,
    wait_for,
    wait_until_no_live_blocks,
)

PROMPT = "The quick brown fox jumps over the lazy dog"
MAX_MODEL_LEN = 2048  # room for the tools' prompt, which the tiny vocabulary spells in many tokens
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, its tokenizer adding a BOS (as Llama's does), so add_special_tokens makes a difference."""
    path = tiny_model(tmp_path_factory.mktemp("vllm-api-model"), "tiny-vllm", max_position=MAX_MODEL_LEN)
    tokenizer_file = path / "tokenizer.json"
    spec = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    bos = "<|begin_of_text|>"
    bos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == bos)
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }
    tokenizer_file.write_text(json.dumps(spec), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with local_stack(model_dir, tmp_path_factory.mktemp("vllm-api-logs")) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture
def client(stack: LocalStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    wait_until_no_live_blocks(stack)


def extra(**fields: object) -> dict[str, object]:
    return {"ignore_eos": True, **fields}


# ---------------------------------------------------------------------------------------------- utility routes


def test_tokenize_and_detokenize_in_vllms_shapes(stack, tokenizer) -> None:
    url = stack.url
    plain = httpx.post(f"{url}/tokenize", json={"model": stack.model_name, "prompt": PROMPT}).json()
    assert plain == {
        "count": len(tokenizer.encode(PROMPT)),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": plain["tokens"],
    }
    assert plain["tokens"] == tokenizer.encode(PROMPT)
    bare = httpx.post(
        f"{url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}
    )
    bare_body = bare.json()
    assert bare_body["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    assert bare_body["token_strs"] == [tokenizer.id_to_token(t) for t in bare_body["tokens"]]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    chat = httpx.post(f"{url}/tokenize", json={"model": stack.model_name, "messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages) and chat["count"] == len(chat["tokens"])
    no_prompt = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tokenizer.encode_chat(messages, add_generation_prompt=False)

    back = httpx.post(f"{url}/detokenize", json={"model": stack.model_name, "tokens": plain["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(plain["tokens"])}

    for path, body, status in (
        ("/detokenize", {"tokens": [10**6]}, 400),
        ("/tokenize", {"model": "gpt-4o", "prompt": "x"}, 404),
        ("/tokenize", {"prompt": "x", "bogus": 1}, 400),
        ("/tokenize", {"messages": messages, "continue_final_message": True}, 400),
    ):
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == status, response.text
        assert response.json()["error"]["message"]


def test_tokenizer_info_version_ping_and_model_card(stack, tokenizer) -> None:
    info = httpx.get(f"{stack.url}/tokenizer_info").json()
    assert info["tokenizer_class"] and info["eos_token"] == tokenizer.special_tokens["eos_token"]
    assert info["chat_template"] == tokenizer.chat_templates["default"]
    assert info["model_max_length"] == MAX_MODEL_LEN and info["vocab_size"] == tokenizer.vocab_size
    assert httpx.get(f"{stack.url}/version").json()["version"]
    assert httpx.get(f"{stack.url}/ping").status_code == 200
    assert httpx.post(f"{stack.url}/ping").status_code == 200
    card = httpx.get(f"{stack.url}/v1/models/{stack.model_name}").json()
    assert card["id"] == stack.model_name and card["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{stack.url}/v1/models/other").status_code == 404
    for path in ("/v1/audio/transcriptions",):  # /v1/responses and /v1/embeddings are served: their own tests
        response = httpx.post(f"{stack.url}{path}", json={"model": stack.model_name, "input": "x"})
        assert response.status_code == 404 and path in response.json()["error"]["message"]
        assert "not supported" in response.json()["error"]["message"]
    # a generating server refuses embeddings by name (tests/gateway/test_embeddings_api.py: the other way round)
    response = httpx.post(f"{stack.url}/v1/embeddings", json={"model": stack.model_name, "input": "x"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "wrong_task"
    assert "/v1/completions" in response.json()["error"]["message"]


# ---------------------------------------------------------------------------------------------- output settings


def test_include_stop_str_in_output(client, stack, model_dir, tokenizer) -> None:
    full, tokens = reference_text(model_dir, tokenizer.encode(PROMPT), 16)
    windows = [full[i : i + 3] for i in range(len(full) // 3, len(full) - 3)]
    stop = next(w for w in windows if "\ufffd" not in w and w.strip())
    cut = full[: full.index(stop)]
    for stream in (False, True):
        result = client.completions.create(
            model=stack.model_name,
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body=extra(include_stop_str_in_output=True),
        )
        text = "".join(c.choices[0].text for c in result) if stream else result.choices[0].text
        assert text == cut + stop

    # a stop token's text: left out, as vLLM does, unless asked for
    stop_id = tokens[3]
    at = tokens.index(stop_id)
    for include in (False, True):
        result = client.completions.create(
            model=stack.model_name,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body=extra(stop_token_ids=[stop_id], include_stop_str_in_output=include),
        )
        assert result.choices[0].finish_reason == "stop"
        assert result.choices[0].text == tokenizer.decode(tokens[: at + include], skip_special_tokens=True)


def test_skip_special_tokens_off_decodes_as_transformers(client, stack, model_dir, tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    _, tokens = reference_text(model_dir, prompt, 12)
    for skip in (True, False):
        result = client.completions.create(
            model=stack.model_name,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body=extra(skip_special_tokens=skip, spaces_between_special_tokens=False),
        )
        assert result.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=skip)


def test_return_tokens_as_token_ids(client, stack, model_dir, tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    _, tokens = reference_text(model_dir, prompt, 5)
    result = client.completions.create(
        model=stack.model_name,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body=extra(return_tokens_as_token_ids=True),
    )
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{t}" for t in tokens]
    assert all(all(key.startswith("token_id:") for key in top) for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=stack.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra(return_tokens_as_token_ids=True),
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 3 and all(e.token.startswith("token_id:") for e in entries)
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_continuous_usage_stats_in_every_chunk(client, stack, tokenizer, kind) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "completion":
        stream = client.completions.create(
            model=stack.model_name, prompt=PROMPT, max_tokens=6, stream=True, stream_options=options, **GREEDY
        )
        prompt_tokens = len(tokenizer.encode(PROMPT))
    else:
        messages = [{"role": "user", "content": "hi"}]
        stream = client.chat.completions.create(
            model=stack.model_name, messages=messages, max_tokens=6, stream=True, stream_options=options, **GREEDY
        )
        prompt_tokens = len(tokenizer.encode_chat(messages))
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.prompt_tokens == prompt_tokens for c in chunks)
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_truncate_prompt_tokens_and_add_special_tokens(client, stack, model_dir, tokenizer) -> None:
    prompt = tokenizer.encode(PROMPT)
    result = client.completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=4, **{**GREEDY, "extra_body": extra(truncate_prompt_tokens=3)}
    )
    assert result.usage.prompt_tokens == 3
    assert result.choices[0].text == reference_text(model_dir, prompt[-3:], 4)[0]

    bare = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert bare != prompt  # the tiny model's tokenizer adds a BOS
    result = client.completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=4, **{**GREEDY, "extra_body": extra(add_special_tokens=False)}
    )
    assert result.usage.prompt_tokens == len(bare)
    assert result.choices[0].text == reference_text(model_dir, bare, 4)[0]

    messages = [{"role": "user", "content": "hi there"}]
    chat = client.chat.completions.create(
        model=stack.model_name,
        messages=messages,
        max_tokens=2,
        **{**GREEDY, "extra_body": extra(add_special_tokens=True, truncate_prompt_tokens=5)},
    )
    assert chat.usage.prompt_tokens == 5


def test_echo_puts_the_prompt_first(client, stack, model_dir, tokenizer) -> None:
    expected, _ = reference_text(model_dir, tokenizer.encode(PROMPT), 6)
    whole = client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=6, echo=True, **GREEDY)
    assert whole.choices[0].text == PROMPT + expected
    stream = client.completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=6, echo=True, stream=True, **GREEDY
    )
    assert "".join(c.choices[0].text for c in stream) == PROMPT + expected

    ids = [5, 6, 7, 8, 9]
    echoed = client.completions.create(model=stack.model_name, prompt=ids, max_tokens=3, echo=True, **GREEDY)
    assert (
        echoed.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True) + reference_text(model_dir, ids, 3)[0]
    )

    for stream in (False, True):
        only = client.completions.create(
            model=stack.model_name,
            prompt=[PROMPT, "hello"],
            max_tokens=0,
            echo=True,
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        if stream:
            chunks = list(only)
            assert [c.choices[0].text for c in chunks if c.choices] == [PROMPT, "hello"]
            assert chunks[-1].usage.completion_tokens == 0
        else:
            assert [c.text for c in only.choices] == [PROMPT, "hello"]
            assert only.usage.completion_tokens == 0
            assert only.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) + len(tokenizer.encode("hello"))

    # echo with logprobs: the prompt is scored by the executor (its first token null), then the completion's
    scored = client.completions.create(
        model=stack.model_name, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1, **GREEDY
    )
    lp = scored.choices[0].logprobs
    prompt_len = len(tokenizer.encode(PROMPT))
    assert scored.choices[0].text.startswith(PROMPT) and len(lp.tokens) == prompt_len + 2
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert lp.text_offset[prompt_len] == len(PROMPT)


def test_best_of_returns_the_choices_of_highest_cumulative_logprob(client, stack) -> None:
    common = dict(model=stack.model_name, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=77)
    every = client.completions.create(n=4, logprobs=0, **common, extra_body={"ignore_eos": True})
    scored = sorted(every.choices, key=lambda c: -math.fsum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=4, **common, extra_body={"ignore_eos": True})
    assert [c.text for c in best.choices] == [c.text for c in scored[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    with_logprobs = client.completions.create(n=1, best_of=4, logprobs=1, **common, extra_body={"ignore_eos": True})
    assert with_logprobs.choices[0].text == scored[0].text
    assert len(with_logprobs.choices[0].logprobs.tokens) == 6


# ---------------------------------------------------------------------------------------------- vLLM's metrics


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the gateway's /metrics: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_vllm_metrics_after_requests(client, stack, tokenizer) -> None:
    model = (("model_name", stack.model_name),)
    before = scrape(stack.url)
    prompt_tokens = len(tokenizer.encode(PROMPT))
    for _ in range(2):
        client.completions.create(model=stack.model_name, prompt=PROMPT, max_tokens=5, **GREEDY)
    list(
        client.chat.completions.create(
            model=stack.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True, **GREEDY
        )
    )
    chat_prompt = len(tokenizer.encode_chat([{"role": "user", "content": "hi"}]))
    after = scrape(stack.url)

    def grew(name: str, labels: tuple[tuple[str, str], ...] = model) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    success = tuple(sorted((*model, ("finished_reason", "length"))))
    assert grew("vllm:request_success_total", success) == 3
    assert grew("vllm:generation_tokens_total") == 14
    assert grew("vllm:prompt_tokens_total") == 2 * prompt_tokens + chat_prompt
    assert grew("vllm:prefix_cache_queries_total") == 2 * prompt_tokens + chat_prompt
    assert 0 <= grew("vllm:prefix_cache_hits_total") <= 2 * prompt_tokens + chat_prompt
    assert grew("vllm:request_prompt_tokens_sum") == 2 * prompt_tokens + chat_prompt
    assert grew("vllm:request_generation_tokens_sum") == 14
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert grew(f"{name}_count") == 3, name
    assert grew("vllm:inter_token_latency_seconds_count") == 2 * 4 + 3
    assert after[("vllm:num_requests_running", model)] >= 0
    assert after[("vllm:num_requests_waiting", model)] >= 0
    assert 0.0 <= after[("vllm:kv_cache_usage_perc", model)] <= 1.0
    assert after[("vllm:num_preemptions_total", model)] >= 0
    assert after[("vllm:spec_decode_num_draft_tokens_total", model)] == 0  # (no --speculative-config)
    assert after[("vllm:spec_decode_num_accepted_tokens_total", model)] == 0
    # next to pagedkv's own
    assert ("pagedkv_gateway_generated_tokens_total", ()) in after


# ---------------------------------------------------------------------------------------------- tools


def test_tools_and_tool_history_are_rendered_by_the_template(client, stack, model_dir, tokenizer) -> None:
    from transformers import AutoTokenizer

    from tests.support.tools import HISTORY, TOOLS, hf_messages

    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    rendered = hf.apply_chat_template(hf_messages(), tools=TOOLS, add_generation_prompt=True, tokenize=False)
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    answers = {}
    for choice in ("auto", "none"):
        result = client.chat.completions.create(
            model=stack.model_name,
            messages=HISTORY,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=6,
            **GREEDY,
        )
        assert result.usage.prompt_tokens == len(expected)
        answers[choice] = result.choices[0].message
    # the random model writes no call: 'auto' answers its text, as 'none' does
    assert answers["auto"].content == answers["none"].content and not answers["auto"].tool_calls
    stream = client.chat.completions.create(
        model=stack.model_name, messages=HISTORY, tools=TOOLS, max_tokens=6, stream=True, **GREEDY
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answers["none"].content
    assert chunks[-1].choices[0].finish_reason == "length"
    tokenized = httpx.post(f"{stack.url}/tokenize", json={"messages": HISTORY, "tools": TOOLS}).json()
    assert tokenized["tokens"] == expected


# Tools whose arguments the random model can only finish: bounded strings and numbers, no other properties.
BOUNDED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in BOUNDED_TOOLS}
FORCED = {"temperature": 0, "max_tokens": 300}


def checked_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, its arguments valid against its function's parameters."""
    import jsonschema

    found = []
    for call in calls:
        assert call.type == "function" and call.id
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        found.append((call.function.name, arguments))
    return found


def streamed_calls(stream) -> tuple[list[tuple[str, dict]], str | None]:
    """The calls a stream's tool_calls deltas add up to (name, parsed arguments), and its finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            if delta.function.name:
                assert call["name"] is None and delta.id, "a call's id and name come once, first"
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_named_tool_choice_is_one_call_of_that_function(client, stack, name) -> None:
    body = {
        "model": stack.model_name,
        "messages": [{"role": "user", "content": "Weather in Zürich?"}],
        "tools": BOUNDED_TOOLS,
        "tool_choice": {"type": "function", "function": {"name": name}},
        **FORCED,
    }
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "stop"  # vLLM's, for a named choice
    assert not choice.message.content
    calls = checked_calls(choice.message.tool_calls)
    assert [n for n, _ in calls] == [name]
    assert streamed_calls(client.chat.completions.create(**body, stream=True)) == (calls, "stop")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_is_at_least_one_call_of_the_tools(client, stack, tokenizer, parallel) -> None:
    (close,) = tokenizer.encode("]", add_special_tokens=False)
    body = {
        "model": stack.model_name,
        "messages": [{"role": "user", "content": "Weather in Zürich?"}],
        "tools": BOUNDED_TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": parallel,
        # the random model would add calls to the array until max_tokens: "]" favoured wherever it is allowed
        "logit_bias": {str(close): 50},
        **FORCED,
    }
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    calls = checked_calls(choice.message.tool_calls)
    assert len(calls) >= 1 and all(n in SCHEMAS for n, _ in calls)
    if not parallel:
        assert len(calls) == 1
    assert streamed_calls(client.chat.completions.create(**body, stream=True)) == (calls, "tool_calls")


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"response_format": {"type": "json_object"}}, "cannot be combined with response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "a+"}}}, "cannot be combined with structured_outputs"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "cannot be combined with guided_json"),
    ],
)
def test_forced_tool_choice_with_another_constraint_is_a_400(client, stack, extra, words) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=stack.model_name,
            messages=[{"role": "user", "content": "hi"}],
            tools=BOUNDED_TOOLS,
            tool_choice="required",
            max_tokens=2,
            **extra,
        )
    assert words in refused.value.message and refused.value.param == "tool_choice"


def test_tool_call_parser_flag(stack, model_dir, tmp_path) -> None:
    """--tool-call-parser none: 'auto' has nothing to parse with, and says so; 'none' still renders the tools."""
    from tests.support.tools import TOOLS

    gateway = GatewayProcess(
        model_dir,
        stack.executor_endpoints,
        stack.blockd_endpoint,
        tmp_path / "gw.log",
        "--tool-call-parser",
        "none",
        keys_dir=stack.keys_dir,  # the stack's executors take only its key set's clients
    )
    try:
        gateway.wait_listening()
        wait_for(lambda: health(gateway.url)["status"] == "ok", timeout_s=30, what="the gateway's executors")
        body = {"model": stack.model_name, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        refused = httpx.post(f"{gateway.url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=30)
        assert refused.status_code == 400 and "--tool-call-parser" in refused.json()["error"]["message"]
        answered = httpx.post(
            f"{gateway.url}/v1/chat/completions", json={**body, "max_tokens": 2, "tool_choice": "none"}, timeout=30
        )
        assert answered.status_code == 200, answered.text
    finally:
        gateway.stop()


def test_best_of_with_batched_prompts(client, stack) -> None:
    result = client.completions.create(
        model=stack.model_name,
        prompt=[PROMPT, "hello there"],
        n=2,
        best_of=3,
        max_tokens=4,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert result.usage.completion_tokens == 2 * 3 * 4  # every sampled choice was generated
