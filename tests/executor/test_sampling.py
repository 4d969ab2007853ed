"""The sampler against first principles: greedy is argmax, truncation keeps the right tokens, draws follow p."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
import torch

from executor import sampling
from executor.params import MAX_BAD_WORDS, SamplingParams
from executor.sampling import Sampler, SampleRow, choice_generator, process_logits
from tests.support.sampling import EOS, reference_processing

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


def test_a_seeded_row_draws_the_same_whatever_else_shares_the_batch():
    params = SamplingParams(seed=7, temperature=0.8)
    mine, noise = torch.randn(300, generator=torch.Generator().manual_seed(3)), torch.randn(300)
    sampler = Sampler(CPU, seed=None)
    others = [SamplingParams(temperature=1.3), SamplingParams(top_k=5), SamplingParams(temperature=0.0)]

    def tokens(batch: list[SamplingParams]) -> list[int]:
        generator = choice_generator(params, 0, CPU)
        at = batch.index(params)
        logits = torch.stack([mine if q is params else noise for q in batch])
        rows = [SampleRow(q, generator if q is params else None) for q in batch]
        return [sampler(logits, rows).token_ids[at] for _ in range(30)]

    alone = tokens([params])
    assert len(set(alone)) > 1
    assert tokens([*others, params]) == alone  # after other random, truncated and greedy rows
    assert tokens([others[0], params, others[0], others[2]]) == alone


def test_zero_probability_tokens_are_never_drawn_even_at_the_ends_of_the_vocabulary():
    logits = torch.full((2, 64), float("-inf"))
    logits[0, 0] = 0.0  # only the first token possible
    logits[1, 63] = 0.0  # only the last
    sampler = Sampler(CPU, seed=5)
    rows = [SampleRow(SamplingParams(temperature=1.0), None)] * 2
    for _ in range(200):
        assert sampler(logits, rows).token_ids == [0, 63]


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
        (SamplingParams(max_tokens=-1), "max_tokens"),
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


# ------------------------------------------------------------------------------------------ logits processing


def random_case(seed: int, batch: int = 8, vocab: int = 64) -> tuple[torch.Tensor, list[SampleRow]]:
    """Fresh random logits and rows: each row draws a random mix of the processing settings (some none)."""
    g = torch.Generator().manual_seed(seed)

    def pick(options: list) -> Any:
        return options[int(torch.randint(len(options), (1,), generator=g))]

    def ids(count: int) -> list[int]:
        return torch.randint(vocab, (count,), generator=g).tolist()

    logits = torch.randn(batch, vocab, generator=g) * 3
    rows = []
    for _ in range(batch):
        prompt_len = pick([1, 5, 12])
        tokens = ids(prompt_len + pick([0, 1, 4, 20]))
        output = tokens[prompt_len:]
        words: list[tuple[int, ...]] = []
        if pick([False, True]):
            words = [tuple(ids(1)), tuple(ids(3))]
            if len(output) >= 2:
                words.append((*output[-2:], *ids(1)))  # its prefix ends the output: its last token is banned
                words.append((output[-1], *ids(1)))
        params = SamplingParams(
            max_tokens=50,
            temperature=pick([0.0, 0.8]),
            presence_penalty=pick([0.0, 0.5, -1.5]),
            frequency_penalty=pick([0.0, 0.3, 2.0]),
            repetition_penalty=pick([1.0, 1.3, 0.7]),
            min_tokens=pick([0, 3, 30]),
            stop_token_ids=tuple(pick([(), (7, 9)])),
            ignore_eos=pick([False, True]),
            logit_bias=tuple(pick([(), ((1, 5.0), (2, -100.0), (output[-1] if output else 4, 2.5))])),
            bad_words_token_ids=tuple(words),
            allowed_token_ids=pick([None, None, tuple(ids(10))]),
        )
        rows.append(SampleRow(params, None, tokens, prompt_len))
    return logits, rows


@pytest.mark.parametrize("seed", range(12))
def test_batched_processing_equals_the_per_row_reference(seed):
    logits, rows = random_case(seed)
    original = logits.clone()
    processed = process_logits(logits.clone(), rows, EOS)
    for i, row in enumerate(rows):
        expected = reference_processing(original[i], row.params, list(row.tokens), row.prompt_len, EOS)
        torch.testing.assert_close(processed[i], expected, rtol=1e-6, atol=1e-5, msg=f"row {i}: {row.params}")


@pytest.mark.parametrize("seed", range(4))
def test_greedy_rows_take_the_argmax_of_the_processed_logits_and_logprobs_stay_raw(seed):
    logits, rows = random_case(seed, batch=6)
    rows = [
        SampleRow(msgspec.structs.replace(r.params, temperature=0.0, logprobs=2), None, r.tokens, r.prompt_len)
        for r in rows
    ]
    original = logits.clone()
    sampled = Sampler(CPU, seed=0, eos_token_ids=EOS)(logits, rows)
    assert torch.equal(logits, original)  # the caller's logits are not modified
    raw = torch.log_softmax(original, -1)
    for i, row in enumerate(rows):
        expected = reference_processing(original[i], row.params, list(row.tokens), row.prompt_len, EOS)
        assert sampled.token_ids[i] == int(expected.argmax()), i
        chosen, _ = sampled.logprobs[i]
        assert math.isclose(chosen, raw[i, sampled.token_ids[i]].item(), abs_tol=1e-5)


def test_random_rows_never_draw_what_processing_banned():
    logits = torch.zeros(1, 8)
    params = SamplingParams(
        temperature=1.0,
        allowed_token_ids=(1, 2, 3, 4, 5),
        bad_words_token_ids=((2,), (7, 3)),  # 2 always; 3 only after 7
        logit_bias=((5, -100.0),),
        min_tokens=5,
        stop_token_ids=(4,),
    )
    seen = set(draw_rows(logits, SampleRow(params, None, [0, 7], 1), 2000))
    assert seen == {1}  # 2 banned, 3 follows 7, 4 stops before min_tokens, 5 biased away
    seen = set(draw_rows(logits, SampleRow(params, None, [0, 6, 6, 6, 6, 6], 1), 2000))
    assert seen == {1, 3, 4}  # min_tokens reached, 3 no longer follows 7


def draw_rows(logits: torch.Tensor, row: SampleRow, times: int, seed: int = 0) -> list[int]:
    sampler = Sampler(CPU, seed=seed, eos_token_ids=EOS)
    return sampler(logits.expand(times, -1).clone(), [row] * times).token_ids


def test_min_p_keeps_tokens_at_least_min_p_times_as_likely_as_the_top_one_after_temperature():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(draw(logits, SamplingParams(min_p=0.2), 3000).tolist()) == {0, 1, 2}  # above 0.1
    assert set(draw(logits, SamplingParams(min_p=0.5), 3000).tolist()) == {0, 1}  # above 0.25
    # temperature 0.5 squares the odds: 0.5 : 0.3 : 0.15 -> 1 : 0.36 : 0.09
    assert set(draw(logits, SamplingParams(min_p=0.3, temperature=0.5), 3000).tolist()) == {0, 1}


def test_min_p_draws_follow_the_renormalised_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    counts = torch.bincount(draw(logits, SamplingParams(min_p=0.2), 20000), minlength=4)
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95 * 20000
    chi2 = (((counts[:3] - expected[:3]) ** 2) / expected[:3]).sum().item()
    assert counts[3] == 0 and chi2 < 25, counts.tolist()


def test_neutral_settings_skip_processing(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("processing ran for neutral settings")

    monkeypatch.setattr(sampling, "process_logits", fail)
    monkeypatch.setattr(sampling, "_apply_min_p", fail)
    neutral = SamplingParams(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0)
    assert not neutral.processes_logits
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    rows = [SampleRow(neutral, None, [1, 2, 3], 2), SampleRow(SamplingParams(temperature=0.0), None)] * 2
    sampled = Sampler(CPU, seed=0)(logits.repeat(2, 1)[:4], rows)
    assert sampled.token_ids[1] == int(logits[1].argmax())


def test_rows_without_processing_are_left_alone_in_a_processed_batch():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    rows = [
        SampleRow(SamplingParams(), None, [1, 2, 3], 1),
        SampleRow(SamplingParams(repetition_penalty=2.0, logit_bias=((0, 3.0),)), None, [1, 2, 3], 1),
        SampleRow(SamplingParams(min_p=0.1, allowed_token_ids=(4,)), None, [5], 1),
    ]
    processed = process_logits(logits.clone(), rows, EOS)
    assert torch.equal(processed[0], logits[0])
    assert not torch.equal(processed[1], logits[1])


@pytest.mark.parametrize(
    "params, fragment",
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-2.1), "frequency_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(min_tokens=-1), "min_tokens"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(logit_bias=((100, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((1, 1.0), (1, 2.0))), "logit_bias"),
        (SamplingParams(bad_words_token_ids=((),)), "bad_words"),
        (SamplingParams(bad_words_token_ids=((1, 100),)), "bad_words"),
        (SamplingParams(bad_words_token_ids=((1,),) * (MAX_BAD_WORDS + 1)), "bad_words"),
        (SamplingParams(allowed_token_ids=()), "allowed_token_ids"),
        (SamplingParams(allowed_token_ids=(5, 100)), "allowed_token_ids"),
    ],
)
def test_bad_processing_parameters_are_named(params, fragment):
    problem = params.validate(vocab_size=100)
    assert problem is not None and fragment in problem


def test_processing_parameters_travel_on_the_wire():
    params = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.05,
        min_tokens=2,
        logit_bias=((3, -1.5),),
        bad_words_token_ids=((1, 2), (4,)),
        allowed_token_ids=(1, 2, 3),
    )
    assert params.validate(vocab_size=100) is None
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
