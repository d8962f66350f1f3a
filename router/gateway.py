"""The request pipeline: prepare → decide → dispatch (prefetch, relay) → observe.

`Gateway` owns what a request touches (models with their tokenizers and indexes, the
worker pool, the policy, the pooled HTTP session, metrics) and wires the steps that
live in their own modules: router/intake/prepare.py, router/upstream/prefetch.py, router/upstream/relay.py,
router/api/admin_view.py. The ASGI plumbing is router/api/app.py.

Every request ends with a response or an explicit error: a worker failing before its
first chunk is replaced by the next best (Decision.ranked, `routing.retries` times);
after the first chunk the client gets an SSE error event (streaming) or a 502; a
client that goes away cancels the handler, which closes the upstream connection and
cancels the request's prefetch.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from prometheus_client.core import Metric

from .api import admin_view as admin
from .api.admin_policy import LOOPBACK_HOSTS, network_policy
from .api.errors import ApiError, rate_limited, unavailable, upstream_failed
from .binding import Binder
from .config import Config
from .fleet.discovery import Discovery
from .fleet.drain import InFlight
from .fleet.fleetconfig import WorkerConfig
from .fleet.ingest_adapter import PoolIngest
from .fleet.membership import Membership
from .fleet.netpolicy import PolicyResolver
from .fleet.pool import WorkerPool
from .fleet.replica_sync import ReplicaSync
from .fleet.worker import State, Worker
from .intake.bodyrate import BodyRate
from .intake.budget import ByteBudget
from .intake.memtrim import MemoryTrim
from .intake.model import ModelRuntime, ModelTable
from .intake.prepare import Prepared, Preparer
from .intake.tenancy import Tenancy, Tenant
from .intake.tokenize import Tokenization, Tokenizer
from .planner.explain import explain as explain_decision
from .planner.fleet import revision_knobs, whole_engine_blocks
from .planner.gateway_queue import prefill_size
from .planner.load import queue_seconds
from .planner.registry import make_policy, policy_params
from .planner.types import Decision, Estimate, RouteRequest
from .telemetry.fidelity import KeyFidelity
from .telemetry.metrics import GatewayMetrics
from .telemetry.observe import Observer, access
from .telemetry.recorder import TraceRecorder
from .telemetry.tracing import RequestTracer
from .upstream.attempt import Attempt, Out
from .upstream.client import UpstreamClient
from .upstream.http1 import MAX_IDLE_S
from .upstream.pair import Prefilled, prefill
from .upstream.passthrough import PassThrough
from .upstream.prefetch import Prefetch, Prefetcher, prefetch_rule
from .upstream.proxy import UpstreamError
from .upstream.redact import worker_message
from .upstream.relay import Relay

log = logging.getLogger("kvroute.gateway")


class Gateway:
    """Built complete by `await Gateway.create(cfg)`, on the loop that serves it."""

    def __init__(self, cfg: Config) -> None:
        """Everything a request touches; on a running loop (the HTTP session binds to it).
        `create` then registers the workers: use it."""
        self.cfg = cfg
        if not cfg.admin_token:
            where = "local clients only" if cfg.listen.host in LOOPBACK_HOSTS else "disabled"
            log.warning("no admin_token: the admin API is %s (listening on %s)", where, cfg.listen.host)
        self.metrics = GatewayMetrics()
        self.tenancy = Tenancy(cfg)
        self.models = _models(cfg)
        params = cfg.routing.policy_kwargs()
        self.policy = make_policy(cfg.routing.policy, **params)
        self.policy_name = cfg.routing.policy
        self.policy_params = {**policy_params(cfg.routing.policy), **params}  # in effect: defaults + config
        self.tokenization = Tokenization()
        self.preparer = Preparer(cfg.limits, self.models, self.tenancy, self.tokenization, self.metrics)
        self.body_budget = ByteBudget(cfg.limits.max_inflight_body_bytes)
        self.memtrim = MemoryTrim()  # a huge request's freed memory back to the system
        self.body_rate = BodyRate(cfg.limits.tenant_large_body_bytes_per_s, cfg.limits.max_body_bytes)
        tr = cfg.observability.trace
        self.recorder = TraceRecorder(tr.path, tr.salt, tr.block_tokens, tr.max_ids) if tr.enabled else None
        self.fidelity = KeyFidelity()
        self.observer = Observer(self.policy, self.metrics, self.recorder, self.fidelity,
                                 cfg.observability.request_log,
                                 RequestTracer.build(cfg.observability.otel), self.policy_name)
        self._bg: set[asyncio.Task[Any]] = set()
        self._admin_timeout = aiohttp.ClientTimeout(total=2.0, connect=cfg.pool.connect_timeout_s)
        self.metrics.add_state_collector(self._collect_state)
        self.binder = Binder(cfg.routing.gateway_queue, self._predicted_queues, self.metrics)
        self.inflight = InFlight()  # the requests the end of a drain must end (router/fleet/drain.py)
        self.stopping = False  # SIGTERM: not ready, finishing what is in flight
        self.closed = False
        conn = aiohttp.TCPConnector(
            limit=cfg.pool.max_connections, limit_per_host=0, keepalive_timeout=MAX_IDLE_S,
            enable_cleanup_closed=True,
            resolver=PolicyResolver(network_policy(cfg.admin)),  # names re-checked at each resolution
        )
        self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False)
        self.ingest = PoolIngest()
        self.pool = WorkerPool(
            cfg.pool,
            dict(self.models.by_id),
            self.session,
            ingest=self.ingest,
            worker_max_inflight=cfg.limits.worker_max_inflight,
            replicas=cfg.routing.replicas,
            on_state=self._on_worker_state,
            on_refused=lambda w, code: self.metrics.worker_refused.labels(w.id, code).inc(),
            on_load=lambda w: self.binder.check(w.model.id),
        )
        self.prefetcher = Prefetcher(self.session, prefetch_rule(cfg.routing.prefetch), self.metrics, self.spawn,
                                     cfg.pool.connect_timeout_s)
        # every route's requests to the workers (chat, completions, pass-through, embeddings)
        self.upstream = UpstreamClient(self.session, cfg.pool)
        self.relay = Relay(self.upstream, self.pool, self.observer)
        self.pool.probe.upstream = self.upstream.lean  # keep-alive polls, closed with the client
        self.pool.network = network_policy(cfg.admin)
        self.passthrough = PassThrough(self.upstream, self.pool, self.observer)
        self.membership = Membership(self.pool)
        self.discovery: Discovery | None = None  # with `discovery` entries in the config
        # `kvroute serve --processes N`: admin changes shared with the other processes
        self.replicas: ReplicaSync | None = None

    @classmethod
    async def create(cls, cfg: Config, replicas: Callable[[Gateway], ReplicaSync] | None = None) -> Gateway:
        """A gateway ready to serve on the running loop: built, the config's workers
        registered, discovery started, and (`replicas`, under --processes) the other
        processes' admin changes taken in. Closed again if any of it fails."""
        gw = cls(cfg)
        try:
            if replicas is not None:
                gw.replicas = replicas(gw)
            await gw.membership.set_static(cfg.workers, "config")
            if cfg.discovery:
                gw.discovery = Discovery(cfg.discovery, gw._on_discovered)
                await gw.discovery.start()
            if gw.replicas is not None:  # the other processes' admin changes, before serving
                await gw.replicas.start()
        except BaseException:
            await gw.close()
            raise
        return gw

    def _on_discovered(self, workers: dict[str, WorkerConfig]) -> None:
        self.membership.set_discovered(workers)
        self.spawn(self.membership.reconcile("dns"))

    async def reload(self, new: Config) -> dict[str, Any]:
        """A re-read config file (SIGHUP): the worker list and discovery entries apply now;
        other sections need a restart, and the log says which changed."""
        old = self.cfg
        if new.discovery != old.discovery:
            if self.discovery is not None:
                await self.discovery.close()
                self.discovery = None
            self.membership.set_discovered({})
            if new.discovery:
                self.discovery = Discovery(new.discovery, self._on_discovered)
                await self.discovery.start()
        diff = await self.membership.set_static(new.workers, "reload")
        later = [k for k in type(new).model_fields if k not in ("workers", "discovery")
                 and getattr(new, k) != getattr(old, k)]
        if later:
            log.warning("config reloaded; these sections changed but apply only after a restart: %s",
                        ", ".join(later), extra={"kv": {"restart_needed": later}})
        self.cfg = old.model_copy(update={"workers": new.workers, "discovery": new.discovery})
        return {**diff.as_dict(), "restart_needed": later}

    async def close(self) -> None:
        """Everything the gateway holds, let go once (a second call does nothing)."""
        if self.closed:
            return
        self.closed = True
        self.binder.close()
        if self.replicas is not None:
            await self.replicas.close()
        if self.discovery is not None:
            await self.discovery.close()
        for t in list(self._bg):
            t.cancel()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
        await self.pool.close()
        await self.ingest.close()
        self.upstream.close()
        await self.session.close()
        self.tokenization.close()
        await self.preparer.screener.aclose()
        if self.recorder is not None:
            self.recorder.close()

    def _on_worker_state(self, w: Worker, state: State) -> None:
        self.metrics.child(self.metrics.worker_transitions, w.id, state.value).inc()
        if state is State.UNHEALTHY:
            self.policy_forget(w.id)

    def policy_forget(self, worker_id: str) -> None:
        self.fidelity.forget(worker_id)
        cal = getattr(self.policy, "calibrator", None)
        if cal is not None and hasattr(cal, "forget"):
            cal.forget(worker_id)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A background task the gateway owns (cancelled on close)."""
        t = asyncio.get_running_loop().create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)
        return t

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready: every model has a healthy worker, and every healthy worker's cache is in
        the index (a restarted gateway routes by cache from its first request)."""
        pool = self.pool
        per_model = {m: len(pool.routable(m)) for m in self.models.by_id}
        indexing = sorted(w.id for m in self.models.by_id for w in pool.healthy(m) if not pool.indexed(w))
        ok = all(per_model.values()) and not indexing and not self.stopping
        return ok, {"healthy_workers": per_model, "indexing_workers": indexing, "tokenizers_loaded": True,
                    "stopping": self.stopping}

    # ------------------------------------------------------------------ prepare, decide

    async def prepare(
        self, chat: bool, body: bytes, headers: Mapping[str, str], tenant: Tenant | None = None
    ) -> Prepared:
        return await self.preparer.prepare(chat, body, headers, tenant)

    def _open(self, workers: list[Worker]) -> list[Worker]:
        """Those under their in-flight caps."""
        return [w for w in workers if w.max_inflight is None or len(w.inflight) < w.max_inflight]

    def _predicted_queues(self, model_id: str) -> list[float]:
        """Each worker that could take a request of the model now: its predicted queue (s)."""
        workers = self._open(self.pool.routable(model_id))
        self.pool.refresh_ages(workers, time.monotonic())
        return [queue_seconds(w.view) for w in workers]

    def _prefill_tokens(self, prep: Prepared) -> float:
        """The gateway queue's size of a held request (gateway_queue.prefill_size)."""
        held = max((m.blocks for m in prep.model.index.match(prep.plan.digests).values()), default=0)
        return prefill_size(len(prep.ids), held, prep.model.block_size)

    def _candidates(self, prep: Prepared) -> list[Worker]:
        """Healthy workers of the model that can serve the request as asked, under their caps."""
        return self.candidates(prep.model, prep.ours_error, prep.lora)

    def candidates(self, model: ModelRuntime, ours_error: ApiError | None = None,
                   lora: str | None = None) -> list[Worker]:
        """Healthy workers of `model` under their caps (only vLLM ones with `ours_error`: what
        our workers cannot serve; only those that list adapter `lora`); 429/503 when there
        is none."""
        workers = self.pool.routable(model.id)
        if not workers:
            failing = self.pool.healthy(model.id)  # alive, but out of routing by their breakers
            if failing:
                self.metrics.child(self.metrics.shed, "workers_failing").inc()
                wait = min(w.breaker.retry_after_s(time.monotonic()) for w in failing)
                raise rate_limited("The model's workers are failing requests right now; retry later.",
                                   max(wait, self.cfg.routing.default_retry_after_s), "workers_failing")
            self.metrics.child(self.metrics.shed, "no_healthy_worker").inc()
            raise unavailable(f"No healthy worker serves model {model.id!r} right now.", 1.0)
        if lora is not None:
            workers = [w for w in workers if lora in w.adapters]
            if not workers:
                self.metrics.child(self.metrics.shed, "no_healthy_worker").inc()
                raise unavailable(f"No healthy worker serves adapter {lora!r} of model {model.id!r} right now.", 1.0)
        if ours_error is not None:  # only pass-through workers take what ours do not implement
            workers = [w for w in workers if w.passes_through]
            if not workers:
                raise ours_error
        open_ = self._open(workers)
        if not open_:
            self.metrics.child(self.metrics.shed, "worker_caps").inc()
            raise rate_limited("Every worker of this model is at its in-flight cap.",
                               self.cfg.routing.default_retry_after_s, "worker_caps")
        return open_

    def _route_request(self, prep: Prepared, workers: list[Worker]) -> RouteRequest:
        model = prep.model
        now = time.monotonic()
        self.pool.refresh_ages(workers, now)
        plan = prep.plan
        # an engine always computes the last prompt token: a hybrid worker's windows are
        # checked where its reuse can end (kvindex/group_match.py)
        cap = (len(prep.ids) - 1) // model.block_size
        matches = model.index.match(plan.digests, max_blocks=cap)
        if plan.vllm_digests is not None:
            vids = [w.id for w in workers if w.kind == "vllm"]
            if vids:
                matches.update(model.index.match(plan.vllm_digests, vids, max_blocks=cap))
        for w in workers:  # price only whole engine blocks
            m = matches.get(w.id)
            if m is not None and w.block_size > model.block_size:
                whole = whole_engine_blocks(m, w.block_size // model.block_size)
                if whole is None:
                    del matches[w.id]
                else:
                    matches[w.id] = whole
        return RouteRequest(len(prep.ids), plan.digests, matches, prep.max_tokens, now, prep.rid)

    def decide(self, prep: Prepared) -> tuple[Decision, RouteRequest]:
        """Candidates, index lookup and the policy's choice. `kvroute_decision_seconds`
        is the routing work a request pays for: its block keys (computed in prepare),
        the index lookup and the scoring."""
        t = time.perf_counter()
        workers = self._candidates(prep)
        rr = self._route_request(prep, workers)
        d = self.policy.choose(rr, [w.view for w in workers])
        m = self.metrics
        m.child(m.decision, self.policy_name).observe(prep.keys_s + time.perf_counter() - t)
        m.child(m.choices, self.policy_name, d.reason).inc()
        return d, rr

    def explain(self, prep: Prepared) -> dict[str, Any]:
        """What routing would do for this request now (nothing is sent, nothing changes)."""
        workers = self._candidates(prep)
        rr = self._route_request(prep, workers)
        d = explain_decision(self.policy, rr, [w.view for w in workers])
        out = admin.explain_dict(prep, self.policy_name, d, rr, self.policy_params)
        out["gateway_queue"] = {**self.cfg.routing.gateway_queue.model_dump(), "held": self.binder.held(prep.model.id)}
        out["revise_predictions"] = self.cfg.routing.revise_predictions
        out["speeds"] = {w.id: admin.speeds_summary(w) for w in workers}
        if d.reason == "speeds_unknown":
            out["note"] = ("speeds of " + ", ".join(w.id for w in workers if not w.view.speeds_known)
                           + " not measured yet: routed by cache affinity and load")
        return out

    # ------------------------------------------------------------------ dispatch

    async def complete(self, prep: Prepared, out: Out) -> int:
        """Route and relay one prepared request; returns the HTTP status sent. The caller
        holds the tenant's concurrency slot (taken before any work on the request)."""
        try:
            return await self._dispatch(prep, out)
        except ApiError as e:
            if self.observer.request_log:
                access.info("request refused", extra={"kv": {
                    "request_id": prep.request_id, "response_id": prep.rid, "tenant": prep.tenant.id,
                    "model": prep.model.id, "status": e.status, "code": e.code, "policy": self.policy_name}})
            raise
        finally:
            self.tenancy.remember_salt(prep.tenant, prep.cache_salt)

    def _shed(self, d: Decision) -> Exception:
        self.metrics.child(self.metrics.shed, d.reason).inc()
        retry = d.retry_after_s or self.cfg.routing.default_retry_after_s
        if d.reason == "no_workers":
            return unavailable("No eligible worker for this request.", retry)
        return rate_limited(f"All workers are too busy for this request ({d.reason}); retry later.", retry, d.reason)

    async def _dispatch(self, prep: Prepared, out: Out) -> int:
        m = self.metrics
        if self.binder.enabled:
            await self.binder.turn(prep.model.id, lambda: self._prefill_tokens(prep), prep.tenant.id)
        d, rr = self.decide(prep)
        if d.worker_id is None:
            raise self._shed(d)
        if d.pd is not None:
            if d.pd.chosen.kind == "pair":
                return await self._dispatch_pair(prep, d, rr, out)
            m.child(m.pd_served, d.pd.chosen.kind).inc()
        retries = self.cfg.routing.retries
        order = [d.worker_id] + [w for w in d.ranked if w != d.worker_id][:retries]
        estimates = {e.worker_id: e for e in d.estimates}
        last: UpstreamError | None = None
        last_w: Worker | None = None
        tried = slow = 0
        for wid in order:
            w = self.pool.workers.get(wid)
            if w is None or w.state is not State.HEALTHY:
                continue
            if tried >= 1 + retries:
                break
            if tried:
                m.child(m.retries, "before_first_byte").inc()
            tried += 1
            try:
                return await self._attempt(prep, d, rr, w, estimates.get(wid), out, tried)
            except UpstreamError as e:
                if not e.retryable:
                    raise (e.api_error or upstream_failed("A worker failed to answer.")) from None
                last, last_w = e, w
                slow += e.phase == "connect_timeout"
                log.warning("request %s: worker %s failed before the first byte: %s", prep.rid, w.id, e)
        if last is not None and last.api_error is not None and last.api_error.status == 429:
            m.child(m.shed, "worker_429").inc()
            raise last.api_error
        if slow and slow == tried:
            raise self._slow_to_accept()
        if last is None:
            raise unavailable("No healthy worker could take this request.", 1.0)
        log.warning("request %s: no worker answered (%d tried): %s", prep.rid, tried, last)
        said = _worker_said(last, last_w)
        why = f" (the worker said: {said})" if said else ""
        if tried > 1:
            raise upstream_failed(f"The {tried} workers tried failed before answering{why}; retry the request.")
        raise upstream_failed(f"The worker failed before answering{why}; retry the request.")

    async def _dispatch_pair(self, prep: Prepared, d: Decision, rr: RouteRequest, out: Out) -> int:
        """Serve a pair decision (router/upstream/pair.py has the exchange). The options are
        tried in the record's order (the chosen one, then the alternatives by score):
        a prefill worker that fails is skipped, the next option served (another pair, or
        a single / bypass worker serving the request alone). Once a prefill succeeded,
        its `kv_transfer_params` go to each decode worker tried, until one answers: a
        decode worker that fails before its first byte is replaced by the next
        decode-capable worker of the ranking with the same parameters (the prefill
        worker keeps the blocks until its own bound: vLLM's abort timeout, our pin
        bound; the gateway cannot release them). Nothing left: a 502 saying the decode
        side failed after the prefill."""
        assert d.pd is not None
        m = self.metrics
        estimates = {e.worker_id: e for e in d.estimates}
        views = {w.id: w for w in self.pool.workers.values()}
        legs = 2 * (1 + self.cfg.routing.retries)
        failed: set[str] = set()
        done: Prefilled | None = None
        last: UpstreamError | None = None
        tried = 0

        def usable(wid: str | None) -> Worker | None:
            w = views.get(wid) if wid is not None else None
            return w if w is not None and w.state is State.HEALTHY and wid not in failed else None

        options = [d.pd.chosen, *d.pd.alternatives]
        # after a prefill, any decode-capable worker of the ranking may decode
        decoders = [wid for wid in d.ranked if (w := views.get(wid)) is not None and w.cfg.role != "prefill"]
        queue: list[tuple[str, str | None, str]] = [(o.kind, o.prefill_worker, o.decode_worker) for o in options]
        queue += [("pair", None, wid) for wid in decoders]
        for kind, pid, did in queue:
            if tried >= legs:
                break
            dw = usable(did)
            if dw is None or (kind == "pair" and pid is None and done is None):
                continue
            if kind == "pair" and done is None:
                pw = usable(pid)
                if pw is None:
                    continue
                tried += 1
                predicted = d.pd.chosen.terms.get("prefill_ttft") if pid == d.pd.chosen.prefill_worker else None
                try:
                    done = await prefill(self.upstream, self.pool, prep, pw, estimates.get(pw.id), predicted)
                    if predicted is not None and predicted > 0:
                        # P's one-token answer is its TTFT: the prefill leg calibrates P
                        self.policy.observe(pw.id, predicted, done.seconds, done.kv)
                except UpstreamError as e:
                    self._failed_leg(pw, e)
                    if not e.retryable:
                        raise (e.api_error or upstream_failed("The prefill worker failed to answer.")) from None
                    failed.add(pw.id)
                    last = e
                    m.child(m.retries, "prefill_failed").inc()
                    log.warning("request %s: prefill worker %s failed: %s", prep.rid, pw.id, e)
                    continue
            elif kind != "pair" and done is not None:
                continue  # the prompt's KV waits on a prefill worker: decode it, do not compute it again
            tried += 1
            try:
                status = await self._attempt(prep, d, rr, dw, estimates.get(dw.id), out, tried,
                                             done if kind == "pair" else None)
            except UpstreamError as e:
                if not e.retryable:
                    raise (e.api_error or upstream_failed("A worker failed to answer.")) from None
                failed.add(dw.id)
                last = e
                m.child(m.retries, "decode_failed" if done is not None else "before_first_byte").inc()
                log.warning("request %s: worker %s failed before the first byte: %s", prep.rid, dw.id, e)
                continue
            m.child(m.pd_served, kind).inc()
            return status
        if done is not None:
            raise upstream_failed(f"The decode side failed after the prompt was prefilled on {done.worker.id} "
                                  f"({last}); retry the request.")
        if last is None:
            raise unavailable("No healthy worker could take this request.", 1.0)
        raise upstream_failed(f"Every prefill and fallback worker tried failed before answering ({last}); "
                              "retry the request.")

    def _failed_leg(self, w: Worker, e: UpstreamError) -> None:
        self.metrics.child(self.metrics.upstream_errors, w.id, e.phase).inc()
        if e.fatal or e.worker_trouble:
            self.pool.report_failure(w, str(e), e.fatal)

    def _slow_to_accept(self) -> ApiError:
        """Every worker tried was too busy to accept the connection: live workers that are
        overloaded, so a 429 with Retry-After (a 502 would tell the client they failed)."""
        self.metrics.child(self.metrics.shed, "slow_to_accept").inc()
        return rate_limited("The model's workers are too busy to accept this request; retry later.",
                            self.cfg.routing.default_retry_after_s, "slow_to_accept")

    async def _attempt(
        self, prep: Prepared, d: Decision, rr: RouteRequest, w: Worker, est: Estimate | None, out: Out,
        tries: int = 1, pair: Prefilled | None = None,
    ) -> int:
        """One try on worker `w`: prefetch (for the chosen worker), count, relay. `pair`:
        the decode leg of a prefill/decode pair, after its prefill."""
        chosen = w.id == d.worker_id
        predicted = d.predicted_ttft if chosen else (est.t_ttft if est else None)
        if pair is not None:
            # the pair's prediction counts from the prefill's dispatch: not this leg's to calibrate
            predicted = None
        pf = None
        if chosen:
            peer = self.pool.workers.get(d.prefetch_from_peer) if d.prefetch_from_peer else None
            pf = self.prefetcher.send(prep, d, w, rr, est, peer)
        prefill = est.recompute_tokens if est is not None and est.eligible else len(prep.ids)
        if pair is not None and pair.params is not None:
            prefill = max(1, len(prep.ids) - pair.moved_tokens)  # the tail past the moved blocks
        if self.cfg.routing.revise_predictions:
            w.fleet.revise_ahead(est, time.monotonic(), revision_knobs(self.policy, w.id))
        rec = self.pool.dispatched(w, prefill, len(prep.ids) + prep.max_tokens, est)
        try:
            await self._let_prefetch_lead(pf)
            a = Attempt(prep, w, rec, rr, predicted, pf, reason=d.reason if chosen else "retry", tries=tries)
            if pair is not None:
                a.kv_transfer, a.prefill_worker, a.kv_moved_tokens = pair.params, pair.worker.id, pair.moved_tokens
            if w.passes_through:
                return await self.passthrough.run(a, out)
            return await self.relay.run(a, out)
        except asyncio.CancelledError:  # the client left
            self.metrics.disconnects.inc()
            if not rec.prefilled:
                self.prefetcher.cancel(pf)
            raise
        except UpstreamError as e:
            self.metrics.child(self.metrics.upstream_errors, w.id, e.phase).inc()
            self.prefetcher.cancel(pf)
            if e.fatal or e.worker_trouble:
                self.pool.report_failure(w, str(e), e.fatal)
            raise
        finally:
            self.pool.finished(rec)

    async def _let_prefetch_lead(self, pf: Prefetch | None) -> None:
        if pf is None or pf.task is None:
            return
        if pf.peer:
            # A peer pull is known to the worker only through the prefetch: let it be
            # accepted first (never wait long).
            await asyncio.wait({pf.task}, timeout=self.cfg.routing.prefetch.ack_timeout_s)
        else:
            # Local tiers: one loop turn puts the prefetch on the wire before the request;
            # waiting for its 202 would only add a round trip to TTFT.
            await asyncio.sleep(0)

    # ------------------------------------------------------------------ admin

    async def purge_tenant(self, tenant_id: str) -> dict[str, Any]:
        return await admin.purge_tenant(self.tenancy, self.pool, self.session, tenant_id, self._admin_timeout)

    def index_stats(self) -> dict[str, Any]:
        return admin.index_stats(self.models, self.ingest)

    def _collect_state(self) -> list[Metric]:
        if self.pool is None:
            return []
        return admin.state_gauges(self.pool, self.models, self.ingest)


def _worker_said(e: UpstreamError, w: Worker | None) -> str | None:
    """A failed worker's own 5xx message, fit for the client (router/upstream/redact.py)."""
    if e.said is None or w is None:
        return None
    host = urlsplit(w.url).hostname or ""
    return worker_message(e.said, (w.id, w.url, host))


def _models(cfg: Config) -> ModelTable:
    """The served models, each tokenizer folder loaded once, shared prefixes resolved."""
    table = ModelTable()
    toks: dict[str, Tokenizer] = {}
    for m in cfg.models:
        key = str(m.tokenizer.resolve())
        tok = toks.get(key)
        if tok is None:
            tok = toks[key] = Tokenizer(m.tokenizer)
        table.add(ModelRuntime(m, tok))
    for sp in cfg.shared_prefixes:
        for rt in table.by_id.values():
            if sp.model is None or table.get(sp.model) is rt:
                rt.add_shared_prefix(sp)
    return table
