"""Online calibration of the cost model from what workers report (usage.kv, docs/wire.md).

Profiles give each worker's speeds up front; reality differs (batching with decodes,
a slower disk, a congested network). Per worker the calibrator keeps a prefill time
multiplier (a clamped log-space EWMA with outlier rejection, or with `prefill_quantile`
set a low quantile of recent ratios: a reported prefill also holds the chunks of the
requests it shared steps with), per-tier load time multipliers (EWMAs), optionally a TTFT
offset (the median recent residual), plus predicted-vs-actual TTFT errors for the
metrics. Not
thread-safe (one owner, like the index); bounded in workers and window. Details:
docs/planner.md.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvindex.tiers import Tier

from .terms.decode_ride import decode_ride_seconds
from .terms.kv_load import load_seconds
from .terms.recompute import prefill_seconds
from .types import CostParams, Link

_TIER_BY_NAME = {t.name: t for t in Tier}


@dataclass(slots=True)
class ErrorStats:
    """Predicted vs actual TTFT (error = actual - predicted, seconds)."""

    count: int = 0
    mean_error_s: float = 0.0  # > 0: the model predicts too little
    std_error_s: float = 0.0
    mean_abs_error_s: float = 0.0
    mean_abs_rel_error: float = 0.0  # |actual - predicted| / actual
    p50_abs_rel_error: float = 0.0  # over the recent window
    p90_abs_rel_error: float = 0.0


@dataclass(slots=True)
class _ErrorAcc:
    window: int
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    abs_sum: float = 0.0
    rel_sum: float = 0.0
    recent: deque[float] = field(default_factory=deque)

    def add(self, err: float, rel: float) -> None:
        self.n += 1
        d = err - self.mean
        self.mean += d / self.n
        self.m2 += d * (err - self.mean)
        self.abs_sum += abs(err)
        self.rel_sum += rel
        self.recent.append(rel)
        if len(self.recent) > self.window:
            self.recent.popleft()

    def stats(self) -> ErrorStats:
        if not self.n:
            return ErrorStats()
        rs = sorted(self.recent)
        return ErrorStats(
            self.n,
            self.mean,
            math.sqrt(self.m2 / self.n),
            self.abs_sum / self.n,
            self.rel_sum / self.n,
            rs[(len(rs) - 1) // 2],
            rs[min(len(rs) - 1, int(0.9 * len(rs)))],
        )


@dataclass(slots=True)
class WorkerCoefficients:
    """One worker's calibrated multipliers (1.0 = its profile is right)."""

    prefill_scale: float = 1.0
    link_scales: dict[Tier, float] = field(default_factory=dict)
    prefill_samples: int = 0
    link_samples: dict[Tier, int] = field(default_factory=dict)
    rejected: int = 0
    prefill_streak: int = 0
    link_streaks: dict[Tier, int] = field(default_factory=dict)
    # Recent prefill ratios (observed / predicted), for the quantile estimator.
    prefill_ratios: deque[float] = field(default_factory=deque)
    # TTFT residual correction: what the model leaves out on this worker, in seconds
    # (the median of recent actual - predicted TTFTs, taken before this correction).
    ttft_offset_s: float = 0.0
    residuals: deque[float] = field(default_factory=deque)


def _num(d: Mapping[str, object], key: str) -> float | None:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v >= 0.0 else None


class Calibrator:
    """Per-worker coefficients refined from usage.kv, and TTFT error statistics."""

    def __init__(
        self,
        alpha: float = 0.2,
        min_scale: float = 0.25,
        max_scale: float = 4.0,
        outlier_ratio: float = 3.0,
        accept_after: int = 3,
        min_prefill_tokens: int = 64,
        window: int = 256,
        max_workers: int = 4096,
        prefill_quantile: float | None = None,
        prefill_window: int = 64,
        ttft_offset: bool = False,
        max_offset_s: float = 1.0,
        offset_min_samples: int = 3,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0.0 < min_scale <= 1.0 <= max_scale:
            raise ValueError(f"need 0 < min_scale <= 1 <= max_scale, got {min_scale}, {max_scale}")
        if outlier_ratio <= 1.0:
            raise ValueError(f"outlier_ratio must be > 1, got {outlier_ratio}")
        if accept_after < 1 or window < 1 or max_workers < 1 or min_prefill_tokens < 0 or prefill_window < 1:
            raise ValueError(
                "accept_after, window, prefill_window and max_workers must be >= 1, min_prefill_tokens >= 0")
        if prefill_quantile is not None and not 0.0 <= prefill_quantile <= 1.0:
            raise ValueError(f"prefill_quantile must be in [0, 1] or None, got {prefill_quantile}")
        self.prefill_quantile = prefill_quantile
        self.prefill_window = prefill_window
        self.ttft_offset = ttft_offset
        self.max_offset_s = max_offset_s
        # A worker's first request is often its slowest (warm-up): an offset from it alone would
        # send the worker's cached prompts elsewhere, so none until this many residuals (the
        # median of three outvotes one slow one).
        self.offset_min_samples = offset_min_samples
        self.alpha = alpha
        self.min_scale = min_scale
        self.max_scale = max_scale
        self._log_outlier = math.log(outlier_ratio)
        self.accept_after = accept_after
        self.min_prefill_tokens = min_prefill_tokens
        self.window = window
        self.max_workers = max_workers
        self._coef: dict[str, WorkerCoefficients] = {}
        # Workers whose speeds a SpeedFit measures (WorkerView.speeds_fitted): their prefill
        # scale and TTFT offset stay neutral, or the same error would be corrected twice.
        self._fitted: set[str] = set()
        self._errors: dict[str, _ErrorAcc] = {}
        self._all = _ErrorAcc(window * 4)

    # ------------------------------------------------------------------ feeding

    def observe(
        self,
        worker_id: str,
        base: CostParams | None,
        predicted_ttft: float | None,
        actual_ttft: float,
        kv: Mapping[str, object] | None,
        decodes: int = 0,
    ) -> None:
        """One finished prefill. `base`: the CostParams the prediction used (None: errors only);
        `decodes`: the worker's running requests then, whose decode steps the prefill's steps
        carried (taken off the measured prefill: the scale is the prefill's own)."""
        if predicted_ttft is not None and math.isfinite(predicted_ttft) and math.isfinite(actual_ttft):
            if actual_ttft >= 0.0:
                err = actual_ttft - predicted_ttft
                rel = abs(err) / max(actual_ttft, 1e-3)
                acc = self._errors.get(worker_id)
                if acc is None:
                    acc = self._errors[worker_id] = _ErrorAcc(self.window)
                    self._bound(self._errors)
                acc.add(err, rel)
                self._all.add(err, rel)
        if base is None or not isinstance(kv, Mapping):
            return
        fitted = worker_id in self._fitted
        co = self._coef.get(worker_id)
        if co is None:
            co = self._coef[worker_id] = WorkerCoefficients()
            self._bound(self._coef)
        if self.ttft_offset and not fitted and predicted_ttft is not None and math.isfinite(predicted_ttft) \
                and math.isfinite(actual_ttft) and actual_ttft >= 0.0:
            self._offset_update(co, actual_ttft - predicted_ttft + co.ttft_offset_s)
        loaded_raw = kv.get("loaded_tokens")
        loaded: dict[Tier, float] = {}
        if isinstance(loaded_raw, Mapping):
            for name, _v in loaded_raw.items():
                t = _TIER_BY_NAME.get(name) if isinstance(name, str) else None
                n = _num(loaded_raw, name)
                if t is not None and n:
                    loaded[t] = n
        recomputed = _num(kv, "recomputed_tokens")
        prefill_ms = _num(kv, "prefill_ms")
        if (
            not fitted
            and recomputed is not None
            and recomputed >= max(self.min_prefill_tokens, 1)
            and prefill_ms
            and base.prefill_tokens_per_s > 0.0
        ):
            self._prefill_sample(co, base, int(recomputed), int(sum(loaded.values())), prefill_ms / 1000.0, decodes)
        below = [t for t in loaded if t is not Tier.GPU]
        load_ms = _num(kv, "load_ms")
        prefetched = _num(kv, "prefetched_tokens") or 0.0
        if len(below) == 1 and load_ms and not prefetched and base.block_size > 0:
            t = below[0]
            link = base.links.get(t)
            if link is not None and link.read_Bps > 0.0:
                blocks = math.ceil(loaded[t] / base.block_size)
                pred = load_seconds(link, blocks, base.block_bytes)
                if pred > 0.0:
                    cur = co.link_scales.get(t, 1.0)
                    new, streak, ok = self._update(cur, load_ms / 1000.0 / pred, co.link_streaks.get(t, 0))
                    co.link_scales[t] = new
                    co.link_streaks[t] = streak
                    co.link_samples[t] = co.link_samples.get(t, 0) + ok
                    co.rejected += not ok

    def _prefill_sample(self, co: WorkerCoefficients, base: CostParams, new: int, cached: int, measured_s: float,
                        decodes: int) -> None:
        """One prefill-speed sample: the measured prefill less the decode steps it carried,
        against the wire formula for the same (new, cached) tokens."""
        pred = prefill_seconds(base, new, cached)
        if pred <= 0.0:
            return
        own = measured_s - decode_ride_seconds(base, new, decodes)
        if own <= 0.0:  # the ride was priced above the whole measured prefill
            co.rejected += 1
            return
        ratio = own / pred
        if self.prefill_quantile is not None:
            ok = self._quantile_update(co, ratio)
        else:
            co.prefill_scale, co.prefill_streak, ok = self._update(co.prefill_scale, ratio, co.prefill_streak)
        co.prefill_samples += ok
        co.rejected += not ok

    def _offset_update(self, co: WorkerCoefficients, residual: float) -> None:
        """The TTFT offset: the median of the last `prefill_window` residuals, in [0, max_offset_s]."""
        rs = co.residuals
        rs.append(residual)
        if len(rs) > self.prefill_window:
            rs.popleft()
        if len(rs) < self.offset_min_samples:
            return
        v = sorted(rs)[len(rs) // 2]
        co.ttft_offset_s = 0.0 if v < 0.0 else self.max_offset_s if v > self.max_offset_s else v

    def offset(self, worker_id: str) -> float:
        """Seconds to add to this worker's predicted TTFT (0 when off, unknown or fitted)."""
        co = self._coef.get(worker_id)
        return co.ttft_offset_s if co is not None and worker_id not in self._fitted else 0.0

    def set_fitted(self, worker_id: str, fitted: bool) -> None:
        """Whether a SpeedFit measures this worker's speeds (module doc of speedfit.py)."""
        if fitted:
            if worker_id not in self._fitted:
                self._fitted.add(worker_id)
                self._bound_set()
        else:
            self._fitted.discard(worker_id)

    def _bound_set(self) -> None:
        while len(self._fitted) > self.max_workers:
            self._fitted.pop()

    def _quantile_update(self, co: WorkerCoefficients, ratio: float) -> bool:
        """The prefill scale as the `prefill_quantile` of the last `prefill_window` ratios
        (module doc: interference only ever lengthens a reported prefill)."""
        if not (ratio > 0.0 and math.isfinite(ratio)):
            return False
        rs = co.prefill_ratios
        rs.append(ratio)
        if len(rs) > self.prefill_window:
            rs.popleft()
        if len(rs) < self.accept_after:  # one request's timing alone must not re-rank the fleet
            return True
        q = self.prefill_quantile
        assert q is not None
        srt = sorted(rs)
        v = srt[min(len(srt) - 1, int(q * len(srt)))]
        co.prefill_scale = self.min_scale if v < self.min_scale else self.max_scale if v > self.max_scale else v
        return True

    def _update(self, cur: float, ratio: float, streak: int) -> tuple[float, int, bool]:
        """EWMA step in log space with outlier rejection; returns (value, streak, accepted)."""
        if not (ratio > 0.0 and math.isfinite(ratio)):
            return cur, streak, False
        lr = math.log(ratio)
        lc = math.log(cur)
        if abs(lr - lc) > self._log_outlier:
            streak += 1
            if streak < self.accept_after:
                return cur, streak, False
        streak = 0
        v = math.exp(lc + self.alpha * (lr - lc))
        v = self.min_scale if v < self.min_scale else self.max_scale if v > self.max_scale else v
        return v, streak, True

    def _bound(self, d: dict[str, Any]) -> None:
        while len(d) > self.max_workers:
            del d[next(iter(d))]

    def forget(self, worker_id: str) -> None:
        """Drop a removed worker's state."""
        self._coef.pop(worker_id, None)
        self._errors.pop(worker_id, None)
        self._fitted.discard(worker_id)

    # ------------------------------------------------------------------ reading

    def factors(self, worker_id: str) -> tuple[float, dict[Tier, float] | None]:
        """(prefill time multiplier, per-tier load time multipliers) for the cost model."""
        co = self._coef.get(worker_id)
        if co is None:
            return 1.0, None
        return 1.0 if worker_id in self._fitted else co.prefill_scale, (co.link_scales or None)

    @property
    def active(self) -> bool:
        """True once any worker has coefficients (callers may skip `factors` until then)."""
        return bool(self._coef)

    def coefficients(self, worker_id: str) -> WorkerCoefficients | None:
        return self._coef.get(worker_id)

    def apply(self, worker_id: str, base: CostParams) -> CostParams:
        """A copy of `base` with this worker's calibration applied (effective speeds)."""
        ps, ls = self.factors(worker_id)
        links = {}
        for t, link in base.links.items():
            s = ls.get(t, 1.0) if ls else 1.0
            links[t] = Link(link.read_Bps / s, link.latency_s * s)
        return replace(
            base,
            prefill_tokens_per_s=base.prefill_tokens_per_s / ps,
            prefill_attn_s_per_token2=base.prefill_attn_s_per_token2 * ps,
            prefill_overhead_s=base.prefill_overhead_s * ps,
            links=links,
        )

    def error_stats(self, worker_id: str | None = None) -> ErrorStats:
        """TTFT prediction error for one worker, or over all of them."""
        if worker_id is None:
            return self._all.stats()
        acc = self._errors.get(worker_id)
        return acc.stats() if acc else ErrorStats()

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per worker coefficients, for metrics and the admin API (plain types)."""
        out: dict[str, dict[str, Any]] = {}
        for wid, co in self._coef.items():
            out[wid] = {
                "prefill_scale": co.prefill_scale,
                "prefill_samples": co.prefill_samples,
                "link_scales": {t.name: v for t, v in co.link_scales.items()},
                "link_samples": {t.name: v for t, v in co.link_samples.items()},
                "rejected": co.rejected,
            }
        return out
