"""The engine's measured speeds, in the gateway's cost model (docs/wire.md `speeds`).

Prefill of `n` new tokens after `c` cached ones takes
`overhead + n / tokens_per_s + attn * n * (c + n / 2)`: a least-squares fit over the
engine's own chunk timings, recent ones weighing most (exponential forgetting), with
every coefficient kept >= 0 (the best non-negative fit over the subsets of terms that
keep the linear one). Three sums of squares are all it stores. A decode step's time is an
exponentially weighted mean of the recent decode steps.
"""
from __future__ import annotations

import itertools

import numpy as np

# Features scaled so that the normal equations stay well conditioned in float64.
_N_SCALE = 1e3
_ATTN_SCALE = 1e6


class PrefillFit:
    def __init__(self, forget: float = 0.98) -> None:
        self.forget = forget
        self.samples = 0
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._coef: np.ndarray | None = None

    def add(self, n: int, c: int, seconds: float) -> None:
        x = _features(n, c)
        f = self.forget
        self._xtx = f * self._xtx + np.outer(x, x)
        self._xty = f * self._xty + x * seconds
        self.samples += 1
        self._coef = None

    def coefficients(self) -> tuple[float, float, float] | None:
        """(tokens_per_s, attn_s_per_token2, overhead_s), or None before any sample."""
        if not self.samples:
            return None
        if self._coef is None:
            self._coef = self._solve()
        b0, b1, b2 = (float(v) for v in self._coef)
        return _N_SCALE / b1, b2 / _ATTN_SCALE, b0

    def predict(self, n: int, c: int) -> float | None:
        co = self.coefficients()
        if co is None:
            return None
        tps, attn, overhead = co
        return overhead + n / tps + attn * n * (c + n / 2)

    def _solve(self) -> np.ndarray:
        """Least squares with all coefficients >= 0: the best feasible fit over the subsets of
        terms that keep the linear one (3 unknowns: 4 subsets)."""
        a = self._xtx + np.eye(3) * 1e-12 * max(np.trace(self._xtx), 1e-30)
        best, best_cost = None, np.inf
        for extra in itertools.chain.from_iterable(itertools.combinations((0, 2), k) for k in range(3)):
            idx = sorted((1, *extra))
            sub = np.linalg.lstsq(a[np.ix_(idx, idx)], self._xty[idx], rcond=None)[0]
            if (sub < 0).any():
                continue
            coef = np.zeros(3)
            coef[idx] = sub
            cost = coef @ a @ coef - 2 * coef @ self._xty  # residual up to a constant
            if cost < best_cost:
                best, best_cost = coef, cost
        if best is None or best[1] <= 0:  # only when every timing was ~0
            best = np.array([0.0, 1e-9, 0.0])
        return best


class Ewma:
    def __init__(self, alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


def _features(n: int, c: int) -> np.ndarray:
    return np.array([1.0, n / _N_SCALE, n * (c + n / 2) / _ATTN_SCALE])
