"""The worker pool: membership, health and registration, load polling, accounting.

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
from typing import Protocol

import aiohttp
import msgspec

from kvindex.index import IndexError_

from ..config import PoolConfig
from ..intake.model import ModelRuntime
from ..planner.fleet import FleetWorker
from ..planner.inflight import InflightLedger
from ..planner.types import Estimate, WorkerView
from .breaker import Breaker
from .costs import cost_params, pins, speeds_stated
from .fleetconfig import EventsConfig, WorkerConfig
from .netpolicy import NetworkPolicy, NetworkRefused
from .probe import BadAnswer, Probe
from .speed_probe import probe_speeds
from .worker import Inflight, State, Worker

log = logging.getLogger("kvroute.pool")

_SELF_DRAINING = "worker reports draining"


# How often a registered worker's `/v1/models` is checked again (a process serving another
# model on the same address); a restart is seen at once, as a failed probe or poll.
IDENTITY_EVERY_S = 10.0


class IngestLike(Protocol):
    """What the pool needs from KV-event ingestion (router/fleet/ingest_adapter.py)."""

    def add_worker(self, worker: Worker) -> None: ...

    def remove_worker(self, worker: Worker) -> None: ...

    def probe(self, worker: Worker) -> None: ...

    def indexed(self, worker: Worker, target_seq: int | None) -> bool: ...


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
        self.ingest = ingest
        self.worker_max_inflight = worker_max_inflight
        self.replicas = replicas  # gateway replicas behind one balancer (InflightLedger.replicas)
        self.workers: dict[str, Worker] = {}
        self._routable: dict[str, list[Worker]] = {}
        self._on_state = on_state
        self._on_refused = on_refused
        self._on_load = on_load  # after each load report (the gateway queue's binding check)
        self._closed = False
        self._breakers_until = 0.0  # no breaker is open after this time
        self.probe = Probe(session, cfg.probe_timeout_s, cfg.connect_timeout_s)
        self.changed = asyncio.Event()
        self.network: NetworkPolicy | None = None  # set by the gateway: what registration may connect to

    # ------------------------------------------------------------------ membership

    def add(self, wc: WorkerConfig) -> Worker:
        if wc.id in self.workers:
            raise ValueError(f"worker {wc.id!r} already exists")
        assert wc.model is not None
        model = self.models[wc.model]
        view = WorkerView(wc.id, cost_params(model, wc.cost), url=wc.url, supports_prefetch=wc.kind == "kvroute")
        w = Worker(wc, model, FleetWorker(view, pins(wc.cost), InflightLedger(wc.id, replicas=self.replicas)),
                   breaker=Breaker(self.cfg.breaker_failures, self.cfg.breaker_open_s, self.cfg.breaker_max_open_s))
        w.max_inflight = wc.max_inflight or self.worker_max_inflight
        if wc.kind == "vllm":
            model.keys.has_vllm_workers = True
        self.workers[wc.id] = w
        w.task = asyncio.get_running_loop().create_task(self._monitor(w), name=f"monitor-{wc.id}")
        return w

    async def remove(self, worker_id: str) -> Worker:
        w = self._get(worker_id)
        del self.workers[worker_id]
        self._leave(w)
        w.state = State.UNHEALTHY
        w.reason = "removed"
        self._rebuild(w.model.id)
        for t in (w.task, w.probe_task):
            if t is not None:
                t.cancel()
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
        return w

    def drain(self, worker_id: str, draining: bool = True) -> Worker:
        w = self._get(worker_id)
        w.admin_drained = draining  # a worker not registered yet is drained once it is
        if draining and w.state is State.HEALTHY:
            self._set_state(w, State.DRAINING, "drained by admin")
            if w.in_index:
                w.model.index.set_draining(w.id, True)
        elif not draining and w.state is State.DRAINING:
            self._set_state(w, State.HEALTHY, "")
            if w.in_index:
                w.model.index.set_draining(w.id, False)
        return w

    def _get(self, worker_id: str) -> Worker:
        w = self.workers.get(worker_id)
        if w is None:
            raise KeyError(worker_id)
        return w

    def routable(self, model_id: str) -> list[Worker]:
        """Healthy, non-draining workers of a model whose breaker is closed (or half-open)."""
        ws = self._routable.get(model_id, [])
        if not self._breakers_until:
            return ws
        now = time.monotonic()
        if now >= self._breakers_until:
            self._breakers_until = 0.0
            return ws
        return [w for w in ws if not w.breaker.is_open(now)]

    def healthy(self, model_id: str) -> list[Worker]:
        """Healthy, non-draining workers of a model, breakers regardless."""
        return self._routable.get(model_id, [])

    def _rebuild(self, model_id: str) -> None:
        self._routable[model_id] = [
            w for w in self.workers.values() if w.model.id == model_id and w.state is State.HEALTHY
        ]
        self.changed.set()

    def _set_state(self, w: Worker, state: State, reason: str) -> None:
        if w.state is state and w.reason == reason:
            return
        if w.state is not state:
            log.info("worker %s: %s -> %s %s", w.id, w.state.value, state.value, reason)
        w.state = state
        w.reason = reason
        self._rebuild(w.model.id)
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

    def _join(self, w: Worker) -> None:
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

    def _leave(self, w: Worker) -> None:
        if not w.in_index:
            return
        w.in_index = False
        if w.events is not None and self.ingest is not None:
            self.ingest.remove_worker(w)
        elif w.model.index.has_worker(w.id):
            w.model.index.remove_worker(w.id)

    # ------------------------------------------------------------------ monitor

    async def _monitor(self, w: Worker) -> None:
        cfg = self.cfg
        next_health = next_identity = 0.0
        while not self._closed:
            try:
                if w.state in (State.PENDING, State.UNHEALTHY, State.REFUSED):
                    if await self._register(w):
                        if not w.view.speeds_known:
                            self._start_probe(w)
                        next_health = time.monotonic() + cfg.health_interval_s
                        continue
                    await asyncio.sleep(cfg.health_interval_s * (5 if w.state is State.REFUSED else 1))
                    continue
                now = time.monotonic()
                polled = await self._poll_load(w)  # a failed poll leaves the view stale, never unhealthy
                if now >= next_health:
                    next_health = now + cfg.health_interval_s
                    # A vLLM server that just answered `/metrics` is alive: its `/health` says no more.
                    if (polled and w.kind != "kvroute") or await self._check_health(w):
                        if now < next_identity or await self._check_identity(w):
                            w.fails = 0
                        next_identity = max(next_identity, now + IDENTITY_EVERY_S)
                    else:
                        self._health_failed(w, w.last_error, w.last_refused)
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

    def _health_failed(self, w: Worker, why: str, refused: bool = False) -> None:
        """A failed `/health` probe: dead when refused (nothing listens), or after
        `unhealthy_after` failures in a row over at least `unhealthy_min_s`."""
        now = time.monotonic()
        if w.fails == 0:
            w.failing_since = now
        w.fails += 1
        w.failures_total += 1
        cfg = self.cfg
        long_enough = w.fails >= cfg.unhealthy_after and now - w.failing_since >= cfg.unhealthy_min_s
        if w.state in (State.HEALTHY, State.DRAINING) and (refused or long_enough):
            self._leave(w)
            self._set_state(w, State.UNHEALTHY, why)

    def report_failure(self, w: Worker, why: str, fatal: bool) -> None:
        """The proxy saw the worker fail: a refused connection takes it out at once (its
        process is gone); anything else counts toward its circuit breaker."""
        w.last_error = why
        if fatal:
            self._health_failed(w, why, refused=True)  # (counts the failure)
            return
        w.failures_total += 1
        now = time.monotonic()
        was_open = w.breaker.is_open(now)
        if w.breaker.failure(now) and not was_open:
            self._breakers_until = max(self._breakers_until, w.breaker.open_until)
            log.warning("worker %s: circuit open for %.1f s after %d failures in a row (%s)", w.id,
                        w.breaker.backoff_s, w.breaker.fails, why)
            self.changed.set()

    def report_success(self, w: Worker) -> None:
        """A first token arrived: the breaker closes."""
        if w.breaker.fails:
            if w.breaker.open_until:
                log.info("worker %s: circuit closed", w.id)
            w.breaker.success()

    async def _check_health(self, w: Worker) -> bool:
        st = await self.probe.health(w)
        if st is None:
            return False
        if w.kind == "kvroute":
            if st == "draining" and w.state is State.HEALTHY:
                self._set_state(w, State.DRAINING, _SELF_DRAINING)
                if w.in_index:
                    w.model.index.set_draining(w.id, True)
            elif st == "ok" and w.state is State.DRAINING and w.reason == _SELF_DRAINING:
                self._set_state(w, State.HEALTHY, "")  # it stopped draining by itself
                if w.in_index:
                    w.model.index.set_draining(w.id, False)
        return True

    async def _register(self, w: Worker) -> bool:
        model = w.model
        if not await self._network_allows(w, False):
            return False
        if not await self._check_health(w):
            return False
        if w.kind == "kvroute":
            try:
                info = await self.probe.info(w)
            except BadAnswer as e:
                self._refuse(w, str(e), "bad_info")
                return False
            if info is None:
                return False
            if info.namespace_digest != model.digest_hex:
                self._refuse(
                    w,
                    f"namespace digest {info.namespace_digest[:16]}… differs from model {model.id!r}'s "
                    f"{model.digest_hex[:16]}… (worker model {info.model!r}); check model id, revision, "
                    f"kv_dtype, parallel and block_size in both configs",
                    "namespace_mismatch",
                )
                return False
            w.info = info
            w.block_size = info.block_size
            w.block_bytes = info.block_bytes or 0
            w.remote_group = w.cfg.remote_group or info.remote_group
            w.capabilities = set(info.capabilities)
            if w.cfg.events is not None:
                w.events = w.cfg.events
            elif info.events is not None and info.events.endpoint:
                ev = info.events
                w.events = EventsConfig(endpoint=ev.endpoint, replay_endpoint=ev.replay_endpoint,
                                        topic=ev.topic or "kv")
            else:
                w.events = None
            w.view.supports_prefetch = "prefetch" in w.capabilities
            w.view.supports_peer_pull = "peer_pull" in w.capabilities
            w.view.gpu_block_tokens = info.block_size
        else:
            w.block_size = w.cfg.block_size or model.block_size
            w.remote_group = w.cfg.remote_group
            w.events = w.cfg.events
            w.capabilities = set()
            w.view.supports_prefetch = False
            w.view.supports_peer_pull = False
            w.view.gpu_block_tokens = 0
        if w.block_size % model.block_size and (w.kind != "sglang" or model.block_size % w.block_size):
            self._refuse(
                w,
                f"block size {w.block_size} is not a multiple of model {model.id!r}'s index block size "
                f"{model.block_size}" + (" nor a page size dividing it" if w.kind == "sglang" else ""),
                "block_size",
            )
            return False
        if not await self._check_identity(w):
            return False
        w.view.cost = cost_params(model, w.cfg.cost, (w.block_size, w.block_bytes))
        # A (re)started process is measured anew: its speeds may not be the last one's.
        w.fleet.speed = None
        w.view.speeds_fitted = False
        w.view.speeds_known = speeds_stated(model, w.cfg.cost, w.kind)
        if not await self._network_allows(w, True):
            return False
        try:
            self._join(w)
        except (IndexError_, ValueError, OSError) as e:
            self._refuse(w, f"cannot index this worker: {e}", "index")
            return False
        except Exception as e:  # zmq.ZMQError: an events endpoint that cannot be bound/parsed
            where = w.events.endpoint if w.events else "?"
            self._refuse(w, f"cannot subscribe to its KV events at {where}: {e}", "events")
            return False
        w.fails = 0
        await self._poll_load(w)
        w.index_target = await self._republish(w)
        w.registered_at = time.monotonic()
        if w.admin_drained:  # drained through the admin API before it (re)registered
            self._set_state(w, State.DRAINING, "drained by admin")
            if w.in_index:
                w.model.index.set_draining(w.id, True)
        else:
            self._set_state(w, State.HEALTHY, "")
        return True

    async def _network_allows(self, w: Worker, events: bool) -> bool:
        """Its URL (or, `events`, its event endpoints, trusted only as configured) passes the
        network policy (router/fleet/netpolicy.py); refused otherwise, before anything connects."""
        if self.network is None:
            return True
        try:
            if not events:
                await self.network.check_url(w.cfg.url)
            elif w.events is not None:
                ev = w.events
                await self.network.check_events(ev.endpoint, ev.replay_endpoint, ev.bind, ev is w.cfg.events)
        except NetworkRefused as e:
            if e.transient:  # its name does not resolve yet: tried again, as an unreachable worker is
                w.last_error = str(e)
                return False
            self._refuse(w, str(e), "network_policy")
            return False
        return True

    async def _republish(self, w: Worker) -> int | None:
        """Ask our worker to publish everything it holds, so the index knows its cache now
        rather than when it next happens to store a block (a gateway restarted next to a
        warm fleet); returns the sequence number to wait for, None when there is none."""
        if w.kind != "kvroute" or w.events is None or self.ingest is None:
            return None
        try:
            async with self.session.post(w.url + "/kv/republish", headers=w.headers(), timeout=self.probe.timeout) as r:
                body = await r.read()
                if r.status != 200:
                    log.info("worker %s cannot republish its blocks (HTTP %d): its index fills as it works",
                             w.id, r.status)
                    return None
            seq = msgspec.json.decode(body).get("seq")
            return seq if isinstance(seq, int) and seq >= 0 else None
        except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError, AttributeError) as e:
            log.info("worker %s: republish failed (%s): its index fills as it works", w.id, e)
            return None

    def indexed(self, w: Worker) -> bool:
        """The worker's cache is known to the index (or it is past waiting for it)."""
        if self.ingest is None or w.events is None:
            return True
        if time.monotonic() - w.registered_at > self.cfg.index_ready_timeout_s:
            return True
        return self.ingest.indexed(w, w.index_target)

    async def _check_identity(self, w: Worker) -> bool:
        """The worker must serve the configured model (its `/v1/models`): a worker started on
        another model would answer for it. Refused otherwise; False also when unreadable."""
        try:
            listed = await self.probe.models(w)
        except BadAnswer as e:
            self._refuse(w, str(e), "bad_models")
            return False
        if listed is None:
            self._health_failed(w, w.last_error, w.last_refused)
            return False
        names, adapters = listed
        model = w.model
        wanted = [model.id, *model.cfg.served_names]
        served = next((n for n in wanted if n in names), None)
        if served is None:
            self._refuse(w, f"serves {sorted(set(names))}, not model {model.id!r} (or its names "
                            f"{model.cfg.served_names})", "model_mismatch")
            return False
        w.served_model = served
        w.adapters = frozenset(a for a, parent in adapters.items() if parent in wanted)
        model.adapters |= w.adapters
        return True

    def _refuse(self, w: Worker, why: str, code: str) -> None:
        first = w.state is not State.REFUSED or w.reason != why
        if first:
            log.error("worker %s refused: %s", w.id, why)
            if self._on_refused is not None:
                self._on_refused(w, code)
        self._leave(w)
        self._set_state(w, State.REFUSED, why)

    async def _poll_load(self, w: Worker) -> bool:
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

    # ------------------------------------------------------------------ accounting

    def refresh_ages(self, workers: Iterable[Worker], now: float) -> None:
        """Before a decision: report ages and the ledger's view at `now` (inflight_loads)."""
        for w in workers:
            w.fleet.refresh(now)

    def dispatched(self, w: Worker, prefill_tokens: int, kv_tokens: int, est: Estimate | None = None) -> Inflight:
        """Count a dispatch; `est`: the chosen worker's Estimate (its predicted KV load)."""
        return Inflight(w, w.fleet.dispatched(time.monotonic(), prefill_tokens, kv_tokens, est))

    def accepted(self, r: Inflight) -> None:
        """The worker answered 200: reports asked for from now on include the request."""
        r.worker.fleet.accepted(r.ticket, time.monotonic())

    def first_token(self, r: Inflight) -> None:
        r.worker.fleet.first_token(r.ticket, time.monotonic())
        self.report_success(r.worker)

    def finished(self, r: Inflight) -> None:
        r.worker.fleet.finished(r.ticket)

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
            self._leave(w)
