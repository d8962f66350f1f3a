"""Errors in OpenAI's shape, with the status codes the SDK maps to its exception classes.

Every failure a client can see goes through `ApiError`: the OpenAI SDK turns 400 into
BadRequestError, 401 AuthenticationError, 404 NotFoundError, 429 RateLimitError (and
honours Retry-After), 5xx InternalServerError — so a client can act on the class alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec

_ENC = msgspec.json.Encoder()


@dataclass(slots=True)
class ApiError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self, request_id: str | None = None) -> bytes:
        return error_body(self.message, self.type, self.param, self.code, request_id)

    def response_headers(self) -> dict[str, str]:
        h = dict(self.headers)
        if self.retry_after_s is not None:
            h["retry-after"] = str(max(1, math.ceil(self.retry_after_s)))
        return h


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None, request_id: str | None = None
) -> bytes:
    err: dict[str, object] = {"message": message, "type": type_, "param": param, "code": code}
    if request_id:
        err["request_id"] = request_id
    return _ENC.encode({"error": err})


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def unauthorized(message: str = "Incorrect or missing API key.") -> ApiError:
    return ApiError(401, message, "authentication_error", None, "invalid_api_key")


def forbidden(message: str) -> ApiError:
    return ApiError(403, message, "permission_error", None, "forbidden")


def not_found(message: str, param: str | None = None, code: str | None = "not_found") -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def too_large(limit: int, unread: bool = True) -> ApiError:
    """`unread`: the body was not read to its end, so the connection cannot carry another
    request (it closes after a bounded drain of the rest)."""
    return ApiError(413, f"Request body larger than {limit} bytes.", "invalid_request_error", None,
                    "request_too_large", headers={"connection": "close"} if unread else {})


def rate_limited(message: str, retry_after_s: float, code: str = "overloaded") -> ApiError:
    return ApiError(429, message, "rate_limit_error", None, code, retry_after_s)


def unavailable(message: str, retry_after_s: float | None = 1.0, code: str = "no_healthy_worker") -> ApiError:
    return ApiError(503, message, "service_unavailable", None, code, retry_after_s)


def upstream_failed(message: str) -> ApiError:
    return ApiError(502, message, "upstream_error", None, "worker_failed")


def internal(request_id: str) -> ApiError:
    return ApiError(500, f"Internal error (request id {request_id}); it has been logged.", "internal_error", None,
                    "internal_error")
