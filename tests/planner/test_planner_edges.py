"""Boundaries of the routing policies and the cost model that the other planner tests
leave open: the exact thresholds (`>` vs `>=`), which worker a fallback picks, and the
calibrated cost model agreeing with the effective speeds it stands for.

Each test names the rule it pins; they were written against surviving mutants
(bench/notes/mutation.md), so each would fail if that rule were changed by one operator.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from tuned import tuned

from kvindex.index import PrefixMatch
from kvindex.tiers import Tier
from router.planner import make_policy
from router.planner.calibration import Calibrator
from router.planner.cost import RequestContext, estimate_worker, ttft_lower_bound
from router.planner.fleet import PrefetchRule, plan_prefetch
from router.planner.inflight import InflightLedger
from router.planner.terms.kv_load import load_seconds
from router.planner.terms.recompute import prefill_seconds
from router.planner.types import CostParams, Decision, Link, RouteRequest, WorkerView

B = 16
BLOCK_BYTES = 2 * 1024 * 1024


def cost(**kw: object) -> CostParams:
    base: dict[str, object] = dict(
        block_size=B,
        block_bytes=BLOCK_BYTES,
        prefill_tokens_per_s=40_000.0,
        prefill_attn_s_per_token2=1e-10,
        prefill_overhead_s=0.004,
        links={Tier.CPU: Link(50e9, 1e-5), Tier.DISK: Link(6e9, 1e-4)},
    )
    base.update(kw)
    return CostParams(**base)  # type: ignore[arg-type]


def fleet(n: int, **kw: object) -> list[WorkerView]:
    return [WorkerView(f"w{i}", cost(), **kw) for i in range(n)]  # type: ignore[arg-type]


def request(tokens: int, matches: dict[str, PrefixMatch] | None = None) -> RouteRequest:
    return RouteRequest(tokens, list(range(tokens // B)), matches or {})


def pm(wid: str, *runs: tuple[Tier, int]) -> PrefixMatch:
    return PrefixMatch(wid, sum(n for _, n in runs), tuple(runs))


# ----------------------------------------------------------------------------- cache_aware


def test_cache_aware_imbalance_sends_to_the_least_loaded_worker_wherever_it_sits():
    """When the fleet is imbalanced, SGLang's rule sends to the least loaded worker: the
    one with the fewest outstanding requests, not the first or second in fleet order.
    The retry order is by load too."""
    p = make_policy("cache_aware")
    ws = fleet(3)
    ws[0].running_requests = 100
    ws[1].running_requests = 50  # w2 idle: the least loaded sits last
    d = p.choose(request(1600, {"w0": pm("w0", (Tier.GPU, 99))}), ws)
    assert (d.worker_id, d.reason) == ("w2", "imbalanced")
    assert d.ranked == ["w2", "w1", "w0"]


def test_cache_aware_imbalance_is_the_load_difference_not_the_sum():
    """Imbalance is `max - min > balance_abs_threshold`: two busy workers 20 requests
    apart (sum 40 > 32) are balanced, so the cache hit still wins."""
    p = make_policy("cache_aware")
    ws = fleet(2)
    ws[0].running_requests, ws[1].running_requests = 30, 10
    d = p.choose(request(1600, {"w0": pm("w0", (Tier.GPU, 90))}), ws)
    assert (d.worker_id, d.reason) == ("w0", "cache_hit")


def test_cache_aware_imbalance_thresholds_are_strict():
    """Both imbalance tests are strict: a difference of exactly `balance_abs_threshold`,
    or a ratio of exactly `balance_rel_threshold`, is still balanced (cache wins)."""
    hit = request(1600, {"w0": pm("w0", (Tier.GPU, 90))})
    ws = fleet(2)
    ws[0].running_requests = 32  # 32 - 0 == the absolute threshold
    d = make_policy("cache_aware", balance_abs_threshold=32).choose(hit, ws)
    assert (d.worker_id, d.reason) == ("w0", "cache_hit")
    ws[0].running_requests, ws[1].running_requests = 80, 40  # 80 == 2.0 * 40
    d = make_policy("cache_aware", balance_abs_threshold=32, balance_rel_threshold=2.0).choose(hit, ws)
    assert (d.worker_id, d.reason) == ("w0", "cache_hit")
    ws[0].running_requests = 81  # one more and it is imbalanced
    d = make_policy("cache_aware", balance_abs_threshold=32, balance_rel_threshold=2.0).choose(hit, ws)
    assert (d.worker_id, d.reason) == ("w1", "imbalanced")


def test_cache_aware_hit_rate_must_exceed_the_threshold():
    """A match covering exactly `cache_threshold` of the prompt is a miss: the request
    goes where the most GPU blocks are free."""
    p = make_policy("cache_aware", cache_threshold=0.5)
    ws = fleet(2)
    ws[1].gpu_free_blocks = 500
    d = p.choose(request(1600, {"w0": pm("w0", (Tier.GPU, 50))}), ws)  # 50 * 16 / 1600 == 0.5
    assert (d.worker_id, d.reason) == ("w1", "cache_miss")
    d = p.choose(request(1600, {"w0": pm("w0", (Tier.GPU, 51))}), ws)
    assert (d.worker_id, d.reason) == ("w0", "cache_hit")


# ----------------------------------------------------------------------------- dynamo


def test_dynamo_active_blocks_are_the_gpu_blocks_in_use():
    """Without the router's own KV accounting, Dynamo's decode load is the GPU blocks in
    use (`capacity - free`, never below 0): an idle worker adds nothing, a worker using
    60 of 100 blocks adds 60 to the cost."""
    p = make_policy("dynamo")
    idle, busy = fleet(2, gpu_capacity_blocks=100, gpu_free_blocks=100)
    busy.gpu_free_blocks = 40
    r = request(320)  # 20 blocks, nothing cached
    assert p.cost(r, idle) == pytest.approx(20 + 20)  # prefill blocks + request blocks
    assert p.cost(r, busy) == pytest.approx(20 + 60 + 20)
    over = replace(idle, gpu_free_blocks=150)  # a report with more free than capacity
    assert p.cost(r, over) == pytest.approx(40)
    assert p.choose(r, [busy, idle]).worker_id == "w0"


# ----------------------------------------------------------------------------- kv_cost


def test_kv_cost_tie_window_includes_the_absolute_slack():
    """Near-ties go to the less loaded worker within `score * (1 + tie_margin) + tie_abs_s`:
    with no relative margin, a worker 2 ms slower but with fewer outstanding requests
    still wins under a 5 ms absolute slack (and loses without it)."""
    ws = fleet(2)
    ws[0].running_requests = 3
    r = request(4096, {"w0": pm("w0", (Tier.GPU, 8))})  # w0 a little faster (128 cached tokens)
    alone = tuned("kv_cost", tie_margin=0.0, tie_abs_s=0.0).choose(r, ws)
    assert alone.worker_id == "w0"
    gap = next(e.t_ttft for e in alone.estimates if e.worker_id == "w1") - alone.predicted_ttft
    assert 0.001 < gap < 0.005
    d = tuned("kv_cost", tie_margin=0.0, tie_abs_s=0.005).choose(r, ws)
    assert (d.worker_id, d.reason) == ("w1", "tie_less_load")


def test_kv_cost_pruning_keeps_workers_inside_the_absolute_tie_window():
    """Pruning skips a worker only when its lower bound is past the tie window; a worker
    whose bound is inside it (here: 2 ms behind, tie_abs_s 5 ms) is evaluated and wins
    the tie on load, exactly as the full evaluation decides."""
    ws = fleet(3)
    ws[0].running_requests = 3
    ws[1].running_requests = 3
    r = request(4096, {"w0": pm("w0", (Tier.GPU, 8)), "w1": pm("w1", (Tier.GPU, 8))})
    for params in (dict(tie_margin=0.0, tie_abs_s=0.005), dict(tie_margin=0.0, tie_abs_s=0.0)):
        fast = tuned("kv_cost", **params).choose(r, ws)
        full = tuned("kv_cost", all_estimates=True, **params).choose(r, ws)
        assert (fast.worker_id, fast.reason) == (full.worker_id, full.reason)
    assert tuned("kv_cost", tie_margin=0.0, tie_abs_s=0.005).choose(r, ws).worker_id == "w2"
    # The window's edge is inside it: three identical idle-queue workers tie exactly, and
    # the last one (fewest outstanding) must still be evaluated to win the tie.
    ws = fleet(3)
    ws[0].running_requests = ws[1].running_requests = 2
    d = tuned("kv_cost", tie_margin=0.0, tie_abs_s=0.0, balance_eps=None).choose(request(4096), ws)
    assert (d.worker_id, d.reason, len(d.estimates)) == ("w2", "tie_less_load", 3)


def test_kv_cost_bounded_load_limit_counts_the_new_request():
    """The bounded-load guard: limit = ceil((1 + eps) * (outstanding + 1) / n) + slack, and
    a worker stays in the pool while its load plus this request is within it. With
    eps 0, slack 0 and loads 1 and 2: limit 2, so w0 (1 + 1 <= 2) may win but w1
    (2 + 1 > 2) is held, even though w1 holds the whole prefix."""
    ws = fleet(2)
    ws[0].running_requests, ws[1].running_requests = 1, 2
    r = request(8192, {"w1": pm("w1", (Tier.GPU, 500))})
    d = tuned("kv_cost", balance_eps=0.0, balance_slack=0.0).choose(r, ws)
    assert (d.worker_id, d.reason) == ("w0", "min_ttft")
    held = next(e for e in d.estimates if e.worker_id == "w1")
    assert not held.eligible and "bounded load: 2 outstanding > 1" in held.note
    assert d.ranked == ["w0", "w1"]
    # one more slack request and w1 is back in the pool, where its cache wins
    d = tuned("kv_cost", balance_eps=0.0, balance_slack=1.0).choose(r, ws)
    assert d.worker_id == "w1"


@pytest.mark.parametrize(("below", "prefetch"), [(2, 0), (3, 3), (4, 4)])
def test_kv_cost_prefetch_needs_at_least_min_prefetch_blocks_below_gpu(below, prefetch):
    """The decision asks the worker to raise its CPU blocks toward GPU only when at least
    `min_prefetch_blocks` of them are to be loaded (exactly the minimum counts)."""
    ws = fleet(1)
    r = request(1600, {"w0": pm("w0", (Tier.CPU, below))})
    d = tuned("kv_cost", min_prefetch_blocks=3).choose(r, ws)
    assert d.estimates[0].load_blocks == below
    assert d.prefetch_blocks == prefetch


# ----------------------------------------------------------------------------- cost model, calibrated


def _calibrated(prefill_scale: float, cpu_scale: float) -> Calibrator:
    """A calibrator that has learnt these multipliers for worker w0 (alpha 1: one step)."""
    cal = Calibrator(alpha=1.0, accept_after=1, min_scale=0.1, max_scale=10.0)
    base = cost()
    t = prefill_seconds(base, 4000, 0) * prefill_scale
    cal.observe("w0", base, None, t, {"recomputed_tokens": 4000, "prefill_ms": t * 1000.0})
    t = load_seconds(base.links[Tier.CPU], 10, BLOCK_BYTES) * cpu_scale
    cal.observe("w0", base, None, t, {"loaded_tokens": {"CPU": 10 * B}, "load_ms": t * 1000.0})
    ps, ls = cal.factors("w0")
    assert ps == pytest.approx(prefill_scale) and ls == {Tier.CPU: pytest.approx(cpu_scale)}
    return cal


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize(("ps", "cs"), [(2.0, 3.0), (0.5, 0.25)])
def test_calibrated_estimate_equals_the_estimate_over_effective_speeds(ps, cs, prefetch):
    """The cost model scales time by the calibrator's multipliers: a prefill `ps` times
    slower (speed / ps, attention and overhead * ps) and CPU loads `cs` times slower
    (per-block time and latency * cs). That must equal pricing the effective speeds
    `Calibrator.apply` shows (the admin API's numbers) with no scaling at all."""
    cal = _calibrated(ps, cs)
    w = WorkerView("w0", cost(), waiting_requests=2, waiting_prefill_tokens=3000, supports_prefetch=prefetch)
    eff = replace(w, cost=cal.apply("w0", w.cost))
    for matches in ({}, {"w0": pm("w0", (Tier.GPU, 20), (Tier.CPU, 200))}):
        r = request(8192, matches)
        ctx = RequestContext.build(r, [w])
        scale, links = cal.factors("w0")
        a = estimate_worker(ctx, w, prefill_scale=scale, link_scales=links)
        b = estimate_worker(RequestContext.build(r, [eff]), eff)
        assert (a.load_blocks, a.recompute_tokens) == (b.load_blocks, b.recompute_tokens)
        for f in ("t_queue", "t_load", "t_load_total", "t_prefill", "t_ttft"):
            assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-9, abs=1e-12), f
        assert ttft_lower_bound(ctx, w, prefill_scale=scale) == pytest.approx(
            ttft_lower_bound(RequestContext.build(r, [eff]), eff), rel=1e-9)
    # the CPU run is really loaded, at the calibrated link speed
    r = request(8192, {"w0": pm("w0", (Tier.CPU, 100))})
    a = estimate_worker(RequestContext.build(r, [w]), w, prefill_scale=ps, link_scales={Tier.CPU: cs})
    assert a.load_blocks == 100
    assert a.t_load_total == pytest.approx(load_seconds(w.cost.links[Tier.CPU], 100, BLOCK_BYTES) * cs)


def test_lower_bound_scales_the_prefill_with_the_calibration():
    """The pruning bound is `T_queue + T_prefill * prefill_scale`: with nothing cached it
    equals the full estimate, calibrated or not (a bound above the estimate would prune
    the best worker, one far below would prune nothing)."""
    w = WorkerView("w0", cost(), waiting_requests=1, waiting_prefill_tokens=500)
    ctx = RequestContext.build(request(4096), [w])
    for ps in (1.0, 0.5, 3.0):
        est = estimate_worker(ctx, w, prefill_scale=ps)
        assert ttft_lower_bound(ctx, w, prefill_scale=ps) == pytest.approx(est.t_ttft, rel=1e-12)
        assert est.t_prefill == pytest.approx(prefill_seconds(w.cost, 4096, 0, ps), rel=1e-12)


def test_calibration_never_goes_below_min_scale():
    """A worker that looks absurdly fast (prefill 100x quicker than its profile, again
    and again) is believed only down to `min_scale`, so one bad clock cannot make the
    router send it everything."""
    base = cost()
    cal = Calibrator(min_scale=0.25, accept_after=1)
    t = prefill_seconds(base, 4000, 0) / 100
    for _ in range(100):
        cal.observe("w0", base, None, t, {"recomputed_tokens": 4000, "prefill_ms": t * 1000.0})
    assert cal.factors("w0")[0] == 0.25
    assert cal.coefficients("w0").prefill_samples == 100  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- in-flight ledger


def test_report_taken_counts_every_request_the_report_may_not_know():
    """After a report asked for at `sent_at`, the since-report counts are every live
    request the worker had not accepted before then (all of them, summed, not the last
    one), and their prefill tokens unless their first token came already."""
    led = InflightLedger("w")
    a = led.dispatched(1.0, 300, 1000)
    led.dispatched(1.1, 200, 500)
    c = led.dispatched(1.2, 100, 400)
    d = led.dispatched(1.3, 50, 400)
    led.accepted(a, 1.5)
    led.accepted(c, 2.5)
    led.first_token(d, 2.6)
    led.report_taken(sent_at=2.0)  # knows a; b is unread, c and d came after (d prefilled)
    assert (led.since_requests, led.since_prefill_tokens) == (3, 300)
    led.report_taken(sent_at=None)  # an instantaneous poll knows everything
    assert (led.since_requests, led.since_prefill_tokens) == (0, 0)


def test_a_request_accepted_when_the_report_was_asked_for_is_known_to_it():
    """`accepted_at == sent_at` counts as known: the worker held it when it was asked."""
    led = InflightLedger("w")
    a = led.dispatched(1.0, 300, 1000)
    led.accepted(a, 2.0)
    led.report_taken(sent_at=2.0)
    assert (led.since_requests, led.since_prefill_tokens) == (0, 0)


def test_first_token_keeps_the_earlier_acceptance_time():
    """A first token implies acceptance, but never moves an acceptance already seen:
    a request accepted before a report stays known to it."""
    led = InflightLedger("w")
    a = led.dispatched(1.0, 300, 1000)
    led.accepted(a, 1.5)
    led.first_token(a, 3.0)
    assert a.accepted_at == 1.5
    led.report_taken(sent_at=2.0)
    assert led.since_requests == 0
    b = led.dispatched(4.0, 100, 100)  # never seen accepted: the first token dates it
    led.first_token(b, 5.0)
    assert b.accepted_at == 5.0
    assert (b.worker_id, b.t_dispatch) == ("w", 4.0)


# ----------------------------------------------------------------------------- prefetch plan


def test_prefetch_of_exactly_min_blocks_is_sent():
    """`routing.prefetch.min_blocks` is a minimum: a plan of exactly that many blocks (in
    total, and after skipping the leading GPU run) is sent."""
    rule = PrefetchRule(min_blocks=2)
    d = Decision("w", "kv_cost", "min_ttft", prefetch_blocks=2)
    p = plan_prefetch(d, 10, None, None, rule, True)
    assert p is not None and (p.start, p.end) == (0, 2)
    d = Decision("w", "kv_cost", "min_ttft", prefetch_blocks=3)
    p = plan_prefetch(d, 10, pm("w", (Tier.GPU, 1), (Tier.CPU, 2)), None, rule, True)
    assert p is not None and (p.start, p.end, p.blocks) == (1, 3, 2)
    assert plan_prefetch(d, 10, pm("w", (Tier.GPU, 2), (Tier.CPU, 1)), None, rule, True) is None


def test_prefetch_deadline_is_never_negative_or_nan():
    """Sanity of the deadline arithmetic the gateway puts on the wire (milliseconds)."""
    d = Decision("w", "kv_cost", "min_ttft", prefetch_blocks=4)
    p = plan_prefetch(d, 10, None, None, PrefetchRule(), True)
    assert p is not None and math.isfinite(p.deadline_s) and p.deadline_s > 0


# ----------------------------------------------------------------------------- calibration rules


def _prefill_obs(cal: Calibrator, ratio: float, tokens: int = 4000, wid: str = "w0") -> None:
    """One finished prefill of `tokens` that took `ratio` times the profile's prediction."""
    base = cost()
    t = prefill_seconds(base, tokens, 0) * ratio
    cal.observe(wid, base, None, t, {"recomputed_tokens": tokens, "prefill_ms": t * 1000.0})


def test_an_outlier_is_believed_only_after_accept_after_in_a_row():
    """A prefill 5x off the current scale (beyond `outlier_ratio` 3) is rejected until
    `accept_after` (3) such prefills came in a row; a believable one in between starts
    the count again. Catches the streak counting two per outlier, or never resetting."""
    cal = Calibrator(alpha=1.0, accept_after=3, outlier_ratio=3.0, min_scale=0.1, max_scale=10.0)
    for _ in range(2):
        _prefill_obs(cal, 5.0)
        assert cal.factors("w0")[0] == 1.0
    _prefill_obs(cal, 1.2)  # believable: taken, and the outlier count starts again
    assert cal.factors("w0")[0] == pytest.approx(1.2)
    for _ in range(2):
        _prefill_obs(cal, 6.0)
        assert cal.factors("w0")[0] == pytest.approx(1.2)
    _prefill_obs(cal, 6.0)  # the third in a row: the worker really is that slow now
    assert cal.factors("w0")[0] == pytest.approx(6.0)
    co = cal.coefficients("w0")
    assert co is not None and (co.prefill_samples, co.rejected) == (2, 4)


def test_a_prefill_of_exactly_min_prefill_tokens_is_a_sample():
    """`min_prefill_tokens` is a minimum: a prefill of exactly that many tokens calibrates,
    one token fewer does not (too short to time)."""
    cal = Calibrator(alpha=1.0, accept_after=1, min_prefill_tokens=100)
    _prefill_obs(cal, 2.0, tokens=99)
    co = cal.coefficients("w0")
    assert co is not None and co.prefill_samples == 0
    _prefill_obs(cal, 2.0, tokens=100)
    assert co.prefill_samples == 1 and cal.factors("w0")[0] == pytest.approx(2.0)


@pytest.mark.parametrize("prefill_ms", [-5.0, math.inf, math.nan, True, "12", None])
def test_a_timing_that_is_not_a_duration_is_ignored_not_rejected(prefill_ms):
    """A worker's `prefill_ms` that is negative, not finite or not a number is no
    measurement at all: no sample, and not counted as a rejected outlier either (which
    would feed the outlier streak)."""
    cal = Calibrator(accept_after=1)
    cal.observe("w0", cost(), None, 0.1, {"recomputed_tokens": 4000, "prefill_ms": prefill_ms})
    co = cal.coefficients("w0")
    assert co is not None and (co.prefill_samples, co.rejected) == (0, 0)


def test_a_worker_without_a_known_prefill_speed_is_not_calibrated():
    """Without a prefill speed (0: not measured yet) there is no prediction to compare
    with: the observation is skipped, not divided by zero."""
    cal = Calibrator(accept_after=1)
    cal.observe("w0", cost(prefill_tokens_per_s=0.0), None, 0.1, {"recomputed_tokens": 4000, "prefill_ms": 50.0})
    co = cal.coefficients("w0")
    assert co is not None and (co.prefill_samples, co.rejected) == (0, 0)


def test_calibrator_bounds_are_inclusive_where_documented():
    """`min_prefill_tokens` may be 0 and `prefill_quantile` may be 1.0 (the maximum);
    below 0 and above 1 are refused."""
    Calibrator(min_prefill_tokens=0)
    Calibrator(prefill_quantile=1.0)
    Calibrator(prefill_quantile=0.0)
    with pytest.raises(ValueError):
        Calibrator(min_prefill_tokens=-1)
    with pytest.raises(ValueError):
        Calibrator(prefill_quantile=1.01)


def test_the_calibration_snapshot_names_its_fields():
    """The admin API's calibration view (`Calibrator.snapshot`) has these keys, tiers by
    name; a renamed key breaks its readers."""
    snap = _calibrated(2.0, 3.0).snapshot()["w0"]
    assert snap["prefill_scale"] == pytest.approx(2.0) and snap["prefill_samples"] == 1
    assert snap["link_scales"] == {"CPU": pytest.approx(3.0)} and snap["link_samples"] == {"CPU": 1}
    assert snap["rejected"] == 0


# ----------------------------------------------------------------------------- baselines


def test_dynamo_credits_every_matched_run_gpu_fully_and_lower_tiers_by_offload_credit():
    """Dynamo's overlap credit sums the match's runs: GPU blocks count whole, lower tiers
    `offload_credit` each. 20 request blocks, 5 on GPU and 10 on CPU at credit 0.5:
    10 blocks left to prefill, plus the request's 20 blocks."""
    p = make_policy("dynamo", offload_credit=0.5)
    (w,) = fleet(1)
    r = request(320, {"w0": pm("w0", (Tier.GPU, 5), (Tier.CPU, 10))})
    assert p.cost(r, w) == pytest.approx((20 - 5 - 10 * 0.5) + 20)


def test_least_loaded_says_why_and_bad_parameters_name_themselves():
    """The baselines' decisions carry their reason (`least_loaded`), which the choices
    metric counts; a bad policy parameter is refused with its own name."""
    ws = fleet(2)
    ws[0].running_requests = 3
    d = make_policy("least_loaded").choose(request(320), ws)
    assert (d.worker_id, d.reason) == ("w1", "least_loaded")
    with pytest.raises(ValueError, match="balance_abs_threshold"):
        make_policy("cache_aware", balance_abs_threshold=-1)


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "cache_aware", "dynamo"])
def test_a_baselines_prediction_assumes_no_prefetch(name):
    """A baseline plans no prefetch, so the TTFT it predicts loads the worker's CPU
    blocks after the queue, not during it: the estimate without prefetch overlap (which
    is larger here, with a queue to hide the load behind)."""
    w = WorkerView("w0", cost(), waiting_requests=2, waiting_prefill_tokens=6000, supports_prefetch=True)
    r = request(8192, {"w0": pm("w0", (Tier.CPU, 400))})
    ctx = RequestContext.build(r, [w])
    plain = estimate_worker(ctx, w, False, False, False).t_ttft
    overlapped = estimate_worker(ctx, w, True, False, False).t_ttft
    assert plain > overlapped + 1e-4  # the two differ here
    d = make_policy(name).choose(r, [w])
    assert d.predicted_ttft == pytest.approx(plain, rel=1e-9)
