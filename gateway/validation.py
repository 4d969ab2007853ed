"""Checks on a request before any work is done for it: its body read within `--max-body-bytes` (413, judged
from Content-Length and again while the body streams in), declared as JSON (415), parsed (400, also for JSON
nested too deep to parse) into the request model, token ids in the vocabulary, max_tokens within the context.
A refusal raises the `APIError` the client gets.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gateway import errors
from gateway.api import GenerationRequest, require_json_object, validation_message
from gateway.state import Gateway


def token_limit(gateway: Gateway, prompt: list[int], asked: int | None, param: str) -> int:
    """max_tokens for this prompt: what was asked, if it fits in the context; all the room left if not asked."""
    limit = gateway.max_model_len
    if limit is None:
        raise errors.no_executor(gateway.why_unavailable())
    if not prompt:
        raise errors.invalid_request("The prompt is empty.", param=param)
    room = limit - len(prompt)
    if asked is None:
        if room < 1:
            raise errors.context_length_exceeded(
                f"This model's maximum context length is {limit} tokens. However, your {param} has "
                f"{len(prompt)} tokens, leaving no room for the completion.",
                param,
            )
        return room
    if asked > room:
        raise errors.context_length_exceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt) + asked} tokens ({len(prompt)} in the {param}, {asked} for the completion). Please "
            "reduce the length of the prompt or the completion.",
            param,
        )
    return asked


def check_token_ids(gateway: Gateway, tokens: list[int], param: str = "prompt") -> list[int]:
    vocab = gateway.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in tokens):
        raise errors.invalid_request(f"{param} token ids must be in [0, {vocab}).", param=param)
    return tokens


def check_stop_token_ids(gateway: Gateway, body: GenerationRequest) -> None:
    vocab = gateway.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
        raise errors.invalid_request(f"stop_token_ids must be token ids in [0, {vocab}).", param="stop_token_ids")


def _too_large(limit: int) -> errors.APIError:
    return errors.APIError(
        413,
        f"The request body is larger than this gateway accepts ({limit} bytes; --max-body-bytes).",
        type="invalid_request_error",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 415 unless it is declared as JSON, and with 413 once it passes `limit` bytes
    (before reading anything when Content-Length says so)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise errors.APIError(
            415,
            f"The request body must be JSON, sent with Content-Type: application/json (not {media_type or 'none'!r}).",
            type="invalid_request_error",
            code="unsupported_media_type",
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def load_json(raw_body: bytes) -> Any:
    """The body as JSON: 400 for anything else, nesting too deep included."""
    try:
        return json.loads(raw_body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise errors.invalid_request("The request body is not valid JSON.") from None
    except RecursionError:
        raise errors.invalid_request("The request body is JSON nested too deeply.") from None


def validate_json(raw: Any, model: type[BaseModel]) -> Any:
    """`raw` as a request of `model`: 400 naming the parameter otherwise."""
    try:
        return model.model_validate(require_json_object(raw))
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise errors.invalid_request(message, param=param) from None
    except RecursionError:
        raise errors.invalid_request("The request body is JSON nested too deeply.") from None


async def parse_body(request: Request, model: type[BaseModel], limit: int) -> Any:
    return validate_json(load_json(await read_body(request, limit)), model)
