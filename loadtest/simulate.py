"""The offline simulator: a trace through simulated engines and the planner's policies,
on a virtual clock (discrete events), in seconds of wall time.

Events, in time order (ties: engine work, then load polls, then actions, then
arrivals): an engine's next step end or transfer completion (`SimEngine.
next_event_time`, lazily rescheduled after every call into the engine), a worker's
load poll (every `poll_interval_s`, staggered), a scenario action (add/remove a
worker, switch a model version, ...), a request arrival. An arrival is routed by
`SimRouter` (loadtest/router_model.py: the gateway's view of the fleet, or the truth
for `kv_cost_true_state`), prefetched, and submitted; a refusal (429 from a full queue) is
retried once on the next-ranked worker, as the gateway does. Every request ends with
a result: finished, shed (no worker), refused, failed, or — past `max_drain_s` after
the last arrival — "unfinished" (never dropped silently).

The HTTP path is optional (`RouterSettings`: intake, route delay, per-request and
per-burst jitter, send delay; all zero by default): an arrival passes the gateway's
one-at-a-time intake, is routed its route delay (and jitters) later, and reaches its
worker its send delay after the decision (the router counts it in flight from the
decision on; a load report counts it from its submission). A refusal's retry pays the
send delay again.

Latencies are measured from arrival (the moment the client issues it): TTFT = first
token − arrival, TPOT = (last − first) / (n − 1), E2E = last − arrival.
`prefetch_hidden_s` of a request = the load time of the KV a prefetch had already
raised when it was scheduled (`usage.kv.prefetched_tokens`), priced at the link
bandwidth of the tiers the planner's estimate planned to prefetch from.

Why one module of ~580 lines: it is one discrete-event loop, and every handler below
(arrival, route, bind, submit, first token, finish, worker churn) reads and writes the
same event heap, pending requests and engines at the same virtual instant. What does not
need that state lives apart: the router's view (router_model.py), the engines
(workers/sim), the gateway queue (router/planner/gateway_queue.py), the run's counters
(simstats.py), the statistics (summary.py).
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from router.planner.fleet import revision_knobs
from router.planner.gateway_queue import GatewayQueue, prefill_size
from router.planner.pd import PairPolicyBase
from router.planner.registry import make_policy
from router.planner.types import Decision, Estimate, RouteRequest
from workers.sim import SimEngine, SimRequest
from workers.sim.engine import BadRequest, QueueFull, Usage

from .blockkeys import KeyCache, TraceKeyer
from .dp_fleet import DPServer, make_fleet
from .fleet import FleetSpec, parse_tiers, tiers_label
from .results import RequestResult, Run, RunMeta
from .router_model import Inflight, RouterSettings, SimRouter
from .sim_pairs import prefill_leg
from .simstats import error_stats, fleet_stats, gateway_stats, prefetch_hidden_s, router_stats
from .summary import SLO_TPOT_S, SLO_TTFT_S
from .tokens import TokenSynth
from .trace import Trace, TraceError, TraceRequest

_ENGINE, _POLL, _ACTION, _ARRIVAL, _ROUTE, _SUBMIT, _RELEASE = 0, 1, 2, 3, 4, 5, 6
# How long a P->D transfer may wait for the decode worker's link before it is dropped (the
# decode worker then recomputes what did not arrive).

Action = Callable[["Simulation", float], None]


@dataclass(slots=True)
class SimSettings:
    fleet: FleetSpec = field(default_factory=FleetSpec)
    router: RouterSettings = field(default_factory=RouterSettings)
    speed: float = 1.0
    vocab_size: int = 8192
    seed: int = 0
    max_drain_s: float = 3600.0  # after the last arrival, how long unfinished requests may run
    # Goodput's SLOs (loadtest/summary.py): a request counts when it succeeded with TTFT and
    # TPOT both within them.
    slo_ttft_s: float = SLO_TTFT_S
    slo_tpot_s: float = SLO_TPOT_S


@dataclass(slots=True, eq=False)
class _Routed:
    """A routed request's attempts: the decision, its order of workers, the one under way."""

    d: Decision
    rr: RouteRequest
    keys: list[bytes]
    tokens: array[int] | None
    order: list[str]
    i: int = 0  # the attempt under way: `order[i]`
    pf_blocks: int = 0  # blocks its prefetch asked for (attempt 0 only)
    last_err: str = ""


@dataclass(slots=True, eq=False)
class _Pending:
    rid: str
    req: TraceRequest
    res: RequestResult
    arrival: float
    worker: str | None = None
    rec: Inflight | None = None
    predicted: float | None = None
    est: Estimate | None = None
    first: float | None = None
    routed: _Routed | None = None
    predicted_at_dispatch: float | None = None  # before any revision (Simulation._revise_ahead)
    hold_s: float = 0.0  # time spent there before being bound
    prefill_worker: str | None = None  # a pair decision's prefill worker (its decode worker: `worker`)


class Simulation:
    """One policy over one trace on one fleet; `run()` returns the results."""

    def __init__(
        self,
        trace: Trace,
        policy: str,
        settings: SimSettings,
        *,
        policy_params: dict[str, Any] | None = None,
        label: str | None = None,
        synth: TokenSynth | None = None,
        keys: KeyCache | None = None,
        actions: Iterable[tuple[float, Action]] = (),
        request_hook: Callable[[TraceRequest, float], TraceRequest] | None = None,
    ) -> None:
        if not settings.speed > 0:
            raise TraceError("speed must be > 0")
        self.trace = trace
        self.policy_name = policy
        self.settings = settings
        self.params = dict(policy_params or {})
        self.policy = make_policy(policy, **self.params)
        self.label = label or policy
        self.true_state = bool(getattr(self.policy, "true_state", False))
        if settings.fleet.pd is not None and not isinstance(self.policy, PairPolicyBase):
            raise TraceError(f"a disaggregated fleet (pd) is routed by the pair policies, not {policy!r}")
        profile = settings.fleet.resolved_profile()
        self.router = SimRouter(self.policy, profile.block_size, settings.router, true_state=self.true_state)
        self.fleet = make_fleet(settings.fleet, on_events=self.router.events_sink)
        self.synth = synth or TokenSynth.for_trace(trace, vocab_size=settings.vocab_size, seed=settings.seed)
        if keys is None:
            keys = KeyCache(TraceKeyer(self.synth, self.fleet.profile.namespace()))
        if keys.keyer.block_size != self.fleet.block_size:
            raise TraceError("the key cache's block size differs from the fleet's")
        self.keys = keys
        self.request_hook = request_hook
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._sched: dict[str, float | None] = {}
        self._pending: dict[str, _Pending] = {}
        self._results: list[RequestResult] = []
        self._arrivals_left = 0
        self._polling: set[str] = set()
        self.counters: dict[str, int] = {"retries": 0, "shed": 0, "refused": 0, "failed": 0, "unfinished": 0,
                                         "predictions_revised": 0}
        if settings.fleet.pd is not None or self.policy_name.startswith("pd_"):
            self.counters.update(pd_single=0, pd_pair=0, pd_bypass=0, pd_transfer_blocks=0,
                                 pd_transfer_refused=0)
        self._dispatch_err: list[float] = []  # |error| of predictions as made at dispatch
        self._actions = list(actions)
        self.removed: list[SimEngine] = []  # engines that left (their stats still count)
        self._draining: set[str] = set()
        self._intake_free = -math.inf  # when the gateway's intake takes the next request
        rs = settings.router
        self._gq: GatewayQueue[_Pending] | None = None
        if rs.gateway_order != "none" or rs.hold_target_s is not None:
            order = "fifo" if rs.gateway_order == "none" else rs.gateway_order
            self._gq = GatewayQueue(order=order, hold_target_s=rs.hold_target_s, max_wait_s=rs.max_hold_s)
        self._release_at = -math.inf
        self._holds: list[float] = []
        self._by_ticket: dict[Inflight, _Pending] = {}
        self._jitter = random.Random(settings.router.transport_seed)
        self._burst_at = -math.inf  # the issue time whose burst delay `_burst_delay` is
        self._burst_delay = 0.0

    # ------------------------------------------------------------------ plumbing

    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._seq), payload))

    def _reschedule(self, wid: str) -> None:
        eng = self.fleet.engines.get(wid)
        if eng is None:
            return
        t = eng.next_event_time()
        if t is not None and t != self._sched.get(wid):
            self._sched[wid] = t
            self._push(t, _ENGINE, wid)

    def _start_polls(self, wid: str, now: float) -> None:
        iv = self.settings.router.poll_interval_s
        if self.true_state or iv <= 0:
            return
        n = max(1, len(self.fleet.engines))
        phase = (len(self._polling) % n) / n * iv
        self._polling.add(wid)
        self._push(now + phase + iv, _POLL, wid)

    # ------------------------------------------------------------------ fleet changes (scenarios)

    def add_worker(self, now: float, worker_id: str | None = None) -> str:
        eng = self.fleet.add(worker_id)
        self.router.join(eng, now)
        self._start_polls(eng.worker_id, now)
        return eng.worker_id

    def remove_worker(self, now: float, worker_id: str, *, fail: bool = True) -> int:
        """Take a worker out. `fail`: it dies, its requests error out (the client sees an
        explicit error); otherwise it drains: no new requests, the running ones finish."""
        if not fail:
            self.router.set_draining(worker_id)
            self._draining.add(worker_id)
            return 0
        eng = self.fleet.remove(worker_id)
        self.removed.append(eng)
        self.router.leave(worker_id)
        self._polling.discard(worker_id)
        self._sched.pop(worker_id, None)
        lost = 0
        for _rid, p in list(self._pending.items()):
            if p.worker == worker_id:
                self._fail(p, now, 0, f"worker {worker_id} failed")
                lost += 1
        return lost

    # ------------------------------------------------------------------ requests

    def _fail(self, p: _Pending, now: float, status: int, msg: str, kind: str | None = None) -> None:
        """End a request with an explicit error; `kind` names its counter (default: by status)."""
        p.res.status = status
        p.res.error = msg
        if p.rec is not None:
            self.router.finished(p.rec)
            self._by_ticket.pop(p.rec, None)
        self._done(p)
        self.counters[kind or ("failed" if status in (0, 500) else "refused")] += 1

    def _done(self, p: _Pending) -> None:
        self._pending.pop(p.rid, None)
        self._results.append(p.res)

    def _arrive(self, req: TraceRequest, now: float) -> None:
        if self.request_hook is not None:
            req = self.request_hook(req, now)
        rid = f"r{req.index}"
        res = RequestResult(run=self.label, index=req.index, arrival_s=now, start_s=now,
                            prompt_tokens=req.input_length)
        p = _Pending(rid, req, res, now)
        self._pending[rid] = p
        t = self._route_time(req.input_length, now)
        if t > now:
            self._push(t, _ROUTE, p)
        else:
            self._route(p, now)

    def _route_time(self, prompt_tokens: int, now: float) -> float:
        """When the gateway routes a request issued now (RouterSettings' HTTP path)."""
        r = self.settings.router
        t = now
        if r.intake_s > 0.0:
            t = max(t, self._intake_free) + r.intake_s
            self._intake_free = t
        t += r.route_delay(prompt_tokens)
        if r.burst_jitter_s > 0.0:
            if now != self._burst_at:  # the first request of a burst draws the delay all of it shares
                self._burst_at = now
                self._burst_delay = self._jitter.random() * r.burst_jitter_s
            t += self._burst_delay
        if r.route_jitter_s > 0.0:
            t += self._jitter.random() * r.route_jitter_s
        return t

    def _route(self, p: _Pending, now: float) -> None:
        """Route now, or hold in the gateway queue (RouterSettings.gateway_order)."""
        gq = self._gq
        if gq is None:
            return self._bind(p, now)
        req = p.req
        _keys, digests = self.keys.get(req)
        best = 0
        if not self.true_state and digests:
            best = max((m.blocks for m in self.router.index.match(digests).values()), default=0)
        size = prefill_size(req.input_length, best, self.router.block_size)
        gq.push(p, size, now, req.cache_salt or req.lora or "")
        if self._release_at != now:  # after every arrival of this instant (its kind sorts last)
            self._release_at = now
            self._push(now, _RELEASE, None)

    def _release(self, now: float) -> None:
        """Bind held requests while the gateway queue lets them go (late binding, order)."""
        gq = self._gq
        if gq is None:
            return
        while len(gq):
            if gq.hold_target_s is not None:
                cands = [w for w in self.router.workers if w not in self._draining]
                if gq.should_hold(self.router.queue_estimates(now, cands), now):
                    return
            p = gq.pop(now)
            if p is None or self._pending.get(p.rid) is not p:
                continue
            p.hold_s = now - p.arrival
            self._holds.append(p.hold_s)
            self._bind(p, now)

    def _bind(self, p: _Pending, now: float) -> None:
        req = p.req
        keys, digests = self.keys.get(req)
        candidates = [w for w in self.router.workers if w not in self._draining]
        if not candidates:
            return self._fail(p, now, 503, "no worker", "shed")
        d, rr = self.router.route(req.input_length, req.output_length, keys, digests, now, p.rid,
                                  candidates if self._draining else None)
        if d.worker_id is None:
            return self._fail(p, now, 429, f"shed: {d.reason}", "shed")
        order = [d.worker_id] + [w for w in d.ranked if w != d.worker_id][: self.settings.router.retries]
        tokens = array("I", self.synth.token_bytes(req)) if not self.true_state else None
        p.routed = _Routed(d, rr, keys, tokens, order)
        if d.pd is not None:
            self.counters["pd_" + d.pd.chosen.kind] += 1
        if d.prefill_worker_id is not None:
            return prefill_leg(self, p, now)  # loadtest/sim_pairs.py
        self._attempt(p, now)

    def _attempt(self, p: _Pending, now: float) -> None:
        """Send to `order[i]` (then the next ones while they refuse at once)."""
        a = p.routed
        assert a is not None
        req = p.req
        send = self.settings.router.send_delay(req.input_length)
        while a.i < len(a.order):
            wid = a.order[a.i]
            if wid not in self.router.workers:
                a.i += 1
                continue
            est = self.router.estimate_for(a.d, wid)
            a.pf_blocks = 0
            if a.i == 0:
                a.pf_blocks = self.router.send_prefetch(a.d, a.rr, a.keys, wid, est, now, "p-" + p.rid)
            prefill = est.recompute_tokens if est is not None and est.eligible else req.input_length
            self._revise_ahead(wid, est, now)
            rec = self.router.dispatched(wid, prefill, req.input_length + req.output_length, now, est)
            p.worker, p.rec, p.est = wid, rec, est
            p.predicted = a.d.predicted_ttft if wid == a.d.worker_id else (est.t_ttft if est else None)
            p.predicted_at_dispatch = p.predicted
            self._by_ticket[rec] = p
            if send > 0.0:
                self._push(now + send, _SUBMIT, p)
                return
            if self._submit(p, now):
                return
            a.i += 1
        self._fail(p, now, 429, a.last_err or "no worker took the request")

    def _revise_ahead(self, wid: str, est: Estimate | None, now: float) -> None:
        """The router is about to send a request to `wid`: the predictions of those it sent
        there before that the newcomer will delay move by that delay
        (FleetWorker.revise_ahead, which the gateway runs too; docs/simulator.md)."""
        if not self.settings.router.revise_predictions:
            return
        w = self.router.workers.get(wid)
        if w is None:
            return
        for t, d in w.fleet.revise_ahead(est, now, revision_knobs(self.policy, wid)):
            self._revise(t, d)

    def _revise(self, t: Inflight, d: float) -> None:
        q = self._by_ticket.get(t)
        if q is None or q.predicted is None:
            return
        q.predicted += d
        if q.res.predicted_ttft_s is not None:
            q.res.predicted_ttft_s += d
        self.counters["predictions_revised"] += 1

    def _submitted(self, p: _Pending, now: float) -> None:
        """A send reached its worker, unless the request failed in transit (its worker
        was removed: `remove_worker` fails what is bound for it too)."""
        if self._pending.get(p.rid) is not p or p.rec is None:
            return
        if not self._submit(p, now):
            assert p.routed is not None
            p.routed.i += 1
            self._attempt(p, now)

    def _submit(self, p: _Pending, now: float) -> bool:
        """Hand the request to its worker's engine. False: refused with 429, try the next."""
        req, res, rec, a = p.req, p.res, p.rec, p.routed
        assert rec is not None and p.worker is not None and a is not None
        pf_blocks = a.pf_blocks
        wid = p.worker
        w = self.router.workers[wid]
        sreq = SimRequest(
            p.rid, req.input_length, req.output_length, keys=a.keys, token_ids=a.tokens,
            cache_salt=req.cache_salt, lora=req.lora,
            # `p` is this call's parameter, never rebound: the callbacks close over it directly
            on_first_token=lambda t, u: self._first(p, t, u),
            on_finish=lambda t, u: self._finish(p, t, u),
            on_error=lambda t, msg: self._fail(p, t, 500, msg),
        )
        try:
            w.engine.submit(sreq, now)
        except (QueueFull, BadRequest) as e:
            self.router.finished(rec)  # the worker never held it: undo the dispatch
            self._by_ticket.pop(rec, None)
            p.rec = None
            if pf_blocks:
                w.engine.cancel_prefetch("p-" + p.rid)
            self._reschedule(wid)
            if isinstance(e, BadRequest):
                self._fail(p, now, e.status, e.message)
                return True
            a.last_err = f"429 from {wid}: {e.message}"
            self.counters["retries"] += a.i < len(a.order) - 1
            return False
        self.router.accepted(rec, now)
        res.worker = w.engine.placed(p.rid) if isinstance(w.engine, DPServer) else wid  # a server's: its rank
        res.predicted_ttft_s = p.predicted + p.hold_s if p.predicted is not None else None
        res.client_queue_s = p.hold_s
        res.prefetch_blocks = pf_blocks
        self._reschedule(wid)
        return True

    def _first(self, p: _Pending, t: float, u: Usage) -> None:
        p.first = t
        p.res.ttft_s = t - p.arrival
        pd = p.predicted_at_dispatch
        if pd is not None and p.res.ttft_s > 0.0:
            self._dispatch_err.append(abs(pd + p.hold_s - p.res.ttft_s) / p.res.ttft_s)
        if p.rec is not None:
            self.router.first_token(p.rec)
            kv = u.to_dict()["kv"]
            # a pair's decode leg: the prediction was the whole pair's, not this worker's
            pred = None if p.prefill_worker is not None else p.predicted
            self.router.observe(p.rec.worker_id, pred, t - p.rec.t_dispatch, kv)

    def _finish(self, p: _Pending, t: float, u: Usage) -> None:
        r = p.res
        r.e2e_s = t - p.arrival
        r.output_tokens = u.completion_tokens
        if p.first is not None and u.completion_tokens > 1:
            r.tpot_s = (t - p.first) / (u.completion_tokens - 1)
        r.prompt_tokens = u.prompt_tokens
        r.cached_tokens = u.cached_tokens
        r.loaded_tokens = {k: v for k, v in u.loaded_tokens.items() if v}
        r.recomputed_tokens = u.recomputed_tokens
        r.prefetched_tokens = u.prefetched_tokens
        r.queue_ms, r.load_ms, r.prefill_ms = u.queue_ms, u.load_ms, u.prefill_ms
        r.prefetch_hidden_s = self._hidden(p, u)
        if p.rec is not None:
            self.router.finished(p.rec)
            self._by_ticket.pop(p.rec, None)
        self._done(p)

    def _hidden(self, p: _Pending, u: Usage) -> float | None:
        w = self.router.workers.get(p.worker) if p.worker is not None else None
        if not u.prefetched_tokens or p.est is None or w is None:
            return None
        return prefetch_hidden_s(p.est, w.view.cost, u.prefetched_tokens)

    # ------------------------------------------------------------------ the loop

    def run(self) -> Run:
        wall0 = time.perf_counter()
        speed = self.settings.speed
        for engine in list(self.fleet.engines.values()):
            self.router.join(engine, 0.0)
        for wid in list(self.fleet.engines):
            self._start_polls(wid, 0.0)
        reqs = self.trace.requests
        for r in reqs:
            self._push(r.arrival_s / speed, _ARRIVAL, r)
        self._arrivals_left = len(reqs)
        for t, fn in self._actions:
            self._push(t, _ACTION, fn)
        last_arrival = reqs[-1].arrival_s / speed if reqs else 0.0
        stop_at = last_arrival + self.settings.max_drain_s
        heap = self._heap
        engines = self.fleet.engines
        sched = self._sched
        steps = 0
        while heap:
            t, kind, _, x = heapq.heappop(heap)
            if t > stop_at:
                break
            self.now = t
            steps += 1
            if kind == _ENGINE:
                if sched.get(x) != t:
                    continue
                sched[x] = None
                eng = engines.get(x)
                if eng is None:
                    continue
                eng.advance(t)
                self._reschedule(x)
            elif kind == _POLL:
                if x not in self._polling or x not in engines:
                    continue
                self.router.poll(x, t)
                self._reschedule(x)
                if self._gq is not None and len(self._gq):
                    self._release(t)
                if self._pending or self._arrivals_left:
                    self._push(t + self.settings.router.poll_interval_s, _POLL, x)
                else:
                    self._polling.discard(x)
            elif kind == _ACTION:
                x(self, t)
                for wid in list(engines):
                    self._reschedule(wid)
            elif kind == _ARRIVAL:
                self._arrivals_left -= 1
                self._arrive(x, t)
            elif kind == _ROUTE:
                pending = self._pending.get(x.rid)
                if pending is not None and pending is x:
                    self._route(pending, t)
            elif kind == _RELEASE:
                self._release(t)
            else:
                self._submitted(x, t)
            self._maybe_drain_out(t)
        for p in list(self._pending.values()):
            self.counters["unfinished"] += 1
            p.res.status, p.res.error = 0, f"unfinished when the simulation stopped at t={self.now:.1f}s"
            if p.rec is not None:
                self.router.finished(p.rec)
            self._results.append(p.res)
        self._pending.clear()
        self._results.sort(key=lambda r: r.index)
        wall = time.perf_counter() - wall0
        ends = [r.arrival_s + r.e2e_s for r in self._results if r.e2e_s is not None]
        duration = (max(ends) if ends else 0.0) - (reqs[0].arrival_s / speed if reqs else 0.0)
        meta = RunMeta(
            run=self.label,
            mode="sim",
            policy=self.policy_name,
            trace=self.trace.name,
            speed=speed,
            workers=self.settings.fleet.workers * self.settings.fleet.dp,
            profile=self.fleet.profile.name,
            tiers=tiers_label(parse_tiers(self.settings.fleet.tiers)),
            duration_s=duration,
            wall_s=wall,
            params={"policy": self.params, "router": self.settings.router.to_dict(),
                    "block_size": self.fleet.block_size, "remote_groups": self.settings.fleet.remote_groups,
                    "seed": self.settings.seed,
                    "slo": {"ttft_s": self.settings.slo_ttft_s, "tpot_s": self.settings.slo_tpot_s},
                    "pd": list(self.settings.fleet.pd) if self.settings.fleet.pd is not None else None,
                    "pd_link_Bps": self.settings.fleet.pd_link_Bps,
                    "dp": self.settings.fleet.dp, "dp_routing": self.settings.fleet.dp_routing},
            stats=self._stats(steps, wall),
        )
        return Run(meta, self._results)

    def _maybe_drain_out(self, now: float) -> None:
        """Finish draining workers whose last request is done."""
        if not self._draining:
            return
        for wid in list(self._draining):
            if not any(p.worker == wid for p in self._pending.values()):
                self._draining.discard(wid)
                if wid in self.fleet.engines:
                    self.removed.append(self.fleet.remove(wid))
                self.router.leave(wid)
                self._polling.discard(wid)

    def _stats(self, steps: int, wall: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "sim_events": steps,
            "sim_rate_req_per_wall_s": round(len(self._results) / wall, 1) if wall > 0 else None,
            **router_stats(self.router.counters),
            **fleet_stats(self.fleet.all_engines() + self.removed, self.fleet.remotes),
            **self.counters,
        }
        if not self.true_state:
            out["index_blocks"] = len(self.router.index)
        if self._gq is not None:
            out.update(gateway_stats(self._holds, self._results))
        out.update(error_stats("pred_err_dispatch", self._dispatch_err))
        cal = getattr(self.policy, "calibrator", None)
        snap = cal.snapshot() if cal is not None else {}
        if snap:
            scales = [v["prefill_scale"] for v in snap.values()]
            out["calibrated_prefill_scale_mean"] = round(sum(scales) / len(scales), 4)
        return out
