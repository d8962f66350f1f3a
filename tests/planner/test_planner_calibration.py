"""Online calibration: convergence, robustness to outliers and bad input, error stats."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvindex.tiers import Tier
from router.planner.calibration import Calibrator
from router.planner.terms.decode_ride import decode_ride_seconds
from router.planner.terms.kv_load import load_seconds
from router.planner.terms.recompute import prefill_seconds
from router.planner.types import CostParams, Link

BASE = CostParams(
    block_size=16,
    block_bytes=2 * 1024 * 1024,
    prefill_tokens_per_s=40_000.0,
    prefill_attn_s_per_token2=1e-10,
    prefill_overhead_s=0.004,
    links={Tier.CPU: Link(50e9, 1e-5), Tier.DISK: Link(6e9, 1e-4)},
)


def kv_prefill(new: int, cached: int, seconds: float, loaded_tier: str = "GPU") -> dict:
    return {
        "loaded_tokens": {loaded_tier: cached},
        "recomputed_tokens": new,
        "prefill_ms": seconds * 1000.0,
        "load_ms": 0.0,
        "prefetched_tokens": 0,
    }


def test_prefill_speed_converges_on_noisy_observations():
    rng = random.Random(1)
    cal = Calibrator()
    true_scale = 1.8  # the worker is 1.8x slower than its profile says
    for _ in range(150):
        new, cached = rng.randrange(200, 8000), rng.randrange(0, 8000)
        actual = prefill_seconds(BASE, new, cached) * true_scale * rng.uniform(0.9, 1.1)
        cal.observe("w0", BASE, None, actual, kv_prefill(new, cached, actual))
    scale, links = cal.factors("w0")
    assert scale == pytest.approx(true_scale, rel=0.05)
    assert links is None
    eff = cal.apply("w0", BASE)
    assert eff.prefill_tokens_per_s == pytest.approx(BASE.prefill_tokens_per_s / scale)
    assert eff.prefill_attn_s_per_token2 == pytest.approx(BASE.prefill_attn_s_per_token2 * scale)
    # the effective params now predict what the worker does
    assert prefill_seconds(eff, 4000, 1000) == pytest.approx(prefill_seconds(BASE, 4000, 1000) * true_scale, rel=0.05)
    assert cal.coefficients("w0").prefill_samples == 150
    assert cal.factors("other") == (1.0, None)


def test_decode_steps_carried_by_the_prefill_are_not_taken_for_slow_prefill():
    # The measured prefill includes the decode steps of the worker's running requests; the
    # scale is the prefill's own, so with those taken off it stays at the profile's 1.0.
    rng = random.Random(2)
    base = replace(BASE, decode_step_s=0.02, max_batched_tokens=2048)
    cal, naive = Calibrator(), Calibrator()
    for _ in range(100):
        new, cached, decodes = rng.randrange(200, 8000), rng.randrange(0, 8000), rng.randrange(1, 64)
        actual = prefill_seconds(base, new, cached) + decode_ride_seconds(base, new, decodes)
        cal.observe("w0", base, None, actual, kv_prefill(new, cached, actual), decodes)
        naive.observe("w0", base, None, actual, kv_prefill(new, cached, actual))
    assert cal.factors("w0")[0] == pytest.approx(1.0, rel=0.02)
    assert naive.factors("w0")[0] > 1.2


def test_bandwidth_converges_per_tier():
    cal = Calibrator()
    for i in range(100):
        tokens = 16 * (50 + i)
        actual = load_seconds(BASE.links[Tier.DISK], tokens // 16, BASE.block_bytes) * 3.0
        kv = {"loaded_tokens": {"GPU": 160, "DISK": tokens}, "recomputed_tokens": 10, "load_ms": actual * 1000}
        cal.observe("w0", BASE, None, actual, kv)
    _, links = cal.factors("w0")
    assert links == {Tier.DISK: pytest.approx(3.0, rel=0.02)}
    eff = cal.apply("w0", BASE)
    assert eff.links[Tier.DISK].read_Bps == pytest.approx(2e9, rel=0.02)
    assert eff.links[Tier.CPU].read_Bps == BASE.links[Tier.CPU].read_Bps
    assert BASE.links[Tier.DISK].read_Bps == 6e9  # the base is not touched


def test_ambiguous_load_observations_are_not_attributed():
    cal = Calibrator()
    two_tiers = {"loaded_tokens": {"CPU": 1600, "DISK": 1600}, "load_ms": 500.0}
    prefetched = {"loaded_tokens": {"DISK": 1600}, "load_ms": 500.0, "prefetched_tokens": 1600}
    for kv in (two_tiers, prefetched):
        for _ in range(10):
            cal.observe("w0", BASE, None, 1.0, kv)
    assert cal.factors("w0") == (1.0, None)


def test_outliers_rejected_but_a_lasting_shift_is_accepted():
    cal = Calibrator(accept_after=3)
    good = prefill_seconds(BASE, 4000, 0)
    for _ in range(20):
        cal.observe("w0", BASE, None, good, kv_prefill(4000, 0, good))
    cal.observe("w0", BASE, None, good * 50, kv_prefill(4000, 0, good * 50))  # a GC pause
    assert cal.factors("w0")[0] == pytest.approx(1.0)
    assert cal.coefficients("w0").rejected == 1
    for _ in range(60):  # the worker really became 3.5x slower (e.g. a noisy neighbour)
        cal.observe("w0", BASE, None, good * 3.5, kv_prefill(4000, 0, good * 3.5))
    assert cal.factors("w0")[0] == pytest.approx(3.5, rel=0.05)


def test_scales_are_clamped():
    cal = Calibrator(max_scale=4.0, accept_after=1)
    good = prefill_seconds(BASE, 4000, 0)
    for _ in range(100):
        cal.observe("w0", BASE, None, good * 20, kv_prefill(4000, 0, good * 20))
    assert cal.factors("w0")[0] == 4.0


@pytest.mark.parametrize(
    "kv",
    [
        None,
        "garbage",
        {},
        {"recomputed_tokens": "many", "prefill_ms": None},
        {"recomputed_tokens": -5, "prefill_ms": 10.0},
        {"recomputed_tokens": 4000, "prefill_ms": float("nan")},
        {"recomputed_tokens": 4000, "prefill_ms": 0.0},
        {"recomputed_tokens": 10, "prefill_ms": 5.0},  # too small to tell overhead from speed
        {"loaded_tokens": {"NVME?": 100, 7: 3, "DISK": "x"}, "load_ms": 3.0},
        {"loaded_tokens": [1, 2], "recomputed_tokens": True, "prefill_ms": True},
    ],
)
def test_bad_usage_never_raises_nor_moves_coefficients(kv):
    cal = Calibrator()
    cal.observe("w0", BASE, 0.1, 0.2, kv)
    assert cal.factors("w0") == (1.0, None)
    assert cal.error_stats("w0").count == 1


def test_ttft_error_statistics():
    cal = Calibrator()
    for pred, actual in [(0.1, 0.2), (0.2, 0.1), (0.3, 0.3), (0.4, 0.6)]:
        cal.observe("w0", None, pred, actual, None)
    cal.observe("w1", None, 1.0, 2.0, None)
    cal.observe("w1", None, None, 2.0, None)  # no prediction: nothing to compare
    s = cal.error_stats("w0")
    assert s.count == 4
    assert s.mean_error_s == pytest.approx((0.1 - 0.1 + 0 + 0.2) / 4)
    assert s.mean_abs_error_s == pytest.approx((0.1 + 0.1 + 0 + 0.2) / 4)
    assert s.mean_abs_rel_error == pytest.approx((0.5 + 1.0 + 0 + 1 / 3) / 4)
    assert s.p50_abs_rel_error == pytest.approx(1 / 3)
    assert cal.error_stats().count == 5
    assert cal.error_stats("nobody").count == 0
    cal.forget("w0")
    assert cal.error_stats("w0").count == 0


def test_state_is_bounded():
    cal = Calibrator(max_workers=3, window=4)
    for i in range(10):
        cal.observe(f"w{i}", BASE, 0.1, 0.1, kv_prefill(4000, 0, 0.1))
    assert len(cal.snapshot()) == 3 and "w9" in cal.snapshot()
    for _ in range(3):
        cal.observe("w9", None, 0.1, 0.2, None)  # relative error 0.5
    for _ in range(4):
        cal.observe("w9", None, 0.1, 0.1, None)  # exact
    s = cal.error_stats("w9")
    assert s.count == 8  # running stats count everything
    assert s.mean_abs_rel_error == pytest.approx(1.5 / 8)
    assert s.p90_abs_rel_error == 0.0  # quantiles: the last 4 only


def test_constructor_validates():
    for bad in (dict(alpha=0.0), dict(min_scale=2.0), dict(outlier_ratio=1.0), dict(window=0)):
        with pytest.raises(ValueError):
            Calibrator(**bad)
