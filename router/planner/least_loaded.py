"""`least_loaded`: the worker with the fewest outstanding requests (load-only baseline)."""
from __future__ import annotations

from collections.abc import Sequence

from .base import PolicyBase
from .load import outstanding_requests, pending_prefill_tokens
from .types import Decision, RouteRequest, WorkerView


class LeastLoadedPolicy(PolicyBase):
    """Fewest outstanding requests (report + in-flight), then fewest pending prefill
    tokens; exact ties rotate so an idle fleet is not filled worker by worker."""

    name = "least_loaded"

    def __init__(self, *, calibrate: bool = True) -> None:
        super().__init__(calibrate=calibrate)
        self._turn = 0

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        ok = self._split_capped(workers)
        if not ok:
            return self._shed_capped(workers)
        n = len(ok)
        t = self._turn % n
        self._turn = t + 1
        keyed = sorted(
            ((outstanding_requests(w), pending_prefill_tokens(w), (i - t) % n, w) for i, w in enumerate(ok)),
            key=lambda x: x[:3],
        )
        ranked = [x[3].worker_id for x in keyed]
        return self._decide(req, keyed[0][3], ranked, "least_loaded")
