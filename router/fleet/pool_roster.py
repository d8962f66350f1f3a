"""The pool's roster: the workers it holds, the state each is in, the routable ones per
model, and each worker's place in its model's prefix index (router/fleet/pool.py)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from ..config import PoolConfig
from ..intake.model import ModelRuntime
from ..planner.fleet import FleetWorker
from ..planner.inflight import InflightLedger
from ..planner.types import WorkerView
from .breaker import Breaker
from .costs import cost_params, pins
from .fleetconfig import WorkerConfig
from .worker import State, Worker

log = logging.getLogger("kvroute.pool")


class IngestLike(Protocol):
    """What the pool needs from KV-event ingestion (router/fleet/ingest_adapter.py)."""

    def add_worker(self, worker: Worker) -> None: ...

    def remove_worker(self, worker: Worker) -> None: ...

    def probe(self, worker: Worker) -> None: ...

    def indexed(self, worker: Worker, target_seq: int | None) -> bool: ...


class Roster:
    def __init__(
        self,
        cfg: PoolConfig,
        models: dict[str, ModelRuntime],
        ingest: IngestLike | None,
        worker_max_inflight: int | None,
        replicas: int,
        on_state: Callable[[Worker, State], None] | None,
    ) -> None:
        self.cfg = cfg
        self.models = models
        self.ingest = ingest
        self.worker_max_inflight = worker_max_inflight
        self.replicas = replicas  # gateway replicas behind one balancer (InflightLedger.replicas)
        self.workers: dict[str, Worker] = {}
        self._routable: dict[str, list[Worker]] = {}
        self._on_state = on_state
        self.breakers_until = 0.0  # no breaker is open after this time (set by pool_health.py)
        self.changed = asyncio.Event()

    def create(self, wc: WorkerConfig) -> Worker:
        """A new worker of the config, held from now on (PENDING until it registers)."""
        if wc.id in self.workers:
            raise ValueError(f"worker {wc.id!r} already exists")
        assert wc.model is not None
        model = self.models[wc.model]
        view = WorkerView(wc.id, cost_params(model, wc.cost), url=wc.url, supports_prefetch=wc.kind == "kvroute",
                          role=wc.role)
        w = Worker(wc, model, FleetWorker(view, pins(wc.cost), InflightLedger(wc.id, replicas=self.replicas)),
                   breaker=Breaker(self.cfg.breaker_failures, self.cfg.breaker_open_s, self.cfg.breaker_max_open_s))
        w.max_inflight = wc.max_inflight or self.worker_max_inflight
        if wc.kind == "vllm":
            model.keys.has_vllm_workers = True
        self.workers[wc.id] = w
        return w

    def get(self, worker_id: str) -> Worker:
        w = self.workers.get(worker_id)
        if w is None:
            raise KeyError(worker_id)
        return w

    def routable(self, model_id: str) -> list[Worker]:
        """Healthy, non-draining workers of a model whose breaker is closed (or half-open)."""
        ws = self._routable.get(model_id, [])
        if not self.breakers_until:
            return ws
        now = time.monotonic()
        if now >= self.breakers_until:
            self.breakers_until = 0.0
            return ws
        return [w for w in ws if not w.breaker.is_open(now)]

    def healthy(self, model_id: str) -> list[Worker]:
        """Healthy, non-draining workers of a model, breakers regardless."""
        return self._routable.get(model_id, [])

    def rebuild(self, model_id: str) -> None:
        self._routable[model_id] = [
            w for w in self.workers.values() if w.model.id == model_id and w.state is State.HEALTHY
        ]
        self.changed.set()

    def set_state(self, w: Worker, state: State, reason: str) -> None:
        if w.state is state and w.reason == reason:
            return
        if w.state is not state:
            log.info("worker %s: %s -> %s %s", w.id, w.state.value, state.value, reason)
        w.state = state
        w.reason = reason
        self.rebuild(w.model.id)
        if state is State.UNHEALTHY:
            self._abort_inflight(w)
        if self._on_state is not None:
            self._on_state(w, state)

    @staticmethod
    def _abort_inflight(w: Worker) -> None:
        """A dead worker's requests end now: before their first byte they are retried
        elsewhere, after it they get an explicit error event."""
        for t in list(w.inflight):
            if t.abort is not None:
                t.abort()

    # ------------------------------------------------------------------ index + ingest

    def join(self, w: Worker) -> None:
        if w.in_index:
            return
        idx = w.model.index
        if idx.has_worker(w.id):
            idx.remove_worker(w.id)
        if w.events is not None and self.ingest is not None:
            self.ingest.add_worker(w)
        else:
            idx.add_worker(w.id, w.model.namespace.digest, w.block_size, w.remote_group,
                           trusted_digests=w.trusted_digests)
        w.in_index = True

    def leave(self, w: Worker) -> None:
        if not w.in_index:
            return
        w.in_index = False
        if w.events is not None and self.ingest is not None:
            self.ingest.remove_worker(w)
        elif w.model.index.has_worker(w.id):
            w.model.index.remove_worker(w.id)
