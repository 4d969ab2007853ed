"""--max-step-ms: a step's token budget sized from the measured cost of the steps before it. Model-free: costs are
given (a step's size in, its seconds out), through the budget directly or a clock the step loop reads."""

from __future__ import annotations

from executor.scheduler import Chunk
from executor.step_budget import StepBudget
from executor.step_loop import Draw
from tests.executor.test_scheduler import Harness


def linear(overhead_s: float, per_token_s: float):
    return lambda tokens: overhead_s + per_token_s * tokens


def test_without_a_target_or_a_measure_the_budget_is_the_cap() -> None:
    assert StepBudget(2048, None).tokens() == 2048
    untimed = StepBudget(2048, 0)
    untimed.observe(2048, 9.0)
    assert untimed.tokens() == 2048
    assert StepBudget(2048, 100).tokens() == 2048  # nothing measured yet


def test_the_budget_is_what_the_fitted_cost_allows_in_the_target() -> None:
    cost = linear(0.010, 0.001)  # 10 ms a step, 1 ms a token: 100 ms hold 90 tokens
    budget = StepBudget(2048, 100)
    for tokens in (2048, 400, 1000, 90, 300, 16):
        budget.observe(tokens, cost(tokens))
    overhead, per_token = budget.cost()
    assert round(overhead, 6) == 0.010 and round(per_token, 6) == 0.001
    assert budget.tokens() == 90


def test_steps_of_one_size_scale_to_the_target_without_shrinking_in_a_spiral() -> None:
    budget = StepBudget(4096, 500)
    budget.observe(64, 0.050)  # decode-only steps: 64 tokens in 50 ms, nothing to separate overhead from cost
    budget.observe(64, 0.050)
    assert budget.cost() is None
    assert budget.tokens() == 640  # scaled by target / measured
    budget.observe(2048, 2.0)  # slow: the fit now tells overhead from per-token cost and the budget comes down
    assert 400 < budget.tokens() < 640


def test_the_budget_stays_within_the_floor_and_the_cap() -> None:
    slow = StepBudget(2048, 50, min_tokens=136)
    for tokens in (256, 512, 1024):
        slow.observe(tokens, tokens * 0.01)  # 10 ms a token: 5 tokens would fit
    assert slow.tokens() == 136  # every decode and a block of prefill, however slow
    fast = StepBudget(2048, 500)
    for tokens in (256, 512, 1024):
        fast.observe(tokens, tokens * 1e-6)
    assert fast.tokens() == 2048
    assert fast.computed_tokens == 1792 and round(fast.busy_s, 6) == 0.001792


class CostClock:
    """The step loop's clock: each forward pass of `tokens` tokens takes cost(tokens) seconds of it."""

    def __init__(self, cost) -> None:
        self.now, self.cost = 0.0, cost

    def __call__(self) -> float:
        return self.now

    def charge(self, chunks: list[Chunk]) -> None:
        self.now += self.cost(sum(len(c.token_ids) for c in chunks))


def test_the_scheduler_sizes_steps_by_their_measured_cost() -> None:
    h = Harness(num_blocks=128, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    # 1 ms a step and 1 ms a token against a 20 ms target: 19 tokens a step, the floor being 2 + 4 = 6.
    h.scheduler.step_budget = StepBudget(64, 20, min_tokens=6)
    clock = CostClock(linear(0.001, 0.001))
    h.loop.clock = clock
    run = h.loop.model.run

    def timed_run(chunks: list[Chunk], rows: list) -> list[Draw]:
        clock.charge(chunks)
        return run(chunks, rows)

    h.loop.model.run = timed_run  # type: ignore[method-assign]
    h.submit("decode", 3, max_tokens=40)
    h.submit("long", 300, max_tokens=2)
    records = h.run()
    sizes = [sum(len(c.token_ids) for c in r.chunks) for r in records if r.chunks]
    assert sizes[0] == 3 + 61  # nothing measured yet: the cap
    assert max(sizes[4:]) <= 19  # once measured, no step is longer than the target allows
    assert max(sizes[4:]) >= 15  # and the prefill still fills what the target leaves
    h.assert_all_done()
