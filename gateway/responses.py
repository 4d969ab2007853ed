"""OpenAI response bodies and stream chunks, built from generation events. Pure functions of their inputs."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
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


# ---------------------------------------------------------------------------------------------- logprobs


@dataclass
class CompletionLogprobs:
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, tokenizer: Tokenizer, entries: Sequence[ep.TokenLogprob], offset: int, as_ids: bool = False) -> None:
        """Entries of tokens whose text starts at character `offset` of the choice's text (`as_ids`: tokens
        named `token_id:N`, vLLM's return_tokens_as_token_ids)."""
        pending = b""  # bytes of a character that the next tokens complete
        for entry in entries:
            self.tokens.append(token_label(tokenizer, entry.token_id, as_ids))
            self.token_logprobs.append(entry.logprob)
            self.top_logprobs.append({token_label(tokenizer, t, as_ids): lp for t, lp in entry.top})
            self.text_offset.append(offset)
            pending += tokenizer.token_bytes(entry.token_id)
            try:
                offset += len(pending.decode("utf-8"))
                pending = b""
            except UnicodeDecodeError:
                pass  # the offset moves once the character is whole

    def add_prompt(
        self,
        tokenizer: Tokenizer,
        prompt: Sequence[int],
        entries: Sequence[ep.TokenLogprob],
        top: int,
        as_ids: bool = False,
    ) -> None:
        """echo: the prompt's tokens come first, its first token with a null logprob and top_logprobs (OpenAI)."""
        start = len(self.tokens)
        self.add(tokenizer, [ep.TokenLogprob(prompt[0], 0.0, []), *entries], 0, as_ids)
        self.token_logprobs[start] = None
        self.top_logprobs[start] = None
        for i, entry in enumerate(entries, start + 1):
            self.top_logprobs[i] = {token_label(tokenizer, t, as_ids): lp for t, lp in entry.top[:top]}

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


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


def chat_logprobs(
    tokenizer: Tokenizer, entries: Sequence[ep.TokenLogprob], top: int, as_ids: bool = False
) -> list[dict[str, Any]]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_label(tokenizer, token_id, as_ids),
            "logprob": logprob,
            "bytes": list(tokenizer.token_bytes(token_id)),
        }

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top[:top]]} for e in entries]


# ---------------------------------------------------------------------------------------------- completions


def completion_chunk(
    env: Envelope,
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    chunk = {
        "id": env.id,
        "object": "text_completion",
        "created": env.created,
        "model": env.model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if usage is not None:  # vLLM's continuous_usage_stats
        chunk["usage"] = usage_body(usage)
    return chunk


def completion_body(env: Envelope, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return {
        "id": env.id,
        "object": "text_completion",
        "created": env.created,
        "model": env.model,
        "choices": choices,
        "usage": usage_body(usage),
    }


def usage_chunk(env: Envelope, object_name: str, usage: Usage) -> dict[str, Any]:
    return {
        "id": env.id,
        "object": object_name,
        "created": env.created,
        "model": env.model,
        "choices": [],
        "usage": usage_body(usage),
    }


# ---------------------------------------------------------------------------------------------- chat


def chat_chunk(
    env: Envelope,
    index: int,
    delta: dict[str, Any],
    logprobs: list[dict[str, Any]] | None,
    finish_reason: str | None,
    usage: Usage | None = None,
) -> dict[str, Any]:
    chunk = {
        "id": env.id,
        "object": "chat.completion.chunk",
        "created": env.created,
        "model": env.model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else {"content": logprobs},
                "finish_reason": finish_reason,
            }
        ],
    }
    if usage is not None:  # vLLM's continuous_usage_stats
        chunk["usage"] = usage_body(usage)
    return chunk


def chat_body(env: Envelope, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return {
        "id": env.id,
        "object": "chat.completion",
        "created": env.created,
        "model": env.model,
        "choices": choices,
        "usage": usage_body(usage),
    }
