"""Prefill/decode disaggregation in the planner: the KV transfer term, the pair decision
(pd.py) and the pair policies (pd_cost, pd_round_robin, pd_prefix)."""
from __future__ import annotations

import math

import pytest

from kvindex.index import PrefixMatch
from kvindex.tiers import Tier
from router.planner import explain, make_policy
from router.planner.pd import check_role
from router.planner.terms.kv_transfer import (
    UNKNOWN_PAIR_LINK,
    kv_bytes_per_token,
    kv_transfer_bytes,
    kv_transfer_seconds,
    transfer_link,
)
from router.planner.types import CostParams, Link, RouteRequest, WorkerView

B = 16
BLOCK_BYTES = 2 * 1024 * 1024  # 128 KiB per token (Llama-3-8B bf16) x 16


def cost(**kw) -> CostParams:
    base = dict(block_size=B, block_bytes=BLOCK_BYTES, prefill_tokens_per_s=40_000.0, prefill_overhead_s=0.004,
                decode_step_s=0.007, links={Tier.CPU: Link(50e9, 1e-5), Tier.PEER: Link(25e9, 5e-4)})
    base.update(kw)
    return CostParams(**base)


def view(wid: str, role: str, **kw) -> WorkerView:
    return WorkerView(wid, cost(), role=role, **kw)


def pd_fleet(p: int = 2, d: int = 2) -> list[WorkerView]:
    return [view(f"p{i}", "prefill") for i in range(p)] + [view(f"d{i}", "decode") for i in range(d)]


def request(tokens: int, matches: dict[str, PrefixMatch] | None = None, max_tokens: int = 100) -> RouteRequest:
    return RouteRequest(tokens, list(range(tokens // B)), matches or {}, max_tokens)


def gpu(wid: str, blocks: int) -> PrefixMatch:
    return PrefixMatch(wid, blocks, ((Tier.GPU, blocks),))


# ---------------------------------------------------------------- the transfer term


def test_transfer_bytes_bandwidth_and_latency():
    c = cost()
    assert kv_bytes_per_token(c) == 128 * 1024
    assert kv_transfer_bytes(1000, c) == 1000 * 128 * 1024
    link = Link(25e9, 5e-4)
    t = kv_transfer_seconds(1000, c, link)
    assert t == pytest.approx(5e-4 + 1000 * 128 * 1024 / 25e9)
    # twice the bandwidth halves the byte part, the latency stays
    t2 = kv_transfer_seconds(1000, c, Link(50e9, 5e-4))
    assert t2 - 5e-4 == pytest.approx((t - 5e-4) / 2)
    # the learned scale multiplies the whole
    assert kv_transfer_seconds(1000, c, link, 2.0) == pytest.approx(2 * t)
    assert kv_transfer_seconds(0, c, link) == 0.0
    assert kv_transfer_seconds(10, c, None) == math.inf
    assert kv_transfer_seconds(10, c, Link(0.0)) == math.inf


def test_transfer_link_is_the_pairs_own_else_the_decode_workers_peer_link():
    p, d = view("p", "prefill"), view("d", "decode")
    assert transfer_link(p, d) is d.cost.links[Tier.PEER]
    own = Link(100e9, 1e-5)
    assert transfer_link(p, d, {("p", "d"): own}) is own
    assert transfer_link(d, p, {("p", "d"): own}) is p.cost.links[Tier.PEER]


# ---------------------------------------------------------------- the pair decision


def test_pd_cost_pairs_prefill_and_decode_workers_with_every_term():
    ws = pd_fleet()
    d = make_policy("pd_cost").choose(request(8000), ws)
    assert d.prefill_worker_id in {"p0", "p1"} and d.worker_id in {"d0", "d1"}
    rec = d.pd
    assert rec is not None and rec.chosen.kind == "pair"
    t = rec.chosen.terms
    moved = (8000 - 1) // B * B
    assert t["transfer_tokens"] == moved and t["transfer_bytes"] == moved * 128 * 1024
    assert t["transfer"] == pytest.approx(5e-4 + moved * 128 * 1024 / 25e9)
    assert rec.chosen.t_ttft == pytest.approx(t["prefill_ttft"] + t["transfer"] + t["decode_queue"] + t["decode_tail"])
    assert rec.chosen.score == pytest.approx(rec.chosen.t_ttft + 99 * 0.007)
    assert d.predicted_ttft == rec.chosen.t_ttft
    assert d.recompute_tokens == 8000 - moved
    # the alternatives are priced too, and explain says why they lost
    assert rec.alternatives and all(a.score >= rec.chosen.score for a in rec.alternatives)
    assert "min_cost" in rec.why or "tie_less_load" in rec.why
    assert rec.to_dict()["chosen"]["terms"]["transfer"] == t["transfer"]


def test_overloaded_prefill_worker_is_avoided():
    ws = pd_fleet()
    ws[0].waiting_prefill_tokens, ws[0].waiting_requests = 200_000, 10  # p0: seconds of queue
    d = make_policy("pd_cost").choose(request(4000), ws)
    assert d.prefill_worker_id == "p1"
    p0 = [a for a in d.pd.alternatives if a.prefill_worker == "p0"]
    assert p0 and p0[0].terms["prefill_queue"] > 1.0


def test_prefill_worker_holding_the_prefix_wins_when_others_would_recompute():
    ws = pd_fleet()
    matches = {"p1": gpu("p1", 900)}
    d = make_policy("pd_cost").choose(request(16_000, matches), ws)
    assert d.prefill_worker_id == "p1"
    assert d.pd.chosen.terms["prefill_recompute_tokens"] < 16_000 - 800 * B


def test_bypass_a_decode_worker_holding_the_prefix_skips_the_remote_prefill():
    ws = pd_fleet()
    # d1 holds all but the last ~100 tokens of a 12k-token prompt on GPU
    matches = {"d1": gpu("d1", 12_000 // B - 6)}
    d = make_policy("pd_cost").choose(request(12_000, matches), ws)
    assert d.worker_id == "d1" and d.prefill_worker_id is None
    assert d.pd.chosen.kind == "bypass"
    assert d.recompute_tokens <= 7 * B
    # the remote prefill it skipped is among the alternatives, dearer, and explain shows it
    pair = [a for a in d.pd.alternatives if a.kind == "pair"]
    assert pair and pair[0].score > d.pd.chosen.score
    e = explain(make_policy("pd_cost"), request(12_000, matches), ws)
    assert e.pd is not None and e.pd.chosen.kind == "bypass" and "bypass d1" in e.pd.why
    assert len(e.estimates) == len(ws)


def test_no_bypass_when_the_decode_worker_would_prefill_too_much():
    ws = pd_fleet()
    matches = {"d1": gpu("d1", 100)}  # 1,600 of 12,000 tokens: 10k to compute
    d = make_policy("pd_cost").choose(request(12_000, matches), ws)
    assert d.pd.chosen.kind == "pair"
    assert not any(a.kind == "bypass" for a in d.pd.alternatives)
    # a decode worker already holding part of the prompt receives only the rest
    assert d.worker_id == "d1"
    assert d.pd.chosen.terms["transfer_tokens"] == ((12_000 - 1) // B - 100) * B


def test_an_idle_aggregated_worker_beats_a_pair_and_a_busy_one_loses_to_it():
    ws = [view("p0", "prefill"), view("d0", "decode"), view("b0", "both")]
    d = make_policy("pd_cost").choose(request(4000), ws)
    assert d.pd.chosen.kind == "single" and d.worker_id == "b0"  # no transfer to pay
    ws[2].waiting_prefill_tokens, ws[2].waiting_requests = 100_000, 5
    d = make_policy("pd_cost").choose(request(4000), ws)
    assert d.pd.chosen.kind == "pair" and (d.prefill_worker_id, d.worker_id) == ("p0", "d0")


def test_decode_side_cost_steers_to_the_faster_decode_worker():
    ws = pd_fleet()
    ws[2].cost.decode_step_s = 0.012  # d0's batch is heavier
    d = make_policy("pd_cost").choose(request(2000, max_tokens=500), ws)
    assert d.worker_id == "d1"
    assert d.pd.chosen.t_tpot == 0.007


def test_round_robin_and_prefix_pairing():
    ws = pd_fleet()
    rr = make_policy("pd_round_robin")
    pairs = [(x.prefill_worker_id, x.worker_id) for x in (rr.choose(request(3000), ws) for _ in range(4))]
    assert pairs == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]
    ws[3].inflight_requests = 5  # d1 busier
    matches = {"p1": gpu("p1", 100)}
    d = make_policy("pd_prefix").choose(request(3000, matches), ws)
    assert (d.prefill_worker_id, d.worker_id) == ("p1", "d0")
    # neither bypasses, even when a decode worker holds the prompt
    matches = {"d1": gpu("d1", 3000 // B - 2)}
    for name in ("pd_round_robin", "pd_prefix"):
        assert make_policy(name).choose(request(3000, matches), ws).pd.chosen.kind == "pair"


def test_on_an_aggregated_fleet_the_pair_policies_route_whole_requests():
    ws = [view(f"w{i}", "both") for i in range(3)]
    for name in ("pd_cost", "pd_round_robin", "pd_prefix"):
        d = make_policy(name).choose(request(3000), ws)
        assert d.prefill_worker_id is None and d.pd.chosen.kind == "single"


def test_roles_are_checked():
    assert check_role("decode") == "decode"
    with pytest.raises(ValueError, match="unknown worker role 'prefil'"):
        check_role("prefil")
    with pytest.raises(ValueError, match="unknown worker role"):
        make_policy("pd_cost").choose(request(100), [view("x", "prefil")])


def test_a_fleet_without_decode_workers_or_all_capped_sheds():
    ws = [view("p0", "prefill"), view("p1", "prefill")]
    d = make_policy("pd_cost").choose(request(1000), ws)
    assert d.worker_id is None and d.retry_after_s is not None


def test_a_pair_nobody_described_is_still_priced():
    """vLLM workers registered without `cost:` have no PEER link: the pair is priced over
    the stated default link (and chosen), never shed as if it could not move KV."""
    bare = [WorkerView("p0", cost(links={}), role="prefill"), WorkerView("d0", cost(links={}), role="decode")]
    assert transfer_link(bare[0], bare[1]) is UNKNOWN_PAIR_LINK
    d = make_policy("pd_cost").choose(request(512), bare)
    assert d.worker_id == "d0" and d.prefill_worker_id == "p0" and math.isfinite(d.predicted_ttft or math.inf)
