"""Errors an engine raises for a request it will not take, each mapped to an HTTP status.

The HTTP app turns them into OpenAI's error shape (docs/wire.md); the offline simulator
catches them to count rejections. Nothing is dropped silently: a request is either
accepted (and then finishes or gets an explicit error) or refused with one of these.
"""
from __future__ import annotations


class EngineError(Exception):
    """A request refused or failed, with the HTTP status and OpenAI error type it maps to."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after


class BadRequest(EngineError):
    status = 400
    type = "invalid_request_error"


class UnsupportedParameter(BadRequest):
    """A request field this worker's engine does not implement: refused, never dropped."""

    code = "unsupported_parameter"


class RequestTooLarge(BadRequest):
    """Prompt + max_tokens exceed the model's context or the worker's KV capacity."""

    code = "context_length_exceeded"


class QueueFull(EngineError):
    """The waiting queue is at max_waiting: retry later (429 + Retry-After)."""

    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class PrefetchQueueFull(QueueFull):
    code = "prefetch_queue_full"


class Draining(EngineError):
    status = 503
    type = "service_unavailable"
    code = "draining"


class NotFound(EngineError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    """A model (or LoRA adapter) this worker does not serve: OpenAI's 404."""

    code = "model_not_found"

    def __init__(self, model: str, param: str = "model") -> None:
        super().__init__(f"The model `{model}` does not exist.", param=param)


class NotImplementedByEngine(EngineError):
    """The engine behind this worker does not offer what the request asks (501)."""

    status = 501
    type = "invalid_request_error"
    code = "not_implemented"
