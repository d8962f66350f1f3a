"""Operations endpoints: /load (the router's queue and speed view), /info (identity,
namespace, event endpoints), /health (draining or not), /metrics (Prometheus)."""
from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvwire import EventsInfo
from workers.api import Engine
from workers.errors import NotImplementedByEngine
from workers.metrics import WorkerMetrics

from .common import json_response


class OpsHandlers:
    """GET /load, /info, /health, /metrics."""

    def __init__(self, engine: Engine, metrics: WorkerMetrics, url: str, events: EventsInfo | None,
                 peer_export: bool) -> None:
        self.engine = engine
        self.metrics = metrics
        self.url = url
        self.events = events
        self.peer_export = peer_export

    async def load(self, request: Request) -> Response:
        return json_response(self.engine.load())

    async def info(self, request: Request) -> Response:
        """The engine's /info plus what only the server knows: its URL, its event endpoints,
        and whether peers can pull from it (`/kv/blocks` needs a peer token: without one,
        every pull would be refused, so `peer_pull` is not advertised)."""
        info = self.engine.info()
        caps = info.capabilities if self.peer_export else [c for c in info.capabilities if c != "peer_pull"]
        return json_response(msgspec.structs.replace(info, url=self.url, events=self.events, capabilities=caps))

    async def republish(self, request: Request) -> Response:
        """Everything held, published as one batch of KV events; answers its sequence number,
        so a subscriber knows when it has applied it."""
        republish = getattr(self.engine, "republish", None)
        if republish is None:
            raise NotImplementedByEngine("this engine cannot republish its blocks")
        return json_response({"seq": republish()})

    async def health(self, request: Request) -> Response:
        return json_response({"status": "draining" if self.engine.draining else "ok"})

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
