"""The worker pool: the gateway's one handle on its workers, composed of

- the roster (pool_roster.py): the workers held, their states, the routable ones per
  model, their places in the prefix index;
- registration and identity (pool_register.py);
- health and circuit breakers (pool_health.py);
- load polling (pool_load.py);
- per-request accounting (pool_accounting.py).

Each worker has one monitor task. It registers the worker (kvroute: `/info`, whose
namespace digest and block size must match the model's; vLLM: everything from
config), adds it to the model's prefix index and to KV-event ingestion, then polls its
load every `pool.load_poll_interval_s` (by default 0.1 s for ours, 2 s for vLLM's `/metrics`) and its `/health` every
`pool.health_interval_s`. `pool.unhealthy_after` consecutive failures, or one refused
connection on a request, take it out of routing and drop its index entries (a dead
worker's cache is not trusted); when it answers again it is registered afresh. Health
is decided by `/health` probes (consecutive failures over a minimum time, or a refused
connection), never by a slow `/load` under a burst; what the proxy sees fail feeds the
worker's circuit breaker (router/fleet/breaker.py) instead, which keeps its index entries.
Routing state per worker lives in its `FleetWorker` (router/planner/fleet.py), shared
with the offline simulator.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

import aiohttp

from ..config import PoolConfig
from ..intake.model import ModelRuntime
from .fleetconfig import WorkerConfig
from .netpolicy import NetworkPolicy
from .pool_accounting import Accounting
from .pool_health import Health
from .pool_load import LoadPolling
from .pool_register import Registration
from .pool_roster import IngestLike, Roster
from .probe import Probe
from .speed_probe import probe_speeds
from .worker import State, Worker

log = logging.getLogger("kvroute.pool")

__all__ = ["IDENTITY_EVERY_S", "IngestLike", "WorkerPool"]

# How often a registered worker's `/v1/models` is checked again (a process serving another
# model on the same address); a restart is seen at once, as a failed probe or poll.
IDENTITY_EVERY_S = 10.0


class WorkerPool:
    def __init__(
        self,
        cfg: PoolConfig,
        models: dict[str, ModelRuntime],
        session: aiohttp.ClientSession,
        *,
        ingest: IngestLike | None = None,
        worker_max_inflight: int | None = None,
        replicas: int = 1,
        on_state: Callable[[Worker, State], None] | None = None,
        on_refused: Callable[[Worker, str], None] | None = None,
        on_load: Callable[[Worker], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.models = models
        self.session = session
        self._closed = False
        self.probe = Probe(session, cfg.probe_timeout_s, cfg.connect_timeout_s)
        self.roster = Roster(cfg, models, ingest, worker_max_inflight, replicas, on_state)
        self.health = Health(cfg, self.roster, self.probe)
        self.load = LoadPolling(self.probe, ingest, on_load)
        self.registration = Registration(cfg, self.roster, self.health, self.probe, session, ingest,
                                         self.load.poll, on_refused)
        self.accounting = Accounting(self.health)
        self.workers = self.roster.workers
        self.changed = self.roster.changed
        # What the gateway calls per request, bound once (no extra call per use).
        self.routable = self.roster.routable
        self.healthy = self.roster.healthy
        self.refresh_ages = self.load.refresh_ages
        self.dispatched = self.accounting.dispatched
        self.accepted = self.accounting.accepted
        self.first_token = self.accounting.first_token
        self.finished = self.accounting.finished
        self.report_failure = self.health.report_failure
        self.report_success = self.health.report_success
        self.indexed = self.registration.indexed

    @property
    def network(self) -> NetworkPolicy | None:
        """What registration may connect to (set by the gateway)."""
        return self.registration.network

    @network.setter
    def network(self, policy: NetworkPolicy | None) -> None:
        self.registration.network = policy

    # ------------------------------------------------------------------ membership

    def add(self, wc: WorkerConfig) -> Worker:
        w = self.roster.create(wc)
        w.task = asyncio.get_running_loop().create_task(self._monitor(w), name=f"monitor-{wc.id}")
        return w

    async def remove(self, worker_id: str) -> Worker:
        w = self.roster.get(worker_id)
        del self.workers[worker_id]
        self.roster.leave(w)
        w.state = State.UNHEALTHY
        w.reason = "removed"
        self.roster.rebuild(w.model.id)
        for t in (w.task, w.probe_task):
            if t is not None:
                t.cancel()
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
        return w

    def drain(self, worker_id: str, draining: bool = True) -> Worker:
        w = self.roster.get(worker_id)
        w.admin_drained = draining  # a worker not registered yet is drained once it is
        if draining and w.state is State.HEALTHY:
            self.roster.set_state(w, State.DRAINING, "drained by admin")
            if w.in_index:
                w.model.index.set_draining(w.id, True)
        elif not draining and w.state is State.DRAINING:
            self.roster.set_state(w, State.HEALTHY, "")
            if w.in_index:
                w.model.index.set_draining(w.id, False)
        return w

    # ------------------------------------------------------------------ monitor

    async def _monitor(self, w: Worker) -> None:
        cfg = self.cfg
        next_health = next_identity = 0.0
        while not self._closed:
            try:
                if w.state in (State.PENDING, State.UNHEALTHY, State.REFUSED):
                    if await self.registration.register(w):
                        if not w.view.speeds_known:
                            self._start_probe(w)
                        next_health = time.monotonic() + cfg.health_interval_s
                        continue
                    await asyncio.sleep(cfg.health_interval_s * (5 if w.state is State.REFUSED else 1))
                    continue
                now = time.monotonic()
                polled = await self.load.poll(w)  # a failed poll leaves the view stale, never unhealthy
                if now >= next_health:
                    next_health = now + cfg.health_interval_s
                    # A vLLM server that just answered `/metrics` is alive: its `/health` says no more.
                    if (polled and w.kind != "kvroute") or await self.health.check(w):
                        if now < next_identity or await self.registration.check_identity(w):
                            w.fails = 0
                        next_identity = max(next_identity, now + IDENTITY_EVERY_S)
                    else:
                        self.health.failed(w, w.last_error, w.last_refused)
                await asyncio.sleep(cfg.poll_interval_s(w.kind))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a monitor must never die: log, back off, go on
                log.exception("worker %s monitor: %s", w.id, e)
                await asyncio.sleep(cfg.health_interval_s)

    def _start_probe(self, w: Worker) -> None:
        """Measure the worker's speeds beside its monitor (a slow or hanging probe must not
        hold up its health checks and polls)."""
        if w.probe_task is not None and not w.probe_task.done():
            w.probe_task.cancel()
        w.probe_task = asyncio.get_running_loop().create_task(self._probe(w), name=f"speed-probe-{w.id}")

    async def _probe(self, w: Worker) -> None:
        given = await probe_speeds(self.session, w, w.model.tokenizer.vocab_size)
        if not w.view.speeds_known:  # it could not be measured now: serving traffic will measure it
            w.view.speeds_known = True
            log.warning("worker %s: its speeds could not be measured at join (%d probe(s) answered); it is "
                        "priced with the default speeds until requests measure it", w.id, given)

    # ------------------------------------------------------------------ lifecycle

    async def wait_ready(self, timeout: float, model_ids: Iterable[str] | None = None) -> bool:
        """Until every model has a healthy worker (True), or `timeout` passes (False)."""
        ids = list(model_ids) if model_ids is not None else list(self.models)
        deadline = time.monotonic() + timeout
        while True:
            if all(self.routable(m) for m in ids):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 0.25))
            except TimeoutError:
                pass

    async def close(self) -> None:
        self._closed = True
        tasks = [t for w in self.workers.values() for t in (w.task, w.probe_task) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        for w in self.workers.values():
            self.roster.leave(w)
