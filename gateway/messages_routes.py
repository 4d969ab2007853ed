"""Anthropic's Messages API routes: POST /v1/messages (gateway.messages_api's body, answered by
gateway.messages) and POST /v1/messages/count_tokens. `anthropic-version` is accepted (every version answers
alike here) but must look like one (YYYY-MM-DD); errors on these routes are in Anthropic's shape
(gateway.errors.error_body, chosen by the path)."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway import errors
from gateway.chat_run import count_tokens, run_chat
from gateway.messages import Messages
from gateway.messages_api import MessagesPrompt, MessagesRequest
from gateway.state import Gateway
from gateway.validation import parse_body

_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")


def _check_version(request: Request) -> None:
    version = request.headers.get("anthropic-version")
    if version is not None and not _VERSION.fullmatch(version.strip()):
        raise errors.invalid_request(f"anthropic-version must be a date such as 2023-06-01, got {version[:40]!r}")


def add_messages_routes(app: FastAPI, gateway: Gateway, max_body_bytes: int) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        _check_version(request)
        body: MessagesRequest = await parse_body(request, MessagesRequest, max_body_bytes)
        chat = body.chat(gateway.tool_call_parser)
        parser = gateway.tool_call_parser

        def endpoint(prompt: list[int]) -> Messages:
            return Messages(chat, gateway.tokenizer, parser, len(prompt))

        return await run_chat(gateway, request, chat, endpoint, "messages")

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(request: Request) -> dict[str, Any]:
        _check_version(request)
        body: MessagesPrompt = await parse_body(request, MessagesPrompt, max_body_bytes)
        gateway.check_model(body.model)
        chat = body.chat_prompt()
        return {"input_tokens": await count_tokens(gateway, chat, "messages")}
