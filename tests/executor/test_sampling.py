"""The sampler against first principles: greedy is argmax, truncation keeps the right tokens, draws follow p."""

from __future__ import annotations

import math

import pytest
import torch

from executor.params import SamplingParams
from executor.sampling import Sampler, SampleRow, choice_generator

CPU = torch.device("cpu")


def draw(logits: torch.Tensor, params: SamplingParams, times: int, seed: int = 0) -> torch.Tensor:
    sampler = Sampler(CPU, seed=seed)
    rows = [SampleRow(params, None)] * times
    return torch.tensor(sampler(logits.expand(times, -1).clone(), rows).token_ids)


def test_greedy_rows_are_argmax_whatever_the_other_rows_do():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    rows = [SampleRow(SamplingParams(temperature=0.0), None), SampleRow(SamplingParams(temperature=1.0), None)] * 2
    rows.append(SampleRow(SamplingParams(temperature=0.0), None))
    sampled = Sampler(CPU, seed=1)(logits, rows)
    for i in (0, 2, 4):
        assert sampled.token_ids[i] == int(logits[i].argmax())


def test_draws_follow_the_softmax_at_the_given_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    for temperature in (1.0, 0.5):
        counts = torch.bincount(draw(logits, SamplingParams(temperature=temperature), 20000), minlength=4)
        expected = torch.softmax(logits / temperature, -1) * 20000
        chi2 = (((counts - expected) ** 2) / expected).sum().item()
        assert chi2 < 25, (temperature, counts.tolist(), expected.tolist())  # 3 dof: p < 1e-4 by chance


def test_top_k_and_top_p_keep_exactly_the_tokens_they_should():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen_k = set(draw(logits, SamplingParams(top_k=2), 3000).tolist())
    assert seen_k == {0, 1}
    seen_p = set(draw(logits, SamplingParams(top_p=0.75), 3000).tolist())  # 0.5 + 0.3 reaches 0.75
    assert seen_p == {0, 1}
    seen_p = set(draw(logits, SamplingParams(top_p=0.5), 3000).tolist())  # the top token alone reaches it
    assert seen_p == {0}
    seen_p = set(draw(logits, SamplingParams(top_p=0.81), 3000).tolist())
    assert seen_p == {0, 1, 2}


def test_seeded_choices_are_reproducible_and_distinct():
    params = SamplingParams(seed=42, temperature=1.0, n=2)
    logits = torch.zeros(1, 1000)
    sampler = Sampler(CPU, seed=None)

    def run(index: int) -> list[int]:
        generator = choice_generator(params, index, CPU)
        return [sampler(logits, [SampleRow(params, generator)]).token_ids[0] for _ in range(20)]

    assert run(0) == run(0)
    assert run(0) != run(1)
    assert choice_generator(SamplingParams(seed=None), 0, CPU) is None
    assert choice_generator(SamplingParams(seed=3, temperature=0.0), 0, CPU) is None  # greedy needs no luck


def test_logprobs_are_the_model_distribution_with_top_alternatives():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0.0, logprobs=2)
    sampled = Sampler(CPU, seed=0)(logits, [SampleRow(params, None)])
    chosen, top = sampled.logprobs[0]
    reference = torch.log_softmax(logits[0].double(), -1)
    assert sampled.token_ids == [0]
    assert math.isclose(chosen, reference[0].item(), abs_tol=1e-6)
    assert [t for t, _ in top] == [0, 2]
    assert math.isclose(top[1][1], reference[2].item(), abs_tol=1e-6)
    none = Sampler(CPU, seed=0)(logits, [SampleRow(SamplingParams(temperature=0.0), None)])
    assert none.logprobs == [None]


@pytest.mark.parametrize(
    "params, fragment",
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(n=65), "n must"),
        (SamplingParams(seed=2**70), "seed"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(stop_token_ids=(7, 100)), "stop_token_ids"),
    ],
)
def test_bad_parameters_are_named(params, fragment):
    problem = params.validate(vocab_size=100)
    assert problem is not None and fragment in problem


def test_good_parameters_pass():
    assert (
        SamplingParams(
            max_tokens=5, temperature=0.7, top_p=0.9, top_k=40, seed=-5, n=3, logprobs=5, stop_token_ids=(1, 2)
        ).validate(vocab_size=100)
        is None
    )
