"""The worker HTTP surface (docs/design.md §4.3, docs/wire.md): one FastAPI app for every engine.

`WorkerApp` holds the handler groups (workers/web/: OpenAI completions, models and
tokenizer, /kv/*, ops), each handler a plain method taking a Request, and gives every
route the same error handling: an engine's refusal becomes its OpenAI-shaped
4xx/429/503, an unexpected exception an OpenAI-shaped 500 carrying a logged request id.
FastAPI documents the routes in /openapi.json (request schemas generated from the msgspec
structs, which still decode the bodies); the two generation routes also have a direct
lane past FastAPI's routing and middleware (`WorkerFastAPI`). Structure, streaming and
disconnects: docs/worker-app.md.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import Receive, Scope, Send

from kvwire import EventsInfo
from kvwire.linger import LingeringClose
from workers.api import Embeds, Engine, ServesAdapters
from workers.errors import BadRequest, EngineError
from workers.metrics import WorkerMetrics
from workers.schema import (
    DOCUMENTED,
    BlocksBody,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    EmbeddingBody,
    PrefetchBody,
    PurgeBody,
    TokenizeBody,
)
from workers.web.common import (
    JSON,
    MAX_BODY_BYTES,
    Limits,
    ServedModels,
    decode_error,
    error_response,
    from_engine_error,
)
from workers.web.completions import CompletionHandlers
from workers.web.embeddings import EmbeddingHandlers
from workers.web.kv import KVHandlers
from workers.web.models import ModelHandlers
from workers.web.ops import OpsHandlers

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]
SCHEMA_REF = "#/components/schemas/{name}"
FAST_ROUTES = ("/v1/completions", "/v1/chat/completions")


def _version() -> str:
    try:
        return version("kvroute")
    except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0"


def _param(name: str, where: str, typ: str, description: str, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": where, "required": required, "schema": {"type": typ}, "description": description}


@dataclass(frozen=True, slots=True)
class RouteSpec:
    """One route of the worker surface: what FastAPI registers and /openapi.json shows."""

    path: str
    name: str
    method: str
    handler: Handler
    summary: str
    body: type[msgspec.Struct] | None = None
    params: tuple[dict[str, Any], ...] = ()
    streams: bool = False  # answers text/event-stream when the body asks for `stream`
    text: bool = False  # answers text/plain

    def openapi_extra(self) -> dict[str, Any]:
        """The parts FastAPI cannot infer from a handler taking a bare Request."""
        error = {"description": "OpenAI-shaped error", "content": {JSON: {"schema": _ref("ErrorBody")}}}
        extra: dict[str, Any] = {"responses": {"default": error}}
        if self.body is not None:
            extra["requestBody"] = {"required": True, "content": {JSON: {"schema": _ref(self.body.__name__)}}}
        if self.params:
            extra["parameters"] = list(self.params)
        if self.streams:
            extra["responses"]["200"] = {"content": {"text/event-stream": {"schema": {"type": "string"}}}}
        return extra


def _ref(name: str) -> dict[str, str]:
    return {"$ref": SCHEMA_REF.format(name=name)}


class _Lane:
    """A guarded handler as a bare ASGI app: what FastAPI's route does with it, minus the
    routing, the dependency solving and the exit stacks."""

    __slots__ = ("handler",)

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.handler(Request(scope, receive, send))
        await response(scope, receive, send)


class WorkerFastAPI(FastAPI):
    """FastAPI with a direct lane for the generation routes (POST /v1/completions and
    /v1/chat/completions): per request, FastAPI's middleware stack, router and endpoint
    wrapper cost more than the handler's own HTTP work (docs/worker-app.md), and a
    router fleet pays that CPU on every request. The lane calls the same guarded handler
    the registered route calls, behind the same outer error middleware, so both answer
    with the same bytes; the routes stay registered (for /openapi.json, and for a mounted
    app with a root_path, which always takes FastAPI's path)."""

    def __init__(self, *, fast: Mapping[str, Handler], components: Mapping[str, Any], **kw: Any) -> None:
        super().__init__(**kw)
        on_error = self.exception_handlers.get(Exception)
        self.lanes: dict[str, ServerErrorMiddleware] = {
            path: ServerErrorMiddleware(_Lane(h), handler=on_error) for path, h in fast.items()
        }
        self.components = dict(components)
        # a refusal sent before the body was read (413, 403 on /kv/blocks) reaches the client
        self._outer = LingeringClose(self._dispatch)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._outer(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            lane = self.lanes.get(scope["path"])
            if lane is not None:
                scope["app"] = self
                await lane(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's schema plus the msgspec bodies under components/schemas."""
        if self.openapi_schema is None:
            schema = super().openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(self.components)
        return self.openapi_schema or {}


class WorkerApp:
    """One worker's routes over one engine; see the module doc."""

    def __init__(
        self,
        engine: Engine,
        *,
        url: str = "",
        events: EventsInfo | None = None,
        peer_token: str | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        info = engine.info()
        limits = Limits.from_info(info, max_body_bytes)
        models = ServedModels.from_info(info, engine.adapters() if isinstance(engine, ServesAdapters) else None)
        self.engine = engine
        self.metrics = WorkerMetrics(engine)
        self.openai = CompletionHandlers(engine, self.metrics, models, limits)
        self.models = ModelHandlers(engine.tokenizer, models, limits)
        self.kv = KVHandlers(engine, limits, peer_token)
        self.ops = OpsHandlers(engine, self.metrics, url, events, peer_export=bool(peer_token))
        # /v1/embeddings only where the engine embeds (the simulated one); elsewhere a 404
        self.embed = EmbeddingHandlers(engine, engine.tokenizer, models, limits) if isinstance(engine, Embeds) else None

    def routes(self) -> list[RouteSpec]:
        o, m, kv, ops = self.openai, self.models, self.kv, self.ops
        keys = _param("keys_b64", "query", "string", "concatenated 32-byte block keys in base64", required=True)
        meta = _param("meta", "query", "string", "`1` or `true`: with each block's metadata")
        pid = _param("prefetch_id", "path", "string", "the id the prefetch was sent with", required=True)
        mid = _param("model_id", "path", "string", "a served model name", required=True)
        return [
            RouteSpec("/v1/completions", "completions", "POST", o.completions, "OpenAI completion (token ids or text)",
                      CompletionBody, streams=True),
            RouteSpec("/v1/chat/completions", "chat", "POST", o.chat, "OpenAI chat completion", ChatBody, streams=True),
            RouteSpec("/v1/models", "models", "GET", m.list_models, "Served models (OpenAI list)"),
            RouteSpec("/v1/models/{model_id:path}", "model", "GET", m.get_model, "One served model", params=(mid,)),
            RouteSpec("/tokenize", "tokenize", "POST", m.tokenize, "Prompt or messages to token ids (vLLM's shape)",
                      TokenizeBody),
            RouteSpec("/detokenize", "detokenize", "POST", m.detokenize, "Token ids to text (vLLM's shape)",
                      DetokenizeBody),
            *([RouteSpec("/v1/embeddings", "embeddings", "POST", self.embed.embeddings,
                         "OpenAI embeddings (deterministic vectors from the tokens)", EmbeddingBody)]
              if self.embed is not None else []),
            RouteSpec("/kv/prefetch", "prefetch", "POST", kv.prefetch, "Raise blocks toward GPU", PrefetchBody),
            RouteSpec("/kv/prefetch/{prefetch_id}", "prefetch_cancel", "DELETE", kv.prefetch_cancel,
                      "Cancel a prefetch", params=(pid,)),
            RouteSpec("/kv/blocks", "blocks", "GET", kv.blocks, "Blocks held, for a peer", params=(keys, meta)),
            RouteSpec("/kv/blocks", "blocks", "POST", kv.blocks, "Blocks held, for a peer (long key lists)",
                      BlocksBody),
            RouteSpec("/kv/purge", "purge", "POST", kv.purge, "Drop the blocks of a cache salt, or all", PurgeBody),
            RouteSpec("/kv/republish", "republish", "POST", ops.republish,
                      "Publish every block held as KV events (a restarted gateway rebuilds its index)"),
            RouteSpec("/load", "load", "GET", ops.load, "Queue, blocks and speeds, for the router"),
            RouteSpec("/info", "info", "GET", ops.info, "Identity, KV namespace, event endpoints"),
            RouteSpec("/health", "health", "GET", ops.health, "ok or draining"),
            RouteSpec("/metrics", "metrics", "GET", ops.prometheus, "Prometheus metrics", text=True),
        ]

    def fastapi(self, *, fast_path: bool = True) -> WorkerFastAPI:
        """The app; `fast_path=False` sends every request through FastAPI (tests compare both)."""
        specs = self.routes()
        guarded = {(s.path, s.method): self._guarded(s.name, s.handler) for s in specs}
        fast = {p: guarded[(p, "POST")] for p in FAST_ROUTES} if fast_path else {}
        _, components = msgspec.json.schema_components(DOCUMENTED, ref_template=SCHEMA_REF)
        app = WorkerFastAPI(
            fast=fast,
            components=components,
            title="kvroute worker",
            version=_version(),
            description="The worker surface of docs/wire.md: OpenAI completions, models, tokenizer, /kv/*, ops.",
            docs_url=None,  # the docs UIs fetch their assets from a CDN
            redoc_url=None,
            exception_handlers={
                HTTPException: _http_error,
                RequestValidationError: _validation_error,
                Exception: _any_error,
            },
        )
        for s in specs:
            endpoint = guarded[(s.path, s.method)]
            app.add_api_route(
                s.path,
                endpoint,
                methods=[s.method],
                name=s.name,
                summary=s.summary,
                response_class=PlainTextResponse if s.text else JSONResponse,
                openapi_extra=s.openapi_extra(),
            )
            if s.method == "GET":  # HEAD as Starlette routes answer it (probes), undocumented
                app.add_api_route(s.path, endpoint, methods=["HEAD"], name=s.name, include_in_schema=False)
        app.state.engine = self.engine
        app.state.metrics = self.metrics
        return app

    def _guarded(self, name: str, handler: Handler) -> Handler:
        """The handler with errors turned into OpenAI-shaped responses, and counted."""
        metrics = self.metrics

        async def guarded(request: Request) -> Response:
            try:
                resp = await handler(request)
            except EngineError as e:
                resp = from_engine_error(e)
            except msgspec.MsgspecError as e:
                resp = from_engine_error(decode_error(e))
            except RecursionError:  # JSON nested deeper than the decoder recurses
                resp = from_engine_error(BadRequest("request body is nested too deeply"))
            except Exception:
                rid = uuid.uuid4().hex
                log.exception("unhandled error in %s (request %s)", name, rid)
                resp = error_response(
                    500, f"internal error (request id {rid})", type="server_error", code="internal_error"
                )
            metrics.count(name, resp.status_code)
            return resp

        return guarded


def build_app(
    engine: Engine,
    *,
    url: str = "",
    events: EventsInfo | None = None,
    peer_token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    fast_path: bool = True,
) -> WorkerFastAPI:
    """The worker's FastAPI app over `engine`."""
    w = WorkerApp(engine, url=url, events=events, peer_token=peer_token, max_body_bytes=max_body_bytes)
    return w.fastapi(fast_path=fast_path)


async def _http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's (Starlette's) own 404/405 in OpenAI's shape, with the gateway's codes and
    their headers (Allow)."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        resp = error_response(404, f"Unknown endpoint {where}.", code="unknown_url")
    elif exc.status_code == 405:
        resp = error_response(405, f"Method {request.method} is not allowed on {request.url.path}.",
                              code="method_not_allowed")
    else:
        resp = error_response(exc.status_code, str(exc.detail))
    if exc.headers:
        resp.headers.update(exc.headers)
    return resp


async def _validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI's request validation (422 by default) as OpenAI's 400, naming the first field."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ())]
    param = ".".join(loc[1:] if loc and loc[0] in ("body", "query", "path", "header", "cookie") else loc) or None
    message = f"invalid request: {first.get('msg', 'validation failed')}" + (f" ({param})" if param else "")
    return error_response(400, message, param=param)


async def _any_error(request: Request, exc: Exception) -> Response:  # pragma: no cover - safety net
    rid = uuid.uuid4().hex
    log.error("unhandled error (request %s): %r", rid, exc)
    return error_response(500, f"internal error (request id {rid})", type="server_error", code="internal_error")
