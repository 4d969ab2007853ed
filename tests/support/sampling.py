"""An independent, per-row reference of the sampler's logits processing (vLLM's order), for tests."""

from __future__ import annotations

import torch

from executor.params import SamplingParams

EOS = (3,)


def reference_processing(
    logits: torch.Tensor, params: SamplingParams, tokens: list[int], prompt_len: int, eos: tuple[int, ...]
) -> torch.Tensor:
    """vLLM's logits processing of one row, token by token in plain Python: the oracle of the batched sampler."""
    x = logits.clone()
    output = tokens[prompt_len:]
    if params.allowed_token_ids is not None:
        only = torch.full_like(x, float("-inf"))
        for t in params.allowed_token_ids:
            only[t] = x[t]
        x = only
    for word in params.bad_words_token_ids:
        prefix = list(word[:-1])
        if not prefix or (len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix):
            x[word[-1]] = float("-inf")
    for t, bias in params.logit_bias:
        x[t] += bias
    if len(output) < params.min_tokens:
        for t in [*params.stop_token_ids, *(() if params.ignore_eos else eos)]:
            x[t] = float("-inf")
    if params.repetition_penalty != 1.0:
        for t in set(tokens):
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return x
