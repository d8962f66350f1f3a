"""The router as the offline simulator models it: what the gateway knows, when it knows it.

It runs the gateway's own code on the gateway's inputs: the policy, the fleet view
(`router/planner/fleet.py`: `/load` reports into `WorkerView`s, the in-flight ledger,
the prefetch plan) and a `kvindex.PrefixIndex` fed only by the engines' KV events. Only
timing is the simulator's: polls every `poll_interval_s`, events `event_lag_s` late,
and the optional transport delays of `RouterSettings`. `true_state=True` replaces the
inputs with the engines' truth (the `kv_cost_true_state` policy). Details: docs/simulator.md.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvindex.events import KVEvent
from kvindex.index import PrefixIndex, PrefixMatch
from kvindex.tiers import Tier
from router.planner.fleet import FleetWorker, PrefetchRule, apply_report, plan_prefetch
from router.planner.inflight import InflightLedger, Ticket
from router.planner.load import queue_seconds
from router.planner.types import CostParams, Decision, Estimate, Policy, RouteRequest, WorkerView
from workers.sim import SimEngine
from workers.sim.engine import BadRequest, PrefetchQueueFull

Inflight = Ticket  # one dispatched request (`worker_id`, `t_dispatch`, ...): its ledger's ticket


@dataclass(slots=True)
class RouterSettings:
    poll_interval_s: float = 0.1
    event_lag_s: float = 0.0
    prefetch: bool = True
    prefetch_min_blocks: int = 1
    prefetch_margin_s: float = 0.05
    prefetch_min_deadline_s: float = 0.2
    retries: int = 1
    # The HTTP path between client, gateway and workers (all zero = none, the pure
    # model). An issued request first passes the gateway's intake, one request at a
    # time for `intake_s` each (one event loop: a burst leaves it in issue order, spread
    # out); it is routed `route_delay(prompt)` after that, plus a uniform random
    # `[0, route_jitter_s)` of its own and one `[0, burst_jitter_s)` shared by everything
    # issued at the same instant (how late the client and gateway get to a burst), both
    # drawn from `transport_seed`; it reaches its worker `send_delay(prompt)` after the
    # decision. A per-token delay counts only the tokens
    # beyond `delay_free_tokens`: a body that fits one read of the event loop
    # keeps its place, a larger one needs several turns and is overtaken by the short
    # requests issued with it. That matters: with FCFS chunked prefill a short prompt
    # queued behind an 87k-token one waits its whole prefill, so the order inside a
    # burst of identical timestamps moves a 300-request p50 by 15-25%
    # (loadtest/README.md, "Offline vs HTTP"). `TRANSPORTS["local-http"]` holds the
    # values measured on this project's HTTP stack; each request's delays are its own.
    intake_s: float = 0.0
    route_delay_s: float = 0.0
    route_delay_s_per_token: float = 0.0
    delay_free_tokens: int = 0
    route_jitter_s: float = 0.0
    burst_jitter_s: float = 0.0
    send_delay_s: float = 0.0
    send_delay_s_per_token: float = 0.0
    transport_seed: int = 0
    # The gateway's own queue (router/planner/gateway_queue.py): `gateway_order` "none"
    # routes each request on arrival; "fifo" / "spf" hold what arrives at one instant (a
    # burst) and bind it in that order; with `hold_target_s` set, requests are also held
    # while every worker's predicted queue exceeds it (late binding), each at most
    # `max_hold_s`.
    # Revise a request's predicted TTFT when the router sends another request into the step
    # it is waiting for (loadtest/simulate.py `_revise_ahead`).
    revise_predictions: bool = True
    gateway_order: str = "none"
    hold_target_s: float | None = None
    max_hold_s: float = 2.0

    def route_delay(self, prompt_tokens: int) -> float:
        return self._leg(self.route_delay_s, self.route_delay_s_per_token, prompt_tokens)

    def send_delay(self, prompt_tokens: int) -> float:
        return self._leg(self.send_delay_s, self.send_delay_s_per_token, prompt_tokens)

    def _leg(self, fixed: float, per_token: float, prompt_tokens: int) -> float:
        over = prompt_tokens - self.delay_free_tokens
        return fixed + (per_token * over if over > 0 else 0.0)

    def with_transport(self, name: str, seed: int = 0) -> RouterSettings:
        """These settings with a named transport model (`TRANSPORTS`) and jitter seed."""
        if name not in TRANSPORTS:
            raise ValueError(f"unknown transport {name!r}; known: {', '.join(sorted(TRANSPORTS))}")
        return replace(self, **TRANSPORTS[name], transport_seed=seed)  # type: ignore[arg-type]

    @property
    def prefetch_rule(self) -> PrefetchRule:
        return PrefetchRule(
            self.prefetch, self.prefetch_min_blocks, self.prefetch_margin_s, self.prefetch_min_deadline_s
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


# Transport models for `RouterSettings.with_transport`. "local-http" is what
# bench/transport_probe.py measured on this project's own stack (replay client → gateway
# → sim-cluster, one 2-core host, 300 Mooncake requests, 4 workers; the mean of a
# round_robin and a least_loaded probe): the requests of one burst reach the workers
# ~2.3 ms apart in issue order; bodies over 24k tokens fall behind by ~0.7 us per token
# beyond that, nearly all of it on the gateway → worker leg (round_robin's assignments
# show the gateway routes them only a few places late); a uniform 0-6.5 ms jitter puts
# as many same-burst pairs out of order as measured (5 and 8 ms fit 9% and 14%); whole
# bursts start unevenly late (22 and 35 ms wide); ~7 ms fixed remains of the client's
# TTFT over the worker's own (39 ms at the median).
TRANSPORTS: dict[str, dict[str, float | int]] = {
    "none": dict(intake_s=0.0, route_delay_s=0.0, route_delay_s_per_token=0.0, delay_free_tokens=0,
                 route_jitter_s=0.0, burst_jitter_s=0.0, send_delay_s=0.0, send_delay_s_per_token=0.0),
    "local-http": dict(intake_s=0.0023, route_delay_s=0.0, route_delay_s_per_token=3.5e-8,
                       delay_free_tokens=24_000, route_jitter_s=0.0065, burst_jitter_s=0.028,
                       send_delay_s=0.0072, send_delay_s_per_token=6.65e-7),
}


@dataclass(slots=True, eq=False)
class _Worker:
    engine: SimEngine
    fleet: FleetWorker

    @property
    def view(self) -> WorkerView:
        return self.fleet.view


@dataclass(slots=True)
class RouterCounters:
    events_batches: int = 0
    events_applied: int = 0
    polls: int = 0
    prefetches_sent: int = 0
    prefetch_blocks_sent: int = 0
    prefetches_refused: int = 0
    max_waiting_seen: int = 0  # the longest waiting queue any load report showed


class SimRouter:
    def __init__(
        self,
        policy: Policy,
        block_size: int,
        settings: RouterSettings,
        *,
        true_state: bool = False,
        max_workers: int = 512,
    ) -> None:
        self.policy = policy
        self.settings = settings
        self.true_state = true_state
        self.block_size = block_size
        self.index = PrefixIndex(block_size, max_workers=max_workers)
        self.workers: dict[str, _Worker] = {}
        self._lagged: deque[tuple[float, str, list[KVEvent]]] = deque()
        self.counters = RouterCounters()
        self._last_decision: Decision | None = None

    # ------------------------------------------------------------------ workers

    def events_sink(self, worker_id: str) -> Callable[[list[KVEvent]], None] | None:
        """The engine's `on_events` callback (None with the true state: it reads the truth)."""
        if self.true_state:
            return None
        lag = self.settings.event_lag_s

        def sink(events: list[KVEvent]) -> None:
            if not events:
                return
            if lag > 0:
                w = self.workers.get(worker_id)
                t = w.engine.now if w is not None else 0.0
                self._lagged.append((t + lag, worker_id, events))
            else:
                self._apply(worker_id, events)

        return sink

    def join(self, engine: SimEngine, now: float) -> None:
        """Register a worker as the gateway does from /info, then take a first report."""
        info = engine.info()
        wid = engine.worker_id
        cost = CostParams(
            block_size=self.block_size,
            block_bytes=engine.block_bytes * self.block_size // engine.bs,
            prefill_tokens_per_s=engine.profile.compute.prefill_tokens_per_s,
        )
        caps = set(info.capabilities)
        view = WorkerView(
            wid,
            cost,
            supports_prefetch="prefetch" in caps,
            supports_peer_pull="peer_pull" in caps,
            gpu_block_tokens=info.block_size,
            role=engine.role,
        )
        self.workers[wid] = _Worker(engine, FleetWorker(view, ledger=InflightLedger(wid)))
        if not self.true_state:
            self.index.add_worker(
                wid, bytes.fromhex(info.namespace_digest), info.block_size, remote_group=info.remote_group
            )
        self.poll(wid, now)

    def leave(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        if not self.true_state and self.index.has_worker(worker_id):
            self.index.remove_worker(worker_id)

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        if not self.true_state and self.index.has_worker(worker_id):
            self.index.set_draining(worker_id, draining)

    # ------------------------------------------------------------------ reports, events

    def poll(self, worker_id: str, now: float) -> None:
        w = self.workers.get(worker_id)
        if w is None:
            return
        w.engine.advance(now)
        # a poll is instantaneous: it knows everything the worker has accepted
        w.fleet.on_report(w.engine.load_report(now), now, now)
        if w.view.waiting_requests > self.counters.max_waiting_seen:
            self.counters.max_waiting_seen = w.view.waiting_requests
        self.counters.polls += 1

    def _apply(self, worker_id: str, events: list[KVEvent]) -> None:
        if self.index.has_worker(worker_id):
            st = self.index.apply(worker_id, events)
            self.counters.events_batches += 1
            self.counters.events_applied += st.stored + st.removed + st.cleared

    def deliver(self, now: float) -> None:
        """Apply lagged events that have arrived by `now`."""
        q = self._lagged
        while q and q[0][0] <= now:
            _, wid, events = q.popleft()
            self._apply(wid, events)

    # ------------------------------------------------------------------ routing

    def _true_views(self, keys: list[bytes], now: float) -> tuple[list[WorkerView], dict[str, PrefixMatch]]:
        views: list[WorkerView] = []
        matches: dict[str, PrefixMatch] = {}
        for wid, w in self.workers.items():
            eng = w.engine
            eng.advance(now)
            apply_report(w.view, eng.load_report(now))
            v = w.view
            w.fleet.ledger.fill(v, now)  # its inflight_loads; the counts are the truth's, below
            v.report_age_s = 0.0
            v.inflight_requests = 0
            v.inflight_prefill_tokens = 0
            v.inflight_since_report_requests = 0
            v.inflight_since_report_prefill_tokens = 0
            views.append(v)
            tiers = eng.match_tiers(keys) if keys else []
            runs: list[tuple[Tier, int]] = []
            n = 0
            for t in tiers:
                if t is None:
                    break
                n += 1
                if runs and runs[-1][0] is t:
                    runs[-1] = (t, runs[-1][1] + 1)
                else:
                    runs.append((t, 1))
            if n:
                matches[wid] = PrefixMatch(wid, n, tuple(runs))
        return views, matches

    def route(
        self, prompt_tokens: int, max_tokens: int, keys: list[bytes], digests: Sequence[int], now: float, rid: str,
        candidates: Sequence[str] | None = None,
    ) -> tuple[Decision, RouteRequest]:
        if self.true_state:
            views, matches = self._true_views(keys, now)
        else:
            views, matches = self._reported_views(now), self.index.match(digests)
        if candidates is not None:
            allowed = set(candidates)
            views = [v for v in views if v.worker_id in allowed]
        rr = RouteRequest(prompt_tokens, digests, matches, max_tokens, now, rid)
        d = self.policy.choose(rr, views)
        self._last_decision = d
        return d, rr

    def _reported_views(self, now: float) -> list[WorkerView]:
        """The gateway's view of every worker now: events delivered, reports aged."""
        self.deliver(now)
        views = []
        for w in self.workers.values():
            w.fleet.refresh(now)
            views.append(w.view)
        return views

    def queue_estimates(self, now: float, candidates: Sequence[str] | None = None) -> list[float]:
        """Each routable worker's predicted queue now, as the policy would see it (the
        gateway queue's late-binding test)."""
        views = self._true_views([], now)[0] if self.true_state else self._reported_views(now)
        allowed = set(candidates) if candidates is not None else None
        return [queue_seconds(v, exact=self.true_state) for v in views
                if allowed is None or v.worker_id in allowed]

    def estimate_for(self, d: Decision, worker_id: str) -> Estimate | None:
        for e in d.estimates:
            if e.worker_id == worker_id:
                return e
        return None

    def send_prefetch(
        self, d: Decision, rr: RouteRequest, keys: list[bytes], worker_id: str, est: Estimate | None, now: float,
        pid: str,
    ) -> int:
        """The gateway's prefetch step; returns blocks asked for (0 = none sent)."""
        w = self.workers[worker_id]
        plan = plan_prefetch(d, len(keys), rr.matches.get(worker_id), est, self.settings.prefetch_rule,
                             w.view.supports_prefetch)
        if plan is None:
            return 0
        source = None
        if plan.peer:
            peer = self.workers.get(plan.peer)
            source = peer.engine if peer is not None else None
        try:
            w.engine.prefetch(keys[plan.start:plan.end], now, now + plan.deadline_s, pid, source)
        except (PrefetchQueueFull, BadRequest):  # a 429/400 to the gateway: counted, the request goes on
            self.counters.prefetches_refused += 1
            return 0
        self.counters.prefetches_sent += 1
        self.counters.prefetch_blocks_sent += plan.blocks
        return plan.blocks

    # ------------------------------------------------------------------ accounting

    def dispatched(
        self, worker_id: str, prefill_tokens: int, kv_tokens: int, now: float, est: Estimate | None = None
    ) -> Inflight:
        """Count a dispatch. `est`: the chosen worker's estimate (default: from the last
        decision routed, which is the one being dispatched in the simulator)."""
        w = self.workers[worker_id]
        if est is None and self._last_decision is not None:
            est = self.estimate_for(self._last_decision, worker_id)
        return w.fleet.dispatched(now, prefill_tokens, kv_tokens, est)

    def accepted(self, r: Inflight, now: float) -> None:
        """The request reached its worker (after `send_delay`): reports from now on hold it."""
        w = self.workers.get(r.worker_id)
        if w is not None:
            w.fleet.accepted(r, now)

    def first_token(self, r: Inflight) -> None:
        w = self.workers.get(r.worker_id)
        if w is None:  # it left: nothing to count any more
            r.prefilled = True
            return
        w.fleet.first_token(r)

    def finished(self, r: Inflight) -> None:
        w = self.workers.get(r.worker_id)
        if w is None:
            r.prefilled = r.done = True
            return
        w.fleet.finished(r)

    def observe(self, worker_id: str, predicted: float | None, measured: float, kv: dict[str, Any] | None) -> None:
        self.policy.observe(worker_id, predicted, measured, kv)
