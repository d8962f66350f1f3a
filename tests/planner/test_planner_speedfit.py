"""SpeedFit: a worker's speeds measured from clean samples, robust to outliers, unclamped."""
from __future__ import annotations

import random

import pytest

from router.planner.speedfit import MIN_SAMPLES, FitState, Sample, SpeedFit, fit_samples
from router.planner.terms.recompute import prefill_seconds
from router.planner.types import CostParams


def _base() -> CostParams:
    # The router's default for a worker it knows nothing about: 10k tokens/s.
    return CostParams(block_size=32, block_bytes=32 * 4096, prefill_tokens_per_s=10_000.0)


def _engine(new: int, running: int, *, tps: float = 1100.0, overhead: float = 0.03, ride: float = 0.006) -> float:
    return overhead + new / tps + ride * running


def test_fit_recovers_an_engine_20x_slower_than_assumed() -> None:
    rng = random.Random(1)
    samples = [Sample(n, 0, r, _engine(n, r) * rng.uniform(0.97, 1.03))
               for n, r in ((rng.randint(16, 512), rng.randint(0, 3)) for _ in range(40))]
    fit = fit_samples(_base(), samples)
    assert 10_000.0 / fit.scale == pytest.approx(1100.0, rel=0.08)
    assert fit.overhead_s == pytest.approx(0.03, abs=0.01)
    assert fit.ride_s == pytest.approx(0.006, abs=0.004)
    assert fit.rel_spread < 0.05


def test_outliers_do_not_move_the_fit() -> None:
    rng = random.Random(2)
    clean = [Sample(n, 0, 0, _engine(n, 0)) for n in (rng.randint(32, 512) for _ in range(30))]
    stalled = [Sample(64, 0, 0, 5.0) for _ in range(4)]  # a few requests caught behind a hiccup
    fit = fit_samples(_base(), clean + stalled)
    assert 10_000.0 / fit.scale == pytest.approx(1100.0, rel=0.05)


def test_cached_tokens_shrink_the_predicted_prefill() -> None:
    base = CostParams(block_size=32, block_bytes=1, prefill_tokens_per_s=5000.0, prefill_attn_s_per_token2=1e-8)
    samples = [Sample(n, c, 0, 0.01 + 2 * prefill_seconds(base, n, c)) for n, c in
               ((64, 0), (128, 256), (256, 0), (512, 512), (96, 1024), (300, 100))]
    fit = fit_samples(base, samples)
    assert fit.scale == pytest.approx(2.0, rel=0.02)
    assert fit.ttft(base, 128, 2048, 0) == pytest.approx(0.01 + 2 * prefill_seconds(base, 128, 2048), rel=0.02)


def test_states_probing_fitted_drifting() -> None:
    sf = SpeedFit(_base())
    assert sf.state is FitState.PROBING and sf.confidence == 0.0 and not sf.trusted
    for i in range(MIN_SAMPLES - 1):
        sf.add(Sample(64 * (i + 1), 0, 0, _engine(64 * (i + 1), 0)))
    assert sf.state is FitState.PROBING
    for i in range(20):
        sf.add(Sample(32 + 20 * i, 0, 0, _engine(32 + 20 * i, 0)))
    assert sf.state is FitState.FITTED and sf.trusted and sf.confidence > 0.5
    # The engine halves its speed (another tenant on the host): the latest samples sit off the fit.
    for _ in range(5):
        sf.add(Sample(400, 0, 0, _engine(400, 0, tps=400.0)))
    assert sf.state is FitState.DRIFTING
    for i in range(80):  # the window moves on: the new speed is the fit
        sf.add(Sample(32 + 6 * i, 0, 0, _engine(32 + 6 * i, 0, tps=400.0)))
    assert sf.state is FitState.FITTED
    assert 10_000.0 / sf.fit.scale == pytest.approx(400.0, rel=0.05)  # type: ignore[union-attr]


def test_apply_respects_pins_and_writes_speeds() -> None:
    sf = SpeedFit(_base())
    for n in (64, 128, 256, 512, 384, 192):
        sf.add(Sample(n, 0, 0, _engine(n, 0)))
    live = _base()
    sf.apply(live, frozenset({"prefill_overhead_s"}))
    assert live.decode_step_s == 0.0  # the step time is a report's, never the fit's
    assert live.prefill_tokens_per_s == pytest.approx(1100.0, rel=0.05)
    assert live.prefill_overhead_s == 0.0  # pinned by the operator
    assert sf.summary()["state"] == "fitted"


def test_bad_samples_are_ignored() -> None:
    sf = SpeedFit(_base())
    for s in (Sample(0, 0, 0, 0.1), Sample(10, 0, 0, 0.0), Sample(10, 0, 0, float("nan"))):
        sf.add(s)
    assert sf.total == 0


def test_queue_scale_measures_how_the_real_wait_follows_the_predicted_queue() -> None:
    rng = random.Random(3)
    samples = []
    for _ in range(60):
        n, q = rng.randint(32, 512), (rng.random() * 0.3 if rng.random() < 0.5 else 0.0)
        samples.append(Sample(n, 0, 0, (_engine(n, 0) + 2.5 * q) * rng.uniform(0.97, 1.03), q))
    fit = fit_samples(_base(), samples)
    assert fit.queue_scale == pytest.approx(2.5, rel=0.1)
    assert 10_000.0 / fit.scale == pytest.approx(1100.0, rel=0.1)
    live = _base()
    sf = SpeedFit(_base())
    for s in samples:
        sf.add(s)
    sf.apply(live)
    assert live.queue_scale == pytest.approx(2.5, rel=0.1)


def test_few_queued_samples_leave_the_queue_as_predicted() -> None:
    samples = [Sample(n, 0, 0, _engine(n, 0)) for n in (64, 128, 256, 512, 384, 192)]
    samples.append(Sample(64, 0, 0, 9.0, 0.1))  # one stray queued request
    assert fit_samples(_base(), samples).queue_scale == 1.0
