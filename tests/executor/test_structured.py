"""Structured output through the engine with the random-weight tiny model: whatever the weights, greedy output
under a JSON schema parses and validates (jsonschema), regex and choice outputs match; the grammar is compiled
once per spec (cache hits counted), off the step, and a bad spec is rejected after the submit.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch

from executor import protocol as ep
from executor.engine import Engine, RequestRejected
from executor.params import GrammarSpec, SamplingParams
from executor.sampling import Sampler, SampleRow
from executor.structured import BitmaskApplier, Grammars, build_grammar, new_matcher
from tests.executor.harness import make_engine, random_prompts

SCHEMAS = {
    "required_fields": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "member": {"type": "boolean"},
        },
        "required": ["name", "age", "member"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", 3]}},
        "required": ["color", "size"],
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
        },
        "required": ["tags"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "boolean"}},
                "required": ["x", "y"],
            },
            "labels": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["id"],
                },
                "maxItems": 2,
            },
        },
        "required": ["point", "labels"],
    },
}
MAX_TOKENS = 400


def structured(kind: str, source: str = "", **fields) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, structured=GrammarSpec(kind, source, param="test"), **fields
    )


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], timeout_s: float = 300.0):
    """Submit every request at once and step until all are done: {id: (choices' tokens, finish reasons)} or
    {id: Rejected}."""
    out: dict[str, object] = {}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
        out[request_id] = ([[] for _ in range(params.n)], [None] * params.n)
    deadline = time.monotonic() + timeout_s
    while engine.has_work():
        assert time.monotonic() < deadline, "the engine did not finish"
        for item in engine.step():
            if type(item) is ep.Rejected:
                out[item.request_id] = item
                continue
            tokens, reasons = out[item.request_id]
            tokens[item.index] += item.token_ids
            reasons[item.index] = item.finish_reason
    return out


def decode(model_dir, tokens: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir)).decode(tokens, skip_special_tokens=True)


def test_outputs_follow_json_schemas_regex_and_choice(tiny_models, blockd):
    model = tiny_models["llama"]
    engine = make_engine(model, blockd.endpoint, num_blocks=128, max_num_seqs=16, max_num_batched_tokens=256)
    prompts = random_prompts([7, 19, 4, 30, 11, 9, 15, 6], vocab=512, seed=3)
    requests = {
        f"schema-{name}": (prompts[i], structured("json", json.dumps(schema)))
        for i, (name, schema) in enumerate(SCHEMAS.items())
    }
    requests["json-object"] = (prompts[4], structured("json_object"))
    requests["regex"] = (prompts[5], structured("regex", r"[a-z]{2,6}-\d{3}"))
    requests["choice"] = (prompts[6], structured("choice", json.dumps(["yes", "no", 'say "maybe"\n'])))
    requests["free"] = (prompts[7], SamplingParams(max_tokens=12, temperature=0.0))  # side by side, unconstrained
    out = run(engine, requests)
    for name, schema in SCHEMAS.items():
        tokens, reasons = out[f"schema-{name}"]
        text = decode(model, tokens[0])
        assert reasons == ["stop"], (name, text)
        jsonschema.validate(json.loads(text), schema)
    tokens, reasons = out["json-object"]
    assert reasons == ["stop"]
    assert isinstance(json.loads(decode(model, tokens[0])), dict)
    tokens, reasons = out["regex"]
    assert reasons == ["stop"] and re.fullmatch(r"[a-z]{2,6}-\d{3}", decode(model, tokens[0]))
    tokens, reasons = out["choice"]
    assert reasons == ["stop"] and decode(model, tokens[0]) in ("yes", "no", 'say "maybe"\n')
    tokens, reasons = out["free"]
    assert len(tokens[0]) == 12 or reasons == ["stop"]


def test_compilation_is_cached_per_spec_and_every_choice_has_its_matcher(tiny_models, blockd):
    model = tiny_models["llama"]
    engine = make_engine(model, blockd.endpoint, num_blocks=128, max_num_seqs=16, max_num_batched_tokens=256)
    prompts = random_prompts([5, 12, 8], vocab=512, seed=5)
    choices = json.dumps(["alpha", "beta", "gamma"])
    first = run(engine, {"a": (prompts[0], structured("choice", choices))})
    assert engine.grammars is not None and (engine.grammars.hits, engine.grammars.misses) == (0, 1)
    # The same spec again (from another parameter: the key is the constraint alone), with 3 random choices each.
    spec = GrammarSpec("choice", choices, param="other")
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=7, n=3, structured=spec)
    out = run(engine, {"b": (prompts[1], params), "c": (prompts[2], params)})
    assert (engine.grammars.hits, engine.grammars.misses) == (2, 1)
    assert len(engine.grammars.cache) == 1
    for tokens, reasons in [first["a"], out["b"], out["c"]]:
        assert all(r == "stop" for r in reasons)
        assert all(decode(model, t) in ("alpha", "beta", "gamma") for t in tokens)


def test_a_spec_that_does_not_compile_is_rejected_and_others_go_on(tiny_models, blockd):
    model = tiny_models["llama"]
    engine = make_engine(model, blockd.endpoint, num_blocks=128, max_num_seqs=16, max_num_batched_tokens=256)
    prompt = random_prompts([6], vocab=512, seed=1)[0]
    bad_schema = SamplingParams(structured=GrammarSpec("json", '{"type": "nope"}', param="response_format"))
    bad_regex = SamplingParams(structured=GrammarSpec("regex", "(abc", param="guided_regex"))
    bad_grammar = SamplingParams(structured=GrammarSpec("grammar", "root ::= missing", param="guided_grammar"))
    out = run(
        engine,
        {
            "schema": (prompt, bad_schema),
            "regex": (prompt, bad_regex),
            "grammar": (prompt, bad_grammar),
            "fine": (prompt, structured("regex", "[0-9]{4}")),
        },
    )
    for request_id, param, words in [
        ("schema", "response_format", "nope"),
        ("regex", "guided_regex", "parenthesis"),
        ("grammar", "guided_grammar", "missing"),
    ]:
        rejected = out[request_id]
        assert type(rejected) is ep.Rejected and rejected.code == "invalid_grammar", rejected
        assert rejected.message.startswith(param) and words in rejected.message, rejected.message
    tokens, reasons = out["fine"]
    assert reasons == ["stop"] and re.fullmatch("[0-9]{4}", decode(model, tokens[0]))
    assert not engine.requests and not engine.has_work()
    with pytest.raises(RequestRejected) as info:  # the same spec again: refused at once, from the cache
        engine.add_request("again", prompt, bad_regex)
    assert info.value.code == "invalid_grammar" and "parenthesis" in info.value.message
    assert not engine.requests and not engine.has_work()


def test_a_request_aborted_while_its_grammar_compiles_is_gone(tiny_models, blockd):
    engine = make_engine(tiny_models["llama"], blockd.endpoint)
    engine.add_request("r", [1, 2, 3], structured("regex", "x{1,3}"))
    assert engine.has_work() and "r" in engine._compiling
    deltas = engine.abort("r")
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert not engine.has_work() and not engine.requests


def test_the_bitmask_is_applied_to_the_constrained_rows_only(tiny_models):
    """BitmaskApplier against a plain torch reference: the matchers' allowed tokens, unpacked, masked_fill."""
    grammars = Grammars(tiny_models["llama"], 512, [1])
    compiled = grammars.compile(GrammarSpec("regex", "[a-c]+x")).result(timeout=300)
    matchers = [new_matcher(compiled), new_matcher(compiled)]
    assert matchers[1].accept_token(build_allowed(matchers[1])[0])  # one step on: another state
    logits = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    BitmaskApplier()(masked, [1, 3], matchers)
    expected = logits.clone()
    for row, matcher in zip([1, 3], matchers):
        allowed = torch.zeros(512, dtype=torch.bool)
        allowed[build_allowed(matcher)] = True
        expected[row] = expected[row].masked_fill(~allowed, float("-inf"))
    assert torch.equal(masked, expected)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    grammars.close()
    assert build_grammar(GrammarSpec("choice", '["a"]')) is not None


def build_allowed(matcher) -> list[int]:
    """The tokens a matcher allows next, from its bitmask, bit by bit (the reference)."""
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(1, 512)
    matcher.fill_next_token_bitmask(bitmask, 0)
    words = bitmask[0].tolist()
    return [t for t in range(512) if (words[t // 32] >> (t % 32)) & 1]


def test_unconstrained_batches_never_touch_the_grammar_path():
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.randn(3, 64)
    rows = [SampleRow(SamplingParams(temperature=0.0), None) for _ in range(3)]
    assert sampler(logits, rows).token_ids == logits.argmax(dim=-1).tolist()
    assert sampler._bitmask is None
