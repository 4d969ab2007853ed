"""vLLM's utility routes, in vLLM's shapes: `/tokenize`, `/detokenize`, `/tokenizer_info`, `/version`, `/ping`.

Tools such as lm-eval probe these to count tokens with the server's own tokenizer instead of a local copy.
`/tokenize` takes a plain prompt (`{"model", "prompt", "add_special_tokens"}`) or chat messages (`{"model",
"messages", "add_generation_prompt", "add_special_tokens", "tools"}`) and answers `{"count", "max_model_len",
"tokens"}` (and `"token_strs"` with `return_token_strs`); `/detokenize` turns `{"model", "tokens"}` back into
`{"prompt"}`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway import errors
from gateway.api import ChatMessage, Tool, chat_tools
from gateway.state import Gateway
from gateway.text import PromptError
from gateway.validation import check_token_ids, load_json, parse_body, read_body, validate_json


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def version() -> str:
    try:
        return importlib.metadata.version("pagedkv")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def tokenizer_info(gateway: Gateway) -> dict[str, Any]:
    """What tokenizer_config.json says (vLLM answers with its tokenizer's init settings), with the special
    tokens as plain strings, the chat template, and the limits this deployment has."""
    tokenizer = gateway.tokenizer
    info: dict[str, Any] = {
        key: value
        for key, value in tokenizer.config.items()
        if key not in ("added_tokens_decoder", "chat_template") and not key.endswith("_token")
    }
    info["tokenizer_class"] = tokenizer.tokenizer_class  # the class AutoTokenizer loaded, as vLLM reports it
    info.update(tokenizer.special_tokens)
    if tokenizer.chat_templates:
        templates = tokenizer.chat_templates
        info["chat_template"] = templates.get("default", next(iter(templates.values())))
    info["vocab_size"] = tokenizer.vocab_size
    info["model_max_length"] = gateway.max_model_len or info.get("model_max_length")
    return info


def add_utility_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = load_json(await read_body(request, gateway.config.max_body_bytes))
        chat = isinstance(raw, dict) and "messages" in raw
        body: Any = validate_json(raw, TokenizeChatRequest if chat else TokenizeCompletionRequest)
        gateway.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            try:
                tokens = gateway.tokenizer.encode_chat(
                    [m.for_template() for m in body.messages],
                    body.add_generation_prompt,
                    tools=chat_tools(body.tools),
                    add_special_tokens=body.add_special_tokens,
                    continue_final_message=body.continue_final_message,
                )
            except PromptError as exc:
                raise errors.invalid_request(str(exc), param="messages") from None
        else:
            tokens = gateway.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        result: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": gateway.max_model_len,
            "tokens": tokens,
        }
        if body.return_token_strs:
            result["token_strs"] = [gateway.tokenizer.id_to_token(t) for t in tokens]
        return result

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body: DetokenizeRequest = await parse_body(request, DetokenizeRequest, gateway.config.max_body_bytes)
        gateway.check_model(body.model)
        check_token_ids(gateway, body.tokens, param="tokens")
        return {"prompt": gateway.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    unsupported = {
        "/v1/audio/transcriptions": "audio",
        "/v1/images/generations": "images",
    }

    def refusal(path: str, what: str) -> Callable[[], Awaitable[JSONResponse]]:
        error = errors.APIError(
            404, f"{path}: {what} is not supported by pagedkv.", type="invalid_request_error", code="not_supported"
        )

        async def refuse() -> JSONResponse:
            return JSONResponse(error.body(), status_code=404)

        return refuse

    for path, what in unsupported.items():
        app.add_api_route(path, refusal(path, what), methods=["POST"], include_in_schema=False)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        return tokenizer_info(gateway)

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        healthy = any(link.healthy for link in gateway.links)
        if healthy:
            return Response(status_code=200)
        return JSONResponse(errors.no_executor(gateway.why_unavailable()).body(), status_code=503)
