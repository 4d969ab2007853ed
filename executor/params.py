"""What a request asks of generation (SamplingParams) and its checks: part of the wire, so free of torch.

The gateway builds these and the executor's sampler (executor.sampling) reads them; keeping them here lets the
gateway speak the executor's protocol without importing torch.
"""

from __future__ import annotations

import math

import msgspec

MAX_LOGPROBS = 20
MAX_BAD_WORDS = 128  # token sequences per request (a word usually gives two: with and without a leading space)
MAX_BAD_WORD_TOKENS = 64  # tokens per banned sequence
MAX_GRAMMAR_CHARS = 1 << 20  # the source of a structured-output constraint (a JSON schema, regex, grammar)
GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class GrammarSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A structured-output constraint, compact: the executor compiles it (xgrammar) once per distinct spec.

    kind "json": `source` is a JSON schema (JSON text); "json_object": any JSON object (`source` empty);
    "regex": a regular expression; "choice": a JSON array of the strings allowed; "grammar": an EBNF grammar
    (xgrammar's, as vLLM's `guided_grammar`). `param` names the request parameter it came from, for messages.
    """

    kind: str
    source: str = ""
    any_whitespace: bool = True  # JSON kinds: whitespace between elements allowed (vLLM's default)
    param: str = ""

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the compile cache's key)."""
        return (self.kind, self.source, self.any_whitespace)

    def validate(self) -> str | None:
        if self.kind not in GRAMMAR_KINDS:
            return f"structured output kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}"
        if len(self.source) > MAX_GRAMMAR_CHARS:
            return f"{self.param or 'the structured output constraint'} is over {MAX_GRAMMAR_CHARS} characters"
        if self.kind != "json_object" and not self.source:
            return f"{self.param or 'the structured output constraint'} must not be empty"
        return None


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
    # None = none; k = each prompt token's logprob (after the first) and the k most likely there (vLLM's name).
    # Computed from the prefill's logits; such a request never takes a prefix-cache hit (a cached prefix has no
    # logits), so its whole prompt is computed.
    prompt_logprobs: int | None = None
    # Logits processing (vLLM's names and meaning); each one's neutral value costs the sampler nothing.
    presence_penalty: float = 0.0  # minus this from each token seen in the output (OpenAI)
    frequency_penalty: float = 0.0  # minus this times the count of each token in the output (OpenAI)
    repetition_penalty: float = 1.0  # tokens of the prompt or output: logits > 0 divided by it, others multiplied
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely (after temperature)
    min_tokens: int = 0  # end-of-sequence and stop_token_ids are banned until this many tokens are out
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), each token once
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # last token banned where the output ends with the rest
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled
    structured: GrammarSpec | None = None  # output constrained to a JSON schema, regex, choice or grammar
    # Beam search (vLLM's use_beam_search, with best_of as the width): 0 = none; k = k beams, the n best returned
    # (executor.beam, as transformers' generate(num_beams=k, do_sample=False)).
    beam_width: int = 0
    length_penalty: float = 1.0  # a finished beam's score: its logprob / (generated tokens ** length_penalty)
    early_stopping: bool | str = False  # True, False or "never" (transformers' meaning)
    # vLLM's priority: lower is served sooner, on an executor started with --scheduling-policy priority (an
    # executor that serves first come, first served refuses any other than 0).
    priority: int = 0

    def validate(self, vocab_size: int) -> str | None:
        if not self.max_tokens >= 0:
            return f"max_tokens must be at least 0, got {self.max_tokens}"
        if self.max_tokens == 0 and self.n != 1:
            return "max_tokens 0 (the prompt only, nothing generated) needs n = 1"
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            return f"temperature must be in [0, 100], got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"top_k must be >= 0 (0 = no limit), got {self.top_k}"
        if not 1 <= self.n <= 64:
            return f"n must be in [1, 64], got {self.n}"
        if not -(2**63) <= self.priority < 2**63:
            return f"priority must fit in 64 bits, got {self.priority}"
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            return f"seed must fit in 64 bits, got {self.seed}"
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            return f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            return f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            return f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad[:3]}"
        if self.structured is not None and (problem := self.structured.validate()):
            return problem
        if self.beam_width and (problem := self._validate_beam()):
            return problem
        return self._validate_processing(vocab_size)

    def _validate_beam(self) -> str | None:
        if not 1 <= self.beam_width <= 64:
            return f"the beam width (best_of) must be in [1, 64], got {self.beam_width}"
        if self.n > self.beam_width:
            return f"beam search returns at most its width's beams: n ({self.n}) must be at most {self.beam_width}"
        if self.early_stopping not in (True, False, "never"):
            return f'early_stopping must be true, false or "never", got {self.early_stopping!r}'
        if not math.isfinite(self.length_penalty):
            return f"length_penalty must be a finite number, got {self.length_penalty}"
        if self.max_tokens < 1:
            return "beam search needs max_tokens of at least 1"
        refused = [
            name
            for name, asked in (
                ("temperature > 0", self.temperature != 0.0),
                ("top_p", self.top_p != 1.0),
                ("top_k", self.top_k != 0),
                ("logprobs", self.logprobs is not None),
                ("prompt_logprobs", self.prompt_logprobs is not None),
                ("structured output", self.structured is not None),
                (
                    "logits processing (penalties, min_p, min_tokens, logit_bias, bad_words, allowed_token_ids)",
                    self.processes_logits,
                ),
            )
            if asked
        ]
        if refused:
            return f"beam search (deterministic, over the model's own logprobs) takes no {refused[0]}"
        return None

    def _validate_processing(self, vocab_size: int) -> str | None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                return f"{name} must be in [-2, 2], got {value}"
        if not 0.0 < self.repetition_penalty < math.inf:
            return f"repetition_penalty must be a number above 0, got {self.repetition_penalty}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be in [0, 1], got {self.min_p}"
        if not 0 <= self.min_tokens <= self.max_tokens:
            return f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            return "logit_bias names a token more than once"
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            return f"logit_bias keys must be token ids in [0, {vocab_size}), got {bad[:3]}"
        bad_bias = [b for _, b in self.logit_bias if not -100.0 <= b <= 100.0]
        if bad_bias:
            return f"logit_bias values must be in [-100, 100], got {bad_bias[:3]}"
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            return f"bad_words accepts at most {MAX_BAD_WORDS} token sequences, got {len(self.bad_words_token_ids)}"
        for word in self.bad_words_token_ids:
            if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS:
                return f"each of bad_words must be 1 to {MAX_BAD_WORD_TOKENS} tokens, got {len(word)}"
            bad = [t for t in word if not 0 <= t < vocab_size]
            if bad:
                return f"bad_words token ids must be in [0, {vocab_size}), got {bad[:3]}"
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                return "allowed_token_ids must not be empty (leave it out to allow every token)"
            if len(self.allowed_token_ids) > vocab_size:
                return (
                    f"allowed_token_ids has {len(self.allowed_token_ids)} ids, more than the vocabulary's {vocab_size}"
                )
            bad = [t for t in self.allowed_token_ids if not 0 <= t < vocab_size]
            if bad:
                return f"allowed_token_ids must be token ids in [0, {vocab_size}), got {bad[:3]}"
        return None

    @property
    def beam_search(self) -> bool:
        return self.beam_width > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether any processing beyond temperature, top-k and top-p applies (False: the sampler's plain path).
        One tuple comparison: the sampler asks it of every row at every step."""
        return (
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            self.min_p,
            self.min_tokens,
            self.logit_bias,
            self.bad_words_token_ids,
            self.allowed_token_ids,
        ) != _NEUTRAL_PROCESSING


_NEUTRAL_PROCESSING = (0.0, 0.0, 1.0, 0.0, 0, (), (), None)
