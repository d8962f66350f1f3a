"""A worker's speeds, fitted from what its own requests show (docs/planner.md, "Knowing the worker").

Every request that loaded nothing from below GPU (a probe at join, or one sent while
serving) measures its worker: its time to first token is the fixed per-request overhead,
the prefill of its new tokens given the cached ones, what each request decoding there
meanwhile adds (its share of the step, and on an engine whose server shares its cores,
the streaming work for it), and the wait for what was ahead of it, which the model
predicted as `queue`:

    ttft = overhead + scale * shape(new, cached) + ride * running + queue_scale * queue

`shape` is the cost model's prefill formula for the worker's starting coefficients, so a
fit keeps their form (linear + attention) and measures the numbers that differ most
between engines; `queue_scale` says how the worker's real wait follows the model's queue
(an engine that interleaves queued prefills with decodes, or shares its cores, waits
longer than the sum of the prefills ahead). Each sample weighs by its relative error (a
50 ms and a 500 ms request count alike) and the fit is a Huber IRLS over a sliding window:
one stalled request moves nothing, a slower engine moves everything. No bound limits what
a fit may find; a term with too few samples to tell it apart stays out.

State: `probing` (too few samples to trust), `fitted`, `drifting` (the latest samples sit
off the fit: the window is moving to a new speed). Pure: the gateway and the simulator
feed it.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from .terms.recompute import prefill_seconds
from .types import CostParams

WINDOW = 64  # samples a fit looks at: recent enough to follow a change in minutes
MIN_SAMPLES = 4  # below this the worker is `probing`
REFIT_EVERY = 16  # samples between refits of a settled fit (the window, not the refit, is the memory)
REFIT_EVERY_DRIFTING = 4  # ... and of one whose latest samples sit off it
DRIFT_SAMPLES = 8  # the latest samples that decide `drifting`
DRIFT_REL = 0.25  # their median relative residual past this: `drifting`
_HUBER_K = 1.345  # the usual 95%-efficiency constant
_IRLS_ROUNDS = 4


class FitState(StrEnum):
    PROBING = "probing"
    FITTED = "fitted"
    DRIFTING = "drifting"


@dataclass(frozen=True, slots=True)
class Sample:
    new_tokens: int
    cached_tokens: int
    running: int  # requests decoding on the worker when this one started
    ttft_s: float  # from dispatch to first token
    queue_s: float = 0.0  # the model's predicted queue for it (0: nothing was ahead)


@dataclass(frozen=True, slots=True)
class Fit:
    overhead_s: float
    scale: float  # x the starting coefficients' prefill time
    ride_s: float  # added per request decoding on the worker meanwhile
    rel_spread: float  # robust spread of the relative residuals (1.4826 x MAD)
    samples: int
    queue_scale: float = 1.0  # real wait per second of predicted queue

    def ttft(self, base: CostParams, new: int, cached: int, running: int, queue_s: float = 0.0) -> float:
        shape = prefill_seconds(base, new, cached) - base.prefill_overhead_s
        return self.overhead_s + self.scale * shape + self.ride_s * running + self.queue_scale * queue_s


class SpeedFit:
    """One worker's samples and current fit; `base`: its starting coefficients (profile,
    config or the worker's own report), which give the fit its shape."""

    def __init__(self, base: CostParams) -> None:
        self.base = replace(base, links=dict(base.links))
        self.samples: deque[Sample] = deque(maxlen=WINDOW)
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=WINDOW)  # each sample's features
        self.fit: Fit | None = None
        self.state = FitState.PROBING
        self.total = 0

    def add(self, s: Sample) -> None:
        """One clean sample; refits when due (64 rows at most: ~0.2 ms with numpy)."""
        if s.ttft_s <= 0.0 or not math.isfinite(s.ttft_s) or s.new_tokens <= 0:
            return
        self.samples.append(s)
        self._rows.append(_features(self.base, s))
        self.total += 1
        n = len(self.samples)
        if n < MIN_SAMPLES:
            return
        # Once fitted, a refit every few samples follows a change as well (the window is
        # the memory) at a fraction of the gateway's CPU.
        every = REFIT_EVERY_DRIFTING if self.state is FitState.DRIFTING else REFIT_EVERY
        if self.fit is None or n < WINDOW // 4 or self.total % every == 0:
            self.fit = _fit_rows(np.array(self._rows), np.array([q.ttft_s for q in self.samples]))
        self.state = self._state()

    def _state(self) -> FitState:
        fit = self.fit
        if fit is None:
            return FitState.PROBING
        if len(self.samples) >= DRIFT_SAMPLES:
            rel = sorted(_row_residual(fit, x, q.ttft_s)
                         for x, q in zip(list(self._rows)[-DRIFT_SAMPLES:], list(self.samples)[-DRIFT_SAMPLES:],
                                         strict=True))
            if abs(rel[len(rel) // 2]) > DRIFT_REL:
                return FitState.DRIFTING
        return FitState.FITTED

    @property
    def confidence(self) -> float:
        """0..1: grows with samples, falls with the residuals' spread."""
        fit = self.fit
        if fit is None:
            return 0.0
        n = len(self.samples)
        c = n / (n + 2.0 * MIN_SAMPLES) / (1.0 + 2.0 * fit.rel_spread)
        return round(c * (0.5 if self.state is FitState.DRIFTING else 1.0), 3)

    @property
    def trusted(self) -> bool:
        return self.fit is not None and self.state is not FitState.PROBING

    def apply(self, cost: CostParams, pinned: frozenset[str] = frozenset()) -> None:
        """Write the fitted speeds into `cost` (the worker's live coefficients), except
        those an operator pinned."""
        fit = self.fit
        if fit is None:
            return
        b = self.base
        if "prefill_tokens_per_s" not in pinned:
            cost.prefill_tokens_per_s = b.prefill_tokens_per_s / fit.scale
        if "prefill_attn_s_per_token2" not in pinned:
            cost.prefill_attn_s_per_token2 = b.prefill_attn_s_per_token2 * fit.scale
        if "prefill_overhead_s" not in pinned:
            cost.prefill_overhead_s = fit.overhead_s
        cost.ride_per_running_s = fit.ride_s
        cost.queue_scale = fit.queue_scale

    def summary(self) -> dict[str, object]:
        fit = self.fit
        out: dict[str, object] = {"state": self.state.value, "confidence": self.confidence,
                                  "samples": len(self.samples), "samples_total": self.total}
        if fit is not None:
            b = self.base
            out.update(overhead_ms=round(fit.overhead_s * 1e3, 3),
                       prefill_tokens_per_s=round(b.prefill_tokens_per_s / fit.scale, 1),
                       ride_per_running_ms=round(fit.ride_s * 1e3, 3), queue_scale=round(fit.queue_scale, 3),
                       rel_spread=round(fit.rel_spread, 4))
        return out


def _features(base: CostParams, q: Sample) -> tuple[float, float, float, float]:
    """A sample's row of the fit: 1, the prefill shape, running requests, predicted queue."""
    return (1.0, prefill_seconds(base, q.new_tokens, q.cached_tokens) - base.prefill_overhead_s, float(q.running),
            q.queue_s)


def _row_residual(fit: Fit, x: tuple[float, float, float, float], ttft_s: float) -> float:
    pred = fit.overhead_s + fit.scale * x[1] + fit.ride_s * x[2] + fit.queue_scale * x[3]
    return (ttft_s - pred) / ttft_s


def fit_samples(base: CostParams, samples: list[Sample]) -> Fit:
    """Huber IRLS of `ttft = a + s*shape + r*running + k*queue` in relative terms, coefficients
    kept non-negative by dropping a column that comes out negative (then refitting)."""
    return _fit_rows(np.array([_features(base, q) for q in samples]), np.array([q.ttft_s for q in samples]))


def _fit_rows(x: np.ndarray, y: np.ndarray) -> Fit:
    cols = [0, 1, 2, 3]
    for c in (2, 3):
        some = int(np.count_nonzero(x[:, c]))
        if some < MIN_SAMPLES or len(y) - some < MIN_SAMPLES:
            cols.remove(c)  # too few samples on each side: the term would fit a stray sample or two
    coef = _irls(x, y, cols)
    for c in (3, 2, 0):
        if c in cols and coef[c] < 0.0:
            cols.remove(c)
            coef = _irls(x, y, cols)
    if coef[1] <= 0.0:  # times that do not grow with the prompt: the scale alone carries them
        cols = [1] + [c for c in cols if c in (2, 3)]
        coef = _irls(x, y, cols)
    qs = float(coef[3]) if 3 in cols else 1.0
    fit = Fit(max(float(coef[0]), 0.0), float(coef[1]) if coef[1] > 0.0 else 1.0, max(float(coef[2]), 0.0), 0.0,
              len(y), qs)
    pred = fit.overhead_s + fit.scale * x[:, 1] + fit.ride_s * x[:, 2] + fit.queue_scale * x[:, 3]
    return replace(fit, rel_spread=1.4826 * _median(np.abs((y - pred) / y)))


def _irls(x: np.ndarray, y: np.ndarray, cols: list[int]) -> np.ndarray:
    """Weighted least squares in relative terms, reweighted `_IRLS_ROUNDS` times by Huber.
    Each round solves the normal equations (at most 4 x 4): an SVD per round cost the
    gateway more than the rest of a request's bookkeeping."""
    xs = x[:, cols] / y[:, None]  # rows scaled by 1/y: relative residuals
    hw = np.ones_like(y)
    sol = np.zeros(len(cols))
    for _ in range(_IRLS_ROUNDS + 1):
        xw = xs * hw[:, None]
        try:
            sol = np.linalg.solve(xw.T @ xs, xw.sum(axis=0))
        except np.linalg.LinAlgError:  # collinear columns: the minimum-norm solution
            sw = np.sqrt(hw)
            sol = np.linalg.lstsq(xs * sw[:, None], sw, rcond=None)[0]
        res = np.abs(1.0 - xs @ sol)
        k = _HUBER_K * max(_median(res) * 1.4826, 1e-3)
        hw = np.minimum(k / np.maximum(res, 1e-12), 1.0)  # Huber: 1 within k, k/|r| beyond
    out = np.zeros(4)
    out[cols] = sol
    return out


def _median(a: np.ndarray) -> float:
    """`np.median` of a 1-D array, by partition: the same value at a fraction of its cost
    on the few dozen residuals a fit has."""
    n = len(a)
    h = n // 2
    if n % 2:
        return float(np.partition(a, h)[h])
    p = np.partition(a, (h - 1, h))
    return float((p[h - 1] + p[h]) / 2.0)
