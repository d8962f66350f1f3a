"""The gateway's HTTP app on FastAPI: every route documented in `/openapi.json`.

The completion routes are FastAPI routes like the others (documented with their
request schemas), but their handler writes with the raw ASGI send and decodes with
msgspec instead of pydantic. With `fast_path` (the default) the app's own `__call__`
hands those two paths straight to that same handler, skipping the framework's
routing and middleware, which cost tens of microseconds per request (bench/ numbers
in the README); everything else goes through FastAPI. Every error, including the
framework's own 404/405/422, is answered in OpenAI's shape.
"""
from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException
from starlette.responses import Response

from kvwire.linger import expects_continue

from ..fleet.replica_sync import AdminChange
from ..gateway import Gateway
from . import admin as api_admin
from . import openai as api_openai
from .admin_policy import check_browser_safe, open_admin_allowed
from .asgi import AsgiOut, Receive, Scope, Send, duplicate_credentials, read_body
from .embeddings import EmbeddingRequest, EmbeddingsRoute
from .errors import ApiError, bad_request, internal, not_found
from .openai import CompletionRoute, DetokenizeRequest, TokenizeRequest
from .schema import ChatRequest, CompletionRequest

log = logging.getLogger("kvroute.app")
_enc = msgspec.json.Encoder()
_ADMIN_BODY_LIMIT = 1 << 20
_PASS_THROUGH = ("Fields beyond those listed are forwarded unchanged to vLLM workers; kvroute's own "
                 "workers answer a field they do not implement with a 400 naming it.")


def json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type="application/json", headers=headers)


def api_error(e: ApiError, request_id: str | None = None) -> Response:
    return Response(e.body(request_id), status_code=e.status, media_type="application/json",
                    headers=e.response_headers())


class AsgiCall(Response):
    """A FastAPI return value that runs a raw ASGI handler (the completion routes)."""

    def __init__(self, handler: CompletionRoute) -> None:
        self.handler = handler
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.handler(scope, receive, send)


class GatewayAPI(FastAPI):
    def __init__(self, gw: Gateway, *, manage_lifespan: bool = True, fast_path: bool = True) -> None:
        @asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            yield  # the gateway came started (Gateway.create); it closes with the app
            if manage_lifespan:
                await gw.close()

        super().__init__(title="kvroute gateway", version="0.1.0", docs_url=None, redoc_url=None, lifespan=lifespan,
                         description="Cache-aware OpenAI-compatible router. Admin routes need the admin token.")
        self.gw = gw
        self.fast_path = fast_path
        self._hot = {"/v1/chat/completions": CompletionRoute(gw, True), "/v1/completions": CompletionRoute(gw, False),
                     "/v1/embeddings": EmbeddingsRoute(gw)}
        _errors(self, gw)
        _openai_routes(self, gw)
        _ops_routes(self, gw)
        _admin_routes(self, gw)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (dup := duplicate_credentials(scope)) is not None:
            await _refuse_unread(scope, receive, send, bad_request(
                f"The `{dup}` header is sent more than once; send it once.", dup, "duplicate_header"))
            return
        if self.fast_path and scope["type"] == "http" and scope["method"] == "POST":
            hot = self._hot.get(scope["path"])
            if hot is not None:
                await hot(scope, receive, send)
                return
        await super().__call__(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's document plus the msgspec request schemas the completion routes read."""
        if self.openapi_schema is None:
            doc = get_openapi(title=self.title, version=self.version, description=self.description,
                              routes=self.routes)
            _, components = msgspec.json.schema_components([ChatRequest, CompletionRequest, EmbeddingRequest],
                                                           ref_template="#/components/schemas/{name}")
            doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
            self.openapi_schema = doc
        return self.openapi_schema


async def _refuse_unread(scope: Scope, receive: Receive, send: Send, e: ApiError) -> None:
    """Answer `e` before the request's body was read: the connection closes after it (a
    bounded drain of the body first, so that the client reads the answer)."""
    e.headers["connection"] = "close"
    await AsgiOut(send).error(e, unread=None if expects_continue(scope) else receive)


def _errors(app: FastAPI, gw: Gateway) -> None:
    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> Response:
        return api_error(e)

    @app.exception_handler(HTTPException)
    async def on_http(request: Request, e: HTTPException) -> Response:
        if e.status_code == 404:
            return api_error(not_found(f"Unknown endpoint {request.method} {request.url.path}.", None, "unknown_url"))
        if e.status_code == 405:
            return api_error(ApiError(405, f"Method {request.method} is not allowed on {request.url.path}.",
                                      "invalid_request_error", None, "method_not_allowed"))
        return api_error(ApiError(e.status_code, str(e.detail), "invalid_request_error", None, None))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, e: RequestValidationError) -> Response:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        return api_error(bad_request(f"Invalid request: {'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}",
                                     ".".join(loc) or None))

    @app.exception_handler(RecursionError)
    async def on_deep(request: Request, e: RecursionError) -> Response:
        return api_error(bad_request("The request body is nested too deeply.", None, "invalid_json"))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, e: Exception) -> Response:
        rid = "req-" + os.urandom(8).hex()
        log.exception("unhandled error in %s %s (request id %s)", request.method, request.url.path, rid)
        gw.metrics.internal_errors.inc()
        return api_error(internal(rid), rid)


def _bearer_is(request: Request, token: str) -> bool:
    import hmac

    got = request.headers.get("authorization", "")
    return got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip().encode(), token.encode())


async def _body(request: Request, limit: int) -> bytes:
    return await read_body(request.receive, limit, request.headers.get("content-length"))


def _completion_doc(schema: str, summary: str) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {"requestBody": {"required": True, "description": _PASS_THROUGH,
                            "content": {"application/json": {"schema": ref}}}, "summary": summary}


def _completion_endpoint(route: CompletionRoute) -> Any:
    async def complete(request: Request) -> Response:
        return AsgiCall(route)

    return complete


def _openai_routes(app: GatewayAPI, gw: Gateway) -> None:
    for path, chat in (("/v1/chat/completions", True), ("/v1/completions", False)):
        app.add_api_route(path, _completion_endpoint(app._hot[path]), methods=["POST"], tags=["openai"], name=path,
                          openapi_extra=_completion_doc("ChatRequest" if chat else "CompletionRequest",
                                                        "Chat completion" if chat else "Completion"))

    @app.get("/v1/models", tags=["openai"])
    async def models(request: Request) -> Response:
        gw.tenancy.authenticate(request.headers)
        return json(api_openai.models_list(gw))

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def model(model_id: str, request: Request) -> Response:
        gw.tenancy.authenticate(request.headers)
        return json(api_openai.model_card(model_id, api_openai.model_of(gw, model_id)))

    @app.post("/tokenize", tags=["openai"])
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        tenant = gw.tenancy.authenticate(request.headers)
        return json(await api_openai.tokenize(gw, body, tenant.id))

    @app.post("/detokenize", tags=["openai"])
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        gw.tenancy.authenticate(request.headers)
        return json(api_openai.detokenize(gw, body))

    app.add_api_route("/v1/embeddings", _completion_endpoint(app._hot["/v1/embeddings"]), methods=["POST"],
                      tags=["openai"], name="/v1/embeddings",
                      openapi_extra=_completion_doc("EmbeddingRequest", "Embeddings, from a worker of the model"))


def _ops_routes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/health", tags=["operations"])
    async def health() -> Response:
        return json({"status": "ok"})

    @app.get("/ready", tags=["operations"])
    async def ready() -> Response:
        ok, detail = gw.ready()
        return json({"ready": ok, **detail}, 200 if ok else 503)

    metrics_token = gw.cfg.observability.metrics_token

    @app.get("/metrics", tags=["operations"])
    async def metrics(request: Request) -> Response:
        if metrics_token is not None and not _bearer_is(request, metrics_token):
            return api_error(ApiError(401, "GET /metrics needs the metrics token.", "authentication_error", None,
                                      "invalid_metrics_token"))
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _admin_routes(app: FastAPI, gw: Gateway) -> None:
    def admin(request: Request) -> dict[str, str]:
        h = {k.lower(): v for k, v in request.headers.items()}
        client = request.client.host if request.client is not None else None
        gw.tenancy.check_admin(h, open_admin_allowed(gw.cfg.listen.host, client))
        check_browser_safe(request.method, h, gw.cfg.admin_token is not None)
        return h

    @app.get("/admin/workers", tags=["admin"])
    async def workers(request: Request) -> Response:
        admin(request)
        return json(api_admin.workers(gw))

    # Changes are applied here, then in every other process of `--processes` before the answer.

    @app.post("/admin/workers", tags=["admin"], status_code=201, summary="Add a worker (a `workers[]` config entry)")
    async def add_worker(request: Request) -> Response:
        admin(request)
        body = await _body(request, _ADMIN_BODY_LIMIT)
        added = await api_admin.add_worker(gw, body)
        return json(added, 201, await api_admin.replicate(gw, AdminChange("add", body.decode())))

    @app.delete("/admin/workers/{worker_id}", tags=["admin"])
    async def remove_worker(worker_id: str, request: Request) -> Response:
        admin(request)
        removed = await api_admin.remove_worker(gw, worker_id)
        return json(removed, 200, await api_admin.replicate(gw, AdminChange("remove", worker_id)))

    @app.post("/admin/workers/{worker_id}/drain", tags=["admin"])
    async def drain(worker_id: str, request: Request) -> Response:
        admin(request)
        state = api_admin.drain_worker(gw, worker_id, True)
        return json(state, 200, await api_admin.replicate(gw, AdminChange("drain", worker_id)))

    @app.post("/admin/workers/{worker_id}/undrain", tags=["admin"])
    async def undrain(worker_id: str, request: Request) -> Response:
        admin(request)
        state = api_admin.drain_worker(gw, worker_id, False)
        return json(state, 200, await api_admin.replicate(gw, AdminChange("undrain", worker_id)))

    @app.get("/admin/index", tags=["admin"])
    async def index(request: Request) -> Response:
        admin(request)
        return json(gw.index_stats())

    @app.get("/admin/calibration", tags=["admin"])
    async def calibration(request: Request) -> Response:
        admin(request)
        return json(api_admin.calibration(gw))

    @app.post("/admin/route/explain", tags=["admin"], summary="The per-worker cost breakdown, nothing sent",
              openapi_extra=_completion_doc("ChatRequest", "Explain a routing decision"))
    async def explain(request: Request, tenant: str | None = None) -> Response:
        h = admin(request)
        body = await _body(request, gw.cfg.limits.max_body_bytes)
        return json(await api_admin.explain(gw, body, h, tenant or h.get("x-tenant")))

    @app.post("/admin/tenants/{tenant_id}/purge", tags=["admin"])
    async def purge(tenant_id: str, request: Request) -> Response:
        admin(request)
        purged = await gw.purge_tenant(tenant_id)  # each process purges the request salts it has seen
        return json(purged, 200, await api_admin.replicate(gw, AdminChange("purge", tenant_id)))
