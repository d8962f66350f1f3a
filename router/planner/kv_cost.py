"""`kv_cost`: route to the lowest estimated time to first token (DESIGN.md §5).

Per worker the cost model (router/planner/cost.py) gives T_queue, the cut between
loading and recomputing, T_load per tier with prefetch overlap, and T_prefill. Then:

1. Workers at their `max_waiting` cap (or with unusable cost params) are out.
2. Bounded load against herding: a worker with outstanding requests `L` is
   ineligible when `L + 1 > ceil((1 + balance_eps) * (total + 1) / n) + balance_slack`
   (total over the n open workers; Mirrokni et al.'s bounded loads, plus slack). It
   never excludes all: the least loaded has `L <= floor(total / n)`, and
   `floor(total / n) + 1 <= ceil((total + 1) / n)`. Estimates can be wrong (stale reports, other routers); this caps how far a
   hot prefix can pile onto one worker meanwhile.
3. The argmin of the score `T_ttft + interference_weight * T_interference`, where
   T_interference is the delay this request's prefill would add to requests already
   loading their KV on that worker (cost.py's module doc: the engine lets a newcomer's
   prefill run ahead of a request whose load has not landed). Without it, a long
   prompt lands on a worker whose long remote load is in flight, and that request
   then waits for the whole new prefill (the Mooncake p99 tail). Among workers within
   `tie_margin` (relative) + `tie_abs_s` of the best score, the one with the fewest
   outstanding requests, then the shortest queue. `predicted_ttft` stays T_ttft.
4. Shedding: with `max_ttft_s` set, when no open worker's predicted TTFT meets it the
   request is shed (worker_id None, reason "shed_slo", `retry_after_s` ≈ how much
   too slow the best worker is); a worker excluded only by the bounded-load guard
   that does meet it is taken instead ("slo_over_balance").

Reasons (fixed labels): min_ttft, tie_less_load, slo_over_balance, shed_slo,
shed_capped (no open worker), no_workers. The chosen worker is asked to prefetch
blocks [0, k) when some of them sit below GPU (via `prefetch_from_peer` for PEER).

Pruning (why a decision over 64 workers stays well under a millisecond): every worker
first gets a cheap lower bound on its TTFT (`cost.ttft_lower_bound`: queue + prefill
after the most blocks it could reuse). Full estimates are computed in bound order and
stop once the next bound exceeds both the tie window of the best so far and the
second best (scores are >= T_ttft >= the bound, so the interference term keeps
pruning exact): no worker left unevaluated could win, tie, or be the retry target, so
the decision is exactly the one full evaluation gives (a test checks this). Hence,
by default `Decision.estimates` lists the evaluated contenders only and `ranked` is
exact for them, the rest following in bound order; `all_estimates=True` (what
`explain` uses) evaluates every worker.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from kvindex.tiers import Tier

from .base import PolicyBase, check_bool, check_int, check_number, clamp_retry
from .cost import INF, RequestContext, estimate_worker, interference_seconds, ttft_lower_bound
from .load import at_cap, outstanding_requests
from .types import Decision, Estimate, RouteRequest, WorkerView


def _by_ttft(e: Estimate) -> float:
    return e.t_ttft


def _by_score(e: Estimate) -> float:
    s = e.score
    return e.t_ttft if s is None else s


class KVCostPolicy(PolicyBase):
    name = "kv_cost"
    # Trust the report's est_queue_s as exact (no ageing, no in-flight guesses).
    exact_queue: ClassVar[bool] = False

    def __init__(
        self,
        *,
        max_ttft_s: float | None = None,
        tie_margin: float = 0.03,
        tie_abs_s: float = 0.001,
        balance_eps: float | None = 1.0,
        balance_slack: float = 2.0,
        prefetch: bool = True,
        peer_pull: bool = True,
        min_prefetch_blocks: int = 1,
        all_estimates: bool = False,
        calibrate: bool = True,
        interference_weight: float = 1.0,
        interference_slack_s: float = 0.05,
    ) -> None:
        super().__init__(calibrate=calibrate)
        self.interference_weight = check_number("interference_weight", interference_weight, lo=0.0, hi=100.0)
        self.interference_slack_s = check_number("interference_slack_s", interference_slack_s, lo=0.0, hi=10.0)
        self.max_ttft_s = None if max_ttft_s is None else check_number("max_ttft_s", max_ttft_s, lo=0.0, lo_open=True)
        self.tie_margin = check_number("tie_margin", tie_margin, lo=0.0, hi=1.0)
        self.tie_abs_s = check_number("tie_abs_s", tie_abs_s, lo=0.0, hi=10.0)
        self.balance_eps = None if balance_eps is None else check_number("balance_eps", balance_eps, lo=0.0)
        self.balance_slack = check_number("balance_slack", balance_slack, lo=0.0)
        self.prefetch = check_bool("prefetch", prefetch)
        self.peer_pull = check_bool("peer_pull", peer_pull)
        self.min_prefetch_blocks = check_int("min_prefetch_blocks", min_prefetch_blocks, lo=1)
        self.all_estimates = check_bool("all_estimates", all_estimates)

    def _estimate(self, ctx: RequestContext, w: WorkerView, ps: float, ls, load: float) -> Estimate:
        e = estimate_worker(ctx, w, self.prefetch, self.peer_pull, self.exact_queue, ps, ls)
        e.load = load
        loads = w.inflight_loads
        if loads and self.interference_weight > 0.0 and e.eligible:
            overlap = self.prefetch and w.supports_prefetch
            t = interference_seconds(
                loads, e.t_queue, e.t_load_total, e.t_prefill, overlap, self.interference_slack_s
            )
            e.t_interference = t
            e.score = e.t_ttft + self.interference_weight * t
        else:
            e.score = e.t_ttft
        return e

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        if not workers:
            return self._shed_capped(workers)
        full = self.all_estimates
        ctx = RequestContext.build(req, workers)
        coef = self.calibrator.factors if self.calibrate and self.calibrator.active else None
        last = self._last_cost
        prefetch, peer, exact = self.prefetch, self.peer_pull, self.exact_queue
        # (bound, worker, load, prefill scale, link scales) of each open worker
        open_: list[tuple[float, WorkerView, int, float, object]] = []
        out: list[Estimate] = []  # estimates of closed workers (full mode only)
        for w in workers:
            ps, ls = coef(w.worker_id) if coef else (1.0, None)
            last[w.worker_id] = w.cost
            load = outstanding_requests(w)
            lb = ttft_lower_bound(ctx, w, prefetch, peer, exact, ps)
            if lb == INF or (w.max_waiting is not None and at_cap(w)):
                if full:
                    e = self._estimate(ctx, w, ps, ls, load)
                    if e.eligible:
                        e.eligible = False
                        e.note = f"at max_waiting={w.max_waiting}" + (f"; {e.note}" if e.note else "")
                    out.append(e)
                continue
            open_.append((lb, w, load, ps, ls))
        self._bound_last()
        if not open_:
            d = self._shed_capped(workers)
            d.estimates = out
            return d
        held_rows = []
        if self.balance_eps is not None and len(open_) > 1:
            total = sum(r[2] for r in open_) + 1
            limit = math.ceil((1.0 + self.balance_eps) * total / len(open_)) + self.balance_slack
            pool_rows = []
            for r in open_:
                (held_rows if r[2] + 1 > limit else pool_rows).append(r)
            if not pool_rows:  # cannot happen with integer loads (see the module doc)
                pool_rows, held_rows = held_rows, []
        else:
            limit = INF
            pool_rows = open_
        pool_rows.sort(key=lambda r: r[0])
        margin, tie_abs = 1.0 + self.tie_margin, self.tie_abs_s
        pool: list[Estimate] = []
        best_t = second_t = INF
        n_eval = 0
        slo = self.max_ttft_s
        # With an SLO, a worker whose own TTFT meets it must be found even when a
        # better-scored one (interference) misses it: keep evaluating while none meets it.
        slo_open = slo if slo is not None else -INF
        for r in pool_rows:
            if not full and r[0] > best_t * margin + tie_abs and r[0] >= second_t and r[0] > slo_open:
                break
            e = self._estimate(ctx, r[1], r[3], r[4], r[2])
            pool.append(e)
            n_eval += 1
            t = _by_score(e)
            if t < best_t:
                best_t, second_t = t, best_t
            elif t < second_t:
                second_t = t
            if slo is not None and e.t_ttft <= slo:
                slo_open = -INF
        best = min(pool, key=_by_score)
        if slo is not None and best.t_ttft > slo:
            meets = [e for e in pool if e.t_ttft <= slo]
            if meets:
                best = min(meets, key=_by_score)
        # Held workers are evaluated when they may serve under the SLO, or be the retry
        # target (a pool of one): again in bound order, as far as they can matter.
        held: list[Estimate] = []
        held_rows.sort(key=lambda r: r[0])
        slo_reach = slo if slo is not None and best.t_ttft > slo else -INF
        best_held = INF if len(pool_rows) == 1 else -INF
        for r in held_rows:
            if not full and r[0] > slo_reach and r[0] >= best_held:
                break
            e = self._estimate(ctx, r[1], r[3], r[4], r[2])
            e.eligible = False
            e.note = f"bounded load: {r[2]:g} outstanding > {limit - 1:.3g}" + (f"; {e.note}" if e.note else "")
            held.append(e)
            if _by_score(e) < best_held:
                best_held = _by_score(e)
        estimates = pool + held + out
        if full:
            order = {w.worker_id: i for i, w in enumerate(workers)}
            estimates.sort(key=lambda e: order[e.worker_id])
        reason = "min_ttft"
        if slo is not None and best.t_ttft > slo:
            fits = [e for e in held if e.t_ttft <= slo]
            if not fits:
                return Decision(
                    None,
                    self.name,
                    "shed_slo",
                    predicted_ttft=best.t_ttft,
                    estimates=estimates,
                    retry_after_s=clamp_retry(best.t_ttft - slo),
                )
            chosen = min(fits, key=_by_score)
            reason = "slo_over_balance"
        else:
            bound = _by_score(best) * margin + tie_abs
            chosen = best
            for e in pool:
                if slo is not None and e.t_ttft > slo:
                    continue
                if _by_score(e) <= bound and (e.load, e.t_queue, _by_score(e)) < (
                    chosen.load, chosen.t_queue, _by_score(chosen)
                ):
                    chosen = e
            if chosen is not best:
                reason = "tie_less_load"
        pool.sort(key=_by_score)
        held.sort(key=_by_score)
        ranked = [chosen.worker_id]
        ranked += [e.worker_id for e in pool if e is not chosen]
        ranked += [r[1].worker_id for r in pool_rows[n_eval:]]
        seen_held = {e.worker_id for e in held}
        ranked += [e.worker_id for e in held if e is not chosen]
        ranked += [r[1].worker_id for r in held_rows if r[1].worker_id not in seen_held]
        below = sum(chosen.prefetch_blocks.values())
        src = chosen.peer_source if Tier.PEER in chosen.prefetch_blocks else None
        pf = chosen.load_blocks if below and (below >= self.min_prefetch_blocks or src) else 0
        return Decision(
            chosen.worker_id,
            self.name,
            reason,
            predicted_ttft=chosen.t_ttft,
            estimates=estimates,
            prefetch_blocks=pf,
            prefetch_from_peer=src if pf else None,
            ranked=ranked,
            recompute_tokens=chosen.recompute_tokens,
        )
