"""The cost model: hand-computed numbers, the cut's optimality, queue estimates."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.index import PrefixMatch
from kvindex.tiers import Tier
from router.planner.cost import RequestContext, estimate_all, estimate_worker, ttft_lower_bound
from router.planner.load import outstanding_requests, pending_prefill_tokens, queue_seconds, waiting_requests
from router.planner.terms.cut import best_cut, split_by_tier, ttft_at, usable_blocks
from router.planner.terms.decode_ride import decode_ride_seconds
from router.planner.terms.interference import interference_delays
from router.planner.terms.kv_load import load_seconds
from router.planner.terms.memory import memory_seconds
from router.planner.terms.recompute import prefill_seconds
from router.planner.types import CostParams, Link, RouteRequest, WorkerView


def cost(**kw) -> CostParams:
    base = dict(
        block_size=10,
        block_bytes=1000,
        prefill_tokens_per_s=1000.0,
        prefill_attn_s_per_token2=0.0,
        prefill_overhead_s=0.0,
        links={Tier.CPU: Link(1e6), Tier.DISK: Link(1e5, 0.002), Tier.PEER: Link(5e5)},
    )
    base.update(kw)
    return CostParams(**base)


def req(tokens: int, matches: dict[str, PrefixMatch], block: int = 10) -> RouteRequest:
    return RouteRequest(tokens, list(range(tokens // block)), matches)


def pm(wid: str, *runs: tuple[Tier, int]) -> PrefixMatch:
    return PrefixMatch(wid, sum(n for _, n in runs), tuple(runs))


def one(w: WorkerView, r: RouteRequest, others: list[WorkerView] | None = None, **kw):
    ws = [w] + (others or [])
    return estimate_worker(RequestContext.build(r, ws), w, **kw)


# ---------------------------------------------------------------- formulas


def test_prefill_formula_hand_computed():
    c = cost(prefill_tokens_per_s=1000.0, prefill_attn_s_per_token2=1e-6, prefill_overhead_s=0.01)
    # 0.01 + 100/1000 + 1e-6 * 100 * (50 + 100/2) = 0.01 + 0.1 + 0.01
    assert prefill_seconds(c, 100, 50) == pytest.approx(0.12)
    assert prefill_seconds(c, 100, 50, scale=2.0) == pytest.approx(0.24)


def test_interference_hand_computed():
    # a 10 s prefill starting now; the loading request lands at 1 s and waits 9 s. The
    # new request's queue (0.05 s) is that request's own prefill: not really ahead of it.
    assert sum(interference_delays([(1.0, 0.05)], 0.05, 0.0, 10.0, True)) == pytest.approx(9.0)
    # it starts after the load landed: the landed request is ahead of it, no delay
    assert sum(interference_delays([(1.0, 0.0)], 2.0, 0.0, 10.0, True)) == 0.0
    # its own load: overlapped with the queue (start 0.5) or after it (start 0.2 + 0.5)
    assert sum(interference_delays([(0.6, 0.1)], 0.3, 0.5, 1.0, True)) == pytest.approx(0.9)
    assert sum(interference_delays([(0.6, 0.1)], 0.3, 0.5, 1.0, False)) == 0.0
    # ends before the load lands: nothing; two loads landing inside add up
    assert sum(interference_delays([(5.0, 0.0)], 0.0, 0.0, 1.0, True)) == 0.0
    assert sum(interference_delays([(0.5, 0.0), (1.5, 0.0)], 0.0, 0.0, 2.0, True)) == pytest.approx(1.5 + 0.5)
    assert sum(interference_delays([], 0.0, 0.0, 2.0, True)) == 0.0
    # a landing predicted 10 ms before the start is within the slack: it may well land
    # late, and then it waits for the whole prefill
    assert sum(interference_delays([(0.29, 0.0)], 0.3, 0.0, 2.0, True)) == 0.0
    assert sum(interference_delays([(0.29, 0.0)], 0.3, 0.0, 2.0, True, slack_s=0.05)) == pytest.approx(2.0)
    assert sum(interference_delays([(-0.5, 0.0)], 0.0, 0.0, 2.0, True, slack_s=0.05)) == 0.0  # landed


def test_load_formula_latency_once():
    assert load_seconds(Link(1e9, 0.001), 10, 1_000_000) == pytest.approx(0.011)
    assert load_seconds(Link(1e9, 0.001), 0, 1_000_000) == 0.0


def test_usable_blocks_keeps_one_token_to_compute():
    assert usable_blocks(32, 2, 16) == 1  # a full hit still computes the last block
    assert usable_blocks(33, 2, 16) == 2
    assert usable_blocks(1000, 3, 16) == 3
    assert usable_blocks(0, 0, 16) == 0


def test_estimate_gpu_and_cpu_hand_computed():
    # N=101 tokens, B=10: GPU 2 blocks, CPU 3 blocks at 1 ms/block; recompute 1 ms per 1 token.
    w = WorkerView("a", cost())
    e = one(w, req(101, {"a": pm("a", (Tier.GPU, 2), (Tier.CPU, 3))}))
    assert e.load_blocks == 5
    assert e.load_blocks_by_tier == {Tier.GPU: 2, Tier.CPU: 3}
    assert e.prefetch_blocks == {Tier.CPU: 3}
    assert e.recompute_tokens == 51
    assert e.t_load_total == pytest.approx(0.003)
    assert e.t_prefill == pytest.approx(0.051)
    assert e.t_ttft == pytest.approx(0.054)


def test_prefill_steps_carry_the_running_decodes():
    # 250 tokens to recompute, budget 100 per step less 20 decodes: ceil(250 / 80) = 4 steps,
    # each carrying a 5 ms decode step; an idle worker's prefill carries none.
    c = cost(decode_step_s=0.005, max_batched_tokens=100)
    assert decode_ride_seconds(c, 250, 20) == pytest.approx(0.020)
    assert decode_ride_seconds(c, 250, 0) == 0.0
    assert decode_ride_seconds(c, 0, 20) == 0.0
    assert decode_ride_seconds(cost(max_batched_tokens=100), 250, 20) == 0.0  # no decode speed reported
    # more decodes than budget (a bad report): an eighth of it is left, 250 / 12 -> 21 steps
    assert decode_ride_seconds(c, 250, 500) == pytest.approx(21 * 0.005)
    r = req(251, {})
    idle = one(WorkerView("a", c), r)
    busy = one(WorkerView("a", c, running_requests=20), r)
    assert busy.t_prefill == pytest.approx(idle.t_prefill + 0.020)
    assert busy.t_ttft == pytest.approx(idle.t_ttft + 0.020)
    assert ttft_lower_bound(RequestContext.build(r, [WorkerView("a", c, running_requests=20)]),
                            WorkerView("a", c, running_requests=20)) <= busy.t_ttft
    # The report was taken while 20 ran; the router has seen all but 3 of its own finish since.
    stale = WorkerView("a", c, running_requests=20, inflight_requests=3, inflight_since_report_requests=0)
    assert one(stale, r).t_prefill == pytest.approx(idle.t_prefill + decode_ride_seconds(c, 251, 3))


def test_memory_seconds_hand_computed():
    # Capacity 100 blocks of 10 tokens, decode step 10 ms; a 200-token prompt with 100
    # tokens of output needs 30 blocks less those it shares on GPU. Past capacity, the
    # excess waits excess / 100 of one decode lifetime (100 steps = 1 s).
    c = cost(decode_step_s=0.01)
    r = RouteRequest(200, list(range(20)), {}, max_tokens=100)
    ctx = RequestContext.build(r, [])

    def w(kv_tokens: int | None, cap: int = 100, free: int = 0, block: int = 10) -> WorkerView:
        return WorkerView("a", c, gpu_capacity_blocks=cap, gpu_free_blocks=free, active_kv_tokens=kv_tokens,
                          gpu_block_tokens=block)

    assert memory_seconds(ctx, w(950), 0) == pytest.approx(0.25)  # 95 + 30 - 100 = 25 blocks over
    assert memory_seconds(ctx, w(950), 20) == pytest.approx(0.05)  # sharing 20 of them
    assert memory_seconds(ctx, w(950), 25) == 0.0  # fits exactly
    assert memory_seconds(ctx, w(1100), 0) == pytest.approx(0.30)  # already over: all 30 are excess
    assert memory_seconds(ctx, w(None, free=5), 0) == pytest.approx(0.25)  # no count: the report's used blocks
    assert memory_seconds(ctx, w(950), 0, bound=1.25) == 0.0  # 125 blocks fit under 1.25 x capacity
    assert memory_seconds(ctx, w(950, cap=0), 0) == 0.0  # no capacity reported
    assert memory_seconds(ctx, w(950, block=20), 0) == 0.0  # the worker's blocks are twice the index's
    assert memory_seconds(ctx, w(950, block=0), 0) == 0.0  # its block size unknown (vLLM)
    no_speed = WorkerView("a", cost(), gpu_capacity_blocks=100, active_kv_tokens=950, gpu_block_tokens=10)
    assert memory_seconds(ctx, no_speed, 0) == 0.0


def test_slow_tier_is_recomputed_instead():
    # CPU at 20 ms/block while recomputing a 10-token block costs 10 ms: cut after GPU.
    w = WorkerView("a", cost(links={Tier.CPU: Link(5e4)}))
    e = one(w, req(101, {"a": pm("a", (Tier.GPU, 2), (Tier.CPU, 3))}))
    assert e.load_blocks == 2
    assert e.t_load_total == 0.0
    assert e.t_ttft == pytest.approx(0.081)


def test_queue_hides_prefetch_and_the_cut_lands_inside_a_run():
    # No GPU blocks; CPU 2 ms/block; a block recomputes in 1.5 ms; queue 5 ms.
    # f(k) = max(5, 2k) + (101 - 10k) * 0.15 ms: f(2)=17.15, f(3)=16.65, f(4)=17.15.
    c = cost(prefill_tokens_per_s=10 / 0.0015, links={Tier.CPU: Link(5e5)})
    w = WorkerView("a", c, est_queue_s=0.005)
    e = one(w, req(101, {"a": pm("a", (Tier.CPU, 10))}))
    assert e.load_blocks == 3
    assert e.t_ttft == pytest.approx(0.01665)
    assert e.t_load == pytest.approx(0.001)  # 6 ms of load, 5 of them hidden by the queue
    assert e.t_load_total == pytest.approx(0.006)
    # Without prefetch support nothing is hidden: loading 2 ms/block never beats 1.5 ms.
    w2 = WorkerView("a", c, est_queue_s=0.005, supports_prefetch=False)
    e2 = one(w2, req(101, {"a": pm("a", (Tier.CPU, 10))}))
    assert e2.load_blocks == 0 and e2.prefetch_blocks == {}
    assert e2.t_ttft == pytest.approx(0.005 + 101 * 0.00015)


def test_missing_link_stops_the_match():
    w = WorkerView("a", cost(links={Tier.CPU: Link(1e6)}))  # no DISK link
    e = one(w, req(101, {"a": pm("a", (Tier.CPU, 2), (Tier.DISK, 3), (Tier.CPU, 2))}))
    assert e.matched_blocks == {Tier.CPU: 4, Tier.DISK: 3}
    assert e.load_blocks == 2
    assert "no DISK link" in e.note


def test_latency_paid_once_per_tier():
    c = cost(links={Tier.CPU: Link(1e6, 0.004), Tier.DISK: Link(1e6, 0.0)}, prefill_tokens_per_s=100.0)
    w = WorkerView("a", c)
    r = req(101, {"a": pm("a", (Tier.CPU, 2), (Tier.DISK, 2), (Tier.CPU, 2))})
    e = one(w, r)
    assert e.load_blocks == 6
    assert e.t_load_total == pytest.approx(0.004 + 6 * 0.001)


def test_peer_pull_priced_at_bottleneck_link():
    # b holds 8 blocks: 5 on GPU, 3 on DISK (1e5 B/s: 10 ms/block); the PEER link is 5e5 (2 ms/block).
    holder = WorkerView("b", cost(), est_queue_s=1.0)
    links = {Tier.CPU: Link(1e6), Tier.PEER: Link(5e5, 0.001)}
    w = WorkerView("a", cost(prefill_tokens_per_s=100.0, links=links), supports_peer_pull=True)
    r = req(101, {"b": pm("b", (Tier.GPU, 5), (Tier.DISK, 3)), "a": pm("a", (Tier.GPU, 1))})
    e = one(w, r, [holder])
    assert e.matched_blocks == {Tier.GPU: 1, Tier.PEER: 7}
    assert e.load_blocks == 8
    assert e.peer_source == "b"
    # PEER latency 1 ms once + 4 blocks over PEER at 2 ms + 3 over holder's DISK at 10 ms
    # + the holder's DISK latency 2 ms
    assert e.t_load_total == pytest.approx(0.001 + 4 * 0.002 + 3 * 0.01 + 0.002)
    assert e.prefetch_blocks == {Tier.PEER: 7}


def test_no_peer_pull_without_capability_or_link():
    holder = WorkerView("b", cost())
    r = req(101, {"b": pm("b", (Tier.GPU, 8))})
    for w in (
        WorkerView("a", cost(), supports_peer_pull=False),
        WorkerView("a", cost(links={}), supports_peer_pull=True),
        WorkerView("a", cost(), supports_peer_pull=True, supports_prefetch=False),
    ):
        e = one(w, r, [holder])
        assert Tier.PEER not in e.load_blocks_by_tier and e.peer_source is None
    e = one(WorkerView("a", cost(), supports_peer_pull=True), r, [holder], peer=False)
    assert e.peer_source is None


def test_invalid_cost_params_make_worker_ineligible():
    e = one(WorkerView("a", cost(prefill_tokens_per_s=0.0)), req(101, {}))
    assert not e.eligible and math.isinf(e.t_ttft) and "invalid" in e.note


def test_estimate_all_in_worker_order_with_scales():
    ws = [WorkerView("a", cost()), WorkerView("b", cost())]
    r = req(101, {})
    es = estimate_all(r, ws, scales=lambda wid: (2.0, None) if wid == "b" else (1.0, None))
    assert [e.worker_id for e in es] == ["a", "b"]
    assert es[1].t_prefill == pytest.approx(2 * es[0].t_prefill)


# ---------------------------------------------------------------- the cut


segments = st.lists(
    st.tuples(
        st.sampled_from([Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE, Tier.PEER]),
        st.integers(1, 12),
        st.floats(0.0, 0.02),
        st.floats(0.0, 0.02),
    ),
    max_size=6,
).map(lambda segs: [
    (t, n, 0.0 if t is Tier.GPU else bs, 0.0 if t is Tier.GPU else lat, int(t)) for t, n, bs, lat in segs
])


@settings(max_examples=300, deadline=None)
@given(
    segs=segments,
    block=st.sampled_from([1, 4, 16]),
    extra=st.integers(1, 40),
    speed=st.floats(50.0, 1e5),
    attn=st.sampled_from([0.0, 1e-9, 1e-7, 1e-5]),
    overhead=st.floats(0.0, 0.01),
    queue=st.floats(0.0, 0.3),
    overlap=st.booleans(),
)
def test_best_cut_matches_brute_force(segs, block, extra, speed, attn, overhead, queue, overlap):
    n = sum(s[1] for s in segs)
    tokens = n * block + extra
    args = (tokens, block, speed, attn, overhead, queue, overlap)
    best = best_cut(segs, *args)
    brute = min(ttft_at(segs, k, *args).t_ttft for k in range(n + 1))
    assert best.t_ttft == pytest.approx(brute, rel=1e-9, abs=1e-12)
    again = ttft_at(segs, best.k, *args)
    assert again.t_ttft == pytest.approx(best.t_ttft, rel=1e-9, abs=1e-12)
    assert again.t_load == pytest.approx(best.t_load, rel=1e-9, abs=1e-12)
    assert sum(split_by_tier(segs, best.k).values()) == best.k


@settings(max_examples=100, deadline=None)
@given(
    count=st.integers(3, 40),
    start=st.integers(0, 50),
    block_s=st.floats(0.0, 0.01),
    speed=st.floats(100.0, 1e5),
    attn=st.floats(0.0, 1e-5),
    queue=st.floats(0.0, 0.2),
    overlap=st.booleans(),
)
def test_ttft_is_concave_within_a_run_on_each_side_of_the_queue_crossing(
    count, start, block_s, speed, attn, queue, overlap
):
    """The lemma behind `best_cut`: within one run (past its first block) the steps
    T_ttft(k+1) - T_ttft(k) never increase (concavity) wherever T_load(k) stays on one
    side of T_queue, so minima sit at run ends or around the crossing."""
    run = (Tier.CPU, count, block_s, 0.003, 1)
    segs = [(Tier.GPU, start, 0.0, 0.0, 0), run] if start else [run]
    args = (start * 4 + count * 4 + 3, 4, speed, attn, 0.001, queue, overlap)
    ks = range(start + 1, start + count + 1)
    cuts = [ttft_at(segs, k, *args) for k in ks]
    for a, b, c in zip(cuts, cuts[1:], cuts[2:], strict=False):
        if overlap and not (
            (a.t_load <= queue and c.t_load <= queue) or (a.t_load >= queue and c.t_load >= queue)
        ):
            continue  # the kink at the crossing: a candidate of its own
        assert b.t_ttft >= (a.t_ttft + c.t_ttft) / 2 - 1e-12


def test_best_cut_with_no_segments_recomputes_everything():
    cut = best_cut([], 100, 10, 1000.0, 0.0, 0.002, 0.5, True)
    assert cut.k == 0 and cut.t_ttft == pytest.approx(0.5 + 0.102)


def test_ttft_at_rejects_cut_beyond_segments():
    with pytest.raises(ValueError):
        ttft_at([(Tier.CPU, 2, 0.001, 0.0, 1)], 3, 100, 10, 1000.0, 0.0, 0.0, 0.0, True)


# ---------------------------------------------------------------- queue and load


def test_queue_uses_worker_estimate_aged_by_report_age():
    w = WorkerView("a", cost(), est_queue_s=0.5, report_age_s=0.2)
    assert queue_seconds(w) == pytest.approx(0.3)
    w.report_age_s = 1.0
    assert queue_seconds(w) == 0.0
    assert queue_seconds(w, exact=True) == pytest.approx(0.5)  # kv_cost_true_state trusts it


def test_queue_from_tokens_when_worker_gives_no_estimate():
    c = cost(prefill_overhead_s=0.01, prefill_attn_s_per_token2=1e-6)
    w = WorkerView("a", c, waiting_requests=2, waiting_prefill_tokens=1500, running_prefill_tokens=500)
    # 2 * 0.01 + 2000/1000 + 1e-6 * 2000 * (2000/2) / 2
    assert queue_seconds(w) == pytest.approx(0.02 + 2.0 + 1.0)


def test_inflight_since_report_adds_to_the_aged_report():
    w = WorkerView(
        "a", cost(), est_queue_s=0.4, report_age_s=0.1, inflight_since_report_prefill_tokens=200,
        inflight_since_report_requests=1,
    )
    assert queue_seconds(w) == pytest.approx(0.3 + 0.2)


def test_inflight_without_since_report_never_double_counts():
    # Everything in flight may already be in the report: take the larger, not the sum.
    w = WorkerView("a", cost(), est_queue_s=0.4, inflight_prefill_tokens=200)
    assert queue_seconds(w) == pytest.approx(0.4)
    w.inflight_prefill_tokens = 1000  # dispatched since the report: more than it shows
    assert queue_seconds(w) == pytest.approx(1.0)
    assert queue_seconds(w, exact=True) == pytest.approx(0.4)


def test_load_counts():
    w = WorkerView("a", cost(), waiting_requests=2, running_requests=3, inflight_requests=7, waiting_prefill_tokens=10)
    assert outstanding_requests(w) == 7
    assert waiting_requests(w) == 4
    w.inflight_since_report_requests = 1
    assert outstanding_requests(w) == 6
    assert waiting_requests(w) == 3
    w.inflight_prefill_tokens = 50
    w.inflight_since_report_prefill_tokens = 5
    assert pending_prefill_tokens(w) == 15
