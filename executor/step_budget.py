"""A step's token budget sized by time (--max-step-ms): from the measured cost of the steps before, as many tokens
as fit in the target duration, never more than --max-num-batched-tokens.

A step's cost is modelled as `overhead + per_token * tokens` (decode tokens and prefill tokens alike: the linear
layers dominate), fitted by least squares over recent steps with exponential forgetting, so it follows a model
warming up, a host getting busier, contexts growing. While the steps seen do not vary enough in size to separate
overhead from per-token cost, the budget scales the last steps' size by target / measured time instead: that
overshoots at most once and converges, and never shrinks steps in a spiral (small steps looking dear per token).
Decode tokens always run (the scheduler hands them out first): the budget limits the prefill that joins them.

It also counts what it was shown (seconds, tokens), the executor's measured throughput in its load reports.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_STEP_MS = 500.0
DECAY = 0.9  # weight of the past per observed step: about the last 10-20 steps count


@dataclass
class _Sums:
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.x = self.x * decay + x
        self.y = self.y * decay + y
        self.xx = self.xx * decay + x * x
        self.xy = self.xy * decay + x * y


class StepBudget:
    """`tokens()` is the budget of the next step; `observe()` takes in each step's size and measured time."""

    def __init__(
        self, max_tokens: int, max_step_ms: float | None = DEFAULT_MAX_STEP_MS, *, min_tokens: int = 1
    ) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.max_tokens = max_tokens
        self.min_tokens = max(1, min(min_tokens, max_tokens))
        self.target_s = max_step_ms / 1000 if max_step_ms else None  # None or 0: no time bound, the cap only
        self._sums = _Sums()
        self.busy_s = 0.0  # measured, all steps
        self.computed_tokens = 0
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """One step computed `tokens` tokens in `seconds` (its forward pass and sampling)."""
        if tokens <= 0 or seconds < 0:
            return
        self.busy_s += seconds
        self.computed_tokens += tokens
        self.steps += 1
        self._sums.add(float(tokens), seconds, DECAY)

    def cost(self) -> tuple[float, float] | None:
        """(overhead_s, per_token_s) of the fitted model, or None while the steps seen do not separate them."""
        s = self._sums
        if s.w <= 0:
            return None
        mean_x, mean_y = s.x / s.w, s.y / s.w
        var_x = s.xx / s.w - mean_x * mean_x
        if var_x <= (0.1 * mean_x) ** 2:  # sizes nearly all alike: slope and intercept are not identifiable
            return None
        per_token = (s.xy / s.w - mean_x * mean_y) / var_x
        if per_token <= 0:
            return None
        return max(0.0, mean_y - per_token * mean_x), per_token

    def tokens(self) -> int:
        """The token budget of the next step: what fits in --max-step-ms, within [min_tokens, max_tokens]."""
        if self.target_s is None or self._sums.w <= 0:
            return self.max_tokens
        fit = self.cost()
        if fit is not None:
            overhead, per_token = fit
            wanted = (self.target_s - overhead) / per_token
        else:
            s = self._sums
            mean_x, mean_y = s.x / s.w, s.y / s.w
            wanted = mean_x * self.target_s / mean_y if mean_y > 0 else float(self.max_tokens)
        return int(max(self.min_tokens, min(self.max_tokens, wanted + 1e-6)))  # (1e-6: float noise of the fit)
