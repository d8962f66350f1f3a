"""The simulator's gateway queue: burst ordering and late binding, through the planner's
GatewayQueue, with every request still answered once."""
from __future__ import annotations

import pytest

from loadtest.fleet import FleetSpec
from loadtest.router_model import RouterSettings
from loadtest.scenarios.base import sized_profile
from loadtest.simulate import SimSettings, Simulation
from loadtest.trace import Trace, TraceRequest
from loadtest.tracefiles import MOONCAKE_SLICE
from loadtest.traces import load_trace


def _burst(*sizes: int, at: float = 0.0, first: int = 0) -> list[TraceRequest]:
    out = []
    for i, n in enumerate(sizes):
        base = 10_000 * (first + i + 1)
        out.append(TraceRequest(first + i, at, n, 4, tuple(range(base, base + -(-n // 512)))))
    return out


def held_order(run: object) -> list[int]:
    """Held requests in the order they were bound (by the end of their hold)."""
    held = [r for r in run.results if r.client_queue_s > 0.0]  # type: ignore[attr-defined]
    return [r.index for r in sorted(held, key=lambda r: (r.arrival_s + r.client_queue_s, r.client_queue_s))]


def _one(**kw: object) -> SimSettings:
    fleet = FleetSpec(workers=1, profile=sized_profile(gpu_tokens=400_000), block_size=64)
    return SimSettings(fleet=fleet, router=RouterSettings(**kw))  # type: ignore[arg-type]


def test_spf_binds_the_short_prompt_of_a_burst_first() -> None:
    trace = Trace("burst", 512, _burst(60_000, 1_000))
    fifo = Simulation(trace, "round_robin", _one()).run().results
    spf = Simulation(trace, "round_robin", _one(gateway_order="spf")).run().results
    # FCFS at the worker: the short one waits for the long prefill unless bound first
    assert fifo[1].ttft_s > fifo[0].ttft_s * 0.9
    assert spf[1].ttft_s < spf[0].ttft_s / 5
    assert all(r.client_queue_s == 0.0 for r in spf)  # ordering alone holds nothing


def test_late_binding_holds_until_a_worker_drains_and_predictions_count_from_binding() -> None:
    reqs = _burst(40_000) + _burst(2_000, 30_000, 1_500, at=0.05, first=1)
    trace = Trace("late", 512, reqs)
    run = Simulation(trace, "kv_cost", _one(gateway_order="spf", hold_target_s=0.2, max_hold_s=30.0)).run()
    res = run.results
    assert all(r.ok for r in res)
    held = [r for r in res if r.client_queue_s > 0.0]
    assert {r.index for r in held} == {1, 2, 3}  # the first one found the worker idle
    # bound shortest first once the long prefill drained below the target (the two short
    # ones may be bound at the same release and share a step)
    first = {r.index: r.arrival_s + r.ttft_s for r in held}
    assert first[3] <= first[1] < first[2]
    assert held_order(run) == [3, 1, 2]
    assert min(r.client_queue_s for r in held) > 1.0  # the 40k-token prefill had to drain first
    for r in held:  # its prediction, made at binding, plus the hold it had already waited
        assert r.predicted_ttft_s is not None and r.predicted_ttft_s >= r.client_queue_s
    st = run.meta.stats
    assert st["gateway_held"] == 3 and st["gateway_hold_p99_s"] > 0.0 and "pred_err_bind_p50" in st


def test_the_fairness_bound_releases_a_held_request() -> None:
    reqs = _burst(100_000) + _burst(1_000, at=0.01, first=1)
    trace = Trace("fair", 512, reqs)
    run = Simulation(trace, "kv_cost", _one(hold_target_s=0.1, max_hold_s=0.5)).run()
    short = run.results[1]
    # never bound on queue grounds (the long prefill takes seconds), so the bound releases it
    assert 0.5 <= short.client_queue_s < 0.5 + 0.2


def test_every_request_answered_with_the_gateway_queue_on_a_real_slice() -> None:
    trace = load_trace(str(MOONCAKE_SLICE)).window(limit=80)
    fleet = FleetSpec(workers=3, profile=sized_profile(gpu_tokens=150_000), block_size=64)
    rs = RouterSettings(gateway_order="spf", hold_target_s=0.3, max_hold_s=1.0)
    run = Simulation(trace, "kv_cost", SimSettings(fleet=fleet, router=rs, speed=6.0)).run()
    assert [r.index for r in run.results] == list(range(80))
    assert all(r.ok for r in run.results)
    assert max(r.client_queue_s for r in run.results) <= 1.0 + 0.1 + 1e-9  # bound + one poll


def _revision(first: int, second: int, *, busy: bool, revise: bool = True) -> tuple[object, object, dict[str, int]]:
    """Two prompts sent at once to one worker, optionally while a third decodes there."""
    reqs = []
    if busy:
        reqs += [TraceRequest(0, 0.0, 700, 400, tuple(range(900, 902)))]
    reqs += _burst(first, second, at=0.5, first=len(reqs))
    fleet = FleetSpec(workers=1, profile=sized_profile(gpu_tokens=400_000), block_size=64)
    rs = RouterSettings(revise_predictions=revise, poll_interval_s=0.05)
    run = Simulation(Trace("rev", 512, reqs), "kv_cost", SimSettings(fleet=fleet, router=rs)).run()
    a, b = run.results[-2:]
    return a, b, run.meta.stats


def test_a_prediction_moves_when_the_router_sends_another_request_into_its_step() -> None:
    """A short prompt waiting for the step boundary of a decoding worker shares its first
    step with the long prompt sent right after it: its first token comes that chunk later,
    and the router, which sent both, says so."""
    a, b, st = _revision(600, 6_000, busy=True)
    a0, _, st0 = _revision(600, 6_000, busy=True, revise=False)
    assert st["predictions_revised"] == 1 and st0["predictions_revised"] == 0
    assert a.ttft_s == a0.ttft_s  # revising predictions changes nothing else here
    assert a.ttft_s > 5 * (a0.predicted_ttft_s or 0)  # the unrevised prediction was far off
    assert abs(a.predicted_ttft_s - a.ttft_s) < 0.25 * a.ttft_s  # the revised one is close
    assert st["pred_err_dispatch_p90"] >= st["pred_err_dispatch_p50"]
    # an idle worker starts the first request at once, alone: no revision
    _, _, idle = _revision(600, 6_000, busy=False)
    assert idle["predictions_revised"] == 0


def test_a_prefill_longer_than_the_step_budget_is_revised_by_a_rider_in_its_last_step() -> None:
    """A 10,000-token prompt spans two 8,192-token steps; a 3,000-token prompt sent right
    after it rides in its second step, which delays its first token by that chunk."""
    a, b, st = _revision(10_000, 3_000, busy=True)
    a0, _, _ = _revision(10_000, 3_000, busy=True, revise=False)
    assert st["predictions_revised"] == 1
    assert a.ttft_s == a0.ttft_s and b.ttft_s == pytest.approx(a.ttft_s, rel=0.05)  # they end in one step
    err = abs(a.predicted_ttft_s - a.ttft_s) / a.ttft_s
    err0 = abs(a0.predicted_ttft_s - a0.ttft_s) / a0.ttft_s
    assert err < 0.1 < err0
