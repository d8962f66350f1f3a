"""The worker pool: registration, health, load polling, in-flight accounting.

Each worker has one monitor task. It registers the worker (kvroute: GET /info, check
the namespace digest and block size against the model's, learn the events endpoints;
vLLM: everything from config), adds it to the model's prefix index and to KV-event
ingestion, then polls its load (`/load`, or vLLM's `/metrics`) every
`pool.load_poll_interval_s` and its `/health` every `pool.health_interval_s`.
`pool.unhealthy_after` consecutive failures — or one refused connection on a request
— take the worker out of routing and drop its index entries (a dead worker's cache
is not trusted); when it answers again it is registered afresh.

Each worker's `WorkerView` (the planner's input) is one object updated in place: the
report fields at each poll, the router's own in-flight accounting on every dispatch,
first token and finish. That accounting is the worker's `InflightLedger`
(router/planner/inflight.py, shared with the simulator's loadtest/router_model.py):
reports lag, so the view also counts what was dispatched after the last report was
taken (`inflight_since_report_*`: a report knows what was dispatched before its
request was sent), which the planner adds to the aged report
(router/planner/load.py), and at each decision (`refresh_ages`) `inflight_loads`:
the requests whose chosen Estimate loads KV from below GPU and have no first token
yet, for the interference term (router/planner/cost.py `interference_seconds`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import aiohttp
import msgspec
from yarl import URL  # aiohttp's own URL type (a hard dependency of aiohttp)

from kvindex.index import IndexError_
from kvindex.tiers import Tier

from .config import CostConfig, EventsConfig, PoolConfig, WorkerConfig
from .model import ModelRuntime
from .planner.inflight import InflightLedger, Ticket
from .planner.types import CostParams, Estimate, Link, WorkerView
from .vllm_load import parse_vllm_metrics

log = logging.getLogger("kvroute.pool")

_TIERS = {"CPU": Tier.CPU, "DISK": Tier.DISK, "REMOTE": Tier.REMOTE, "PEER": Tier.PEER}
_DEFAULT_PREFILL_TPS = 10_000.0
_SELF_DRAINING = "worker reports draining"


class State(str, Enum):
    PENDING = "pending"  # not registered yet (starting, or came back)
    HEALTHY = "healthy"
    DRAINING = "draining"  # finishing its requests; no new ones
    UNHEALTHY = "unhealthy"  # failed checks; out of routing and index
    REFUSED = "refused"  # incompatible (namespace, block size): never routed


class _Info(msgspec.Struct, forbid_unknown_fields=False):
    namespace_digest: str
    block_size: int
    worker_id: str = ""
    kind: str = "kvroute"
    block_bytes: int | None = None
    max_context_tokens: int | None = None
    events: dict[str, Any] | None = None
    remote_group: str | None = None
    capabilities: list[str] = []
    model: str = ""


class _Speeds(msgspec.Struct, forbid_unknown_fields=False):
    prefill_tokens_per_s: float | None = None
    prefill_attn_s_per_token2: float | None = None
    prefill_overhead_s: float | None = None
    decode_step_s: float | None = None


class _TierLink(msgspec.Struct, forbid_unknown_fields=False):
    read_Bps: float
    latency_s: float = 0.0


class _Blocks(msgspec.Struct, forbid_unknown_fields=False):
    used: int = 0
    free: int = 0
    capacity: int = 0


class _Load(msgspec.Struct, forbid_unknown_fields=False):
    waiting_requests: int = 0
    waiting_prefill_tokens: int = 0
    running_requests: int = 0
    running_prefill_tokens: int = 0
    est_queue_s: float = 0.0
    blocks: dict[str, _Blocks] = {}
    speeds: _Speeds | None = None
    tiers: dict[str, _TierLink] = {}
    max_waiting: int | None = None


_info_dec = msgspec.json.Decoder(_Info)
_load_dec = msgspec.json.Decoder(_Load)


@dataclass(slots=True, eq=False)
class Inflight:
    """One dispatched request: its worker and its ticket in that worker's ledger."""

    worker: Worker
    ticket: Ticket

    @property
    def prefilled(self) -> bool:
        return self.ticket.prefilled


@dataclass(eq=False)
class Worker:
    cfg: WorkerConfig
    model: ModelRuntime
    view: WorkerView
    state: State = State.PENDING
    reason: str = ""
    fails: int = 0
    info: dict[str, Any] | None = None
    events: EventsConfig | None = None
    block_size: int = 0
    block_bytes: int = 0
    remote_group: str | None = None
    capabilities: set[str] = field(default_factory=set)
    in_index: bool = False
    load_t: float = 0.0  # monotonic time of the last load report
    report_sent_t: float = 0.0
    ledger: InflightLedger = field(default_factory=InflightLedger)
    task: asyncio.Task[None] | None = None
    served: int = 0
    failures_total: int = 0
    last_error: str = ""
    max_inflight: int | None = None
    completions_url: URL | None = None  # parsed once: aiohttp re-parses a str URL per request

    @property
    def id(self) -> str:
        return self.cfg.id

    @property
    def inflight(self) -> set[Ticket]:
        """The router's requests in flight on this worker (dispatched, not finished)."""
        return self.ledger.live

    @property
    def url(self) -> str:
        return self.cfg.url

    @property
    def kind(self) -> str:
        return self.cfg.kind

    @property
    def trusted_digests(self) -> bool:
        """Our workers publish digest64 of our own chained keys (docs/wire.md), so the index
        applies them without re-hashing token ids (sampled roots are still verified);
        vLLM's block hashes are its own and are always recomputed from the event's tokens."""
        return self.cfg.kind == "kvroute"

    def summary(self) -> dict[str, Any]:
        v = self.view
        return {
            "id": self.id,
            "url": self.url,
            "kind": self.kind,
            "model": self.model.id,
            "state": self.state.value,
            "reason": self.reason,
            "block_size": self.block_size,
            "remote_group": self.remote_group,
            "capabilities": sorted(self.capabilities),
            "inflight": len(self.inflight),
            "served": self.served,
            "failures": self.failures_total,
            "last_error": self.last_error,
            "load": {
                "waiting_requests": v.waiting_requests,
                "waiting_prefill_tokens": v.waiting_prefill_tokens,
                "running_requests": v.running_requests,
                "est_queue_s": v.est_queue_s,
                "gpu_free_blocks": v.gpu_free_blocks,
                "gpu_capacity_blocks": v.gpu_capacity_blocks,
                "report_age_s": round(time.monotonic() - self.load_t, 3) if self.load_t else None,
            },
            "events": None if self.events is None else self.events.model_dump(),
        }


class IngestLike(Protocol):
    """What the pool needs from KV-event ingestion (router/ingest_adapter.py)."""

    def add_worker(self, worker: Worker) -> None: ...

    def remove_worker(self, worker: Worker) -> None: ...


class WorkerPool:
    def __init__(
        self,
        cfg: PoolConfig,
        models: dict[str, ModelRuntime],
        session: aiohttp.ClientSession,
        *,
        ingest: IngestLike | None = None,
        worker_max_inflight: int | None = None,
        on_state: Callable[[Worker, State], None] | None = None,
        on_refused: Callable[[Worker, str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.models = models
        self.session = session
        self.ingest = ingest
        self.worker_max_inflight = worker_max_inflight
        self.workers: dict[str, Worker] = {}
        self._routable: dict[str, list[Worker]] = {}
        self._on_state = on_state
        self._on_refused = on_refused
        self._closed = False
        self._probe_timeout = aiohttp.ClientTimeout(total=cfg.probe_timeout_s, connect=cfg.connect_timeout_s)
        self.changed = asyncio.Event()

    # ------------------------------------------------------------------ membership

    def add(self, wc: WorkerConfig) -> Worker:
        if wc.id in self.workers:
            raise ValueError(f"worker {wc.id!r} already exists")
        assert wc.model is not None
        model = self.models[wc.model]
        cost = _cost_params(model, None, None, wc.cost)
        view = WorkerView(wc.id, cost, url=wc.url, supports_prefetch=wc.kind == "kvroute")
        w = Worker(wc, model, view, ledger=InflightLedger(wc.id))
        w.max_inflight = wc.max_inflight or self.worker_max_inflight
        if wc.kind == "vllm":
            model.has_vllm_workers = True
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
        if w.task is not None:
            w.task.cancel()
            try:
                await w.task
            except (asyncio.CancelledError, Exception):
                pass
        return w

    def drain(self, worker_id: str, draining: bool = True) -> Worker:
        w = self._get(worker_id)
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
        """Healthy, non-draining workers of a model (a cached list, rebuilt on changes)."""
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
        if self._on_state is not None:
            self._on_state(w, state)

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
            idx.add_worker(w.id, w.model.namespace.digest, w.block_size, w.remote_group, trusted_digests=w.trusted_digests)
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
        next_health = 0.0
        while not self._closed:
            try:
                if w.state in (State.PENDING, State.UNHEALTHY, State.REFUSED):
                    if await self._register(w):
                        next_health = time.monotonic() + cfg.health_interval_s
                        continue
                    await asyncio.sleep(cfg.health_interval_s * (5 if w.state is State.REFUSED else 1))
                    continue
                now = time.monotonic()
                ok = await self._poll_load(w)
                if ok and now >= next_health:
                    # only a passed health check clears the failure count: a worker whose
                    # /health fails while /load answers is still failing
                    next_health = now + cfg.health_interval_s
                    if await self._check_health(w):
                        w.fails = 0
                    else:
                        self._failed(w, w.last_error)
                elif not ok:
                    self._failed(w, w.last_error)
                await asyncio.sleep(cfg.load_poll_interval_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a monitor must never die: log, back off, go on
                log.exception("worker %s monitor: %s", w.id, e)
                await asyncio.sleep(cfg.health_interval_s)

    def _failed(self, w: Worker, why: str, fatal: bool = False) -> None:
        w.fails += 1
        w.failures_total += 1
        if w.state in (State.HEALTHY, State.DRAINING) and (fatal or w.fails >= self.cfg.unhealthy_after):
            self._leave(w)
            self._set_state(w, State.UNHEALTHY, why)

    def report_failure(self, w: Worker, why: str, fatal: bool) -> None:
        """The proxy saw the worker fail: a refused connection takes it out at once."""
        w.last_error = why
        self._failed(w, why, fatal)

    async def _fetch(self, w: Worker, path: str) -> bytes | None:
        try:
            async with self.session.get(w.url + path, timeout=self._probe_timeout) as r:
                body = await r.read()
                if r.status != 200:
                    w.last_error = f"GET {path}: HTTP {r.status}"
                    return None
                return body
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            w.last_error = f"GET {path}: {type(e).__name__}: {e}"
            return None

    async def _check_health(self, w: Worker) -> bool:
        body = await self._fetch(w, "/health")
        if body is None:
            return False
        if w.kind == "kvroute":
            try:
                st = msgspec.json.decode(body).get("status", "ok")
            except (msgspec.DecodeError, AttributeError):
                st = "ok"
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
        if not await self._check_health(w):
            return False
        if w.kind == "kvroute":
            body = await self._fetch(w, "/info")
            if body is None:
                return False
            try:
                info = _info_dec.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._refuse(w, f"/info is not valid: {e}", "bad_info")
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
            w.info = msgspec.to_builtins(info)
            w.block_size = info.block_size
            w.block_bytes = info.block_bytes or 0
            w.remote_group = w.cfg.remote_group or info.remote_group
            w.capabilities = set(info.capabilities)
            if w.cfg.events is not None:
                w.events = w.cfg.events
            elif info.events and info.events.get("endpoint"):
                ev = info.events
                w.events = EventsConfig(
                    endpoint=ev["endpoint"], replay_endpoint=ev.get("replay_endpoint"), topic=ev.get("topic") or "kv"
                )
            else:
                w.events = None
            w.view.supports_prefetch = "prefetch" in w.capabilities
            w.view.supports_peer_pull = "peer_pull" in w.capabilities
        else:
            w.block_size = w.cfg.block_size or model.block_size
            w.remote_group = w.cfg.remote_group
            w.events = w.cfg.events
            w.capabilities = set()
            w.view.supports_prefetch = False
            w.view.supports_peer_pull = False
        if w.block_size % model.block_size:
            self._refuse(
                w,
                f"block size {w.block_size} is not a multiple of model {model.id!r}'s index block size "
                f"{model.block_size}",
                "block_size",
            )
            return False
        w.view.cost = _cost_params(model, w, None, w.cfg.cost)
        try:
            self._join(w)
        except (IndexError_, ValueError, OSError) as e:
            self._refuse(w, f"cannot index this worker: {e}", "index")
            return False
        except Exception as e:  # zmq.ZMQError: an events endpoint that cannot be bound/parsed
            self._refuse(w, f"cannot subscribe to its KV events at {w.events.endpoint if w.events else '?'}: {e}", "events")
            return False
        w.fails = 0
        await self._poll_load(w)
        self._set_state(w, State.HEALTHY, "")
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
        if w.kind == "kvroute":
            body = await self._fetch(w, "/load")
            if body is None:
                return False
            try:
                rep = _load_dec.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                w.last_error = f"/load: {e}"
                return False
            self._apply_load(w, rep)
        else:
            body = await self._fetch(w, "/metrics")
            if body is None:
                return False
            try:
                vl = parse_vllm_metrics(body.decode(errors="replace"))
            except ValueError as e:
                w.last_error = f"/metrics: {e}"
                return False
            v = w.view
            v.waiting_requests = vl.waiting_requests
            v.running_requests = vl.running_requests
            v.waiting_prefill_tokens = 0
            if vl.kv_usage is not None:
                # Its block count comes from cache_config_info; without it, a per-10k scale
                # (the policies then compare workers by fraction only).
                cap = vl.gpu_blocks or 10_000
                v.gpu_capacity_blocks = cap
                v.gpu_free_blocks = int(round((1.0 - vl.kv_usage) * cap))
        w.load_t = time.monotonic()
        w.report_sent_t = sent
        w.ledger.report_taken(sent)
        w.ledger.fill_counts(w.view)
        return True

    def _apply_load(self, w: Worker, rep: _Load) -> None:
        v = w.view
        v.waiting_requests = rep.waiting_requests
        v.waiting_prefill_tokens = rep.waiting_prefill_tokens
        v.running_requests = rep.running_requests
        v.running_prefill_tokens = rep.running_prefill_tokens
        v.est_queue_s = rep.est_queue_s
        gpu = rep.blocks.get("GPU")
        if gpu is not None:
            v.gpu_free_blocks = gpu.free
            v.gpu_capacity_blocks = gpu.capacity or (gpu.used + gpu.free)
        if rep.max_waiting is not None:
            v.max_waiting = rep.max_waiting
        if rep.speeds is not None or rep.tiers:
            _update_cost(v.cost, w, rep)

    # ------------------------------------------------------------------ accounting

    def refresh_ages(self, workers: Iterable[Worker], now: float) -> None:
        """Before a decision: report ages and the ledger's view at `now` (inflight_loads)."""
        for w in workers:
            w.view.report_age_s = now - w.load_t if w.load_t else 0.0
            w.ledger.fill(w.view, now)

    def dispatched(self, w: Worker, prefill_tokens: int, kv_tokens: int, est: Estimate | None = None) -> Inflight:
        """Count a dispatch; `est`: the chosen worker's Estimate (its predicted KV load)."""
        r = Inflight(w, w.ledger.dispatched(time.monotonic(), prefill_tokens, kv_tokens, est))
        w.ledger.fill_counts(w.view)
        return r

    def accepted(self, r: Inflight) -> None:
        """The worker answered 200: reports asked for from now on include the request."""
        r.worker.ledger.accepted(r.ticket, time.monotonic())

    def first_token(self, r: Inflight) -> None:
        w = r.worker
        w.ledger.first_token(r.ticket, time.monotonic())
        w.ledger.fill_counts(w.view)

    def finished(self, r: Inflight) -> None:
        w = r.worker
        w.ledger.finished(r.ticket)
        w.ledger.fill_counts(w.view)

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
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        self._closed = True
        tasks = [w.task for w in self.workers.values() if w.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        for w in self.workers.values():
            self._leave(w)


def _link_map(cfg: CostConfig | None) -> dict[Tier, Link]:
    if cfg is None:
        return {}
    return {_TIERS[k]: Link(v.read_Bps, v.latency_s) for k, v in cfg.links.items()}


def _cost_params(model: ModelRuntime, w: Worker | None, rep: _Load | None, over: CostConfig | None) -> CostParams:
    """Base CostParams: the model's cost defaults, then the worker's overrides.

    `block_size` is the model's index block size (matches are counted in index
    blocks); `block_bytes` is per index block, scaled from the worker's own."""
    base = model.cost.merged(over)
    bs = model.block_size
    bb = base.block_bytes
    if w is not None and w.block_bytes and w.block_size:
        bb = w.block_bytes * bs // w.block_size
    tps = base.prefill_tokens_per_s
    if tps is None:
        tps = _DEFAULT_PREFILL_TPS
    return CostParams(
        block_size=bs,
        block_bytes=bb or bs * 131072,
        prefill_tokens_per_s=tps,
        prefill_attn_s_per_token2=base.prefill_attn_s_per_token2 or 0.0,
        prefill_overhead_s=base.prefill_overhead_s or 0.0,
        decode_step_s=base.decode_step_s or 0.0,
        links=_link_map(base),
    )


def _update_cost(c: CostParams, w: Worker, rep: _Load) -> None:
    """Fold a /load report's speeds and tier links into the worker's CostParams, in place.

    Config overrides (the worker's `cost`) win over reports: an operator's number is a
    deliberate correction."""
    over = w.cfg.cost
    s = rep.speeds
    if s is not None:
        if s.prefill_tokens_per_s and not (over and over.prefill_tokens_per_s):
            c.prefill_tokens_per_s = s.prefill_tokens_per_s
        if s.prefill_attn_s_per_token2 is not None and not (over and over.prefill_attn_s_per_token2 is not None):
            c.prefill_attn_s_per_token2 = s.prefill_attn_s_per_token2
        if s.prefill_overhead_s is not None and not (over and over.prefill_overhead_s is not None):
            c.prefill_overhead_s = s.prefill_overhead_s
        if s.decode_step_s is not None and not (over and over.decode_step_s is not None):
            c.decode_step_s = s.decode_step_s
    for name, link in rep.tiers.items():
        t = _TIERS.get(name.upper())
        if t is None or link.read_Bps <= 0 or (over and name.upper() in over.links):
            continue
        cur = c.links.get(t)
        if cur is None:
            c.links[t] = Link(link.read_Bps, link.latency_s)
        else:
            cur.read_Bps = link.read_Bps
            cur.latency_s = link.latency_s
