"""The ASGI application: a small, direct router over `Gateway` (no framework on the hot path).

A routed request's CPU is the product's cost, and a framework's request objects,
middleware and routing regexes are overhead for a dozen fixed paths. The handler runs
as a task while a watcher awaits the client's disconnect (which cancels it, closing
the upstream connection); every escaping exception becomes an OpenAI-shaped 500 with
a request id. Details: docs/gateway.md.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from .config import WorkerConfig
from .errors import ApiError, bad_request, internal, not_found, too_large
from .gateway import Gateway
from .relay import JSON_HEADERS
from .responses import SSE_DONE, sse_error

log = logging.getLogger("kvroute.app")
_enc = msgspec.json.Encoder()

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _Out:
    """`gateway.Out` over ASGI send; remembers whether the response has started."""

    __slots__ = ("send", "started", "status", "sse")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False
        self.status = 0
        self.sse = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        self.sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, data: bytes, more: bool = False) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def json(self, status: int, obj: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        await self.start(status, JSON_HEADERS + (extra or []))
        await self.body(obj if isinstance(obj, bytes) else _enc.encode(obj))

    async def error(self, e: ApiError, request_id: str | None = None) -> None:
        hdrs = [(k.encode(), v.encode()) for k, v in e.response_headers().items()]
        await self.json(e.status, e.body(request_id), hdrs)


class ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def _read_body(receive: Receive, limit: int, declared: str | None) -> bytes:
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large(limit)
        except ValueError:
            raise bad_request("Invalid Content-Length header.") from None
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        b = msg.get("body", b"")
        if b:
            size += len(b)
            if size > limit:
                raise too_large(limit)
            chunks.append(b)
        if not msg.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class App:
    """The ASGI callable. `lifespan` starts/stops the Gateway when served by uvicorn."""

    def __init__(self, gateway: Gateway, *, manage_lifespan: bool = True) -> None:
        self.gw = gateway
        self.manage_lifespan = manage_lifespan
        from .tenancy import Tenant

        self._unsalted = Tenant("(none)", "", 1 << 30)  # explain without a tenant: unsalted keys
        self._routes: dict[tuple[str, str], Callable[..., Awaitable[None]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
            ("GET", "/v1/models"): self._models,
            ("GET", "/health"): self._health,
            ("GET", "/ready"): self._ready,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/admin/workers"): self._workers,
            ("POST", "/admin/workers"): self._add_worker,
            ("GET", "/admin/index"): self._index,
            ("GET", "/admin/calibration"): self._calibration,
            ("POST", "/admin/route/explain"): self._explain,
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t = scope["type"]
        if t == "http":
            await self._http(scope, receive, send)
        elif t == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                try:
                    if self.manage_lifespan and not self.gw.started:
                        await self.gw.start()
                except Exception as e:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self.manage_lifespan:
                    await self.gw.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        out = _Out(send)
        method = scope["method"]
        path = scope["path"]
        handler = self._routes.get((method, path))
        params: tuple[str, ...] = ()
        if handler is None:
            handler, params = self._dynamic(method, path)
        route = path if handler is not None and not params else (path.rsplit("/", 1)[0] + "/{x}" if params else "unmatched")
        if handler is None:
            if any(p == path for _, p in self._routes):
                err = ApiError(405, f"Method {method} is not allowed on {path}.", "invalid_request_error", None, "method_not_allowed")
                await out.error(err)
                return
            await out.error(not_found(f"Unknown endpoint {method} {path}.", None, "unknown_url"))
            return
        await self._run(handler, scope, receive, out, params, route)

    def _dynamic(self, method: str, path: str) -> tuple[Callable[..., Awaitable[None]] | None, tuple[str, ...]]:
        parts = path.strip("/").split("/")
        if len(parts) >= 3 and parts[0] == "admin":
            if parts[1] == "workers" and len(parts) == 3 and method == "DELETE":
                return self._remove_worker, (parts[2],)
            if parts[1] == "workers" and len(parts) == 4 and method == "POST" and parts[3] in ("drain", "undrain"):
                return self._drain_worker, (parts[2], parts[3])
            if parts[1] == "tenants" and len(parts) == 4 and parts[3] == "purge" and method == "POST":
                return self._purge, (parts[2],)
        return None, ()

    async def _run(self, handler: Callable[..., Awaitable[None]], scope: Scope, receive: Receive, out: _Out, params: tuple[str, ...], route: str) -> None:
        rid = None
        try:
            await handler(scope, receive, out, *params)
        except ApiError as e:
            if out.started:
                log.warning("error after the response started: %s", e)
            else:
                await out.error(e)
            self.gw.metrics.count_request(route, e.status, "-")
        except ClientGone:
            self.gw.metrics.disconnects.inc()
        except asyncio.CancelledError:
            raise
        except Exception:
            rid = "req-" + os.urandom(8).hex()
            log.exception("unhandled error in %s %s (request id %s)", scope["method"], scope["path"], rid)
            self.gw.metrics.internal_errors.inc()
            if not out.started:
                await out.error(internal(rid), rid)
            else:  # never a silent truncation: an explicit error event, then the end
                tail = sse_error(f"Internal error (request id {rid}).", "internal_error", "internal_error", rid) + SSE_DONE if out.sse else b""
                try:
                    await out.body(tail, False)
                except Exception:
                    pass

    # ------------------------------------------------------------------ OpenAI

    async def _complete(self, scope: Scope, receive: Receive, out: _Out, chat: bool) -> None:
        gw = self.gw
        headers = _headers(scope)
        route = "/v1/chat/completions" if chat else "/v1/completions"
        tenant = gw.tenancy.authenticate(headers)
        body = await _read_body(receive, gw.cfg.limits.max_body_bytes, headers.get("content-length"))
        # Completions may run for minutes: from now on, watch for the client leaving.
        me = asyncio.current_task()
        assert me is not None
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_wait_disconnect(receive, me, gone))
        try:
            await self._complete_body(chat, route, body, headers, tenant, out)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            # The client left: the request was cancelled (upstream closed, prefetch cancelled).
            me.uncancel()
            gw.metrics.count_request(route, 499, "-")
        finally:
            watcher.cancel()

    async def _complete_body(self, chat: bool, route: str, body: bytes, headers: dict[str, str], tenant: Any, out: _Out) -> None:
        """Counts the request once, by its final status, and answers every ApiError itself."""
        gw = self.gw
        try:
            prep = await gw.prepare(chat, body, headers, tenant)
        except ApiError as e:
            gw.metrics.count_request(route, e.status, "-")
            await out.error(e)
            return
        try:
            status = await gw.complete(prep, out)
        except ApiError as e:
            gw.metrics.count_request(route, e.status, prep.model.id)
            if out.started:
                log.warning("request %s: error after the response started: %s", prep.rid, e)
                return
            await out.error(e, prep.rid)
            return
        gw.metrics.count_request(route, status, prep.model.id)

    async def _chat(self, scope: Scope, receive: Receive, out: _Out) -> None:
        await self._complete(scope, receive, out, True)

    async def _completions(self, scope: Scope, receive: Receive, out: _Out) -> None:
        await self._complete(scope, receive, out, False)

    async def _models(self, scope: Scope, receive: Receive, out: _Out) -> None:
        self.gw.tenancy.authenticate(_headers(scope))
        data = []
        for name, rt in self.gw.models.by_name.items():
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "kvroute", "root": rt.id,
                         "max_model_len": rt.max_context})
        await out.json(200, {"object": "list", "data": data})

    # ------------------------------------------------------------------ operations

    async def _health(self, scope: Scope, receive: Receive, out: _Out) -> None:
        await out.json(200, {"status": "ok"})

    async def _ready(self, scope: Scope, receive: Receive, out: _Out) -> None:
        ok, detail = self.gw.ready()
        await out.json(200 if ok else 503, {"ready": ok, **detail})

    async def _metrics(self, scope: Scope, receive: Receive, out: _Out) -> None:
        await out.start(200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")])
        await out.body(self.gw.metrics.render())

    # ------------------------------------------------------------------ admin

    def _admin(self, scope: Scope) -> dict[str, str]:
        h = _headers(scope)
        self.gw.tenancy.check_admin(h)
        return h

    async def _workers(self, scope: Scope, receive: Receive, out: _Out) -> None:
        self._admin(scope)
        assert self.gw.pool is not None
        await out.json(200, {"workers": [w.summary() for w in self.gw.pool.workers.values()]})

    async def _add_worker(self, scope: Scope, receive: Receive, out: _Out) -> None:
        from pydantic import ValidationError

        from .config import format_validation_error

        h = self._admin(scope)
        body = await _read_body(receive, 1 << 20, h.get("content-length"))
        try:
            wc = WorkerConfig.model_validate_json(body)
        except ValidationError as e:
            raise bad_request(f"Invalid worker: {format_validation_error(e)}") from None
        gw = self.gw
        assert gw.pool is not None
        if wc.model is None:
            if len(gw.models.by_id) != 1:
                raise bad_request("`model` is required when several models are served.", "model")
            wc.model = next(iter(gw.models.by_id))
        rt = gw.models.get(wc.model)
        if rt is None:
            raise bad_request(f"Unknown model {wc.model!r}.", "model")
        wc.model = rt.id
        if wc.id in gw.pool.workers:
            raise ApiError(409, f"Worker {wc.id!r} already exists.", "invalid_request_error", "id", "conflict")
        w = gw.pool.add(wc)
        await out.json(201, w.summary())

    async def _remove_worker(self, scope: Scope, receive: Receive, out: _Out, wid: str) -> None:
        self._admin(scope)
        assert self.gw.pool is not None
        try:
            w = await self.gw.pool.remove(wid)
        except KeyError:
            raise not_found(f"Unknown worker {wid!r}.") from None
        self.gw.policy_forget(wid)
        await out.json(200, {"removed": w.id})

    async def _drain_worker(self, scope: Scope, receive: Receive, out: _Out, wid: str, action: str) -> None:
        self._admin(scope)
        assert self.gw.pool is not None
        try:
            w = self.gw.pool.drain(wid, action == "drain")
        except KeyError:
            raise not_found(f"Unknown worker {wid!r}.") from None
        await out.json(200, w.summary())

    async def _index(self, scope: Scope, receive: Receive, out: _Out) -> None:
        self._admin(scope)
        await out.json(200, self.gw.index_stats())

    async def _calibration(self, scope: Scope, receive: Receive, out: _Out) -> None:
        self._admin(scope)
        cal = getattr(self.gw.policy, "calibrator", None)
        snap = cal.snapshot() if cal is not None else {}
        await out.json(200, {"policy": self.gw.policy_name, "calibration": msgspec.to_builtins(snap)})

    async def _explain(self, scope: Scope, receive: Receive, out: _Out) -> None:
        h = self._admin(scope)
        gw = self.gw
        body = await _read_body(receive, gw.cfg.limits.max_body_bytes, h.get("content-length"))
        qs = scope.get("query_string", b"").decode()
        q = dict(p.split("=", 1) for p in qs.split("&") if "=" in p)
        tenant = None
        tid = q.get("tenant") or h.get("x-tenant")
        if tid:
            tenant = gw.tenancy.tenants.get(tid)
            if tenant is None:
                raise not_found(f"Unknown tenant {tid!r}.", "tenant")
        else:
            tenant = gw.tenancy.tenants.get("default") or self._unsalted
        chat = "messages" in _peek_keys(body)
        t0 = time.perf_counter()
        prep = await gw.prepare(chat, body, h, tenant)
        result = gw.explain(prep)
        result["explain_ms"] = round((time.perf_counter() - t0) * 1000, 3)
        await out.json(200, result)

    async def _purge(self, scope: Scope, receive: Receive, out: _Out, tenant: str) -> None:
        self._admin(scope)
        await out.json(200, await self.gw.purge_tenant(tenant))


def _peek_keys(body: bytes) -> set[str]:
    try:
        d = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise bad_request("We could not parse the JSON body of your request.", None, "invalid_json") from None
    if not isinstance(d, dict):
        raise bad_request("The request body must be a JSON object.")
    return set(d)


async def _wait_disconnect(receive: Receive, task: asyncio.Task[Any], gone: asyncio.Event) -> None:
    """Cancel `task` when the client disconnects (the body was read already)."""
    while not task.done():
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not task.done():
                gone.set()
                task.cancel()
            return
