"""What a request asks of generation (SamplingParams) and its checks: part of the wire, so free of torch.

The gateway builds these and the executor's sampler (executor.sampling) reads them; keeping them here lets the
gateway speak the executor's protocol without importing torch.
"""

from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """What a request asks of generation. `validate` says what is wrong with it, in one sentence."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k = the chosen token's logprob and the k most likely

    def validate(self, vocab_size: int) -> str | None:
        if not self.max_tokens >= 1:
            return f"max_tokens must be at least 1, got {self.max_tokens}"
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            return f"temperature must be in [0, 100], got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"top_k must be >= 0 (0 = no limit), got {self.top_k}"
        if not 1 <= self.n <= 64:
            return f"n must be in [1, 64], got {self.n}"
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            return f"seed must fit in 64 bits, got {self.seed}"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            return f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad[:3]}"
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
