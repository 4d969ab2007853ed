"""`/v1/embeddings`: inputs tokenized, sent as one `Embed` to an executor serving an embedding model (`--task
embed`), its vectors answered as floats or base64 (little-endian float32, as OpenAI's SDK decodes it). An
executor lost before it answered is replaced by another: an embedding has no state to lose. Generation routes
call `require_task` so that an embedding server refuses them clearly, and the other way round."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from array import array
from typing import Any

from common.tokens import pack_tokens
from executor import protocol as ep
from gateway import errors
from gateway.embedding_request import EmbeddingRequest
from gateway.executors import ExecutorLink, ExecutorLost, ExecutorUnavailable
from gateway.state import Gateway
from gateway.validation import check_token_ids

ROUTE = "/v1/embeddings"
_ENDPOINTS = {"generate": "/v1/completions and /v1/chat/completions", "embed": ROUTE}


def require_task(gateway: Gateway, task: str) -> None:
    """400 when the executors in rotation serve only another task than `task` ("generate" or "embed"). With none
    in rotation it says nothing: the route's own checks come first, and its routing answers 503."""
    tasks = {link.info.task for link in gateway.links if link.healthy and link.info}
    if tasks and task not in tasks:
        served = "an embedding model" if "embed" in tasks else "a generative model"
        raise errors.invalid_request(
            f"This server serves {served} ({gateway.model_name}): use {' or '.join(_ENDPOINTS[t] for t in tasks)}.",
            param="model",
            code="wrong_task",
        )


def tokenize(gateway: Gateway, body: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, truncated as asked and checked against the context."""
    limit = gateway.max_model_len
    if limit is None:
        raise errors.no_executor(gateway.why_unavailable())
    prompts = []
    for i, item in enumerate(body.inputs()):
        if isinstance(item, str):
            tokens = gateway.tokenizer.encode(item, add_special_tokens=body.add_special_tokens)
        else:
            tokens = check_token_ids(gateway, item, param="input")
        if body.truncate_prompt_tokens is not None:
            tokens = tokens[-body.truncate_prompt_tokens :]
        if not tokens:
            raise errors.invalid_request(f"Input {i} is empty.", param="input")
        if len(tokens) > limit:
            raise errors.context_length_exceeded(
                f"This model's maximum context length is {limit} tokens. However, input {i} has {len(tokens)} "
                "tokens. Please shorten it (or set truncate_prompt_tokens).",
                "input",
            )
        prompts.append(tokens)
    return prompts


async def embed(gateway: Gateway, body: EmbeddingRequest, prompts: list[list[int]]) -> dict[str, Any]:
    """The response body: one vector per input, in order, and the usage."""
    request_id = f"embd-{uuid.uuid4().hex}"
    message = ep.Embed(
        request_id=request_id,
        prompts=[pack_tokens(p) for p in prompts],
        dimensions=body.dimensions,
        normalize=body.normalize,
    )
    answer = await _ask(gateway, request_id, message)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
        for i, vector in enumerate(answer.embeddings)
    ]
    gateway.metrics.prompt_tokens.inc(answer.prompt_tokens)
    gateway.metrics.requests.labels(route=ROUTE, status="200").inc()
    return {
        "object": "list",
        "data": data,
        "model": gateway.model_name,
        "created": int(time.time()),
        "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens},
    }


def _encoded(vector: bytes, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector).decode("ascii")
    values = array("f")
    values.frombytes(vector)
    return values.tolist()


async def _ask(gateway: Gateway, request_id: str, message: ep.Embed) -> ep.Embedded:
    tried: set[str] = set()
    while True:
        link = _choose(gateway, tried)
        try:
            queue = link.request(request_id, message)
        except ExecutorUnavailable:
            tried.add(link.endpoint)
            continue
        try:
            item = await queue.get()
        except asyncio.CancelledError:  # the client went away: the executor's answer is not wanted
            link.release(request_id)
            raise
        link.release(request_id)
        if isinstance(item, ExecutorLost):
            tried.add(link.endpoint)
            gateway.metrics.retries.inc()
            continue
        if type(item) is ep.Embedded:
            return item
        if type(item) is ep.Rejected:
            raise _rejection(item)
        raise errors.internal(f"executor {link.endpoint} answered an embedding request with {type(item).__name__}")


def _choose(gateway: Gateway, tried: set[str]) -> ExecutorLink:
    """The least loaded executor in rotation that serves embeddings (a prefix lookup would not help: an
    embedding pass reads no cached blocks)."""
    links = [link for link in gateway.router.healthy(tried) if link.info is not None and link.info.task == "embed"]
    if not links:
        detail = "no executor in rotation serves embeddings" if not tried else "the executors tried were lost"
        raise errors.no_executor(detail)
    return min(links, key=lambda link: link.queue_depth())


def _rejection(item: ep.Rejected) -> errors.APIError:
    if item.code == ep.RejectCode.CONTEXT_LENGTH_EXCEEDED:
        return errors.context_length_exceeded(item.message, "input")
    if item.code == ep.RejectCode.INVALID_REQUEST:
        param = "dimensions" if item.message.startswith("dimensions") else "input"
        return errors.invalid_request(item.message, param=param)
    if item.code == ep.RejectCode.QUEUE_FULL:
        return errors.APIError(429, item.message, type="rate_limit_error", code="queue_full")
    return errors.internal(item.message)
