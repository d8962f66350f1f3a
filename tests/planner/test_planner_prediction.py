"""TTFT prediction under load: robust prefill calibration, the per-worker TTFT offset, and
the co-scheduling term (a newcomer sharing the first step of requests not started yet)."""
from __future__ import annotations

import pytest
from tuned import tuned

from kvindex.tiers import Tier
from router.planner.calibration import Calibrator
from router.planner.fleet import FleetWorker, RevisionKnobs, revision_knobs
from router.planner.inflight import STARTS_KEPT_S, InflightLedger
from router.planner.registry import make_policy
from router.planner.terms.coschedule import (
    coschedule_delay,
    coschedule_load_s,
    coschedule_seconds,
    may_coschedule,
    step_spare,
)
from router.planner.terms.interference import interference_delays
from router.planner.terms.recompute import prefill_seconds
from router.planner.types import CostParams, Estimate, RouteRequest, WorkerView


def cost() -> CostParams:
    return CostParams(block_size=64, block_bytes=64 * 131072, prefill_tokens_per_s=35_000.0,
                      prefill_attn_s_per_token2=1e-9, prefill_overhead_s=0.003, max_batched_tokens=8192)


def kv(tokens: int, prefill_s: float) -> dict[str, object]:
    return {"recomputed_tokens": tokens, "prefill_ms": prefill_s * 1000.0, "loaded_tokens": {}}


def test_quantile_calibration_ignores_the_steps_shared_with_others() -> None:
    """A reported prefill also holds the chunks of the requests it shared steps with: the
    lower quantile keeps the worker's own speed where the mean would drift up."""
    c = cost()
    base = prefill_seconds(c, 4000, 0)
    q = Calibrator(prefill_quantile=0.2, prefill_window=50)
    ewma = Calibrator()
    for i in range(50):
        inflated = 1.0 if i % 3 == 0 else 1.0 + (i % 7)  # a third alone, the rest shared
        for cal in (q, ewma):
            cal.observe("w", c, None, 0.0, kv(4000, base * inflated))
    assert q.factors("w")[0] == pytest.approx(1.0)
    assert ewma.factors("w")[0] > 1.3
    # a slower worker moves every sample, the lower quantile with them
    for _ in range(50):
        q.observe("w", c, None, 0.0, kv(4000, base * 2.0))
    assert q.factors("w")[0] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="prefill_quantile"):
        Calibrator(prefill_quantile=1.5)


def test_ttft_offset_is_the_median_residual_and_converges() -> None:
    c = cost()
    cal = Calibrator(ttft_offset=True, prefill_window=9, max_offset_s=0.5)
    assert cal.offset("w") == 0.0
    pred = 0.1
    for _ in range(30):  # the model misses 40 ms every time: the offset learns it, then holds
        cal.observe("w", c, pred + cal.offset("w"), pred + 0.04, kv(10, 0.0))
    assert cal.offset("w") == pytest.approx(0.04)
    for _ in range(30):  # never below 0, never above max_offset_s
        cal.observe("w", c, 1.0 + cal.offset("w"), 0.5, kv(10, 0.0))
    assert cal.offset("w") == 0.0
    for _ in range(30):
        cal.observe("w", c, 0.1 + cal.offset("w"), 5.0, kv(10, 0.0))
    assert cal.offset("w") == 0.5
    off = Calibrator()
    off.observe("w", c, 0.1, 0.2, kv(10, 0.0))
    assert off.offset("w") == 0.0


def test_coschedule_delay_only_when_the_newcomer_shares_their_step() -> None:
    c = cost()
    starts = ((0.0, 400), (0.005, 300))
    q = prefill_seconds(c, 400, 0) + prefill_seconds(c, 300, 0)  # its queue counts them
    # budget 8192 - 10 decodes - 700 leaves 7482: a 5000-token chunk rides in their step
    d = coschedule_seconds(starts, c, q, 5000, 0, 10)
    assert d == pytest.approx(2 * prefill_seconds(c, 5000, 0))
    # a longer prompt only gets the spare budget in that step
    assert coschedule_seconds(starts, c, q, 20_000, 128, 10) == pytest.approx(
        2 * prefill_seconds(c, 8192 - 10 - 700, 128))
    # no spare budget (their work fills its last step exactly), nothing waiting, or a
    # newcomer that starts later (a queue of its own beyond theirs): no delay
    assert coschedule_seconds(((0.0, 8182),), c, prefill_seconds(c, 8182, 0), 100, 0, 10) == 0.0
    assert coschedule_seconds(((0.0, 2 * 8182),), c, prefill_seconds(c, 2 * 8182, 0), 100, 0, 10) == 0.0
    assert coschedule_seconds((), c, 0.0, 100, 0, 0) == 0.0
    assert coschedule_seconds(starts, c, q + 1.0, 5000, 0, 10) == 0.0
    assert coschedule_seconds(starts, c, q + 0.01, 5000, 0, 10, slack_s=0.02) > 0.0


def test_a_newcomer_rides_in_the_last_step_of_a_prefill_longer_than_the_budget() -> None:
    c = cost()
    budget = 8192 - 10
    # one 10,000-token prefill: 8,182 tokens in its first step, 1,818 in its last, which
    # leaves 6,364 for the newcomer's first chunk; it gets its first token that much later
    starts = ((0.0, 10_000),)
    q = prefill_seconds(c, 10_000, 0)
    assert step_spare(starts, budget) == budget - 1_818
    assert coschedule_delay(starts, c, q, 3_000, 0, 10) == pytest.approx(prefill_seconds(c, 3_000, 0))
    assert coschedule_seconds(starts, c, q, 20_000, 0, 10) == pytest.approx(prefill_seconds(c, budget - 1_818, 0))
    # several requests over one step: where their steps fall is too uncertain, no delay
    assert step_spare(((0.0, 6_000), (0.001, 3_000)), budget) <= 0
    assert step_spare(((0.0, 2 * budget),), budget) == 0 and step_spare((), budget) == budget
    assert step_spare(starts, 0) == 0


def test_a_prefetched_newcomer_rides_only_when_its_kv_lands_before_their_step() -> None:
    c = CostParams(block_size=64, block_bytes=64 * 131072, prefill_tokens_per_s=35_000.0,
                   prefill_attn_s_per_token2=1e-9, prefill_overhead_s=0.003, max_batched_tokens=8192,
                   decode_step_s=0.02)
    starts = ((0.0, 400),)
    q = prefill_seconds(c, 400, 0)
    plain = coschedule_delay(starts, c, q, 1000, 512, 10)
    assert plain > 0.0
    # a 4 ms load lands before the step in progress ends (half a 20 ms decode step): it rides
    assert coschedule_delay(starts, c, q, 1000, 512, 10, load_s=0.004) == pytest.approx(plain)
    # a 15 ms load is likely still arriving at the boundary: passed over, no delay
    assert coschedule_delay(starts, c, q, 1000, 512, 10, load_s=0.015) == 0.0
    # requests that still queue 50 ms leave it until then
    later = ((0.05, 400),)
    assert coschedule_delay(later, c, q, 1000, 512, 10, load_s=0.04) > 0.0
    assert coschedule_delay(later, c, q, 1000, 512, 10, load_s=0.07) == 0.0
    # which estimates may ride at all: no load, or (with prefetch) a load hidden in the queue
    cpu8 = {Tier.CPU: 8}
    hidden = Estimate(worker_id="w0", matched_blocks=cpu8, load_blocks_by_tier=cpu8, prefetch_blocks=cpu8,
                      recompute_tokens=1000, t_queue=0.02, t_load=0.0, t_load_total=0.004, t_prefill=0.03, t_ttft=0.05)
    exposed = Estimate(worker_id="w0", matched_blocks=cpu8, load_blocks_by_tier=cpu8, prefetch_blocks=cpu8,
                       recompute_tokens=1000, t_queue=0.0, t_load=0.004, t_load_total=0.004, t_prefill=0.03,
                       t_ttft=0.034)
    assert may_coschedule(hidden, overlap=True) and coschedule_load_s(hidden, True) == 0.004
    assert not may_coschedule(hidden, overlap=False) and coschedule_load_s(hidden, False) == 0.0
    assert not may_coschedule(exposed, overlap=True)


def test_interference_delays_each_loading_request_by_what_overlaps_its_landing() -> None:
    # the newcomer starts prefilling at 0.1 s (its queue of 0.3 s less the loading
    # requests' own 0.2 s of prefill, which it does not wait for) and ends at 0.4 s
    loads = ((0.05, 0.1), (0.2, 0.1), (0.5, 0.0))
    delays = interference_delays(loads, 0.3, 0.0, 0.3, overlap=True)
    # landed before it starts: prefilling ahead of it, not delayed; lands mid-prefill:
    # waits the rest of it; lands after it ends: not delayed
    assert delays == pytest.approx([0.0, 0.2, 0.0])
    # with 0.1 s of slack the first counts as landing at the start: it waits the whole prefill
    assert interference_delays(loads, 0.3, 0.0, 0.3, True, slack_s=0.1) == pytest.approx([0.3, 0.2, 0.0])
    assert sum(interference_delays(loads, 0.3, 0.0, 0.3, True, 0.1)) == pytest.approx(0.5)
    assert interference_delays((), 0.3, 0.0, 0.3, True) == []


def test_ledger_lists_requests_not_started_and_drops_them_once_started() -> None:
    led = InflightLedger("w0")
    e = Estimate(worker_id="w0", recompute_tokens=500, t_queue=0.2, t_prefill=0.01, t_ttft=0.21)
    t = led.dispatched(10.0, 500, 600, e)
    v = WorkerView("w0", cost())
    led.fill(v, 10.1)
    assert v.inflight_starts == (pytest.approx((0.1, 500)),)
    led.fill(v, 10.2 + STARTS_KEPT_S + 1e-6)  # predicted to have started: gone
    assert v.inflight_starts == ()
    t2 = led.dispatched(11.0, 500, 600, e)
    led.first_token(t2, 11.05)  # it really started (and finished its prefill)
    led.fill(v, 11.1)
    assert v.inflight_starts == ()
    # a request loading KV from below GPU is in inflight_loads instead
    cpu4 = {Tier.CPU: 4}
    eload = Estimate(worker_id="w0", matched_blocks=cpu4, load_blocks_by_tier=cpu4, prefetch_blocks=cpu4,
                     recompute_tokens=100, t_queue=0.0, t_load=0.05, t_load_total=0.05, t_prefill=0.01, t_ttft=0.06)
    led.dispatched(12.0, 100, 200, eload)
    led.fill(v, 12.0)
    assert v.inflight_starts == () and len(v.inflight_loads) == 1
    assert t.prefill_tokens == 500


def _req(tokens: int) -> RouteRequest:
    return RouteRequest(prompt_tokens=tokens, digests=[], matches={})


def test_kv_cost_prices_the_step_it_would_share_when_asked() -> None:
    ws = [WorkerView(f"w{i}", cost(), running_requests=4) for i in range(2)]
    ws[0].inflight_starts = ((0.0, 300),)  # a short request about to start on w0
    ws[0].inflight_since_report_prefill_tokens, ws[0].inflight_since_report_requests = 300, 1
    ws[1].est_queue_s = 0.02  # w1 is slightly busier
    r = _req(6000)
    plain = tuned("kv_cost", all_estimates=True).choose(r, ws)
    assert plain.worker_id == "w0"  # on its own TTFT w0 is better
    d = tuned("kv_cost", all_estimates=True, coschedule_weight=1.0).choose(r, ws)
    assert d.worker_id == "w1"  # but it would hold the short one's first token back
    e0 = d.estimates[0]
    assert e0.t_coschedule == pytest.approx(prefill_seconds(ws[0].cost, 6000, 0)) and e0.t_interference >= \
        e0.t_coschedule
    assert d.predicted_ttft == d.estimates[1].t_ttft  # the prediction stays its own TTFT
    with pytest.raises(ValueError, match="coschedule_weight"):
        tuned("kv_cost", coschedule_weight=-1.0)


def test_kv_cost_prediction_includes_the_learned_offset() -> None:
    ws = [WorkerView("w0", cost())]
    r = _req(2000)
    p = make_policy("kv_cost")
    before = p.choose(r, ws).predicted_ttft
    assert before is not None
    own = prefill_seconds(ws[0].cost, 2000, 0)
    for _ in range(40):  # the worker always answers 30 ms later than the model says
        pred = p.choose(r, ws).predicted_ttft
        p.observe("w0", pred, before + 0.03, kv(2000, own))
    assert p.choose(r, ws).predicted_ttft == pytest.approx(before + 0.03, rel=1e-6)


def test_calibration_constants_reach_the_calibrator() -> None:
    """PREFILL_QUANTILE and TTFT_OFFSET are constants, not settings; a tuning changes them."""
    p = make_policy("kv_cost")
    assert p.calibrator.prefill_quantile == 0.2 and p.calibrator.ttft_offset
    old = tuned("kv_cost", prefill_quantile=None, ttft_offset=False)
    assert old.calibrator.prefill_quantile is None and not old.calibrator.ttft_offset
    with pytest.raises(ValueError, match="prefill_quantile"):
        tuned("kv_cost", prefill_quantile=2.0)
    with pytest.raises(ValueError, match="ttft_offset"):
        tuned("kv_cost", ttft_offset="yes")


def test_a_slow_first_request_alone_sets_no_offset() -> None:
    c = cost()
    cal = Calibrator(ttft_offset=True)
    cal.observe("w", c, 0.1, 0.9, kv(10, 0.0))  # a warm-up request, 0.8 s slow
    assert cal.offset("w") == 0.0  # its cached prompts still go to it
    cal.observe("w", c, 0.1, 0.1, kv(10, 0.0))
    assert cal.offset("w") == 0.0
    cal.observe("w", c, 0.1, 0.1, kv(10, 0.0))  # three residuals: the median is a normal one
    assert cal.offset("w") == pytest.approx(0.0, abs=1e-9)
    for _ in range(3):
        cal.observe("w", c, 0.1 + cal.offset("w"), 0.9, kv(10, 0.0))  # now slow for real: learnt
    assert cal.offset("w") == pytest.approx(0.8)


def test_one_prefill_alone_does_not_rescale_a_worker() -> None:
    c = cost()
    base = prefill_seconds(c, 4000, 0)
    q = Calibrator(prefill_quantile=0.2, accept_after=3)
    for _ in range(2):
        q.observe("w", c, None, 0.0, kv(4000, base * 0.3))
    assert q.factors("w")[0] == 1.0  # two samples: not yet
    q.observe("w", c, None, 0.0, kv(4000, base * 0.3))
    assert q.factors("w")[0] == pytest.approx(0.3)


def test_a_dispatch_revises_the_requests_it_will_delay_on_that_worker() -> None:
    """FleetWorker.revise_ahead, as the gateway and the simulator run it: a newcomer that
    rides in the step of a request not started yet delays it by its chunk, added to that
    request's ticket; one still loading its KV is delayed by the newcomer's prefill where
    it overlaps the landing; no estimate (or an ineligible one) revises nothing."""
    c = cost()
    fw = FleetWorker(WorkerView("w0", c, running_requests=4))
    first = Estimate(worker_id="w0", recompute_tokens=400, t_queue=0.01, t_prefill=prefill_seconds(c, 400, 0),
                     t_ttft=0.01 + prefill_seconds(c, 400, 0))
    t1 = fw.dispatched(10.0, 400, 500, first)
    q2 = 0.01 + prefill_seconds(c, 400, 0)
    second = Estimate(worker_id="w0", recompute_tokens=1000, t_queue=q2, t_prefill=prefill_seconds(c, 1000, 0),
                      t_ttft=q2 + prefill_seconds(c, 1000, 0))
    out = fw.revise_ahead(second, 10.0, RevisionKnobs())
    assert out == [(t1, pytest.approx(prefill_seconds(c, 1000, 0)))]
    assert t1.revised_s == pytest.approx(prefill_seconds(c, 1000, 0))
    assert fw.revise_ahead(None, 10.0, RevisionKnobs()) == []
    second.eligible = False
    assert fw.revise_ahead(second, 10.0, RevisionKnobs()) == []
    # a request loading its KV until 10.3 s: a newcomer prefilling 10.1-10.4 s holds it 0.1 s
    cpu4 = {Tier.CPU: 4}
    loading = Estimate(worker_id="w0", matched_blocks=cpu4, load_blocks_by_tier=cpu4, prefetch_blocks=cpu4,
                       recompute_tokens=100, t_queue=0.0, t_load=0.3, t_load_total=0.3, t_prefill=0.05, t_ttft=0.35)
    fw2 = FleetWorker(WorkerView("w1", c, running_requests=4))
    t2 = fw2.dispatched(10.0, 100, 400, loading)
    late = Estimate(worker_id="w1", recompute_tokens=9000, t_queue=0.15, t_prefill=0.3, t_ttft=0.45)
    assert fw2.revise_ahead(late, 10.0, RevisionKnobs()) == [(t2, pytest.approx(0.1))]


def test_revision_knobs_come_from_the_policy_with_defaults_for_the_baselines() -> None:
    kc = tuned("kv_cost", prefetch=False, coschedule_slack_s=0.005)
    assert revision_knobs(kc, "w0") == RevisionKnobs(False, 1.0, 0.005)
    assert revision_knobs(make_policy("round_robin"), "w0") == RevisionKnobs()
