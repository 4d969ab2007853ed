"""What the responses of every endpoint share: the envelope, server-sent events, usage, error events, tokens as
logprobs name them and vLLM's prompt_logprobs. Pure functions of their inputs; each endpoint's own shapes are in
its module (gateway.completions, gateway.chat).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from executor import protocol as ep
from gateway.errors import APIError
from gateway.generation import Usage
from gateway.text import Tokenizer


@dataclass(frozen=True)
class Envelope:
    """What every response and chunk of one request repeats."""

    id: str
    created: int
    model: str


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")


def error_event(error: APIError) -> str:
    return sse(error.body())


def usage_body(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.report_cached:  # else hidden: it would tell whether someone else sent this prefix
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


def total_usage(usages: Sequence[Usage]) -> Usage:
    return Usage(
        sum(u.prompt_tokens for u in usages),
        sum(u.completion_tokens for u in usages),
        sum(u.cached_tokens for u in usages),
        all(u.report_cached for u in usages),
    )


def usage_chunk(env: Envelope, object_name: str, usage: Usage) -> dict[str, Any]:
    return {
        "id": env.id,
        "object": object_name,
        "created": env.created,
        "model": env.model,
        "choices": [],
        "usage": usage_body(usage),
    }


# ---------------------------------------------------------------------------------------------- logprobs


def token_label(tokenizer: Tokenizer, token_id: int, as_id: bool) -> str:
    """A token as logprobs name it: its text, or `token_id:N` (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_id else tokenizer.token_text(token_id)


def prompt_logprobs(
    tokenizer: Tokenizer, entries: Sequence[ep.TokenLogprob] | None, top: int, as_ids: bool = False
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict by token id (as a string)
    of the prompt token and the `top` most likely ones, each with its logprob, rank and text."""
    if entries is None:
        return None

    def one(logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_label(tokenizer, token_id, as_ids)}

    out: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries:
        position = {str(t): one(lp, rank, t) for rank, (t, lp) in enumerate(entry.top[:top], 1)}
        position.setdefault(str(entry.token_id), one(entry.logprob, entry.rank, entry.token_id))
        out.append(position)
    return out
