"""`round_robin`: each request to the next worker in turn (the no-routing baseline)."""
from __future__ import annotations

from collections.abc import Sequence

from .base import PolicyBase
from .types import Decision, RouteRequest, WorkerView


class RoundRobinPolicy(PolicyBase):
    """Cycles over the workers as given, skipping those at their waiting cap."""

    name = "round_robin"

    def __init__(self, *, calibrate: bool = True) -> None:
        super().__init__(calibrate=calibrate)
        self._cursor = 0

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        ok = self._split_capped(workers)
        if not ok:
            return self._shed_capped(workers)
        n = len(ok)
        start = self._cursor % n
        self._cursor = start + 1
        ranked = [ok[(start + i) % n].worker_id for i in range(n)]
        return self._decide(req, ok[start], ranked, "round_robin")
