"""Request migration: how one choice whose executor was lost mid-generation continues on another, from its prompt
plus the tokens it already generated (recomputed there, or found in a shared KV tier), and when it cannot.

What holds after a migration: docs/architecture.md ("Executor health and failover").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from executor.params import SamplingParams

DEFAULT_MAX_MIGRATIONS = 3  # per generation (--max-migrations)


def refusal(params: SamplingParams) -> str | None:
    """Why this request's choices cannot continue from their tokens elsewhere, or None.

    A continuation makes the tokens already generated part of the prompt, so what the executor decides from the
    *output* alone would be decided afresh: a grammar's matcher would start over at the grammar's start, output
    penalties would no longer count them, a banned multi-token word could be finished across the cut."""
    if params.structured is not None:
        return "structured output (the executor's grammar matcher cannot start part-way)"
    if params.presence_penalty or params.frequency_penalty:
        return "presence or frequency penalties (they count the output only)"
    if any(len(word) > 1 for word in params.bad_words_token_ids):
        return "multi-token bad_words (banned by the output's last tokens)"
    return None


def continuation(
    params: SamplingParams, choice: int, generated: Sequence[int], migration: int
) -> SamplingParams | None:
    """The params of choice `choice`'s continuation after `generated`: one choice, the tokens left of max_tokens,
    min_tokens less what is out, no prompt logprobs (sent already); None if nothing is left to generate.

    A seeded choice gets a seed of its own, from the request's, the choice, the migration and the tokens out: the
    same cut gives the same continuation, yet not the uninterrupted run's draws (the executor's generator cannot
    be moved on by the draws it made elsewhere)."""
    left = params.max_tokens - len(generated)
    if left <= 0:
        return None
    seed = params.seed
    if seed is not None and not params.greedy:
        digest = hashlib.blake2b(f"{seed}:{choice}:{migration}:{len(generated)}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little", signed=True)
    return msgspec.structs.replace(
        params,
        n=1,
        max_tokens=left,
        min_tokens=max(0, params.min_tokens - len(generated)),
        prompt_logprobs=None,
        seed=seed,
    )
