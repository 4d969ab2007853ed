"""Speculative decoding (executor/speculative.py) in the real engine against a real blockd: greedy output equal to
transformers' and to the engine's without speculation, with drafts proposed and accepted; the config's checks."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from blockd.protocol import Trim
from executor.params import SamplingParams
from executor.sequence import Request, Sequence
from executor.speculative import NgramProposer, SpeculativeConfig, SpeculativeConfigError
from pagedkv.bench.spec_workload import documents, repeat_prompt, write_repeating_model
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import drive, hf_greedy, make_engine, random_prompts
from tests.support.models import TINY

NGRAM = SpeculativeConfig.parse(
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
)


def repetitive(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts that repeat their text (an extraction's input): the n-gram lookup finds drafts in them."""
    return [p + p[: len(p) // 2] + p for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "mistral-window"])
def test_greedy_is_unchanged_when_drafts_are_rejected(arch, tiny_models, tmp_path, blockd):
    """The tiny random models never repeat their prompt: the lookup proposes, verification rejects, and the
    output is transformers' and the engine's without speculation (mistral-window: every layer slides, blocks go
    back as sequences pass the window)."""
    if arch == "llama":
        model = tiny_models[arch]
    else:
        model = write_model(tmp_path / arch, arch="mistral", sliding_window=24, quiet=True, **TINY)
    prompts = repetitive(random_prompts([5, 12, 30, 17, 40, 9], vocab=512, seed=3))
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    arrivals = {
        0: [(f"r{i}", p, greedy) for i, p in enumerate(prompts[:4])],
        3: [(f"r{i}", p, greedy) for i, p in enumerate(prompts[4:], 4)],
    }
    spec = make_engine(model, blockd.endpoint, pool_id=f"spec-{arch}", speculative=NGRAM)
    plain = make_engine(model, blockd.endpoint, pool_id=f"plain-{arch}")
    with_spec, without = drive(spec, arrivals), drive(plain, arrivals)
    for i, prompt in enumerate(prompts):
        assert with_spec[f"r{i}"][0].tokens == without[f"r{i}"][0].tokens, f"request {i}"
        assert with_spec[f"r{i}"][0].tokens == hf_greedy(model, prompt, greedy.max_tokens), f"request {i}"
    stats = spec.speculator.stats
    assert stats.proposed_tokens > 0 and stats.accepted_tokens <= stats.proposed_tokens
    load = spec.load()
    assert (load.spec_proposed_tokens, load.spec_accepted_tokens) == (stats.proposed_tokens, stats.accepted_tokens)


def test_seeded_sampling_with_several_choices_runs_to_its_lengths(tiny_models, blockd):
    model = tiny_models["llama"]
    prompts = repetitive(random_prompts([10, 24], vocab=512, seed=7))
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=11, n=3, ignore_eos=True)
    spec = make_engine(model, blockd.endpoint, pool_id="spec-n", speculative=NGRAM)
    results = drive(spec, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    for i in range(len(prompts)):
        for choice in results[f"r{i}"]:
            assert len(choice.tokens) == 20 and choice.finish_reason == "length"
            assert choice.completion_tokens == 20


def test_ngram_lookup_takes_the_longest_latest_match():
    proposer = NgramProposer(1, 3)
    params = SamplingParams(max_tokens=8)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    seq = Sequence("s", Request("r", params, tokens, None, 0.0), 0, list(tokens), None)
    assert proposer.propose(seq, 3) == [7, 8, 5]  # "1 2 3"? no: "5 2 3" absent, "2 3" latest at 5..6
    seq.tokens.append(256)  # a token id whose bytes could match across token boundaries
    assert proposer.propose(seq, 2) == []
    seq.tokens += [1, 2]
    assert proposer.propose(seq, 2) == [3, 7]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
            "> prompt_lookup_max",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown keys"),
        ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs .model."),
    ],
)
def test_bad_configs_are_refused(text, message):
    with pytest.raises(SpeculativeConfigError, match=message):
        SpeculativeConfig.parse(text)


def test_vllm_spellings_parse():
    assert SpeculativeConfig.parse(
        '{"model": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    ) == SpeculativeConfig("ngram", 3, 4, 4)
    assert SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 3}') == SpeculativeConfig(
        "draft_model", 3, model="/m"
    )
    with pytest.raises(SpeculativeConfigError, match="block size"):
        NGRAM.check_block_size(4)


@pytest.fixture(scope="module")
def repeating_model(tmp_path_factory):
    """A tiny model whose greedy text repeats (pagedkv.bench.spec_workload): n-gram drafts get accepted."""
    return write_repeating_model(tmp_path_factory.mktemp("repeating") / "model", arch="llama", **TINY)


def _documents(engine, count: int, length: int) -> list[list[int]]:
    def greedy(starts, n):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        out = drive(engine, {0: [(f"d{i}", s, params) for i, s in enumerate(starts)]})
        return [out[f"d{i}"][0].tokens for i in range(len(starts))]

    return documents(count, length, vocab=512, seed=13, greedy=greedy)


def test_greedy_on_repetitive_text_accepts_most_drafts(repeating_model, blockd):
    spec = make_engine(repeating_model, blockd.endpoint, pool_id="spec-rep", speculative=NGRAM, max_num_seqs=4)
    plain = make_engine(repeating_model, blockd.endpoint, pool_id="plain-rep", max_num_seqs=4)
    prompts = [repeat_prompt(doc) for doc in _documents(plain, 5, 60)]
    greedy = SamplingParams(max_tokens=50, temperature=0.0)
    arrivals = {
        0: [(f"r{i}", p, greedy) for i, p in enumerate(prompts[:3])],
        2: [(f"r{i}", p, greedy) for i, p in enumerate(prompts[3:], 3)],
    }
    with_spec, without = drive(spec, arrivals), drive(plain, arrivals)
    for i, prompt in enumerate(prompts):
        assert with_spec[f"r{i}"][0].tokens == without[f"r{i}"][0].tokens, f"request {i}"
        assert with_spec[f"r{i}"][0].tokens == hf_greedy(repeating_model, prompt, greedy.max_tokens), f"request {i}"
    stats = spec.speculator.stats
    assert stats.acceptance_rate > 0.8, stats
    assert spec.steps * 2 < plain.steps


def test_prefix_hits_and_logprobs_with_speculation(repeating_model, blockd):
    """A second wave shares the first's prompts (prefix-cache hits); logprobs come for every accepted token."""
    spec = make_engine(repeating_model, blockd.endpoint, pool_id="spec-prefix", speculative=NGRAM)
    prompts = [repeat_prompt(doc) for doc in _documents(spec, 2, 40)]
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=2)
    first = drive(spec, {0: [(f"a{i}", p, params) for i, p in enumerate(prompts)]})
    second = drive(spec, {0: [(f"b{i}", p, params) for i, p in enumerate(prompts)]})
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(repeating_model, prompt, params.max_tokens)
        for results, key in ((first, f"a{i}"), (second, f"b{i}")):
            choice = results[key][0]
            assert choice.tokens == expected, key
            assert [lp.token_id for lp in choice.logprobs] == choice.tokens, key
        assert second[f"b{i}"][0].cached_tokens > 0
    assert spec.speculator.stats.accepted_tokens > 0


def _chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of equal distributions (bins with fewer than 10 draws together pooled)."""
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    big = [k for k in keys if a[k] + b[k] >= 10]
    rows = [[a[k], b[k]] for k in big] + [
        [sum(a[k] for k in keys if k not in big), sum(b[k] for k in keys if k not in big)]
    ]
    rows = [r for r in rows if sum(r) > 0]
    table = torch.tensor(rows, dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def test_sampled_output_keeps_the_models_distribution(repeating_model, blockd):
    """Rejection sampling: the tokens drawn with speculation follow the distribution drawn without it, position
    by position (a chi-square test over many seeded requests of a tiny model whose drafts are often accepted)."""
    spec = make_engine(
        repeating_model, blockd.endpoint, pool_id="spec-dist", speculative=NGRAM, max_num_seqs=32, num_blocks=256
    )
    plain = make_engine(repeating_model, blockd.endpoint, pool_id="plain-dist", max_num_seqs=32, num_blocks=256)
    (doc,) = _documents(plain, 1, 40)
    prompt = repeat_prompt(doc)
    draws = 400
    counts = {}
    for name, engine in (("spec", spec), ("plain", plain)):
        seeds = range(draws) if name == "spec" else range(draws, 2 * draws)  # independent samples
        requests = [
            (f"s{i}", prompt, SamplingParams(max_tokens=4, temperature=0.6, seed=seed, ignore_eos=True))
            for i, seed in enumerate(seeds)
        ]
        out = drive(engine, {0: requests})
        counts[name] = [Counter(tuple(out[f"s{i}"][0].tokens[: j + 1]) for i in range(draws)) for j in range(4)]
    assert spec.speculator.stats.accepted_tokens > draws // 4  # drafts were accepted, and rejected
    assert spec.speculator.stats.accepted_tokens < spec.speculator.stats.proposed_tokens
    for j in range(4):  # the joint distribution of the first j + 1 tokens
        p = _chi_square_p(counts["spec"][j], counts["plain"][j])
        assert p > 1e-3, (j, p)


def test_short_of_blocks_the_spare_room_is_trimmed_back(repeating_model, blockd):
    """A pool too small for every sequence's room: speculation's spare reserved blocks go back through blockd's
    trim before anyone is preempted; output stays the plain engine's, and no block leaks (blockd's teardown)."""
    spec = make_engine(repeating_model, blockd.endpoint, pool_id="spec-tight", speculative=NGRAM, num_blocks=24)
    plain = make_engine(repeating_model, blockd.endpoint, pool_id="plain-tight", num_blocks=24)
    prompts = [repeat_prompt(doc) for doc in _documents(plain, 6, 40)]
    trims = []
    step, submit = spec.pool.step, spec.pool.submit_step

    def counted(send):
        def call(ops):
            trims.extend(op for op in ops if type(op) is Trim)
            return send(ops)

        return call

    spec.pool.step, spec.pool.submit_step = counted(step), counted(submit)
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    arrivals = {0: [(f"r{i}", p, greedy) for i, p in enumerate(prompts)]}
    with_spec, without = drive(spec, arrivals), drive(plain, arrivals)
    for i in range(len(prompts)):
        assert with_spec[f"r{i}"][0].tokens == without[f"r{i}"][0].tokens, f"request {i}"
    assert trims, "no trim was sent"
    assert spec.speculator.stats.accepted_tokens > 0


@pytest.mark.parametrize("draft_arch", ["llama", "qwen2"])
def test_a_draft_model_keeps_greedy_output(draft_arch, tiny_models, blockd):
    """The draft is the target itself (every draft accepted) or another tiny model of the same vocabulary (most
    rejected): greedy output is transformers' either way, with concurrency and a second wave of prefix hits."""
    model = tiny_models["llama"]
    config = SpeculativeConfig.parse(
        json.dumps({"method": "draft_model", "model": str(tiny_models[draft_arch]), "num_speculative_tokens": 3})
    )
    spec = make_engine(model, blockd.endpoint, pool_id=f"spec-draft-{draft_arch}", speculative=config)
    prompts = random_prompts([5, 20, 33, 17], vocab=512, seed=9)
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    arrivals = {0: [(f"r{i}", p, greedy) for i, p in enumerate(prompts[:3])], 2: [("r3", prompts[3], greedy)]}
    first = drive(spec, arrivals)
    second = drive(spec, {0: [(f"b{i}", p, greedy) for i, p in enumerate(prompts)]})
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(model, prompt, greedy.max_tokens)
        assert first[f"r{i}"][0].tokens == expected, f"request {i}"
        assert second[f"b{i}"][0].tokens == expected, f"request {i} again"
    stats = spec.speculator.stats
    assert stats.proposed_tokens > 0
    if draft_arch == "llama":
        assert stats.acceptance_rate > 0.9, stats
    else:
        assert stats.accepted_tokens < stats.proposed_tokens


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_models, tmp_path, blockd):
    other = write_model(tmp_path / "other-vocab", arch="llama", quiet=True, **{**TINY, "vocab_size": 384})
    config = SpeculativeConfig.parse(json.dumps({"model": str(other), "num_speculative_tokens": 2}))
    with pytest.raises(SpeculativeConfigError, match="vocabulary of 384 tokens"):
        make_engine(tiny_models["llama"], blockd.endpoint, pool_id="spec-vocab", speculative=config)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be a positive integer"),
        ('{"method": "ngram", "num_speculative_tokens": 16}', "below the block size"),
        ('{"model": "/nonexistent-draft", "num_speculative_tokens": 2}', "not a directory"),
    ],
)
def test_the_executor_refuses_a_bad_config_at_startup(text, message):
    from click.testing import CliRunner

    from executor.main import main

    result = CliRunner().invoke(main, ["--speculative-config", text, "--block-size", "16"])
    assert result.exit_code == 2, result.output
    assert "--speculative-config" in result.output and message in result.output
