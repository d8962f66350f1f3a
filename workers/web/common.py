"""What every worker route shares: OpenAI-shaped errors, bounded body reading, block keys
in base64, and what the engine's /info fixes (limits, served model names)."""
from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvwire import WorkerInfo
from workers.errors import BadRequest, EngineError, ModelNotFound, UnsupportedParameter
from workers.schema import ErrorBody, ErrorInfo

KEY_BYTES = 32
MAX_BODY_BYTES = 64 * 1024 * 1024
JSON = "application/json"
ENCODER = msgspec.json.Encoder()
_DEC_OBJECT = msgspec.json.Decoder(dict[str, Any])
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `([^`]*)`")
_MISSING_FIELD = re.compile(r"missing required field `(\w+)`$")


@dataclass(frozen=True, slots=True)
class Limits:
    """Request bounds of one worker."""

    max_body_bytes: int
    max_context_tokens: int  # 0 when the engine does not say
    max_blocks: int  # most block keys one /kv request may name

    @classmethod
    def from_info(cls, info: WorkerInfo, max_body_bytes: int) -> Limits:
        max_ctx = info.max_context_tokens or 0
        block_size = info.block_size or 16
        return cls(max_body_bytes, max_ctx, max(1, max_ctx // block_size) if max_ctx else 1 << 16)


@dataclass(frozen=True, slots=True)
class ServedModels:
    """The model names a worker answers to. `names` is what /v1/models lists (the served
    names, else the model), its first the name responses carry; the model id itself is
    accepted too, as vLLM's clients often send it. `adapters` are the LoRA adapters the
    engine serves as models of their own (name -> the base model's served name, vLLM's
    `parent`): a request naming one runs with that adapter."""

    names: tuple[str, ...]
    accepted: frozenset[str]
    root: str
    max_model_len: int | None
    adapters: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_info(cls, info: WorkerInfo, adapters: dict[str, str] | None = None) -> ServedModels:
        names = tuple(info.served_model_names or [info.model])
        return cls(names, frozenset(names) | {info.model}, info.model or names[0], info.max_context_tokens,
                   dict(adapters or {}))

    @property
    def default(self) -> str:
        return self.names[0]

    def resolve(self, model: str | None) -> str:
        """The name to answer with: the default when none is asked for, 404 for a stranger."""
        if model is None or model == "":
            return self.default
        if model not in self.accepted and model not in self.adapters:
            raise ModelNotFound(model)
        return model

    def adapter_of(self, model: str) -> str | None:
        """The LoRA adapter a resolved model name runs with (None: the base model)."""
        return model if model in self.adapters else None


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    retry_after: float | None = None,
) -> Response:
    """OpenAI's error shape: `{"error": {message, type, param, code}}` (+ Retry-After)."""
    headers = {"Retry-After": str(max(1, int(retry_after + 0.999)))} if retry_after is not None else None
    body = ErrorBody(ErrorInfo(message, type, param, code))
    return Response(ENCODER.encode(body), status_code=status, media_type=JSON, headers=headers)


def from_engine_error(e: EngineError) -> Response:
    retry = e.retry_after if e.retry_after is not None else (1.0 if e.status in (429, 503) else None)
    return error_response(e.status, e.message, type=e.type, param=e.param, code=e.code, retry_after=retry)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(ENCODER.encode(obj), status_code=status, media_type=JSON)


class Unsupported(UnsupportedParameter):
    """A request field this worker does not implement: refused, never silently dropped."""

    def __init__(self, field: str, what: str | None = None) -> None:
        super().__init__(f"{what or field} is not supported by this worker", param=field)


def decode_object(raw: bytes) -> dict[str, Any]:
    """A JSON body that must be an object (msgspec errors become 400s in the app)."""
    return _DEC_OBJECT.decode(raw)


def decode_error(e: msgspec.MsgspecError) -> BadRequest:
    """A body msgspec refused, as a 400 naming the offending field when msgspec does."""
    msg = str(e)
    unknown = _UNKNOWN_FIELD.match(msg)
    if unknown is not None:
        return Unsupported(unknown.group(1))
    param = None
    if " - at `$." in msg:
        param = msg.rsplit("`$.", 1)[1].rstrip("`").split("[")[0]
    elif (missing := _MISSING_FIELD.search(msg)) is not None:
        param = missing.group(1)
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        return BadRequest(f"request body is not valid JSON: {msg}")
    return BadRequest(f"invalid request: {msg}", param=param)


class TooLarge(EngineError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes."""
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            declared = int(cl)
        except ValueError:
            raise BadRequest("bad Content-Length header") from None
        if declared > limit:
            raise TooLarge(limit)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def keys_from_b64(s: str, max_blocks: int) -> list[bytes]:
    """Concatenated 32-byte block keys in (url-safe or standard) base64, padding optional."""
    s = s.strip().replace("-", "+").replace("_", "/").replace(" ", "+")
    try:
        raw = base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("keys_b64 is not valid base64", param="keys_b64") from None
    if len(raw) % KEY_BYTES:
        raise BadRequest(f"keys_b64 must decode to a multiple of {KEY_BYTES} bytes, got {len(raw)}", param="keys_b64")
    n = len(raw) // KEY_BYTES
    if n > max_blocks:
        raise BadRequest(f"{n} keys exceed the limit of {max_blocks}", param="keys_b64")
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]
