"""Asking the chosen worker to raise a request's blocks toward GPU while it queues.

What to raise is decided by the shared fleet view (`plan_prefetch`, also run by the
offline simulator); this module only puts it on the wire (`POST /kv/prefetch`) and
takes it back (`DELETE /kv/prefetch/{id}`) when the request never uses it.
"""
from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from ..config import PrefetchConfig
from ..fleet.worker import Worker
from ..intake.prepare import Prepared
from ..planner.fleet import PrefetchPlan, PrefetchRule, plan_prefetch
from ..planner.types import Decision, Estimate, RouteRequest
from ..telemetry.metrics import GatewayMetrics

_enc = msgspec.json.Encoder()
Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


@dataclass(slots=True)
class Prefetch:
    """One /kv/prefetch sent for a request (cancelled if the request never uses it)."""

    pid: str
    worker: Worker
    requested_tokens: int
    peer: bool = False  # raises blocks from another worker (source_peer)
    task: asyncio.Task[bool] | None = None
    accepted: bool = False


def prefetch_rule(pc: PrefetchConfig) -> PrefetchRule:
    return PrefetchRule(pc.enabled, pc.min_blocks, pc.margin_s, pc.min_deadline_s)


class Prefetcher:
    def __init__(
        self, session: aiohttp.ClientSession, rule: PrefetchRule, metrics: GatewayMetrics, spawn: Spawn,
        connect_timeout_s: float,
    ) -> None:
        self.session = session
        self.rule = rule
        self.metrics = metrics
        self.spawn = spawn
        self.timeout = aiohttp.ClientTimeout(total=2.0, connect=connect_timeout_s)

    def send(
        self, prep: Prepared, d: Decision, w: Worker, rr: RouteRequest, est: Estimate | None, peer: Worker | None
    ) -> Prefetch | None:
        """Put the decision's prefetch on the wire (in the background); None when there is none.
        `peer`: the worker named by `d.prefetch_from_peer`, if it is still known."""
        plan = plan_prefetch(d, len(prep.plan.keys), rr.matches.get(w.id), est, self.rule, w.view.supports_prefetch)
        if plan is None:
            return None
        body = self._body(prep, plan, peer)
        pf = Prefetch(body["prefetch_id"], w, plan.blocks * prep.model.block_size, body["source_peer"] is not None)
        pf.task = self.spawn(self._post(pf, _enc.encode(body)))
        self.metrics.prefetch_sent.inc()
        self.metrics.prefetch_requested_tokens.inc(pf.requested_tokens)
        return pf

    @staticmethod
    def _body(prep: Prepared, plan: PrefetchPlan, peer: Worker | None) -> dict[str, Any]:
        keys = prep.plan.keys[plan.start:plan.end]
        return {
            "prefetch_id": "p-" + prep.rid,
            "keys_b64": base64.b64encode(b"".join(keys)).decode(),
            "deadline_ms": int(1000 * plan.deadline_s),
            "source_peer": {"url": peer.url, "worker_id": peer.id} if plan.peer and peer is not None else None,
        }

    async def _post(self, pf: Prefetch, payload: bytes) -> bool:
        try:
            async with self.session.post(
                pf.worker.url + "/kv/prefetch", data=payload,
                headers={"content-type": "application/json", **pf.worker.call_headers},
                timeout=self.timeout,
            ) as r:
                await r.read()
                pf.accepted = r.status in (200, 202)
        except (TimeoutError, aiohttp.ClientError, OSError):
            pf.accepted = False
        if not pf.accepted:
            self.metrics.prefetch_failed.inc()
        return pf.accepted

    def cancel(self, pf: Prefetch | None) -> None:
        if pf is None:
            return
        self.metrics.prefetch_cancelled.inc()
        self.spawn(self._delete(pf))

    async def _delete(self, pf: Prefetch) -> None:
        if pf.task is not None and not pf.task.done():
            try:
                await asyncio.wait_for(asyncio.shield(pf.task), 2.0)
            except (TimeoutError, Exception):
                pass
        if not pf.accepted:
            return
        try:
            async with self.session.delete(pf.worker.url + "/kv/prefetch/" + pf.pid, headers=pf.worker.headers(),
                                           timeout=self.timeout) as r:
                await r.read()
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass
