"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a fitting HTTP status; on the
Anthropic routes (/v1/messages) in Anthropic's: `{"type": "error", "error": {"type", "message"}}`."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers  # sent with the response (Retry-After)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def context_length_exceeded(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code="context_length_exceeded")


def model_not_found(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"The model {name!r} does not exist; this gateway serves {served!r}.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def not_found(path: str) -> APIError:
    return APIError(404, f"No route {path}.", type="invalid_request_error", code="not_found")


def queue_full(limit: int) -> APIError:
    return APIError(
        429,
        f"This request would pass the {limit} generations (prompts x n) the gateway holds in flight "
        "(--max-queued-sequences); retry shortly.",
        type="rate_limit_error",
        code="queue_full",
    )


def overloaded(wait_s: float, bound_s: float, retry_after_s: int) -> APIError:
    return APIError(
        429,
        f"The server is overloaded: a request now would wait about {wait_s:.0f} s for the work queued before it, "
        f"past the {bound_s:g} s bound (--max-queue-delay); retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="overloaded",
        headers={"Retry-After": str(retry_after_s)},
    )


def no_executor(detail: str) -> APIError:
    return APIError(503, f"No executor is available: {detail}", type="server_error", code="no_executor_available")


def internal(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


# Anthropic's error types by HTTP status (its Messages API answers errors as {"type": "error", "error": {...}}).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_body(error: APIError) -> dict[str, Any]:
    """The error in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def is_anthropic_path(path: str) -> bool:
    """The routes that answer in Anthropic's shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, error: APIError) -> dict[str, Any]:
    """The error's body in the shape of the API that `path` belongs to."""
    return anthropic_body(error) if is_anthropic_path(path) else error.body()
