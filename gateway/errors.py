"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a fitting HTTP status."""

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
