"""bench/transport_probe.py's analysis recovers a transport it is shown."""
from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "transport_probe", Path(__file__).resolve().parents[2] / "bench" / "transport_probe.py")
assert _spec is not None and _spec.loader is not None
probe = importlib.util.module_from_spec(_spec)
sys.modules["transport_probe"] = probe  # dataclasses look their module up
_spec.loader.exec_module(probe)


def _bursts(jitter: float, seed: int = 7, burst: float = 0.0) -> list:  # type: ignore[type-arg]
    """30 bursts of 12 requests 3 s apart, one in six over 24k tokens, reaching their
    workers as the model says (3 ms intake, 0.6 us/token over 24k, `jitter`, each burst
    late by a uniform [0, burst)), 15 ms fixed."""
    rng = random.Random(1)
    r2 = random.Random(seed + 1)
    late = [r2.random() * burst for _ in range(30)]
    reqs = []
    for i in range(360):
        p = rng.randint(24_500, 90_000) if rng.random() < 1 / 6 else rng.randint(500, 20_000)
        reqs.append(probe.Req(i, (i // 12) * 3.0, 0.0, p, 0.0))
    truth = probe.model_times(reqs, 0.003, 24_000, 6e-7, jitter, seed)
    for r in reqs:
        r.accepted = truth[r.index] + late[r.index // 12]
        r.overhead_ms = (r.accepted - r.issue) * 1000.0 + 15.0
    return reqs


def test_analysis_recovers_intake_free_tokens_lag_and_fixed_cost() -> None:
    m = probe.analyse(_bursts(0.0))
    assert m["delay_free_tokens"] == 24_000
    assert m["intake_ms"] == pytest.approx(3.0, rel=1e-6)
    assert m["lag_us_per_token"] == pytest.approx(0.6, rel=1e-6)
    assert m["jitter_ms"] == 0.0 and m["order_agreement"] == 1.0
    assert m["burst_jitter_ms"] == pytest.approx(0.0, abs=1e-6)
    assert m["fixed_ms"] == pytest.approx(15.0, abs=0.01)


def test_analysis_measures_how_unevenly_bursts_start() -> None:
    m = probe.analyse(_bursts(0.0, burst=0.03))
    assert m["intake_ms"] == pytest.approx(3.0, rel=1e-6)  # per-burst offsets do not bend the slope
    assert m["burst_jitter_ms"] == pytest.approx(30.0, rel=0.35)
    assert m["fixed_ms"] == pytest.approx(15.0, abs=5.0)


def test_analysis_finds_the_jitter_that_scrambles_a_burst() -> None:
    m = probe.analyse(_bursts(0.008))
    assert m["delay_free_tokens"] == 24_000
    assert 5.0 <= m["jitter_ms"] <= 12.0
    assert m["out_of_order_measured"] > probe.analyse(_bursts(0.0))["out_of_order_measured"]
    assert m["fixed_ms"] == pytest.approx(15.0, abs=3.0)
