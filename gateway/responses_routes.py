"""OpenAI's Responses API routes: POST /v1/responses (gateway.responses_api's body, answered by
gateway.responses_endpoint), GET and DELETE /v1/responses/{id} and GET /v1/responses/{id}/input_items (a page:
`order` desc (default) or asc, `limit` 1 to 100 (20), `after` an item id) on the gateway's bounded store
(gateway.response_store). Errors are in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.chat_run import run_chat
from gateway.errors import APIError, invalid_request
from gateway.response_store import ResponseStore
from gateway.responses_api import ResponsesRequest
from gateway.responses_endpoint import Responses
from gateway.state import Gateway
from gateway.validation import parse_body


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"No response with id {response_id[:100]!r} is stored here (never stored, evicted, or deleted).",
        type="invalid_request_error",
        param=param,
        code="response_not_found",
    )


def add_responses_routes(app: FastAPI, gateway: Gateway, max_body_bytes: int, store: ResponseStore) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body: ResponsesRequest = await parse_body(request, ResponsesRequest, max_body_bytes)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = previous.conversation
        new = body.input_messages()
        parser = gateway.tool_call_parser
        chat = body.chat(history, new, parser)

        def endpoint(prompt: list[int]) -> Responses:
            return Responses(chat, gateway.tokenizer, parser, body, history + new, store)

        return await run_chat(gateway, request, chat, endpoint, "input")

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored.response

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        response_id: str, order: str = "desc", limit: int = 20, after: str | None = None
    ) -> dict[str, Any]:
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            raise invalid_request(
                "order must be asc or desc and limit in [1, 100]",
                param="order" if order not in ("asc", "desc") else "limit",
            )
        items = stored.input_items if order == "asc" else stored.input_items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise invalid_request(f"after names no input item of {response_id!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
