"""`kv_cost`: route to the lowest estimated time to first token (docs/design.md §5).

Workers at their cap are out; a bounded-load guard keeps a hot prefix from piling
onto one worker while estimates are stale; the argmin of `T_ttft + interference`
(delays to requests still loading; with a non-zero COSCHEDULE_WEIGHT, to requests
waiting for the step this one would share) wins, near-ties going to the less loaded
worker; with `max_ttft_s` set, a request no worker can serve in time is shed.
Workers are evaluated in the order of a cheap lower bound and pruning stops when none
left could win, tie or be the retry target, so a decision over 64 workers stays well
under a millisecond and equals the full evaluation. Six settings; every other number
is a constant of kv_cost_tuning.py. Reasons (fixed labels): min_ttft, tie_less_load,
saturation_prefix, slo_over_balance, shed_slo, shed_capped, no_workers, speeds_unknown
(a worker not yet measured: cache affinity and load decide). Details: docs/planner.md.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvindex.tiers import Tier

from .base import PolicyBase, check_bool, check_number, clamp_retry
from .cache_aware import CacheAwarePolicy
from .cost import INF, RequestContext, estimate_worker, ttft_lower_bound
from .kv_cost_tuning import DEFAULT, KVCostTuning
from .load import at_cap, outstanding_requests
from .terms.coschedule import coschedule_load_s, coschedule_seconds, may_coschedule
from .terms.decode_ride import running_decodes
from .terms.interference import interference_delays
from .terms.memory import memory_seconds
from .terms.saturation import sticky_pick
from .types import Decision, Estimate, RouteRequest, WorkerView, by_score

LinkScales = dict[Tier, float]


@dataclass(slots=True)
class _Row:
    """An open worker before its full estimate: the cheap bound orders the evaluation."""

    bound: float
    view: WorkerView
    load: int
    prefill_scale: float
    link_scales: LinkScales | None
    offset_s: float = 0.0  # the calibrated TTFT offset (Calibrator.offset)


@dataclass(slots=True)
class _Split:
    """The bounded-load guard's verdict: `pool` may win, `held` only serve under the SLO."""

    pool: list[_Row]
    held: list[_Row]
    limit: float


class KVCostPolicy(PolicyBase):
    name = "kv_cost"
    # Trust the report's est_queue_s as exact (no ageing, no in-flight guesses).
    exact_queue: ClassVar[bool] = False

    def __init__(
        self,
        *,
        max_ttft_s: float | None = None,
        balance_eps: float | None = 1.0,
        prefetch: bool = True,
        peer_pull: bool = True,
        saturation: bool = True,
        calibrate: bool = True,
        _tuning: KVCostTuning = DEFAULT,
    ) -> None:
        """The six settings of docs/planner.md ("Settings"); `_tuning` holds the fixed
        constants and is for tests and ablations only (the registry never lists it)."""
        t = _tuning
        if not isinstance(t, KVCostTuning):
            raise ValueError(f"_tuning must be a KVCostTuning, got {t!r}")
        super().__init__(calibrate=calibrate, prefill_quantile=t.prefill_quantile, ttft_offset=t.ttft_offset)
        self.tuning = t
        self.max_ttft_s = None if max_ttft_s is None else check_number("max_ttft_s", max_ttft_s, lo=0.0, lo_open=True)
        self.balance_eps = None if balance_eps is None else check_number("balance_eps", balance_eps, lo=0.0)
        self.prefetch = check_bool("prefetch", prefetch)
        self.peer_pull = check_bool("peer_pull", peer_pull)
        # The two saturation rules (docs/planner.md, "Saturation"): stickiness to the
        # worker holding the prompt, and the GPU-memory term; `saturation` false: neither.
        self.saturation = check_bool("saturation", saturation)
        self.saturation_band = t.saturation_band if self.saturation else None
        self.memory_weight = t.memory_weight if self.saturation else 0.0
        # What fleet.revision_knobs reads: how late a newcomer may start and share a step.
        self.coschedule_slack_s = t.coschedule_slack_s
        # Every worker evaluated, none pruned: set on its own copy by explain (explain.py).
        self.all_estimates = False
        self._affinity = CacheAwarePolicy(calibrate=False)

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        if not workers:
            return self._shed_capped(workers)
        if not all(w.speeds_known for w in workers):
            return self._by_affinity(req, workers)
        ctx = RequestContext.build(req, workers)
        rows, closed = self._rows(ctx, workers)
        self._bound_last()
        if not rows:
            d = self._shed_capped(workers)
            d.estimates = closed
            return d
        split = self._balance(rows)
        # Saturated: no open worker could give the first token within SATURATION_QUEUE_S
        # (the pool is in bound order; held workers serve only under the SLO).
        band = self.saturation_band if self.saturation_band is not None \
            and split.pool[0].bound >= self.tuning.saturation_queue_s else None
        pool, n_eval = self._evaluate_pool(ctx, split.pool, band)
        best = self._best(pool)
        held = self._evaluate_held(ctx, split, best)
        estimates = pool + held + closed
        if self.all_estimates:
            order = {w.worker_id: i for i, w in enumerate(workers)}
            estimates.sort(key=lambda e: order[e.worker_id])
        slo = self.max_ttft_s
        if slo is not None and best.t_ttft > slo:
            fits = [e for e in held if e.t_ttft <= slo]
            if not fits:
                return Decision(None, self.name, "shed_slo", predicted_ttft=best.t_ttft, estimates=estimates,
                                retry_after_s=clamp_retry(best.t_ttft - slo))
            chosen, reason = min(fits, key=by_score), "slo_over_balance"
        else:
            chosen = self._tie_break(pool, best)
            reason = "min_ttft" if chosen is best else "tie_less_load"
            sticky = self._sticky(pool, best, chosen, band) if band is not None else None
            if sticky is not None and sticky is not chosen:
                chosen, reason = sticky, "saturation_prefix"
        return self._decision(chosen, reason, estimates, self._ranked(chosen, pool, split, n_eval, held))

    def _by_affinity(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        """Some worker's speeds are still the router's defaults (not yet measured): a time
        estimate for it would be a guess, so cache affinity and load decide until it is."""
        d = self._affinity.choose(req, workers)
        d.policy, d.reason = self.name, "speeds_unknown"
        return d

    # ------------------------------------------------------------------ steps

    def _estimate(self, ctx: RequestContext, r: _Row) -> Estimate:
        """The full estimate, scored with the interference this request would cause."""
        w = r.view
        e = estimate_worker(ctx, w, self.prefetch, self.peer_pull, self.exact_queue, r.prefill_scale, r.link_scales)
        e.load = r.load
        if e.eligible and r.offset_s > 0.0:
            e.t_ttft += r.offset_s
        e.score = e.t_ttft
        if not e.eligible:
            return e
        if self.memory_weight > 0.0:
            t = memory_seconds(ctx, w, e.matched_blocks.get(Tier.GPU, 0), self.tuning.memory_bound)
            e.t_memory = t
            e.score += self.memory_weight * t
        overlap = self.prefetch and w.supports_prefetch
        loads = w.inflight_loads
        if loads and self.tuning.interference_weight > 0.0:
            t = sum(interference_delays(loads, e.t_queue, e.t_load_total, e.t_prefill, overlap,
                                        self.tuning.interference_slack_s))
            e.t_interference = t
            e.score += self.tuning.interference_weight * t
        starts = w.inflight_starts
        if starts and self.tuning.coschedule_weight > 0.0 and may_coschedule(e, overlap):
            t = coschedule_seconds(starts, w.cost, e.t_queue, e.recompute_tokens, e.load_blocks * w.cost.block_size,
                                   running_decodes(w), self.coschedule_slack_s, r.prefill_scale,
                                   coschedule_load_s(e, overlap))
            e.t_coschedule = t
            e.t_interference += t
            e.score += self.tuning.coschedule_weight * t
        return e

    def _rows(self, ctx: RequestContext, workers: Sequence[WorkerView]) -> tuple[list[_Row], list[Estimate]]:
        """Open workers with their bounds; the closed ones (at their cap, unusable costs)
        estimated only when every estimate is wanted."""
        coef = self.calibrator.factors if self.calibrate and self.calibrator.active else None
        rows: list[_Row] = []
        closed: list[Estimate] = []
        for w in workers:
            ps, ls = coef(w.worker_id) if coef else (1.0, None)
            self._last_cost[w.worker_id] = (w.cost, running_decodes(w))
            self.calibrator.set_fitted(w.worker_id, w.speeds_fitted)
            r = _Row(0.0, w, outstanding_requests(w), ps, ls,
                     self.calibrator.offset(w.worker_id) if coef else 0.0)
            r.bound = ttft_lower_bound(ctx, w, self.prefetch, self.peer_pull, self.exact_queue, ps)
            if r.bound != INF and not (w.max_waiting is not None and at_cap(w)):
                rows.append(r)
            elif self.all_estimates:
                closed.append(self._closed_estimate(ctx, r))
        return rows, closed

    def _closed_estimate(self, ctx: RequestContext, r: _Row) -> Estimate:
        e = self._estimate(ctx, r)
        if e.eligible:
            e.eligible = False
            e.note = f"at max_waiting={r.view.max_waiting}" + (f"; {e.note}" if e.note else "")
        return e

    def _balance(self, rows: list[_Row]) -> _Split:
        """Bounded load (module doc, step 2); the pool is never empty."""
        if self.balance_eps is None or len(rows) < 2:
            split = _Split(rows, [], INF)
        else:
            total = sum(r.load for r in rows) + 1
            limit = math.ceil((1.0 + self.balance_eps) * total / len(rows)) + self.tuning.balance_slack
            split = _Split([r for r in rows if r.load + 1 <= limit], [r for r in rows if r.load + 1 > limit], limit)
            if not split.pool:  # cannot happen with integer loads (see the module doc)
                split = _Split(split.held, [], limit)
        split.pool.sort(key=lambda r: r.bound)
        split.held.sort(key=lambda r: r.bound)
        return split

    def _evaluate_pool(self, ctx: RequestContext, rows: list[_Row], band: float | None = None
                       ) -> tuple[list[Estimate], int]:
        """Full estimates in bound order, as far as a worker could still win, tie, be the
        retry target, meet the SLO or fall in the saturation `band` (the pruning of the
        module doc)."""
        margin, tie_abs = 1.0 + self.tuning.tie_margin, self.tuning.tie_abs_s
        if band is not None:
            margin, tie_abs = max(margin, 1.0 + band), max(tie_abs, self.tuning.saturation_abs_s)
        slo = self.max_ttft_s
        # With an SLO, a worker whose own TTFT meets it must be found even when a
        # better-scored one (interference) misses it: keep evaluating while none meets it.
        slo_open = slo if slo is not None else -INF
        pool: list[Estimate] = []
        best_t = second_t = INF
        for r in rows:
            if not self.all_estimates and r.bound > best_t * margin + tie_abs and r.bound >= second_t \
                    and r.bound > slo_open:
                break
            e = self._estimate(ctx, r)
            pool.append(e)
            t = by_score(e)
            if t < best_t:
                best_t, second_t = t, best_t
            elif t < second_t:
                second_t = t
            if slo is not None and e.t_ttft <= slo:
                slo_open = -INF
        return pool, len(pool)

    def _best(self, pool: list[Estimate]) -> Estimate:
        """The best score; with an SLO, the best score among those meeting it, if any."""
        best = min(pool, key=by_score)
        slo = self.max_ttft_s
        if slo is not None and best.t_ttft > slo:
            meets = [e for e in pool if e.t_ttft <= slo]
            if meets:
                best = min(meets, key=by_score)
        return best

    def _evaluate_held(self, ctx: RequestContext, split: _Split, best: Estimate) -> list[Estimate]:
        """Held workers, evaluated when they may serve under the SLO or be the retry target
        (a pool of one): again in bound order, as far as they can matter."""
        slo = self.max_ttft_s
        slo_reach = slo if slo is not None and best.t_ttft > slo else -INF
        best_held = INF if len(split.pool) == 1 else -INF
        held: list[Estimate] = []
        for r in split.held:
            if not self.all_estimates and r.bound > slo_reach and r.bound >= best_held:
                break
            e = self._estimate(ctx, r)
            e.eligible = False
            e.note = f"bounded load: {r.load:g} outstanding > {split.limit - 1:.3g}" + (f"; {e.note}" if e.note else "")
            held.append(e)
            best_held = min(best_held, by_score(e))
        return held

    def _sticky(self, pool: list[Estimate], best: Estimate, chosen: Estimate, band: float) -> Estimate | None:
        """In saturation, the worker within the band that holds the most of the prompt
        (terms/saturation.py); None when none holds more than the best and the tie-break's
        pick. A follow-up then stays where its conversation's KV already sits in GPU memory
        (shared with the turn still decoding there) instead of taking fresh blocks elsewhere
        on a queue estimate that is seconds off anyway (docs/planner.md, "Saturation")."""
        t = self.tuning
        return sticky_pick(pool, best, chosen, band, t.saturation_abs_s, self.max_ttft_s, t.saturation_local_tiers)

    def _tie_break(self, pool: list[Estimate], best: Estimate) -> Estimate:
        """Within the tie window of the best score: fewest outstanding, then shortest queue."""
        slo = self.max_ttft_s
        bound = by_score(best) * (1.0 + self.tuning.tie_margin) + self.tuning.tie_abs_s
        chosen = best
        for e in pool:
            if slo is not None and e.t_ttft > slo:
                continue
            if by_score(e) <= bound and (e.load, e.t_queue, by_score(e)) < (
                chosen.load, chosen.t_queue, by_score(chosen)
            ):
                chosen = e
        return chosen

    @staticmethod
    def _ranked(chosen: Estimate, pool: list[Estimate], split: _Split, n_eval: int, held: list[Estimate]) -> list[str]:
        """Fallback order for retries: evaluated pool by score, the unevaluated pool in
        bound order, then the held workers likewise."""
        pool = sorted(pool, key=by_score)
        held = sorted(held, key=by_score)
        ranked = [chosen.worker_id]
        ranked += [e.worker_id for e in pool if e is not chosen]
        ranked += [r.view.worker_id for r in split.pool[n_eval:]]
        seen_held = {e.worker_id for e in held}
        ranked += [e.worker_id for e in held if e is not chosen]
        ranked += [r.view.worker_id for r in split.held if r.view.worker_id not in seen_held]
        return ranked

    def _decision(self, chosen: Estimate, reason: str, estimates: list[Estimate], ranked: list[str]) -> Decision:
        """The pick, asking it to raise [0, k) toward GPU when some of that sits below."""
        below = sum(chosen.prefetch_blocks.values())
        src = chosen.peer_source if Tier.PEER in chosen.prefetch_blocks else None
        pf = chosen.load_blocks if below and (below >= self.tuning.min_prefetch_blocks or src) else 0
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
