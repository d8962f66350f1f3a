"""A registered worker's load, polled (`/load`, or vLLM's `/metrics`) into its routing
state (router/planner/fleet.py), and the index's check against what the worker holds."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from kvindex.index import IndexError_

from .pool_roster import IngestLike
from .probe import Probe
from .worker import Worker


class LoadPolling:
    def __init__(self, probe: Probe, ingest: IngestLike | None, on_load: Callable[[Worker], None] | None) -> None:
        self.probe = probe
        self.ingest = ingest
        self._on_load = on_load  # after each load report (the gateway queue's binding check)

    async def poll(self, w: Worker) -> bool:
        """One load report read into the worker's view; False when it could not be read
        (the view stays stale, the worker is not unhealthy for that)."""
        sent = time.monotonic()
        rep_ = await self.probe.load(w)
        if rep_ is None:
            return False
        w.fleet.on_report(rep_, time.monotonic(), sent)
        self._check_index(w)
        if self._on_load is not None:
            self._on_load(w)
        return True

    def _check_index(self, w: Worker) -> None:
        """An index holding more GPU blocks than the worker can hold has missed removals
        (a lost last event frame shows no gap): ask for the tail of its stream."""
        cap = w.view.gpu_capacity_blocks
        if not cap or not w.in_index or w.events is None or self.ingest is None:
            return
        per_engine = max(1, w.block_size // w.model.block_size)
        try:
            held = w.model.index.local_blocks(w.id)
        except IndexError_:
            return
        if held > cap * per_engine:
            self.ingest.probe(w)

    @staticmethod
    def refresh_ages(workers: Iterable[Worker], now: float) -> None:
        """Before a decision: report ages and the ledger's view at `now` (inflight_loads)."""
        for w in workers:
            w.fleet.refresh(now)
