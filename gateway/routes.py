"""The gateway's HTTP app: OpenAI's completions, chat completions, embeddings (gateway.embeddings) and models
routes, Anthropic's messages (gateway.messages_routes), OpenAI's responses (gateway.responses_routes), health and
metrics, and the error handlers that answer in OpenAI's error shape (Anthropic's on its routes).

A request is parsed and checked here (body size and type, model, parameters), admitted to the queue (its
prompts x n against --max-queued-sequences), tokenized off the event loop (the gateway's text pool), checked
against the context length, then handed with its endpoint (gateway.completions, gateway.chat) to
`exchange.respond`, which runs its generations and answers in the endpoint's shape.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from gateway import errors
from gateway.api import ChatCompletionRequest, CompletionRequest
from gateway.auth import install_api_keys
from gateway.chat import ChatCompletions
from gateway.chat_run import run_chat
from gateway.completions import Completions, echo_only
from gateway.embedding_request import EmbeddingRequest
from gateway.embeddings import embed, require_task, tokenize
from gateway.errors import APIError
from gateway.exchange import respond
from gateway.messages_routes import add_messages_routes
from gateway.response_store import ResponseStore
from gateway.responses_routes import add_responses_routes
from gateway.state import Gateway, GatewayConfig
from gateway.utility import add_utility_routes
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

    def route_label(request: Request) -> str:
        """The metric label of a request's route: its template (/v1/models/{name:path}), never the raw path, so
        the label's values stay few whatever clients send; paths no route matches share one label."""
        route = request.scope.get("route")
        path = getattr(route, "path", None)
        if isinstance(path, str):
            return path
        for candidate in app.router.routes:
            if candidate.matches(request.scope)[0] == Match.FULL:
                return getattr(candidate, "path", "other")
        return "unmatched"

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path.startswith("/v1/"):
            gateway.metrics.requests.labels(route=route_label(request), status=str(exc.status)).inc()
        return JSONResponse(errors.error_body(request.url.path, exc), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = errors.not_found(request.url.path)
        else:
            error = APIError(exc.status_code, str(exc.detail), type="invalid_request_error")
        return JSONResponse(errors.error_body(request.url.path, error), status_code=error.status)

    def prepare_prompts(body: CompletionRequest, raw: list[str | list[int]]) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt (truncated as asked) and, with echo, the text its choices start with."""
        prompts, echo = [], []
        for prompt in raw:
            if isinstance(prompt, str):
                tokens = gateway.tokenizer.encode(prompt, add_special_tokens=body.add_special_tokens)
            else:
                tokens = check_token_ids(gateway, prompt)
            kept = body.truncate(tokens, gateway.max_model_len)
            if body.echo:
                whole = isinstance(prompt, str) and len(kept) == len(tokens)
                echo.append(prompt if whole else gateway.tokenizer.decode(kept, body.skip_special_tokens))
            prompts.append(kept)
        return prompts, echo

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await parse_body(request, CompletionRequest, config.max_body_bytes)
        gateway.check_model(body.model)
        require_task(gateway, "generate")
        check_stop_token_ids(gateway, body)
        raw_prompts = body.prompts()
        if not raw_prompts:
            raise errors.invalid_request("The prompt is empty.", param="prompt")
        admission = contextlib.ExitStack()  # its place in the queue first, then the work of tokenizing
        admission.enter_context(gateway.admitted(len(raw_prompts) * body.n))
        try:
            prompts, echo = await gateway.off_loop(prepare_prompts, body, raw_prompts)
            limits = [token_limit(gateway, p, body.max_tokens, "prompt") for p in prompts]
        except BaseException:
            admission.close()
            raise
        if body.gateway_only:  # echo, max_tokens 0, no logprobs: nothing to run (with logprobs: scored)
            admission.close()
            return echo_only(gateway, body, prompts, echo)
        endpoint = Completions(body, gateway.tokenizer, echo if body.echo else None)
        return await respond(gateway, request, endpoint, prompts, limits, admission)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, config.max_body_bytes)
        gateway.check_model(body.model)
        require_task(gateway, "generate")
        check_stop_token_ids(gateway, body)
        if body.parses_tool_calls and gateway.tool_call_parser == "none":
            raise errors.invalid_request(
                "tool_choice 'auto' needs a tool-call parser, and this model's chat template shows no tool-call "
                "format pagedkv knows: start the gateway with --tool-call-parser hermes or llama3_json, or send "
                "tool_choice 'none'",
                param="tool_choice",
            )
        endpoint = ChatCompletions(body, gateway.tokenizer, gateway.tool_call_parser)
        return await run_chat(gateway, request, body, lambda _prompt: endpoint, "messages")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body: EmbeddingRequest = await parse_body(request, EmbeddingRequest, config.max_body_bytes)
        gateway.check_model(body.model)
        require_task(gateway, "embed")
        with gateway.admitted(1):  # one pass at one executor, whatever the inputs; the body size bounds them
            prompts = await gateway.off_loop(tokenize, gateway, body)
            return await embed(gateway, body, prompts)

    def model_card() -> dict[str, Any]:
        return {
            "id": gateway.model_name,
            "object": "model",
            "created": gateway.created,
            "owned_by": "pagedkv",
            "root": gateway.model_name,
            "parent": None,
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

    add_utility_routes(app, gateway)
    add_messages_routes(app, gateway, config.max_body_bytes)
    app.state.response_store = ResponseStore()
    add_responses_routes(app, gateway, config.max_body_bytes, app.state.response_store)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
