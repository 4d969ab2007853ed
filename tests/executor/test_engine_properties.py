"""Property-based: whatever arrives, aborts and runs short of blocks, the engine's invariants hold at every step.

After each step: every sequence's counters are ordered (tests.executor.harness.check_sequence_invariants) and
blockd's pool passes its invariant check; each time a step's answers come in, the pool client's count of blocks
in use equals blockd's own count.
When the work is done, the pool holds no block and every request ended exactly once per choice.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.params import SamplingParams
from tests.executor.harness import check_sequence_invariants, make_engine

request = st.fixed_dictionaries(
    {
        "prompt_len": st.integers(1, 90),
        "max_tokens": st.integers(1, 20),
        "n": st.integers(1, 3),
        "temperature": st.sampled_from([0.0, 0.0, 1.0]),
        "seed": st.one_of(st.none(), st.integers(0, 2**32)),
    }
)
action = st.one_of(
    st.tuples(st.just("submit"), request),
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("step"), st.integers(1, 6)),
)
_pools = itertools.count()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action, min_size=1, max_size=25), num_blocks=st.integers(12, 40))
def test_engine_invariants_hold_under_any_schedule(tiny_models, blockd, actions, num_blocks):
    pool_id = f"prop-{next(_pools)}"
    engine = make_engine(
        tiny_models["llama"],
        blockd.endpoint,
        num_blocks=num_blocks,
        max_num_seqs=6,
        max_num_batched_tokens=48,
        pool_id=pool_id,
    )
    admin = blockd.client()
    submitted: dict[str, int] = {}
    finished: dict[tuple[str, int], int] = {}

    # Between steps blockd is a step ahead of the pool client's mirror (the next step's ops travel during the
    # forward pass); the two agree each time a step's answers are in, which is where they are compared.
    collect = engine.pool.finish_step
    agreed = []

    def collect_and_compare() -> list:
        results = collect()
        assert admin.stats(pool_id).pools[0].blocks_in_use == engine.pool.blocks_in_use
        agreed.append(True)
        return results

    engine.pool.finish_step = collect_and_compare  # type: ignore[method-assign]

    def step() -> None:
        for delta in engine.step():
            record(delta)
        check_sequence_invariants(engine)
        assert admin.check() == []

    def record(delta) -> None:
        if delta.finish_reason is not None:
            key = (delta.request_id, delta.index)
            assert key not in finished, f"{key} finished twice"
            finished[key] = delta.completion_tokens

    for kind, arg in actions:
        if kind == "submit":
            request_id = f"r{len(submitted)}"
            params = SamplingParams(
                max_tokens=arg["max_tokens"],
                n=arg["n"],
                temperature=arg["temperature"],
                seed=arg["seed"],
                ignore_eos=True,
            )
            engine.add_request(
                request_id, [(7 * i + len(submitted)) % 500 + 4 for i in range(arg["prompt_len"])], params
            )
            submitted[request_id] = arg["n"]
        elif kind == "abort" and submitted:
            for delta in engine.abort(f"r{arg % len(submitted)}"):
                record(delta)
        else:
            for _ in range(arg):
                step()
    while engine.has_work():
        step()
    expected = {(rid, i) for rid, n in submitted.items() for i in range(n)}
    assert set(finished) == expected
    assert agreed or engine.steps == 0
    assert admin.stats(pool_id).pools[0].blocks_in_use == 0 == engine.pool.blocks_in_use
    assert engine.requests == {}
    admin.close()
    engine.pool.unregister()
