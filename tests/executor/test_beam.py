"""Beam search on blockd forks, with a real blockd process: the beams equal transformers' generate(num_beams=k),
and blockd's counters show them sharing their history's blocks."""

from __future__ import annotations

import pytest
import torch

from executor.params import SamplingParams
from tests.executor.harness import drive, hf_greedy_ignoring_eos, hf_model, make_engine, random_prompts


def hf_beams(model_dir, prompt, params: SamplingParams) -> list[list[int]]:
    """transformers' own beam search: the oracle (its sequences padded past an end, cut back here)."""
    model = hf_model(model_dir)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=params.max_tokens,
            num_beams=params.beam_width,
            num_return_sequences=params.n,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            do_sample=False,
        )
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    beams = []
    for row in out[:, len(prompt) :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        beams.append(row[:cut])
    return beams


@pytest.mark.parametrize(
    ("width", "n", "length_penalty", "early_stopping"),
    [(4, 4, 1.0, False), (3, 2, 0.5, True), (4, 1, 2.0, "never")],
)
def test_beam_search_matches_transformers(width, n, length_penalty, early_stopping, tiny_models, blockd):
    model = tiny_models["llama"]
    prompts = random_prompts([5, 21, 40], vocab=512, seed=3)
    params = SamplingParams(
        max_tokens=20,
        temperature=0.0,
        n=n,
        beam_width=width,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    engine = make_engine(model, blockd.endpoint, pool_id="beams")
    results = drive(engine, {0: [(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]})
    for i, prompt in enumerate(prompts):
        got = [choice.tokens for choice in results[f"r{i}"]]
        assert got == hf_beams(model, prompt, params), f"request {i}"


def test_beams_share_their_history_blocks_in_blockd(tiny_models, blockd):
    """blockd holds each block of the beams' common history once: blocks in use stay far below beams x length.
    A continued beam forks (its children's first write copies the open block alone) and a dropped one is freed;
    a greedy request alongside is unchanged."""
    model = tiny_models["llama"]
    prompt, other = random_prompts([100, 30], vocab=512, seed=5)
    width, bs = 4, 16
    params = SamplingParams(max_tokens=24, temperature=0.0, n=2, beam_width=width)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, blockd.endpoint, pool_id="beam-share", num_blocks=128, block_size=bs)
    copies: list[tuple[int, int]] = []
    copy_blocks = engine.model_step.copy_blocks

    def counted(pairs):
        copies.extend(pairs)
        copy_blocks(pairs)

    engine.model_step.copy_blocks = counted
    seen = []

    def on_step(step, engine):
        request = engine.loop.requests.get("beam")
        if request is None or len(request.beam.running) < width:
            return
        lengths = [len(b.seq.tokens) for b in request.beam.running]
        with blockd.client() as client:
            (pool,) = [p for p in client.stats().pools if p.pool_id == "beam-share"]
        seen.append((pool.blocks_in_use, sum(-(-n // bs) for n in lengths), max(lengths)))

    results = drive(engine, {0: [("beam", prompt, params), ("greedy", other, greedy)]}, on_step=on_step)
    assert [c.tokens for c in results["beam"]] == hf_beams(model, prompt, params)
    assert results["greedy"][0].tokens == hf_greedy_ignoring_eos(model, other, greedy.max_tokens)
    assert len(seen) >= 10, seen
    shared = len(prompt) // bs  # the prompt's full blocks: every beam's, held once
    greedy_blocks = -(-(len(other) + greedy.max_tokens) // bs) + 2  # its tokens and its reserved room
    for in_use, unshared, longest in seen:
        assert in_use < unshared, seen
        # Past the shared prompt, each beam holds its own tail and its reserved room (at most two blocks).
        assert in_use <= shared + width * (-(-(longest - shared * bs) // bs) + 2) + greedy_blocks, seen
    assert copies, "a forked beam's first write copies the open block it shares"
    assert len(copies) < len(seen) * width  # one copy per fork, not one per token
