"""Models mixing sliding and global layers (Gemma 2, Gemma 3, gpt-oss) keep their KV in layer groups: every
group's table is a sequence of one blockd pool, the sliding groups' tables hand their blocks back as a sequence
runs. With a real blockd: prompts several windows long, concurrent, in a pool that could not hold them with every
layer allocated in full; tokens and logprobs equal transformers'; a second wave hits the first one's prefix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockd.pool import HOLE
from executor.checkpoint import load_config
from executor.engine import Engine
from executor.layer_groups import layer_groups
from executor.params import SamplingParams
from executor.runner import kv_bytes_per_block
from executor.scheduler import window_blocks
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import check_against_transformers, drive, make_engine, random_prompts
from tests.support.models import TINY

WINDOW = 16
BLOCK_SIZE = 8
BATCH = 32  # max_num_batched_tokens: a prompt is held a step's tokens ahead of what is computed
SPECS = {
    # (make-model options, the groups' sliding flags)
    "gemma2": (dict(arch="gemma2", layers=4, head_dim=32), (False, True)),  # S F S F: 2 layers a group
    "gemma3": (dict(arch="gemma3", layers=6, head_dim=32, sliding_pattern=6), (False, *[True] * 5)),  # 5:1
    "gpt_oss": (dict(arch="gpt_oss", head_dim=32, experts=4, experts_per_token=2), (False, True)),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def grouped_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple]:
    options, groups = SPECS[request.param]
    path = write_model(tmp_path_factory.mktemp(request.param) / request.param, quiet=True,
                       **{**TINY, **options, "sliding_window": WINDOW})  # fmt: skip
    return path, groups


def test_layers_are_grouped_by_kind(tmp_path: Path) -> None:
    gemma3 = load_config(write_model(tmp_path / "g3", quiet=True, **{**TINY, **SPECS["gemma3"][0]},
                                     sliding_window=WINDOW))  # fmt: skip
    groups = layer_groups(gemma3)
    assert (groups.size, groups.sliding, groups.window) == (1, SPECS["gemma3"][1], WINDOW)
    assert groups.group_of == (1, 2, 3, 4, 5, 0)  # layer 5 is the global one: group 0
    # Three layers, S F S: groups of one, the global first; a pool block is one layer's K and V.
    gemma2 = load_config(write_model(tmp_path / "g2", quiet=True, **{**TINY, "layers": 3}, arch="gemma2",
                                     sliding_window=WINDOW))  # fmt: skip
    groups = layer_groups(gemma2)
    assert (groups.size, groups.sliding, groups.group_of, groups.slot_of) == (
        1,
        (False, True, True),
        (1, 0, 2),
        (0,) * 3,
    )
    one_layer = 2 * BLOCK_SIZE * gemma2.num_kv_heads * gemma2.head_dim * 4  # K and V, float32
    assert kv_bytes_per_block(gemma2, BLOCK_SIZE, torch.float32) == one_layer
    # Every layer alike: one group of all of them.
    mistral = load_config(write_model(tmp_path / "m", quiet=True, **TINY, arch="mistral", sliding_window=WINDOW))
    assert layer_groups(mistral).sliding == (True,) and layer_groups(mistral).size == 2
    llama = load_config(write_model(tmp_path / "l", quiet=True, **TINY, arch="llama"))
    assert layer_groups(llama).window is None and layer_groups(llama).pool_groups == ()


def test_sliding_groups_give_blocks_back_and_match_transformers(grouped_model, blockd) -> None:
    model, sliding = grouped_model
    full = sum(1 for s in sliding if not s)
    generate = 24
    prompts = random_prompts([160, 140, 40], vocab=512, seed=41)  # 184 and 164 tokens: over ten windows
    per_seq = -(-(160 + generate) // BLOCK_SIZE)
    # Both long sequences fit with the sliding groups' blocks going back, not with every layer in full.
    num_blocks = 2 * (full * per_seq + (len(sliding) - full) * window_blocks(BLOCK_SIZE, WINDOW + BATCH)) + 8
    assert num_blocks < 2 * len(sliding) * per_seq
    engine = make_engine(model, blockd.endpoint, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                         max_num_batched_tokens=BATCH, pool_id=f"groups-{model.name}")  # fmt: skip
    assert engine.pool.groups == sliding and engine.pool.sliding_window == WINDOW
    assert engine.loop.max_seq_tokens >= 160 + generate
    params = SamplingParams(max_tokens=generate, temperature=0.0, ignore_eos=True, logprobs=1)
    most = {"sliding": 0, "global": 0, "together": 0, "in_use": 0}
    client = blockd.client()  # its own socket: the engine's may have a step in flight

    def watch(_step: int, engine: Engine) -> None:
        pool = engine.pool
        for table_id, seq in pool.seqs.items():
            assert seq.blocks[: seq.holes] == [HOLE] * seq.holes
            assert sliding[seq.group] or seq.holes == 0, table_id
        # Decoding (a few tokens past its prompt: its last prefill chunk's slide goes a round trip or two later), a
        # sliding table holds its window's blocks, a global one all.
        decoding = [s for s in engine.scheduler.running if len(s.tokens) - s.prompt_len > 3 and not s.fork_parent]
        for seq in decoding:
            for group, table_id in enumerate(pool.table_ids(seq.seq_id)):
                kind = "sliding" if sliding[group] else "global"
                most[kind] = max(most[kind], len(pool.seqs[table_id].blocks) - pool.seqs[table_id].holes)
        most["together"] = max(most["together"], sum(1 for s in decoding if s.prompt_len > 100))
        most["in_use"] = max(most["in_use"], client.stats(pool.pool_id).pools[0].blocks_in_use)

    waves = {0: [("a", prompts[0], params), ("b", prompts[1], params)], 2: [("c", prompts[2], params)]}
    results = drive(engine, waves, on_step=watch)
    assert most["sliding"] <= window_blocks(BLOCK_SIZE, WINDOW) < per_seq <= most["global"]
    assert most["together"] == 2  # both long ones at once: more than the pool holds with every layer in full
    assert most["in_use"] <= num_blocks  # (blockd's count)
    # A second wave continuing the first sequence (at once: an idle engine of this harness sends no heartbeats, and
    # blockd drops the index of a silent pool): its first 176 tokens are a hit in every group, though the sliding
    # groups' early blocks went back long ago and were evicted: a query at 176 reads only their last blocks.
    again = [*prompts[0], *results["a"][0].tokens[:16], 3, 1, 4]
    assert client.stats(engine.pool.pool_id).pools[0].counters.evictions > 0
    expected_hit = client.lookup(again)[engine.pool.pool_id]
    pair = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)  # forks every group's tables
    second = drive(engine, {0: [("again", again, params), ("c2", prompts[2], params), ("pair", prompts[1], pair)]})
    assert [c.tokens for c in second["pair"]] == [results["b"][0].tokens[:8]] * 2
    assert second["again"][0].cached_tokens == expected_hit == 176
    assert second["c2"][0].cached_tokens == 32  # all but the block holding its last token
    assert second["c2"][0].tokens == results["c"][0].tokens
    for request_id, prompt in zip("abc", prompts, strict=True):
        assert results[request_id][0].finish_reason == "length"
        check_against_transformers(model, prompt, results[request_id][0])
    check_against_transformers(model, again, second["again"][0])
    stats = client.stats(engine.pool.pool_id).pools[0]
    assert stats.blocks_in_use == 0 and stats.live_sequences == 0
    assert client.check() == []
    client.close()
