"""The router's view of one worker, and the prefetch it sends with a request.

A worker's `WorkerView` joins its last `/load` report with the router's own in-flight
ledger; the prefetch plan says which blocks to raise before the request arrives. The
gateway (router/fleet/pool.py, router/gateway.py) and the offline simulator
(loadtest/router_model.py) both run exactly this code, so what the simulator measures
is what the gateway does. Pure: callers pass the clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvindex.index import PrefixMatch
from kvindex.tiers import Tier
from kvwire import LoadReport

from .inflight import InflightLedger, Ticket
from .speedfit import Sample, SpeedFit
from .terms.coschedule import COSCHEDULE_SLACK_S, coschedule_delay, coschedule_load_s, may_coschedule
from .terms.interference import interference_delays
from .types import Decision, Estimate, Link, WorkerView

TIER_BY_NAME: dict[str, Tier] = {t.name: t for t in Tier}
SPEED_FIELDS = ("prefill_tokens_per_s", "prefill_attn_s_per_token2", "prefill_overhead_s", "decode_step_s")


@dataclass(frozen=True, slots=True)
class Pins:
    """Cost coefficients an operator fixed in config: reports never override them (a
    number in config is a deliberate correction of what the worker measures)."""

    speeds: frozenset[str] = frozenset()
    tiers: frozenset[Tier] = frozenset()


NO_PINS = Pins()


def apply_report(v: WorkerView, rep: LoadReport, pins: Pins = NO_PINS) -> None:
    """Set the view's load fields from a report and fold its speeds and tier links into
    the view's `CostParams`, except what `pins` fixes."""
    v.waiting_requests = rep.waiting_requests
    v.waiting_prefill_tokens = rep.waiting_prefill_tokens
    v.running_requests = rep.running_requests
    v.running_prefill_tokens = rep.running_prefill_tokens
    v.est_queue_s = rep.est_queue_s
    gpu = rep.blocks.get("GPU")
    if gpu is not None:
        v.gpu_free_blocks = gpu.free
        v.gpu_capacity_blocks = gpu.total
    if rep.max_waiting is not None:
        v.max_waiting = rep.max_waiting
    _apply_speeds(v, rep, pins)
    _apply_links(v, rep, pins)


def _apply_speeds(v: WorkerView, rep: LoadReport, pins: Pins) -> None:
    s = rep.speeds
    if s is None:
        return
    c = v.cost
    # A zero throughput is "not measured yet", never a speed to divide by.
    if s.prefill_tokens_per_s and "prefill_tokens_per_s" not in pins.speeds:
        c.prefill_tokens_per_s = s.prefill_tokens_per_s
    if s.prefill_attn_s_per_token2 is not None and "prefill_attn_s_per_token2" not in pins.speeds:
        c.prefill_attn_s_per_token2 = s.prefill_attn_s_per_token2
    if s.prefill_overhead_s is not None and "prefill_overhead_s" not in pins.speeds:
        c.prefill_overhead_s = s.prefill_overhead_s
    if s.decode_step_s is not None and "decode_step_s" not in pins.speeds:
        c.decode_step_s = s.decode_step_s


def _apply_links(v: WorkerView, rep: LoadReport, pins: Pins) -> None:
    links = v.cost.links
    for name, link in rep.tiers.items():
        t = TIER_BY_NAME.get(name.upper())
        if t is None or t is Tier.GPU or link.read_Bps <= 0 or t in pins.tiers:
            continue
        cur = links.get(t)
        if cur is None:
            links[t] = Link(link.read_Bps, link.latency_s)
        else:
            cur.read_Bps = link.read_Bps
            cur.latency_s = link.latency_s


@dataclass(frozen=True, slots=True)
class RevisionKnobs:
    """The policy's settings a revision of predictions uses (`revision_knobs`)."""

    prefetch: bool = True  # the policy prefetches (a load then overlaps the queue)
    scale: float = 1.0  # the worker's calibrated prefill scale
    slack_s: float = COSCHEDULE_SLACK_S  # how late a newcomer may start and still share the step


def revision_knobs(policy: object, worker_id: str) -> RevisionKnobs:
    """What `FleetWorker.revise_ahead` takes from a policy, with the defaults for a policy
    without them (the baselines neither prefetch-plan nor calibrate)."""
    scales = getattr(policy, "scales", None)
    return RevisionKnobs(bool(getattr(policy, "prefetch", True)),
                         scales(worker_id)[0] if callable(scales) else 1.0,
                         float(getattr(policy, "coschedule_slack_s", COSCHEDULE_SLACK_S)))


@dataclass(slots=True, eq=False)
class FleetWorker:
    """One worker as the router knows it: the planner's view, the in-flight ledger and
    when the last report came. Every change to the view goes through here."""

    view: WorkerView
    pins: Pins = NO_PINS
    ledger: InflightLedger = field(default_factory=InflightLedger)
    load_t: float | None = None  # when the last report arrived (None: never)
    speed: SpeedFit | None = None  # fitted from clean samples (None: none yet)

    @property
    def worker_id(self) -> str:
        return self.view.worker_id

    def on_report(self, rep: LoadReport, now: float, sent_at: float | None = None) -> None:
        """A report arrived at `now`; it was asked for at `sent_at` (None: an instantaneous
        poll, which knows everything the worker accepted)."""
        pins = self.pins
        if self.view.speeds_fitted:  # measured speeds outrank what a report claims
            pins = Pins(pins.speeds | frozenset(SPEED_FIELDS), pins.tiers)
        apply_report(self.view, rep, pins)
        self.on_counts(now, sent_at)

    def on_counts(self, now: float, sent_at: float | None = None) -> None:
        """The view's load fields were just set from a report (a vLLM worker's metrics
        come this way): re-base the ledger's since-report counts on it."""
        self.load_t = now
        self.ledger.report_taken(sent_at)
        self.ledger.fill_counts(self.view)

    def refresh(self, now: float) -> None:
        """Before a decision at `now`: the report's age and the ledger's view."""
        self.view.report_age_s = now - self.load_t if self.load_t is not None else 0.0
        self.ledger.fill(self.view, now)

    def dispatched(self, now: float, prefill_tokens: int, kv_tokens: int, est: Estimate | None) -> Ticket:
        v = self.view
        # an idle worker starts a request at once, alone in its step: nothing can share it
        busy = v.running_requests > 0 or v.waiting_requests > 0 or v.inflight_requests > 0 or (
            est is not None and est.t_queue > 0.0)
        led = self.ledger
        waiting = sum(1 for r in led.live if not r.prefilled)
        t = led.dispatched(now, prefill_tokens, kv_tokens, est, busy=busy)
        t.clean = waiting == 0 and v.waiting_requests == 0
        t.running = len(led.live) - 1 - waiting
        if est is not None and est.eligible and v.cost.queue_scale > 0.0:
            t.queue_s = est.t_queue / v.cost.queue_scale
        led.fill_counts(self.view)
        return t

    def speed_sample(self, s: Sample) -> None:
        """A clean request's measured TTFT (speedfit.py); once the fit is trusted its
        speeds replace the view's, except what the operator pinned."""
        if self.speed is None:
            self.speed = SpeedFit(self.view.cost)
        sp = self.speed
        sp.add(s)
        if sp.trusted:
            sp.apply(self.view.cost, self.pins.speeds)
            self.view.speeds_fitted = True
            self.view.speeds_known = True

    def accepted(self, t: Ticket, now: float) -> None:
        self.ledger.accepted(t, now)

    def revise_ahead(self, est: Estimate | None, now: float, knobs: RevisionKnobs) -> list[tuple[Ticket, float]]:
        """The router is about to send a request with estimate `est` here: the requests it
        sent before that the newcomer will delay, each with its delay, which is added to
        its ticket's `revised_s` (docs/planner.md, "Predictions revised by what the router
        sends next"). Those not started whose (last) step it rides in get their first
        token one chunk later (terms/coschedule.py); those still loading their KV, which
        the engine passes over while they load, wait for its prefill where it overlaps
        their landing (terms/interference.py)."""
        if est is None or not est.eligible:
            return []
        v, led = self.view, self.ledger
        overlap = knobs.prefetch and v.supports_prefetch
        out: list[tuple[Ticket, float]] = []
        ahead = led.not_started(now) if may_coschedule(est, overlap) else []
        if ahead:
            starts = [(t.start_at - now, t.prefill_tokens) for t in ahead]  # type: ignore[operator]
            d = coschedule_delay(starts, v.cost, est.t_queue, est.recompute_tokens, est.load_blocks * v.cost.block_size,
                                 v.running_requests, knobs.slack_s, knobs.scale, coschedule_load_s(est, overlap))
            if d > 0.0:
                out += [(t, d) for t in ahead]
        loading = led.still_loading(now)
        if loading:
            loads = [(t.ready_at - now, t.prefill_s) for t in loading]  # type: ignore[operator]
            delays = interference_delays(loads, est.t_queue, est.t_load_total, est.t_prefill, overlap)
            out += [(t, d) for t, d in zip(loading, delays, strict=True) if d > 0.0]
        for t, d in out:
            t.revised_s += d
        return out

    def first_token(self, t: Ticket, now: float | None = None) -> None:
        self.ledger.first_token(t, now)
        self.ledger.fill_counts(self.view)

    def finished(self, t: Ticket) -> None:
        self.ledger.finished(t)
        self.ledger.fill_counts(self.view)


@dataclass(frozen=True, slots=True)
class PrefetchRule:
    """When a prefetch is worth sending, and its deadline (config `routing.prefetch`)."""

    enabled: bool = True
    min_blocks: int = 1
    margin_s: float = 0.05
    min_deadline_s: float = 0.2


@dataclass(frozen=True, slots=True)
class PrefetchPlan:
    """Raise the request's blocks `[start, end)` toward GPU within `deadline_s` (relative),
    from `peer` (a worker id) when set, else from the worker's own lower tiers."""

    start: int
    end: int
    deadline_s: float
    peer: str | None = None

    @property
    def blocks(self) -> int:
        return self.end - self.start


def plan_prefetch(
    d: Decision, n_blocks: int, match: PrefixMatch | None, est: Estimate | None, rule: PrefetchRule,
    supports_prefetch: bool,
) -> PrefetchPlan | None:
    """The prefetch to send with decision `d` to its worker, for a request of `n_blocks`
    full blocks, or None.

    The blocks up to the decision's cut, minus the leading run the worker already holds
    on GPU (nothing to raise there); the deadline covers the predicted queue wait plus a
    margin, so the blocks land before the request needs them and not long after."""
    end = min(d.prefetch_blocks, n_blocks)
    if not rule.enabled or not supports_prefetch or end < rule.min_blocks:
        return None
    start = 0
    if match is not None and match.runs and match.runs[0][0] is Tier.GPU:
        start = min(match.runs[0][1], end)
    if end - start < rule.min_blocks:
        return None
    queue_s = est.t_queue if est is not None else 0.0
    deadline = max(rule.min_deadline_s, queue_s + rule.margin_s)
    return PrefetchPlan(start, end, deadline, d.prefetch_from_peer)


def whole_engine_blocks(m: PrefixMatch, per_engine_block: int) -> PrefixMatch | None:
    """`m` rounded down to whole engine blocks of `per_engine_block` index blocks each: an
    engine whose blocks hold several index blocks cannot reuse part of one (vLLM's CPU
    backend keys 32-token blocks over a 16-token index). None when nothing whole is left."""
    if per_engine_block <= 1 or m.blocks % per_engine_block == 0:
        return m
    keep = m.blocks // per_engine_block * per_engine_block
    if keep == 0:
        return None
    runs: list[tuple[Tier, int]] = []
    left = keep
    for tier, n in m.runs:
        if left <= 0:
            break
        runs.append((tier, min(n, left)))
        left -= n
    return PrefixMatch(m.worker_id, keep, tuple(runs))
