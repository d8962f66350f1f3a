"""The in-flight ledger (router/planner/inflight.py): counts, report bookkeeping, inflight_loads."""
from __future__ import annotations

import pytest

from router.planner.inflight import LOADS_KEPT_S, InflightLedger
from router.planner.types import CostParams, Estimate, WorkerView


def view() -> WorkerView:
    return WorkerView("w", CostParams(block_size=16, block_bytes=1 << 20, prefill_tokens_per_s=10_000.0))


def est(t_queue: float = 0.2, t_load: float = 0.3, t_load_total: float = 0.5, t_prefill: float = 0.1,
        eligible: bool = True) -> Estimate:
    return Estimate(worker_id="w", recompute_tokens=100, t_queue=t_queue, t_load=t_load, t_load_total=t_load_total,
                    t_prefill=t_prefill, t_ttft=t_queue + t_load + t_prefill, eligible=eligible)


def test_counts_follow_dispatch_first_token_and_finish() -> None:
    led, v = InflightLedger(), view()
    led.fill(v, 0.0)
    # nothing dispatched or reported yet: the optional inputs stay unknown
    assert v.inflight_since_report_requests is None and v.active_kv_tokens is None
    a = led.dispatched(1.0, 300, 1000)
    b = led.dispatched(1.5, 200, 500)
    led.fill(v, 2.0)
    assert (v.inflight_requests, v.inflight_prefill_tokens, v.active_kv_tokens) == (2, 500, 1500)
    assert (v.inflight_since_report_requests, v.inflight_since_report_prefill_tokens) == (2, 500)
    assert led.live == {a, b}
    led.first_token(a)
    led.first_token(a)  # idempotent
    led.fill_counts(v)
    assert (v.inflight_requests, v.inflight_prefill_tokens, v.inflight_since_report_prefill_tokens) == (2, 200, 200)
    led.finished(b)  # finishing without a first token takes its prefill tokens too
    led.finished(b)
    led.first_token(b)  # a late first token after the end counts nothing
    led.fill_counts(v)
    assert (v.inflight_requests, v.inflight_prefill_tokens, v.active_kv_tokens) == (1, 0, 1000)
    assert (v.inflight_since_report_requests, v.inflight_since_report_prefill_tokens) == (1, 0)
    led.finished(a)
    led.fill_counts(v)
    assert (v.inflight_requests, v.inflight_prefill_tokens, v.active_kv_tokens) == (0, 0, 0)
    assert v.inflight_since_report_requests == 0 and not led.live
    assert a.done and a.prefilled and b.done and b.prefilled


def test_report_knows_what_was_dispatched_before_it_was_asked_for() -> None:
    led, v = InflightLedger(), view()
    old = led.dispatched(1.0, 400, 800)
    led.accepted(old, 1.01)
    pre = led.dispatched(2.0, 100, 200)
    led.first_token(pre, 2.2)  # a first token also shows the worker holds it
    new = led.dispatched(3.0, 50, 100)
    led.report_taken(2.5)  # the report was asked for at 2.5: it knows `old` and `pre`
    led.fill_counts(v)
    assert (old.since_report, pre.since_report, new.since_report) == (False, False, True)
    assert (v.inflight_since_report_requests, v.inflight_since_report_prefill_tokens) == (1, 50)
    assert (v.inflight_requests, v.inflight_prefill_tokens) == (3, 450)  # the totals do not change
    led.first_token(old)  # known to the report: the since-report counts stay
    led.finished(old)
    led.fill_counts(v)
    assert (v.inflight_since_report_requests, v.inflight_since_report_prefill_tokens) == (1, 50)
    led.first_token(new)
    led.fill_counts(v)
    assert v.inflight_since_report_prefill_tokens == 0 and v.inflight_since_report_requests == 1
    led.report_taken(3.0)  # dispatched exactly when the report was asked for: not known yet
    assert new.since_report
    late = led.dispatched(3.1, 10, 20)
    led.report_taken(3.2)  # dispatched before the report was asked for, but not yet accepted
    assert late.since_report and not old.since_report
    led.accepted(late, 3.3)
    led.report_taken(3.25)  # accepted only after the report was asked for
    assert late.since_report
    led.report_taken(3.4)
    assert not late.since_report
    led.finished(late)
    led.report_taken()  # an instantaneous report knows everything in flight
    led.fill_counts(v)
    assert not new.since_report and not pre.since_report
    assert (v.inflight_since_report_requests, v.inflight_since_report_prefill_tokens) == (0, 0)
    led.finished(new)  # not since-report any more: nothing to take off
    led.fill_counts(v)
    assert (v.inflight_requests, v.inflight_since_report_requests) == (1, 0)


def test_report_before_any_dispatch_makes_since_report_known() -> None:
    led, v = InflightLedger(), view()
    led.report_taken(5.0)
    led.fill_counts(v)
    assert (v.inflight_since_report_requests, v.inflight_since_report_prefill_tokens) == (0, 0)
    assert v.active_kv_tokens is None  # nothing dispatched: still unknown


def test_inflight_loads_list_predicted_loads_until_first_token() -> None:
    led, v = InflightLedger(), view()
    loading = led.dispatched(10.0, 100, 100, est(t_queue=0.2, t_load=0.3, t_prefill=0.1))
    led.dispatched(10.0, 100, 100, est(t_load_total=0.0))  # everything on GPU: no load
    led.dispatched(10.0, 100, 100, est(eligible=False))  # an ineligible estimate predicts nothing
    led.dispatched(10.0, 100, 100, None)  # no estimate (a policy without one)
    assert loading.ready_at == pytest.approx(10.5) and loading.prefill_s == pytest.approx(0.1)
    led.fill(v, 10.1)
    assert len(v.inflight_loads) == 1
    ready_s, prefill_s = v.inflight_loads[0]
    assert ready_s == pytest.approx(0.4) and prefill_s == pytest.approx(0.1)
    led.fill(v, 10.7)  # predicted landed, no first token yet: still listed, slightly negative
    assert v.inflight_loads[0][0] == pytest.approx(-0.2)
    led.first_token(loading)
    led.fill(v, 10.8)
    assert v.inflight_loads == () and not led.loading


def test_inflight_loads_expire_loads_kept_s_past_their_landing() -> None:
    led, v = InflightLedger(), view()
    a = led.dispatched(0.0, 100, 100, est(t_queue=0.0, t_load=1.0))  # lands at 1.0
    b = led.dispatched(0.0, 100, 100, est(t_queue=1.0, t_load=1.0))  # lands at 2.0
    led.fill(v, 1.0 + LOADS_KEPT_S - 1e-6)
    assert len(v.inflight_loads) == 2
    led.fill(v, 1.0 + LOADS_KEPT_S)  # `a` is dropped for good, though it had no first token
    assert [r for r in led.loading] == [b] and len(v.inflight_loads) == 1
    assert v.inflight_loads[0][0] == pytest.approx(1.0 - LOADS_KEPT_S)
    led.fill(v, 0.5)  # time going back does not bring a dropped load back
    assert len(v.inflight_loads) == 1
    led.fill(v, 2.0 + LOADS_KEPT_S)
    assert v.inflight_loads == ()
    # the expiry only bounds the list: both still count as in flight
    assert led.requests == 2 and led.live == {a, b}
    led.finished(a)
    led.finished(b)
    led.fill(v, 100.0)
    assert v.inflight_loads == () and v.inflight_requests == 0


def test_a_finished_load_leaves_the_list() -> None:
    led, v = InflightLedger(), view()
    r = led.dispatched(0.0, 100, 100, est())
    led.fill(v, 0.0)
    assert len(v.inflight_loads) == 1
    led.finished(r)  # failed before its first token (e.g. a retry elsewhere)
    led.fill(v, 0.1)
    assert v.inflight_loads == ()


def test_ledgers_are_independent() -> None:
    a, b = InflightLedger(), InflightLedger()
    va, vb = view(), view()
    a.dispatched(0.0, 10, 20, est())
    a.fill(va, 0.0)
    b.fill(vb, 0.0)
    assert va.inflight_requests == 1 and len(va.inflight_loads) == 1
    assert vb.inflight_requests == 0 and vb.inflight_loads == ()
