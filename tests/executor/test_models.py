"""Every supported family against transformers, at the engine with a real blockd: several tiny random checkpoints
each (head dims, GQA ratios, windows, experts, tied or untied), prompts longer than the window, arriving staggered
and chunked, a second wave hitting the first's prefix cache. Greedy tokens must equal transformers' and each
chosen token's logprob be within 2e-3 of transformers' (float32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from executor.checkpoint import load_config
from executor.models.blocks import Linear
from executor.params import SamplingParams
from pagedkv.tools.model_gen import write_model
from tests.executor.harness import check_against_transformers, drive, make_engine, random_prompts
from tests.support.models import FAMILY_SPECS, TINY

MAX_TOKENS = 12
LOGPROB_TOLERANCE = 2e-3
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="session")
def family_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """name -> the checkpoint of FAMILY_SPECS[name], written on first use."""
    root = tmp_path_factory.mktemp("family-models")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = write_model(root / name, quiet=True, **{**TINY, **FAMILY_SPECS[name]})
        return made[name]

    return get


@pytest.mark.parametrize("name", sorted(FAMILY_SPECS))
def test_family_matches_transformers_past_the_window_with_prefix_caching(name, family_model, blockd):
    model = family_model(name)
    config = load_config(model)
    window = max((w for w in config.sliding_windows if w), default=0)
    shared = random_prompts([40], vocab=512, seed=31)[0]
    first = [*shared, *random_prompts([17], vocab=512, seed=32)[0]]  # 57 tokens, past every window (<= 48)
    others = random_prompts([70, 9], vocab=512, seed=33)
    assert window < len(first)
    # 128 blocks: with layer groups every sliding table holds its window's blocks and a margin (gemma3-l7-w13 has
    # six of them), and 64 would leave its global table less than the first prompt.
    engine = make_engine(model, blockd.endpoint, pool_id=f"pool-{name}", num_blocks=128)
    if engine.runner.device.type == "cpu":  # so the equality below is that of oneDNN's packed linear layers
        assert all(m.packed is not None for m in engine.runner.model.modules() if isinstance(m, Linear))
    waves = {0: [("first", first, PARAMS), ("long", others[0], PARAMS)], 3: [("short", others[1], PARAMS)]}
    results = drive(engine, waves)
    second = [*shared, 5, 6, 7]  # a later request sharing the first one's 40-token prefix
    # At once: an idle engine of this harness sends no heartbeats, and blockd drops the index of a silent pool.
    results |= drive(engine, {0: [("second", second, PARAMS), ("again", others[1], PARAMS)]})
    assert results["second"][0].cached_tokens == 32  # the two full blocks of the shared prefix
    prompts = {"first": first, "long": others[0], "short": others[1], "second": second, "again": others[1]}
    for request_id, prompt in prompts.items():
        assert len(results[request_id][0].tokens) == MAX_TOKENS
        check_against_transformers(model, prompt, results[request_id][0], LOGPROB_TOLERANCE)
