"""The `ideal` lower bound, the slowdown against it and the utilisation measure."""
from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from loadtest.fleet import FleetSpec
from loadtest.ideal import IDEAL, ideal_prefill_s, reusable_blocks
from loadtest.report import slowdown_table, summaries
from loadtest.results import RequestResult, Run, RunMeta
from loadtest.scenarios.base import sized_profile
from loadtest.simulate import SimSettings, Simulation
from loadtest.summary import prefill_busy_fraction, slowdowns, summarize
from loadtest.sweep import ideal_for
from loadtest.trace import Trace, TraceRequest
from loadtest.tracefiles import MOONCAKE_SLICE
from loadtest.traces import load_trace
from router.planner.registry import POLICY_NAMES
from workers.sim import load_profile


def _req(i: int, t: float, n: int = 100) -> TraceRequest:
    return TraceRequest(index=i, arrival_s=t, input_length=n, output_length=1, hash_ids=())


def test_reusable_blocks_counts_only_what_an_earlier_or_simultaneous_request_holds() -> None:
    keys = {0: [b"a", b"b", b"c"], 1: [b"a", b"b", b"x"], 2: [b"a", b"y"], 3: [b"a", b"y", b"z"], 4: [b"q"]}
    reqs = [_req(0, 0.0), _req(1, 1.0), _req(2, 2.0), _req(3, 2.0), _req(4, 3.0)]
    got = reusable_blocks(reqs, lambda r: keys[r.index])
    # 0 is first (nothing before it); 1 reuses a, b; 2 and 3 arrive together and share a, y;
    # 4 shares nothing; a block is reusable only while the leading run lasts
    assert got == [0, 2, 2, 2, 0]


def test_ideal_prefill_is_the_profiles_chunked_formula() -> None:
    p = load_profile("h200-llama3.1-8b")
    c, bs, budget = p.compute, p.block_size, p.scheduler.max_num_batched_tokens
    assert ideal_prefill_s(p, 1000, 0) == pytest.approx(c.prefill_s(1000, 0))
    # cached blocks shorten it; the last prompt token is always computed
    assert ideal_prefill_s(p, 4 * bs, 10) == pytest.approx(c.prefill_s(bs, 3 * bs))
    n = 2 * budget + 100
    assert ideal_prefill_s(p, n, 0) == pytest.approx(
        c.prefill_s(budget, 0) + c.prefill_s(budget, budget) + c.prefill_s(100, 2 * budget))


@pytest.fixture(scope="module")
def slice_() -> object:
    return load_trace(str(MOONCAKE_SLICE)).window(limit=120)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("speed", [1.0, 8.0])
def test_no_policy_beats_the_ideal(slice_: object, policy: str, speed: float) -> None:
    """The bound holds request by request, idle or crowded, for every policy (the true-state
    one included: it is not a bound, `ideal` is)."""
    fleet = FleetSpec(workers=3, profile=sized_profile(gpu_tokens=150_000), block_size=64)
    settings = SimSettings(fleet=fleet, speed=speed)
    run = Simulation(slice_, policy, settings).run()  # type: ignore[arg-type]
    ideal = ideal_for(slice_, settings)  # type: ignore[arg-type]
    assert ideal.meta.mode == IDEAL
    lim = {r.index: r.ttft_s for r in ideal.results}
    ok = [r for r in run.results if r.ok]
    assert len(ok) == len(run.results)
    for r in ok:
        assert r.ttft_s >= lim[r.index] * (1 - 1e-9), (r.index, r.ttft_s, lim[r.index])
    s = summaries([ideal, run])[1]
    assert s.slowdown is not None and s.slowdown["p50"] >= 1.0 and s.slowdown["p99"] >= s.slowdown["p50"]
    assert 0.0 < s.utilisation <= 1.0


def _res(i: int, worker: str, arrival: float, ttft: float, queue_ms: float, prefill_ms: float) -> RequestResult:
    return RequestResult(run="r", index=i, arrival_s=arrival, start_s=arrival, ttft_s=ttft, queue_ms=queue_ms,
                         load_ms=0.0, prefill_ms=prefill_ms, worker=worker)


def test_busy_fraction_merges_overlaps_and_clips_to_the_arrival_window() -> None:
    rs = [
        _res(0, "w0", 0.0, 2.0, 0.0, 2000.0),  # w0 busy [0, 2]
        _res(1, "w0", 1.0, 2.0, 1000.0, 1000.0),  # [1, 3]: overlaps, merged to [0, 3]
        _res(2, "w1", 8.0, 5.0, 0.0, 5000.0),  # [8, 13], clipped to the window's end: [8, 10]
        _res(3, "w0", 10.0, 0.5, 0.0, 500.0),  # the last arrival ends the window: nothing counts
    ]
    run = Run(RunMeta(run="r", mode="sim", workers=2), rs)
    assert prefill_busy_fraction(run) == pytest.approx((3.0 + 2.0) / (2 * 10.0))
    # a run without per-request timings has no utilisation
    bare = Run(RunMeta(run="r", mode="replay", workers=2), [msgspec.structs.replace(r, prefill_ms=None) for r in rs])
    assert prefill_busy_fraction(bare) != prefill_busy_fraction(bare)  # NaN


def test_slowdown_is_per_request_ttft_over_ideal() -> None:
    rs = [_res(0, "w0", 0.0, 0.2, 0.0, 200.0), _res(1, "w0", 1.0, 0.3, 0.0, 300.0)]
    run = Run(RunMeta(run="r", mode="sim", workers=1), rs)
    assert slowdowns(run, {0: 0.1, 1: 0.3}) == pytest.approx([2.0, 1.0])
    s = summarize(run, {0: 0.1, 1: 0.3})
    assert s.slowdown is not None and s.slowdown["mean"] == pytest.approx(1.5)
    assert summarize(run).slowdown is None
    lim = [msgspec.structs.replace(r, run=IDEAL, ttft_s=t) for r, t in zip(rs, (0.1, 0.3), strict=True)]
    ideal = Run(RunMeta(run=IDEAL, mode=IDEAL), lim)
    table = slowdown_table(summaries([ideal, run]))
    row = next(x for x in table.splitlines() if x.startswith("| r |")).split(" | ")
    assert row[-4:] == ["1.50", "1.95", "1.99", "1.50 |"]  # slowdown p50, p95, p99, mean (interpolated)
    assert next(x for x in table.splitlines() if x.startswith(f"| {IDEAL} |")).endswith("1.00 | 1.00 | 1.00 | 1.00 |")


def test_target_util_search_lands_near_the_target(slice_: object) -> None:
    from loadtest.sweep import find_util_speed

    fleet = FleetSpec(workers=2, profile=sized_profile(gpu_tokens=150_000), block_size=64)
    settings = SimSettings(fleet=fleet)
    speed, probes = find_util_speed(slice_, settings, 0.6, tol=0.05, max_probes=5)  # type: ignore[arg-type]
    assert probes and speed > 0
    best = min(probes, key=lambda p: abs(p.utilisation - 0.6))
    assert speed == best.speed
    assert abs(best.utilisation - 0.6) < 0.15
    by_speed = sorted(probes, key=lambda p: p.speed)  # more load, busier fleet
    assert by_speed[0].utilisation <= by_speed[-1].utilisation
    with pytest.raises(ValueError, match="target utilisation"):
        find_util_speed(slice_, settings, 1.2)  # type: ignore[arg-type]


def _over_limit_trace() -> Trace:
    """Request 0 is over the context of `_small_context()`; 1 and 2 repeat its leading blocks."""
    reqs = [TraceRequest(0, 0.0, 4096, 10, tuple(range(8))),  # 4106 tokens > 4000: every engine refuses it
            TraceRequest(1, 1.0, 2048, 10, tuple(range(4))),
            TraceRequest(2, 2.0, 1024, 10, (0, 1))]
    return Trace("over-limit", 512, reqs)


def _small_context() -> SimSettings:
    profile = replace(sized_profile(gpu_tokens=150_000), max_context_tokens=4000)
    return SimSettings(fleet=FleetSpec(workers=2, profile=profile, block_size=64))


def test_the_ideal_leaves_out_what_the_engines_refuse() -> None:
    """The refused request fails in the ideal as on the engines (400, same message) and
    holds no blocks: the next one, which repeats its prefix, computes its whole prompt."""
    trace, settings = _over_limit_trace(), _small_context()
    profile = settings.fleet.resolved_profile()
    ideal = ideal_for(trace, settings)
    first = ideal.results[0]
    assert (first.ok, first.status, first.ttft_s) == (False, 400, None)
    assert first.error is not None and "maximum context length is 4000" in first.error
    assert ideal.results[1].ttft_s == pytest.approx(ideal_prefill_s(profile, 2048, 0))
    assert ideal.results[2].ttft_s == pytest.approx(ideal_prefill_s(profile, 1024, 1024 // 64))


@pytest.mark.parametrize("policy", ["round_robin", "kv_cost"])
def test_ideal_and_policies_count_the_same_requests(policy: str) -> None:
    trace, settings = _over_limit_trace(), _small_context()
    ideal = ideal_for(trace, settings)
    run = Simulation(trace, policy, settings).run()
    assert [r.ok for r in run.results] == [r.ok for r in ideal.results] == [False, True, True]
    assert run.results[0].error == ideal.results[0].error
    s_ideal, s_run = summaries([ideal, run])
    assert (s_ideal.ok, s_ideal.errors) == (s_run.ok, s_run.errors) == (2, {"400": 1})
    for r, lim in zip(run.results[1:], ideal.results[1:], strict=True):
        assert r.ttft_s is not None and lim.ttft_s is not None and r.ttft_s >= lim.ttft_s * (1 - 1e-9)
