"""The worker HTTP surface (DESIGN.md §4.3, docs/wire.md): one app for every engine.

`WorkerApp` holds the handler groups (workers/web/: OpenAI completions, /kv/*, ops),
each handler a plain method taking a Request, and gives every route the same error
handling: an engine's refusal becomes its OpenAI-shaped 4xx/429/503, an unexpected
exception an OpenAI-shaped 500 carrying a logged request id. Structure, streaming and
disconnects: docs/worker-app.md.
"""
from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kvwire import EventsInfo
from workers.api import Engine
from workers.errors import EngineError
from workers.metrics import WorkerMetrics
from workers.web.common import MAX_BODY_BYTES, Limits, decode_error, error_response, from_engine_error
from workers.web.completions import CompletionHandlers
from workers.web.kv import KVHandlers
from workers.web.ops import OpsHandlers

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


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
        self.engine = engine
        self.metrics = WorkerMetrics(engine)
        self.openai = CompletionHandlers(engine, self.metrics, info, limits)
        self.kv = KVHandlers(engine, limits, peer_token)
        self.ops = OpsHandlers(engine, self.metrics, url, events)

    def routes(self) -> list[Route]:
        o, kv, ops = self.openai, self.kv, self.ops
        return [
            self._route("/v1/completions", "completions", o.completions, "POST"),
            self._route("/v1/chat/completions", "chat", o.chat, "POST"),
            self._route("/kv/prefetch", "prefetch", kv.prefetch, "POST"),
            self._route("/kv/prefetch/{prefetch_id}", "prefetch_cancel", kv.prefetch_cancel, "DELETE"),
            self._route("/kv/blocks", "blocks", kv.blocks, "GET", "POST"),
            self._route("/kv/purge", "purge", kv.purge, "POST"),
            self._route("/load", "load", ops.load, "GET"),
            self._route("/info", "info", ops.info, "GET"),
            self._route("/health", "health", ops.health, "GET"),
            self._route("/metrics", "metrics", ops.prometheus, "GET"),
        ]

    def starlette(self) -> Starlette:
        app = Starlette(routes=self.routes(), exception_handlers={HTTPException: _http_error, Exception: _any_error})
        app.state.engine = self.engine
        app.state.metrics = self.metrics
        return app

    def _route(self, path: str, name: str, handler: Handler, *methods: str) -> Route:
        return Route(path, self._guarded(name, handler), methods=list(methods))

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
) -> Starlette:
    """The worker's Starlette app over `engine`."""
    return WorkerApp(engine, url=url, events=events, peer_token=peer_token, max_body_bytes=max_body_bytes).starlette()


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    typ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(exc.status_code, str(exc.detail), type=typ)


async def _any_error(request: Request, exc: Exception) -> Response:  # pragma: no cover - safety net
    rid = uuid.uuid4().hex
    log.error("unhandled error (request %s): %r", rid, exc)
    return error_response(500, f"internal error (request id {rid})", type="server_error", code="internal_error")
