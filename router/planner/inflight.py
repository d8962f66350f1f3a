"""The router's own in-flight accounting for one worker, shared by gateway and simulator.

Load reports lag, so the router counts what it dispatched itself: requests, their
prefill tokens until the first token, their KV tokens, the same restricted to what
was dispatched after the last report, the requests whose KV is predicted to be
still loading (for the interference term) and those predicted not to have started
their prefill yet (for the co-scheduling term). Pure bookkeeping: callers pass `now`, so
the gateway (monotonic time) and the simulator (simulated time) share one
definition. Details: docs/planner.md.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .types import Estimate, WorkerView

# How long past its predicted landing a load stays in `inflight_loads` without a first
# token (the policies' slack decides what counts; this only bounds the list).
LOADS_KEPT_S = 1.0
# A request predicted to start its prefill more than this long ago has started (its step
# is running): a newcomer can no longer share it.
STARTS_KEPT_S = 0.02


@dataclass(slots=True, eq=False)
class Ticket:
    """One dispatched request, as its worker's ledger counts it."""

    worker_id: str
    prefill_tokens: int
    kv_tokens: int
    t_dispatch: float
    since_report: bool = True  # not known to the last report
    accepted_at: float | None = None  # when the worker was seen to hold it (its 200 came back)
    prefilled: bool = False
    done: bool = False
    ready_at: float | None = None  # predicted prefill start, when it loads KV from below GPU
    prefill_s: float = 0.0  # its predicted prefill seconds
    start_at: float | None = None  # predicted prefill start, when it loads nothing
    # What later dispatches to the worker add to its predicted TTFT (FleetWorker.revise_ahead)
    revised_s: float = 0.0
    # Nothing else was waiting for its first token on the worker when this was sent: its
    # TTFT measures the worker's own speed (speedfit.py); `running`: those decoding then.
    clean: bool = False
    running: int = 0
    queue_s: float = 0.0  # the model's queue for it at dispatch, before the worker's queue_scale
    # Ends the request's upstream connection (set by the gateway's relay; the worker died)
    abort: Callable[[], None] | None = None


@dataclass(slots=True, eq=False)
class InflightLedger:
    """One worker's in-flight requests and the counts a `WorkerView` shows of them.

    `since_requests`/`since_prefill_tokens` and `kv_tokens` stay None (unknown to the
    planner, which then falls back) until the first dispatch or report sets them."""

    worker_id: str = ""  # stamped on its tickets
    live: set[Ticket] = field(default_factory=set)
    requests: int = 0
    prefill_tokens: int = 0
    since_requests: int | None = None
    since_prefill_tokens: int | None = None
    kv_tokens: int | None = None
    loading: list[Ticket] = field(default_factory=list)  # with ready_at, maybe prefilled since
    starting: list[Ticket] = field(default_factory=list)  # with start_at, maybe started since
    # Gateway replicas sending to this worker through one balancer: each sees only its own
    # dispatches until the next report, so it counts them this many times (docs/replicas.md).
    replicas: int = 1

    def dispatched(
        self, now: float, prefill_tokens: int, kv_tokens: int, est: Estimate | None = None, *, busy: bool = True
    ) -> Ticket:
        """Count a dispatch; `est` is the chosen worker's Estimate (None: no load known).
        `busy`: the worker is running a step (or has a queue), so the request waits for a
        step boundary that later requests may share (False: it starts at once, alone)."""
        r = Ticket(self.worker_id, prefill_tokens, kv_tokens, now)
        self.live.add(r)
        if est is not None and est.eligible and est.t_load_total > 0.0:
            r.ready_at = now + est.t_queue + est.t_load
            r.prefill_s = est.t_prefill
            self.loading.append(r)
        elif est is not None and est.eligible and busy:
            r.start_at = now + est.t_queue
            self.starting.append(r)
        self.requests += 1
        self.prefill_tokens += prefill_tokens
        self.since_requests = (self.since_requests or 0) + 1
        self.since_prefill_tokens = (self.since_prefill_tokens or 0) + prefill_tokens
        self.kv_tokens = (self.kv_tokens or 0) + kv_tokens
        return r

    def not_started(self, now: float) -> list[Ticket]:
        """Tickets predicted not to have started their prefill at `now` (as `inflight_starts`)."""
        return [r for r in self.starting
                if not r.prefilled and r.start_at is not None and r.start_at + STARTS_KEPT_S > now]

    def still_loading(self, now: float) -> list[Ticket]:
        """Tickets predicted still loading their KV at `now` (as `inflight_loads`)."""
        return [r for r in self.loading
                if not r.prefilled and r.ready_at is not None and r.ready_at + LOADS_KEPT_S > now]

    def accepted(self, r: Ticket, now: float) -> None:
        """The worker answered 200 for it: any report asked for from now on includes it."""
        if r.accepted_at is None:
            r.accepted_at = now

    def first_token(self, r: Ticket, now: float | None = None) -> None:
        """Its prefill is done: its prefill tokens (and its load) leave the counts."""
        if r.prefilled or r.done:
            return
        if r.accepted_at is None and now is not None:
            r.accepted_at = now
        r.prefilled = True
        self.prefill_tokens -= r.prefill_tokens
        if r.since_report and self.since_prefill_tokens:
            self.since_prefill_tokens -= r.prefill_tokens

    def finished(self, r: Ticket) -> None:
        """Done (or failed): whatever it still counts for leaves. Idempotent."""
        if r.done:
            return
        self.first_token(r)
        r.done = True
        self.live.discard(r)
        self.requests -= 1
        if r.since_report and self.since_requests:
            self.since_requests -= 1
        if self.kv_tokens:
            self.kv_tokens -= r.kv_tokens

    def report_taken(self, sent_at: float | None = None) -> None:
        """A load report was just taken. It surely knows the requests the worker had
        accepted before the report was asked for (`sent_at`; None: all in flight, as for
        an instantaneous poll). One merely dispatched before `sent_at` may still be on
        the wire, or unread by the worker, when it answers: counting it as known would
        drop it from both the report and the router's own count, and send the next
        burst to that worker. So the rest stay `since_report` and are re-counted (at
        worst counted twice until the next report)."""
        n = 0
        toks = 0
        for r in self.live:
            r.since_report = sent_at is not None and (r.accepted_at is None or r.accepted_at > sent_at)
            if r.since_report:
                n += 1
                if not r.prefilled:
                    toks += r.prefill_tokens
        self.since_requests = n
        self.since_prefill_tokens = toks

    def fill_counts(self, v: WorkerView) -> None:
        """Write the counts into the view (not `inflight_loads`: that needs the time)."""
        v.inflight_requests = self.requests
        v.inflight_prefill_tokens = self.prefill_tokens
        if self.since_requests is not None:
            k = self.replicas
            v.inflight_since_report_requests = self.since_requests * k
            v.inflight_since_report_prefill_tokens = (
                None if self.since_prefill_tokens is None else self.since_prefill_tokens * k)
        if self.kv_tokens is not None:
            v.active_kv_tokens = self.kv_tokens

    def fill(self, v: WorkerView, now: float) -> None:
        """Everything the view takes from the ledger at decision time `now`, including
        `inflight_loads` (loads predicted not landed yet; older ones are dropped)."""
        self.fill_counts(v)
        if self.starting or v.inflight_starts:
            keep_s = self.starting = self.not_started(now)
            v.inflight_starts = tuple((r.start_at - now, r.prefill_tokens) for r in keep_s)  # type: ignore[operator]
        if not self.loading:
            if v.inflight_loads:
                v.inflight_loads = ()
            return
        keep = self.loading = self.still_loading(now)
        v.inflight_loads = tuple((r.ready_at - now, r.prefill_s) for r in keep)  # type: ignore[operator]
