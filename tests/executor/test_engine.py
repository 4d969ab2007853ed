"""The engine against transformers, with a real blockd process: greedy outputs must be token-for-token identical.

Every test runs against a fresh blockd whose teardown checks that the pool ends with zero blocks in use.
"""

from __future__ import annotations

import math

import pytest

from blockd.protocol import OpError
from executor.engine import RequestRejected
from executor.params import SamplingParams
from tests.executor.harness import (
    drive,
    hf_greedy,
    hf_greedy_ignoring_eos,
    hf_logprobs,
    make_engine,
    random_prompts,
)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_matches_transformers_with_staggered_arrivals(arch, tiny_models, blockd):
    model = tiny_models[arch]
    # Lengths cross block edges (16) and the step's token budget (64: the 150-token prompt is chunked).
    prompts = random_prompts([5, 16, 17, 150, 33, 1, 64], vocab=512, seed=1)
    arrivals = {0: [], 2: [], 5: []}
    for i, prompt in enumerate(prompts):
        arrivals[[0, 2, 5][i % 3]].append((f"r{i}", prompt, GREEDY))
    engine = make_engine(model, blockd.endpoint, pool_id=f"pool-{arch}")
    results = drive(engine, arrivals)
    for i, prompt in enumerate(prompts):
        (choice,) = results[f"r{i}"]
        assert choice.tokens == hf_greedy(model, prompt, GREEDY.max_tokens), f"request {i}"
        assert choice.finish_reason in ("stop", "length")
        assert choice.completion_tokens == len(choice.tokens)


def test_blockd_round_trips_travel_during_the_forward_pass(tiny_models, blockd):
    """After the first step, every step's blockd ops are sent before the forward pass of the step before it, and
    a decoding sequence sends an op a block, not a token; outputs still match transformers."""
    model = tiny_models["llama"]
    prompts = random_prompts([5, 20, 40], vocab=512, seed=21)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, blockd.endpoint, pool_id="overlap")
    pool = engine.pool
    waited, sent_ahead, in_flight_at_forward = [], [], []
    step, submit, execute = pool.step, pool.submit_step, engine.runner.execute

    def counted_step(ops):
        waited.append(ops)
        return step(ops)

    def counted_submit(ops):
        if not waited or waited[-1] is not ops:  # (a waited-for step is sent by the same call)
            sent_ahead.append(len(ops))
        return submit(ops)

    def watched_execute(chunks, tables):
        in_flight_at_forward.append(pool.step_in_flight)
        return execute(chunks, tables)

    pool.step, pool.submit_step, engine.runner.execute = counted_step, counted_submit, watched_execute
    results = drive(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"][0].tokens == hf_greedy_ignoring_eos(model, prompt, 40), f"request {i}"
    assert len(waited) == 2  # only the first step, and the frees after the last forward pass, waited for blockd
    assert len(in_flight_at_forward) == engine.steps and sum(in_flight_at_forward) == len(sent_ahead)
    # 3 x 40 decode tokens in blocks of 16: about ten appends and a few commits and frees, not 120 appends.
    assert sum(sent_ahead) + sum(map(len, waited)) < 40, (sent_ahead, waited)


def test_a_request_arriving_while_a_step_is_in_flight_starts_in_the_next_step(tiny_models, blockd):
    model = tiny_models["llama"]
    first, late = random_prompts([12, 20], vocab=512, seed=22)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, blockd.endpoint, pool_id="arrivals")
    engine.add_request("first", first, params)
    for _ in range(3):
        engine.step()
    engine.add_request("late", late, params)  # the next step is planned already, without it
    deltas = engine.step()  # one extra round trip admits it, and it is computed in this step
    assert [d.token_ids for d in deltas if d.request_id == "late"] == [hf_greedy_ignoring_eos(model, late, 1)]
    tokens = {"first": [], "late": []}
    while engine.has_work():
        for d in engine.step():
            tokens[d.request_id] += d.token_ids
    assert len(tokens["late"]) == 29


def test_llama3_rope_scaling_matches_transformers(llama3_model, blockd):
    prompts = random_prompts([100, 7], vocab=512, seed=2)  # past the original 64-token context
    engine = make_engine(llama3_model, blockd.endpoint)
    results = drive(engine, {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]})
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"][0].tokens == hf_greedy(llama3_model, prompt, GREEDY.max_tokens)


def test_prefix_hit_skips_cached_tokens_and_keeps_output(tiny_models, blockd):
    model = tiny_models["llama"]
    shared = random_prompts([70], vocab=512, seed=3)[0]
    first, second = [*shared, 11, 12, 13], [*shared, 21, 22]
    engine = make_engine(model, blockd.endpoint)
    results = drive(engine, {0: [("first", first, GREEDY)]})
    assert results["first"][0].cached_tokens == 0
    results = drive(engine, {0: [("second", second, GREEDY)]})
    choice = results["second"][0]
    assert choice.cached_tokens == 64  # the 4 full blocks of the shared 70 tokens
    assert choice.tokens == hf_greedy(model, second, GREEDY.max_tokens)
    stats = blockd.client().stats(engine.pool.pool_id).pools[0]
    assert stats.counters.hit_tokens >= 64


def test_memory_pressure_preempts_and_every_output_is_unchanged(tiny_models, blockd):
    model = tiny_models["qwen2"]
    prompts = random_prompts([30, 40, 20, 35, 25, 45], vocab=512, seed=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, blockd.endpoint, num_blocks=14, max_num_seqs=6)
    results = drive(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        choice = results[f"r{i}"][0]
        assert choice.finish_reason == "length" and len(choice.tokens) == 40
        reference = hf_greedy_ignoring_eos(model, prompt, 40)
        assert choice.tokens == reference, f"request {i}"


def test_n2_with_seed_is_reproducible_and_forks_share_the_prompt_blocks(tiny_models, blockd):
    model = tiny_models["llama"]
    prompt = random_prompts([40], vocab=512, seed=5)[0]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, n=2, ignore_eos=True)
    shared_seen = []

    def watch(step, engine):
        seqs = engine.pool.seqs
        if "a#0" in seqs and "a#1" in seqs:
            shared_seen.append(seqs["a#0"].blocks[:2] == seqs["a#1"].blocks[:2])
            # With the next step's ops in flight, blockd may be applying them right now: ask it when it is settled.
            if not engine.pool.step_in_flight:
                blockd_view = blockd.client().sequence("a#1", engine.pool.pool_id)
                shared_seen.append(blockd_view.refcounts[0] == 2)

    engine = make_engine(model, blockd.endpoint, pool_id="pool-a")
    first = drive(engine, {0: [("a", prompt, params)]}, on_step=watch)
    assert len(shared_seen) > 2 and all(shared_seen)
    engine_b = make_engine(model, blockd.endpoint, pool_id="pool-b", seed=999)  # another engine, other luck
    second = drive(engine_b, {0: [("b", prompt, params)]})
    assert [c.tokens for c in first["a"]] == [c.tokens for c in second["b"]]
    assert first["a"][0].tokens != first["a"][1].tokens  # the two choices draw differently
    assert all(len(c.tokens) == 12 for c in first["a"])
    pool_stats = blockd.client().stats("pool-a").pools[0]
    assert pool_stats.counters.copies_on_write >= 1  # the shared partial block was copied on divergence


def test_seeded_request_does_not_depend_on_its_batch(tiny_models, blockd):
    model = tiny_models["mistral"]
    prompt, other = random_prompts([12, 30], vocab=512, seed=6)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
    alone = drive(make_engine(model, blockd.endpoint, pool_id="alone"), {0: [("x", prompt, params)]})
    crowd_engine = make_engine(model, blockd.endpoint, pool_id="crowd")
    crowded = drive(
        crowd_engine, {0: [("noise", other, SamplingParams(max_tokens=10, temperature=1.0)), ("x", prompt, params)]}
    )
    assert alone["x"][0].tokens == crowded["x"][0].tokens


def test_logprobs_match_transformers(tiny_models, blockd):
    model = tiny_models["llama"]
    prompt = random_prompts([20], vocab=512, seed=8)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    results = drive(make_engine(model, blockd.endpoint), {0: [("lp", prompt, params)]})
    choice = results["lp"][0]
    reference = hf_logprobs(model, prompt, choice.tokens)
    for position, entry in enumerate(choice.logprobs):
        assert entry.token_id == choice.tokens[position]
        assert math.isclose(entry.logprob, reference[position, entry.token_id].item(), abs_tol=1e-4)
        top_values, top_ids = reference[position].topk(3)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert all(math.isclose(v, r, abs_tol=1e-4) for (_, v), r in zip(entry.top, top_values.tolist(), strict=False))


def test_stop_token_ids_and_max_tokens_finish_requests(tiny_models, blockd):
    model = tiny_models["llama"]
    prompt = random_prompts([10], vocab=512, seed=9)[0]
    free_run = hf_greedy_ignoring_eos(model, prompt, 8)
    stop_at = free_run[3]
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop_at,), ignore_eos=True)
    results = drive(make_engine(model, blockd.endpoint), {0: [("s", prompt, params)]})
    choice = results["s"][0]
    assert choice.finish_reason == "stop"
    assert choice.tokens == free_run[: free_run.index(stop_at) + 1]


def test_abort_frees_the_request_blocks(tiny_models, blockd):
    engine = make_engine(tiny_models["llama"], blockd.endpoint)
    prompt = random_prompts([50], vocab=512, seed=10)[0]
    engine.add_request("long", prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    engine.add_request("short", prompt[:9], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert blockd.client().stats(engine.pool.pool_id).pools[0].blocks_in_use > 0
    # The next step's ops are on their way to blockd: the abort waits for their answers, then ends the request
    # before that step is scheduled.
    assert engine.abort("long") == []
    assert engine.abort("long") == []  # a second abort is a no-op
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas if d.request_id == "long"] == [("long", "abort")]
    while engine.has_work():
        assert all(d.request_id != "long" for d in engine.step())
    assert blockd.client().stats(engine.pool.pool_id).pools[0].blocks_in_use == 0
    assert "long" not in engine.requests


def test_aborting_a_choice_of_a_request_whose_grammar_compiles_leaves_the_request_running(tiny_models, blockd):
    from executor.params import GrammarSpec

    engine = make_engine(tiny_models["llama"], blockd.endpoint)
    spec = GrammarSpec("regex", "[0-9]{2}z", param="test")  # a spec no other test compiles: not cached
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, n=2, structured=spec))
    assert "r" in engine._compiling
    assert engine.abort("r", 1) == []  # a choice not forked yet has produced nothing to stop
    reasons = {}
    while engine.has_work():
        for delta in engine.step():
            if delta.finish_reason is not None:
                reasons[delta.index] = delta.finish_reason
    assert sorted(reasons) == [0, 1] and "abort" not in reasons.values()  # both choices ran to their end
    assert not engine.requests


def test_invalid_requests_are_rejected_and_change_nothing(tiny_models, blockd):
    engine = make_engine(tiny_models["llama"], blockd.endpoint, num_blocks=8)
    good = random_prompts([12], vocab=512, seed=11)[0]
    engine.add_request("good", good, GREEDY)
    engine.step()
    cases = {
        "empty": ([], GREEDY, "invalid_request"),
        "vocab": ([5, 512], GREEDY, "invalid_request"),
        "negative": ([-1], GREEDY, "invalid_request"),
        "context": ([1] * 512, GREEDY, "context_length_exceeded"),
        "capacity": ([1] * 200, GREEDY, "capacity_exceeded"),
        "temperature": ([1], SamplingParams(temperature=-1.0), "invalid_request"),
        "top_p": ([1], SamplingParams(top_p=0.0), "invalid_request"),
        "n": ([1], SamplingParams(n=0), "invalid_request"),
        "max_tokens": ([1], SamplingParams(max_tokens=-1), "invalid_request"),  # 0: the prompt only (echo)
        "logprobs": ([1], SamplingParams(logprobs=99), "invalid_request"),
        "stop_ids": ([1], SamplingParams(stop_token_ids=(9999,)), "invalid_request"),
        "good": (good, GREEDY, "duplicate_request"),
    }
    for request_id, (prompt, params, code) in cases.items():
        with pytest.raises(RequestRejected) as info:
            engine.add_request(request_id, prompt, params)
        assert info.value.code == code, request_id
        assert info.value.message
    out = []
    while engine.has_work():
        out += [t for d in engine.step() for t in d.token_ids]
    assert len(out) == GREEDY.max_tokens - 1 or engine.requests == {}
    assert list(engine.requests) == []


def test_triton_kernels_forced_end_to_end(tiny_models, blockd):
    model = tiny_models["llama"]
    prompts = random_prompts([20, 5], vocab=512, seed=12)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, blockd.endpoint, backend="triton", pool_id="triton")
    results = drive(engine, {0: [("t0", prompts[0], params)], 1: [("t1", prompts[1], params)]})
    for i, prompt in enumerate(prompts):
        assert results[f"t{i}"][0].tokens == hf_greedy_ignoring_eos(model, prompt, 4)


def test_greedy_n2_choices_both_match_transformers_after_copy_on_write(tiny_models, blockd):
    """Both choices write their own tokens after the shared prompt's partial last block: unless that block
    was copied (K/V included) before the first write, the second choice would attend to garbage."""
    model = tiny_models["qwen2"]
    prompt = random_prompts([21], vocab=512, seed=13)[0]  # 21 tokens: the second block is shared and partial
    params = SamplingParams(max_tokens=20, temperature=0.0, n=2, ignore_eos=True)
    engine = make_engine(model, blockd.endpoint)
    results = drive(engine, {0: [("g", prompt, params)]})
    reference = hf_greedy_ignoring_eos(model, prompt, 20)
    assert [c.tokens for c in results["g"]] == [reference, reference]
    assert blockd.client().stats(engine.pool.pool_id).pools[0].counters.copies_on_write == 1


def test_sharded_checkpoint_gives_the_same_output(tiny_models, tiny_options, blockd, tmp_path):
    from pagedkv.tools.model_gen import write_model

    sharded = write_model(tmp_path / "sharded", arch="llama", max_shard_size="200KiB", quiet=True, **tiny_options)
    assert (sharded / "model.safetensors.index.json").exists()
    prompt = random_prompts([30], vocab=512, seed=14)[0]
    outputs = []
    for i, model in enumerate((tiny_models["llama"], sharded)):
        engine = make_engine(model, blockd.endpoint, pool_id=f"shard-{i}")
        outputs.append(drive(engine, {0: [("s", prompt, GREEDY)]})["s"][0].tokens)
    assert outputs[0] == outputs[1] == hf_greedy(tiny_models["llama"], prompt, GREEDY.max_tokens)


def test_a_wrong_free_block_estimate_never_fails_a_request(tiny_models, blockd):
    """If blockd refuses an append (the executor thought blocks were free), the sequence is preempted and
    recomputed like any other: every request still finishes with the same output."""
    from blockd.client import PoolClient
    from executor.scheduler import Purpose

    class Optimistic:
        """The pool client's view, but claiming 6 more free blocks than there are."""

        def __init__(self, pool: PoolClient) -> None:
            self.pool = pool

        @property
        def seqs(self):
            return self.pool.seqs

        @property
        def refcount(self) -> list[int]:
            return self.pool.refcount

        @property
        def free_blocks(self) -> int:
            return self.pool.free_blocks + 6

    model = tiny_models["llama"]
    prompts = random_prompts([30, 40, 20, 35], vocab=512, seed=15)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine = make_engine(model, blockd.endpoint, num_blocks=12, max_num_seqs=4)
    engine.scheduler.blocks = Optimistic(engine.pool)
    refused = []
    original_apply = engine.scheduler.apply

    def apply(plan, results):
        refused.extend(
            r
            for entry, r in zip(plan.entries, results, strict=True)
            if entry.purpose is Purpose.APPEND and type(r) is OpError
        )
        return original_apply(plan, results)

    engine.scheduler.apply = apply
    results = drive(engine, {0: [(f"r{i}", p, params) for i, p in enumerate(prompts)]})
    assert refused, "the optimistic view never made blockd refuse an append"
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"][0].tokens == hf_greedy_ignoring_eos(model, prompt, 30), f"request {i}"


def test_loading_in_half_precision_keeps_ties_and_float32_rotary_tables(tiny_models):
    import torch

    from executor.runner import load_model

    loaded = load_model(tiny_models["qwen2"], torch.device("cpu"), torch.bfloat16)  # qwen2: tied embeddings
    model = loaded.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.rotary.cos.dtype is torch.float32
    reference = load_model(tiny_models["qwen2"], torch.device("cpu"), torch.float32).model
    torch.testing.assert_close(
        model.model.layers[0].self_attn.qkv_proj.bias.float(),
        reference.model.layers[0].self_attn.qkv_proj.bias,
        atol=1e-2,
        rtol=1e-2,
    )
