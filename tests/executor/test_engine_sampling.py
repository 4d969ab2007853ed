"""Logits processing through the engine, against transformers' generate: greedy outputs must be identical.

Each setting that transformers implements itself is checked against its own processor (repetition_penalty,
logit_bias as sequence_bias, bad_words, min_tokens as min_new_tokens, allowed_token_ids as suppress_tokens); the
OpenAI penalties, which it lacks, against the plain per-row reference of tests/executor/test_sampling.py plugged
into generate. The requests run together, so the batched sampler sees rows with different settings side by side.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from executor.params import SamplingParams
from tests.executor.harness import drive, hf_greedy, hf_model, make_engine, random_prompts, reference_run
from tests.support.sampling import reference_processing

MAX_TOKENS = 20


class Reference(transformers.LogitsProcessor):
    """The per-row reference of the sampler's tests, as a transformers logits processor (batch of one)."""

    def __init__(self, params: SamplingParams, prompt_len: int, eos: tuple[int, ...]) -> None:
        self.params, self.prompt_len, self.eos = params, prompt_len, eos

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        row = reference_processing(scores[0], self.params, input_ids[0].tolist(), self.prompt_len, self.eos)
        return row.unsqueeze(0)  # type: ignore[return-value]


def hf_generate(model_dir: Path, prompt: list[int], **kwargs: Any) -> list[int]:
    model = hf_model(model_dir)
    with reference_run():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def eos_ids(model_dir: Path) -> tuple[int, ...]:
    eos = hf_model(model_dir).generation_config.eos_token_id
    return (eos,) if isinstance(eos, int) else tuple(eos or ())


def greedy(**fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **fields)


def test_processed_greedy_outputs_match_transformers(tiny_models, blockd):
    model = tiny_models["llama"]
    eos = eos_ids(model)
    prompts = random_prompts([9, 40, 17, 70, 5, 23, 12], vocab=512, seed=11)
    plain = [hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    # Banned sequences taken from the unprocessed output, so they do bite: its first token, and a later pair.
    first, (a, b) = plain[2][0], plain[2][5:7]
    allowed = tuple(sorted({*plain[4][:3], 100, 200, 300}))
    everything = greedy(
        repetition_penalty=1.4,
        frequency_penalty=0.7,
        presence_penalty=-0.4,
        logit_bias=((plain[6][1], -30.0), (17, 4.0)),
        min_tokens=4,
    )
    cases: list[tuple[SamplingParams, dict[str, Any]]] = [
        (greedy(repetition_penalty=1.8), {"repetition_penalty": 1.8}),
        (greedy(repetition_penalty=0.6), {"repetition_penalty": 0.6}),
        (greedy(bad_words_token_ids=((first,), (a, b))), {"bad_words_ids": [[first], [a, b]]}),
        (greedy(logit_bias=((plain[3][0], -50.0), (42, 6.0))), {"sequence_bias": {(plain[3][0],): -50.0, (42,): 6.0}}),
        (greedy(allowed_token_ids=allowed), {"suppress_tokens": [t for t in range(512) if t not in allowed]}),
        # end-of-sequence pushed to the top: the output is min_tokens long, then it stops.
        (
            greedy(logit_bias=((eos[0], 100.0),), min_tokens=6),
            {"sequence_bias": {(eos[0],): 100.0}, "min_new_tokens": 6},
        ),
        (
            everything,
            {"logits_processor": transformers.LogitsProcessorList([Reference(everything, len(prompts[6]), eos)])},
        ),
    ]
    engine = make_engine(model, blockd.endpoint)
    arrivals = {0: [(f"r{i}", p, params) for i, (p, (params, _)) in enumerate(zip(prompts, cases, strict=True))]}
    results = drive(engine, arrivals)
    for i, (prompt, (params, hf_kwargs)) in enumerate(zip(prompts, cases, strict=True)):
        (choice,) = results[f"r{i}"]
        expected = hf_generate(model, prompt, **hf_kwargs)
        assert choice.tokens == expected, f"case {i}: {params}"
        assert expected != plain[i], f"case {i} did not change the output: a weak test"
    assert results["r5"][0].tokens[-1] == eos[0] and len(results["r5"][0].tokens) == 7


def test_presence_and_frequency_penalties_match_the_reference_on_every_architecture(tiny_models, blockd):
    for arch, model in tiny_models.items():
        eos = eos_ids(model)
        prompts = random_prompts([30, 8], vocab=512, seed=5)
        params = [greedy(frequency_penalty=1.5), greedy(presence_penalty=2.0, repetition_penalty=1.2)]
        engine = make_engine(model, blockd.endpoint, pool_id=f"pool-{arch}")
        results = drive(engine, {0: [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]})
        for i, (prompt, q) in enumerate(zip(prompts, params, strict=True)):
            processor = transformers.LogitsProcessorList([Reference(q, len(prompt), eos)])
            assert results[f"r{i}"][0].tokens == hf_generate(model, prompt, logits_processor=processor), (arch, i)
