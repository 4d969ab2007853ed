"""The HTTP API's keys: `Authorization: Bearer KEY`, or `x-api-key: KEY` (Anthropic's clients), checked before
anything else is read.

With API keys configured (--api-key, PAGEDKV_GATEWAY_API_KEY, --api-key-file), every /v1/ route needs one of them;
/health and /metrics stay open unless --protect-health / --protect-metrics. A missing or wrong key is answered 401
in OpenAI's error shape (code invalid_api_key; Anthropic's shape on
/v1/messages), before the body is read. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from gateway.errors import APIError, error_body


def read_api_keys(values: Iterable[str], env_value: str | None, files: Iterable[Path]) -> tuple[str, ...]:
    """Every key given: flags, the comma-separated environment variable, and files (one key a line; # comments)."""
    keys = [k.strip() for k in values]
    if env_value:
        keys += [k.strip() for k in env_value.split(",")]
    for path in files:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.append(line)
    return tuple(dict.fromkeys(k for k in keys if k))


def unauthorized(message: str) -> APIError:
    return APIError(401, message, type="invalid_request_error", code="invalid_api_key")


class _RequireApiKey:
    """Pure ASGI (not BaseHTTPMiddleware), so streamed responses and disconnects pass through untouched."""

    def __init__(self, app: Any, keys: tuple[str, ...], protected: set[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.protected = protected

    def _known(self, presented: bytes) -> bool:
        found = False
        for key in self.keys:  # no early exit: the time taken does not tell which key nearly matched
            found |= hmac.compare_digest(presented, key)
        return found

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path.startswith("/v1/") or path == "/v1" or path in self.protected:
                headers = dict(scope["headers"])
                header = headers.get(b"authorization", b"")
                scheme, _, presented = header.partition(b" ")
                api_key = headers.get(b"x-api-key")
                error = None
                if not header and api_key is None:
                    error = unauthorized(
                        "You didn't provide an API key. Send it in the Authorization header "
                        "('Authorization: Bearer KEY') or the x-api-key header."
                    )
                elif api_key is not None and not header:
                    if not self._known(api_key.strip()):
                        error = unauthorized("Incorrect API key provided.")
                elif scheme.lower() != b"bearer" or not self._known(presented.strip()):
                    error = unauthorized("Incorrect API key provided.")
                if error is not None:
                    response = JSONResponse(
                        error_body(path, error), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                    )
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def install_api_keys(app: FastAPI, keys: tuple[str, ...], *, protect_health: bool, protect_metrics: bool) -> None:
    """Refuse requests without one of `keys` (nothing to do when there are none)."""
    if not keys:
        return
    protected = {p for p, on in (("/health", protect_health), ("/metrics", protect_metrics)) if on}
    app.add_middleware(_RequireApiKey, keys=keys, protected=protected)
