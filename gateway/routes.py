"""The gateway's HTTP app: OpenAI's completions, chat completions and models routes, health and metrics, and
the error handlers that answer in OpenAI's error shape.

A request is parsed and checked here (model, parameters, context length), tokenized, then handed to
`exchange.respond`, which runs its generations and answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway import errors
from gateway.api import ChatCompletionRequest, CompletionRequest
from gateway.auth import install_api_keys
from gateway.errors import APIError
from gateway.exchange import respond
from gateway.state import Gateway, GatewayConfig
from gateway.text import PromptError
from gateway.validation import check_stop_token_ids, check_token_ids, parse_body, token_limit


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="pagedkv gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    install_api_keys(app, config.api_keys, protect_health=config.protect_health, protect_metrics=config.protect_metrics)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path.startswith("/v1/"):
            gateway.metrics.requests.labels(route=request.url.path, status=str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = errors.not_found(request.url.path)
        else:
            error = APIError(exc.status_code, str(exc.detail), type="invalid_request_error")
        return JSONResponse(error.body(), status_code=error.status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        gateway.check_model(body.model)
        check_stop_token_ids(gateway, body)
        prompts = []
        for prompt in body.prompts():
            tokens = gateway.tokenizer.encode(prompt) if isinstance(prompt, str) else check_token_ids(gateway, prompt)
            prompts.append(tokens)
        if not prompts:
            raise errors.invalid_request("The prompt is empty.", param="prompt")
        limits = [token_limit(gateway, p, body.max_tokens, "prompt") for p in prompts]
        return await respond(gateway, request, "completion", body, prompts, limits, body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        gateway.check_model(body.model)
        check_stop_token_ids(gateway, body)
        try:
            prompt = gateway.tokenizer.encode_chat(
                [m.for_template() for m in body.messages], body.add_generation_prompt
            )
        except PromptError as exc:
            raise errors.invalid_request(str(exc), param="messages") from None
        limit = token_limit(gateway, prompt, body.token_limit, "messages")
        return await respond(gateway, request, "chat", body, [prompt], [limit], body.logprobs_k)

    def model_card() -> dict[str, Any]:
        return {
            "id": gateway.model_name,
            "object": "model",
            "created": gateway.created,
            "owned_by": "pagedkv",
            "max_model_len": gateway.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        gateway.check_model(name)
        return model_card()

    @app.get("/health")
    async def health() -> JSONResponse:
        healthy = any(link.healthy for link in gateway.links)
        body = {
            "status": "ok" if healthy else "unavailable",
            "model": gateway.model_name,
            "routing": config.routing,
            "in_flight": gateway.in_flight,
            "prefix_lookup": None if gateway.lookup is None else gateway.lookup.reachable,
            "executors": [link.describe() for link in gateway.links],
        }
        if not healthy:
            body["reason"] = gateway.why_unavailable()
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
