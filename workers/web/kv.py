"""The /kv/* endpoints: prefetch (and its cancel), peer export of blocks, purge.

Peer export is authenticated with a bearer token shared by the fleet: without one
configured it is off (403), since it tells a caller which prompts this worker has seen.
Asked with `Accept: application/x-kvroute-kv-records`, an engine holding real KV data
(`BlockDataExporter`, the torch engine) streams the blocks themselves (docs/wire.md).
"""
from __future__ import annotations

import hmac
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from workers.api import RECORDS_MEDIA_TYPE, Engine, PeerRef, PrefetchSpec
from workers.errors import BadRequest, NotFound
from workers.fleetkeys import peer_bearer
from workers.schema import BlocksBody, PrefetchBody, PurgeBody

from .common import Limits, error_response, json_response, keys_from_b64, read_body

MAX_DEADLINE_MS = 600_000.0
_DEC_PREFETCH = msgspec.json.Decoder(PrefetchBody)
_DEC_BLOCKS = msgspec.json.Decoder(BlocksBody)
_DEC_PURGE = msgspec.json.Decoder(PurgeBody)


class KVHandlers:
    """POST /kv/prefetch, DELETE /kv/prefetch/{id}, GET|POST /kv/blocks, POST /kv/purge."""

    def __init__(self, engine: Engine, limits: Limits, peer_token: str | None) -> None:
        self.engine = engine
        self.limits = limits
        # peers present a token derived from the fleet secret, never the secret (workers/fleetkeys.py)
        self._peer_secret = peer_bearer(peer_token).encode() if peer_token else None

    async def prefetch(self, request: Request) -> Response:
        b = _DEC_PREFETCH.decode(await read_body(request, self.limits.max_body_bytes))
        if not b.prefetch_id or len(b.prefetch_id) > 200:
            raise BadRequest("prefetch_id must be 1-200 characters", param="prefetch_id")
        if not (0 < b.deadline_ms <= MAX_DEADLINE_MS):
            raise BadRequest(f"deadline_ms must be in (0, {MAX_DEADLINE_MS:.0f}]", param="deadline_ms")
        keys = keys_from_b64(b.keys_b64, self.limits.max_blocks)
        peer = PeerRef(b.source_peer.url, b.source_peer.worker_id) if b.source_peer is not None else None
        res = await self.engine.prefetch(PrefetchSpec(b.prefetch_id, keys, b.deadline_ms / 1000.0, peer))
        return json_response(
            {"prefetch_id": res.prefetch_id, "accepted_blocks": res.accepted_blocks, "queued": res.queued}, 202
        )

    async def prefetch_cancel(self, request: Request) -> Response:
        pid = request.path_params["prefetch_id"]
        if not self.engine.cancel_prefetch(pid):
            raise NotFound(f"no prefetch {pid!r} in flight", param="prefetch_id")
        return json_response({"prefetch_id": pid, "cancelled": True})

    async def blocks(self, request: Request) -> Response:
        refused = self._refuse_peer(request)
        if refused is not None:
            return refused
        keys_b64, with_meta = await self._blocks_query(request)
        keys = keys_from_b64(keys_b64, self.limits.max_blocks)
        if RECORDS_MEDIA_TYPE in request.headers.get("accept", ""):
            exporter = getattr(self.engine, "export_block_data", None)
            if exporter is None:
                return error_response(406, "this worker does not export KV data (it holds none)",
                                      code="not_acceptable")
            return StreamingResponse(exporter(keys), media_type=RECORDS_MEDIA_TYPE)
        held = self.engine.export_blocks(keys, with_meta)
        out = []
        for x in held:
            d: dict[str, Any] = {"key": x.key.hex(), "tier": x.tier, "bytes": x.nbytes}
            if x.meta is not None:
                d["meta"] = x.meta
            out.append(d)
        return json_response({"blocks": out, "missing": len(keys) - len(held)})

    def _refuse_peer(self, request: Request) -> Response | None:
        """403 when peer export is off, 401 without the right bearer token, else None."""
        if self._peer_secret is None:
            return error_response(
                403, "peer export is disabled on this worker (no peer token)", type="permission_error"
            )
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer ") or not hmac.compare_digest(auth[7:].strip().encode(), self._peer_secret):
            return error_response(
                401, "a valid peer bearer token is required", type="authentication_error", code="invalid_token"
            )
        return None

    async def _blocks_query(self, request: Request) -> tuple[str, bool]:
        """(keys_b64, with metadata) from a POST body (long key lists) or the GET query."""
        if request.method == "POST":
            b = _DEC_BLOCKS.decode(await read_body(request, self.limits.max_body_bytes))
            return b.keys_b64, b.meta
        keys_b64 = request.query_params.get("keys_b64")
        if keys_b64 is None:
            raise BadRequest("keys_b64 is required", param="keys_b64")
        return keys_b64, request.query_params.get("meta", "") in ("1", "true")

    async def purge(self, request: Request) -> Response:
        b = _DEC_PURGE.decode(await read_body(request, self.limits.max_body_bytes))
        if b.all:
            n = self.engine.purge(None, True)
        elif b.cache_salt:
            n = self.engine.purge(b.cache_salt, False)
        else:
            raise BadRequest('send {"cache_salt": "..."} or {"all": true}', param="cache_salt")
        return json_response({"purged_blocks": n})
