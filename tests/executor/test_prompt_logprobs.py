"""Prompt logprobs (vLLM's `prompt_logprobs`) against transformers' log-softmax of the same prompt, with prefix
caching (a cached prefix has no logits: such a request is computed whole) and chunked prefill."""

from __future__ import annotations

import pytest
import torch

from executor.params import SamplingParams
from tests.executor.harness import drive, hf_greedy, hf_model, make_engine, random_prompts, reference_run

TOL = 2e-3


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at prompt positions 0 .. len - 2: row i scores prompt token i + 1."""
    with reference_run():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def check(entries, model_dir, prompt: list[int], k: int) -> None:
    reference = hf_prompt_logprobs(model_dir, prompt)
    assert entries is not None and len(entries) == len(prompt) - 1
    for i, entry in enumerate(entries):
        assert entry.token_id == prompt[i + 1]
        assert abs(entry.logprob - reference[i, prompt[i + 1]].item()) <= TOL, f"position {i + 1}"
        rank = int((reference[i] > reference[i, prompt[i + 1]]).sum()) + 1
        assert abs(entry.rank - rank) <= 1  # a near tie may order either way
        values, ids = reference[i].topk(k)
        assert len(entry.top) == k
        for (token, value), ref_token, ref_value in zip(entry.top, ids.tolist(), values.tolist(), strict=True):
            assert abs(value - ref_value) <= TOL
            assert token == ref_token or abs(reference[i, token].item() - ref_value) <= TOL  # ties may swap


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_prompt_logprobs_match_transformers_cached_and_chunked(arch, tiny_models, blockd):
    model = tiny_models[arch]
    # 150 tokens: past the step's 64-token budget, so the prefill (and the scoring) runs in chunks.
    short, long = random_prompts([21, 150], vocab=512, seed=11)
    engine = make_engine(model, blockd.endpoint, pool_id=f"plp-{arch}")
    asks = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    results = drive(engine, {0: [("short", short, asks), ("long", long, asks)], 1: [("short-again", short, asks)]})
    for rid, prompt in (("short", short), ("long", long), ("short-again", short)):
        (choice,) = results[rid]
        check(choice.prompt_logprobs, model, prompt, 2)
        assert choice.tokens == hf_greedy(model, prompt, 4)
    # The same prompts again: their blocks are cached now, yet a prompt-logprobs request computes them all.
    again = drive(engine, {0: [("long2", long, asks)], 3: [("short2", [*short, 7], asks)]})
    check(again["long2"][0].prompt_logprobs, model, long, 2)
    check(again["short2"][0].prompt_logprobs, model, [*short, 7], 2)
    assert again["long2"][0].cached_tokens == 0
    # A plain request still takes the prefix hit.
    plain = drive(engine, {0: [("hit", long, SamplingParams(max_tokens=2, temperature=0.0))]})
    assert plain["hit"][0].cached_tokens == 144


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(tiny_models, blockd):
    model = tiny_models["llama"]
    (prompt,) = random_prompts([40], vocab=512, seed=12)
    engine = make_engine(model, blockd.endpoint)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    results = drive(engine, {0: [("echo", prompt, params), ("one", prompt[:1], params)]})
    (choice,) = results["echo"]
    assert choice.tokens == [] and choice.finish_reason == "length" and choice.completion_tokens == 0
    check(choice.prompt_logprobs, model, prompt, 0)
    assert results["one"][0].prompt_logprobs == []  # a one-token prompt has nothing to score
    assert SamplingParams(max_tokens=0, n=2).validate(512) is not None
    assert SamplingParams(prompt_logprobs=21).validate(512) is not None


def test_prompt_logprobs_survive_preemption(tiny_models, blockd):
    model = tiny_models["qwen2"]
    prompts = random_prompts([60, 75, 50, 70], vocab=512, seed=13)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    # 8 tokens a step: prefills take many steps, and decodes outgrow the 14 blocks while later prompts are scored.
    engine = make_engine(model, blockd.endpoint, num_blocks=14, max_num_seqs=4, max_num_batched_tokens=8)
    preempted_while_scoring = []

    def watch(_step, engine) -> None:
        preempted_while_scoring.extend(
            s for s in engine.scheduler.waiting if s.preemptions and s.request.prompt_logprobs_pending
        )

    results = drive(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]}, on_step=watch)
    assert preempted_while_scoring, "a request must be preempted half way through its prompt's scoring"
    for i, prompt in enumerate(prompts):
        check(results[f"r{i}"][0].prompt_logprobs, model, prompt, 1)
