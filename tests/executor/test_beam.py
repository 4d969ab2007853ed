"""Beam search on blockd forks, with a real blockd process: the beams equal transformers' generate(num_beams=k),
and blockd's counters show them sharing their history's blocks."""

from __future__ import annotations

import pytest

from executor.engine import RequestRejected
from executor.params import SamplingParams
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import (
    check_sequence_invariants,
    drive,
    hf_beams,
    hf_greedy_ignoring_eos,
    make_engine,
    random_prompts,
)
from tests.support.models import TINY


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
    beams = set()  # every sequence the search ran: the first, and one fork per child

    def on_step(step, engine):
        request = engine.loop.requests.get("beam")
        if request is not None:
            beams.update(s.seq_id for s in request.sequences)
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
    # At most one copy per fork (the open block it shares, if the parent's tokens end inside one), not per token.
    assert len(copies) <= len(beams) - 1, (len(copies), len(beams))
    assert len(beams) > width  # beams were forked past the first round, and dropped ones freed (fixture: no leak)


def test_beams_preempted_when_blocks_run_short_still_match_transformers(tiny_models, blockd):
    """Beam searches run one at a time, in a pool that holds one at its longest but not the greedy requests
    beside it: beams are preempted and recomputed (a beam waits for its preempted siblings' logprobs) and the
    outputs are still transformers'."""
    model = tiny_models["llama"]
    prompts = random_prompts([40, 33, 50, 20, 30, 25, 35], vocab=512, seed=9)
    params = SamplingParams(max_tokens=20, temperature=0.0, n=2, beam_width=4)
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, blockd.endpoint, pool_id="beam-tight", num_blocks=48, block_size=8)
    arrivals = [(f"b{i}", prompt, params) for i, prompt in enumerate(prompts[:3])]
    arrivals += [(f"g{i}", prompt, greedy) for i, prompt in enumerate(prompts[3:])]
    preempted_beams = set()

    def on_step(step, engine):
        for seq in engine.scheduler.waiting:
            if seq.request.beam is not None and seq.preemptions:
                preempted_beams.add(seq.seq_id)

    results = drive(engine, {0: arrivals}, on_step=on_step)
    assert preempted_beams, "no beam was preempted: the pool is not tight enough for this test"
    for i, prompt in enumerate(prompts[:3]):
        assert [c.tokens for c in results[f"b{i}"]] == hf_beams(model, prompt, params), f"request {i}"
    for i, prompt in enumerate(prompts[3:]):
        assert results[f"g{i}"][0].tokens == hf_greedy_ignoring_eos(model, prompt, greedy.max_tokens)


def test_beam_search_too_wide_for_the_cache_is_refused(tiny_models, blockd):
    model = tiny_models["llama"]
    engine = make_engine(model, blockd.endpoint, pool_id="beam-small", num_blocks=16, block_size=8)
    params = SamplingParams(max_tokens=40, temperature=0.0, beam_width=8)
    with pytest.raises(RequestRejected, match="beam search of width 8"):
        engine.add_request("wide", [1, 2, 3], params)
    assert not engine.has_work()


def test_aborted_beam_searches_free_every_beam_and_the_queued_one_starts(tiny_models, blockd):
    """A beam search aborted mid-way ends its n choices with "abort" and frees all its beams' blocks; one
    aborted while queued behind it never starts; the one queued after them runs as transformers' (the blockd
    fixture checks at teardown that no block is left in use)."""
    model = tiny_models["llama"]
    prompts = random_prompts([30, 20, 25], vocab=512, seed=13)
    params = SamplingParams(max_tokens=16, temperature=0.0, n=2, beam_width=3)
    engine = make_engine(model, blockd.endpoint, pool_id="beam-abort")
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", prompt, params)
    for _ in range(4):
        assert not engine.step()  # nothing is sent before a search ends
    assert len(engine.requests["a0"].beam.running) == 3
    aborted = engine.abort("a0") + engine.abort("a1")
    assert sorted((d.request_id, d.index, d.finish_reason) for d in aborted) == [
        ("a0", 0, "abort"),
        ("a0", 1, "abort"),
        ("a1", 0, "abort"),
        ("a1", 1, "abort"),
    ]
    tokens: dict[int, list[int]] = {}
    while engine.has_work():
        for delta in engine.step():
            assert delta.request_id == "a2" and delta.finish_reason is not None
            tokens[delta.index] = delta.token_ids
        check_sequence_invariants(engine)
    assert [tokens[0], tokens[1]] == hf_beams(model, prompts[2], params)
    assert engine.pool.blocks_in_use == 0


def test_beam_search_on_a_sliding_window_model_matches_transformers(tmp_path, blockd):
    """A Mistral whose window (24) is shorter than its beams: the pool slides, a beam forked past its window
    shares the parent's holes, and the child computes from the parent's registered tokens on, which no hole is
    read by."""
    model = write_model(tmp_path / "mistral", quiet=True, **TINY, arch="mistral", sliding_window=24)
    prompts = random_prompts([5, 40, 70], vocab=512, seed=3)
    params = SamplingParams(max_tokens=30, temperature=0.0, n=3, beam_width=4)
    engine = make_engine(model, blockd.endpoint, pool_id="beams-window", block_size=8)
    assert engine.pool.sliding_window == 24
    holes = []
    results = drive(
        engine,
        {0: [(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]},
        on_step=lambda _step, e: holes.append(sum(s.holes for s in e.pool.seqs.values())),
    )
    assert max(holes) > 0  # blocks behind the window went back
    for i, prompt in enumerate(prompts):
        assert [c.tokens for c in results[f"r{i}"]] == hf_beams(model, prompt, params), f"request {i}"
