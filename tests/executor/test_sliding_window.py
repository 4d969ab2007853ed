"""Sliding windows give blocks back: a model whose every layer slides runs sequences several times longer than its
window, in a pool that could not hold them whole, with a real blockd; greedy tokens equal transformers', each
sequence holds about its window's blocks, and prefix hits stay correct."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockd.pool import HOLE
from executor.engine import Engine
from executor.kv_budget import pool_window
from executor.params import SamplingParams
from executor.scheduler import window_blocks
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import drive, hf_greedy_ignoring_eos, make_engine, random_prompts
from tests.support.models import TINY

WINDOW = 24
BLOCK_SIZE = 8
NUM_BLOCKS = 24  # 192 slots: less than the two sequences' 2 x 180 tokens, more than their windows' blocks


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("windowed") / "mistral", quiet=True, **TINY, arch="mistral",
                       sliding_window=WINDOW)  # fmt: skip


def test_every_layers_window_is_the_pools(windowed_model: Path, tmp_path: Path) -> None:
    from executor.checkpoint import load_config

    assert pool_window(load_config(windowed_model)) == WINDOW
    llama = write_model(tmp_path / "llama", quiet=True, **TINY, arch="llama")
    assert pool_window(load_config(llama)) is None


def test_long_sequences_hold_their_window_and_match_transformers(windowed_model: Path, blockd) -> None:
    engine = make_engine(windowed_model, blockd.endpoint, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    assert engine.pool.sliding_window == WINDOW
    assert engine.loop.max_seq_tokens >= 180 > NUM_BLOCKS * BLOCK_SIZE // 2
    prompts = random_prompts([30, 20], vocab=512, seed=5)
    generate = 150  # 180 and 170 tokens: over seven windows
    params = SamplingParams(max_tokens=generate, temperature=0.0, ignore_eos=True)
    most_held = [0]

    def watch(_step: int, engine: Engine) -> None:
        for seq in engine.pool.seqs.values():
            held = len(seq.blocks) - seq.holes
            assert seq.blocks[: seq.holes] == [HOLE] * seq.holes
            most_held[0] = max(most_held[0], held)

    results = drive(engine, {0: [("a", prompts[0], params)], 2: [("b", prompts[1], params)]}, on_step=watch)
    # The window's blocks, the block the slides lag by and the reserved room ahead: never the whole sequence.
    assert most_held[0] <= WINDOW // BLOCK_SIZE + 4 <= window_blocks(BLOCK_SIZE, WINDOW)
    for request_id, prompt in zip("ab", prompts, strict=True):
        choice = results[request_id][0]
        assert choice.finish_reason == "length"
        assert choice.tokens == hf_greedy_ignoring_eos(windowed_model, prompt, generate), request_id
    stats = engine.pool.client.stats(engine.pool.pool_id).pools[0]
    assert stats.blocks_in_use == 0 and stats.live_sequences == 0  # nothing leaked
    assert engine.pool.client.check() == []


def test_blocks_handed_back_stay_prefix_hits(windowed_model: Path, blockd) -> None:
    engine = make_engine(windowed_model, blockd.endpoint, num_blocks=64, block_size=BLOCK_SIZE)
    prompt = random_prompts([40], vocab=512, seed=6)[0]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    holes = [0]

    def watch(_step: int, engine: Engine) -> None:
        holes[0] = max([holes[0], *(seq.holes for seq in engine.pool.seqs.values())])

    first = drive(engine, {0: [("first", prompt, params)]}, on_step=watch)["first"][0]
    assert holes[0] >= (len(prompt) - WINDOW) // BLOCK_SIZE  # its prompt's first blocks went back as it ran
    # A second request sharing the prompt: those blocks went back with their hashes, and are hits still.
    again = [*prompt, 7, 8, 9]
    second = drive(engine, {0: [("again", again, params)]})["again"][0]
    assert second.cached_tokens == len(prompt)
    assert first.tokens == hf_greedy_ignoring_eos(windowed_model, prompt, 30)
    assert second.tokens == hf_greedy_ignoring_eos(windowed_model, again, 30)


def test_a_prompt_longer_than_the_pool_is_served(windowed_model: Path, blockd) -> None:
    engine = make_engine(windowed_model, blockd.endpoint, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    prompt = random_prompts([250], vocab=512, seed=7)[0]  # 250 tokens in a pool of 192 slots
    assert engine.loop.max_prompt_tokens > len(prompt) > NUM_BLOCKS * BLOCK_SIZE
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    result = drive(engine, {0: [("long", prompt, params)]})["long"][0]
    assert result.tokens == hf_greedy_ignoring_eos(windowed_model, prompt, 10)


def test_a_prefix_whose_head_was_evicted_is_a_hit_on_the_blocks_its_window_reads(windowed_model: Path, blockd) -> None:
    # 12 blocks of 8: a 100-token sequence evicts its own first blocks as it grows.
    engine = make_engine(
        windowed_model, blockd.endpoint, num_blocks=12, block_size=BLOCK_SIZE, max_num_batched_tokens=16
    )
    prompt = random_prompts([40], vocab=512, seed=8)[0]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    first = drive(engine, {0: [("first", prompt, params)]})["first"][0]
    assert engine.pool.client.stats(engine.pool.pool_id).pools[0].counters.evictions > 0
    # The first 96 of its tokens again: the query after them reads keys 73.., which the last blocks it freed hold.
    seen = [*prompt, *first.tokens]
    again = [*seen[:96], 1, 2, 3]
    second = drive(engine, {0: [("again", again, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]})
    # (checked against transformers only now: an idle engine of this harness sends no heartbeats, and blockd
    # drops the index of a pool silent past its lease)
    assert second["again"][0].cached_tokens == 96
    assert first.tokens == hf_greedy_ignoring_eos(windowed_model, prompt, 60)
    assert second["again"][0].tokens == hf_greedy_ignoring_eos(windowed_model, again, 8)
