"""What the pool counts per request: each dispatch, acceptance, first token and end in
the worker's in-flight ledger (router/planner/inflight.py); a first token also closes
the worker's circuit breaker."""
from __future__ import annotations

import time

from ..planner.types import Estimate
from .pool_health import Health
from .worker import Inflight, Worker


class Accounting:
    __slots__ = ("health",)

    def __init__(self, health: Health) -> None:
        self.health = health

    @staticmethod
    def dispatched(w: Worker, prefill_tokens: int, kv_tokens: int, est: Estimate | None = None) -> Inflight:
        """Count a dispatch; `est`: the chosen worker's Estimate (its predicted KV load)."""
        return Inflight(w, w.fleet.dispatched(time.monotonic(), prefill_tokens, kv_tokens, est))

    @staticmethod
    def accepted(r: Inflight) -> None:
        """The worker answered 200: reports asked for from now on include the request."""
        r.worker.fleet.accepted(r.ticket, time.monotonic())

    def first_token(self, r: Inflight) -> None:
        r.worker.fleet.first_token(r.ticket, time.monotonic())
        self.health.report_success(r.worker)

    @staticmethod
    def finished(r: Inflight) -> None:
        r.worker.fleet.finished(r.ticket)
