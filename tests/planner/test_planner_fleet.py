"""The fleet view shared by gateway and simulator (router/planner/fleet.py), and its users.

Each rule is checked where it is defined and, once, through each caller: the gateway's
pool (config pins) and the offline simulator's router (reported speeds reach the view).
"""
from __future__ import annotations

import pytest

from kvindex.index import PrefixMatch
from kvindex.tiers import Tier
from kvwire import BlockCounts, LoadReport, Speeds, TierLink
from router.planner.fleet import (
    NO_PINS,
    FleetWorker,
    Pins,
    PrefetchRule,
    apply_report,
    plan_prefetch,
)
from router.planner.inflight import InflightLedger
from router.planner.types import CostParams, Decision, Estimate, Link, WorkerView


def view(**links: Link) -> WorkerView:
    cost = CostParams(block_size=16, block_bytes=1 << 20, prefill_tokens_per_s=1000.0, prefill_attn_s_per_token2=1e-9,
                      prefill_overhead_s=0.002, decode_step_s=0.01, links={Tier[k]: v for k, v in links.items()})
    return WorkerView("w", cost)


def report(**over: object) -> LoadReport:
    rep = LoadReport(
        worker_id="w", waiting_requests=3, waiting_prefill_tokens=900, running_requests=5, running_prefill_tokens=70,
        est_queue_s=0.25, blocks={"GPU": BlockCounts(used=60, free=40, capacity=100), "CPU": BlockCounts(1, 2, 3)},
        speeds=Speeds(prefill_tokens_per_s=5000.0, prefill_attn_s_per_token2=2e-9, prefill_overhead_s=0.004,
                      decode_step_s=0.02),
        tiers={"CPU": TierLink(5e10, 1e-5), "DISK": TierLink(5e9, 1e-4)}, max_waiting=7,
    )
    for k, v in over.items():
        setattr(rep, k, v)
    return rep


# --------------------------------------------------------------------------- apply_report


def test_a_report_sets_every_load_field_and_folds_speeds_and_links() -> None:
    v = view(CPU=Link(1.0, 0.5))
    apply_report(v, report())
    assert (
        v.waiting_requests, v.waiting_prefill_tokens, v.running_requests, v.running_prefill_tokens
    ) == (3, 900, 5, 70)
    assert v.est_queue_s == 0.25 and (v.gpu_free_blocks, v.gpu_capacity_blocks) == (40, 100) and v.max_waiting == 7
    c = v.cost
    assert (c.prefill_tokens_per_s, c.prefill_attn_s_per_token2, c.prefill_overhead_s, c.decode_step_s) == (
        5000.0, 2e-9, 0.004, 0.02)
    cpu = c.links[Tier.CPU]
    assert (cpu.read_Bps, cpu.latency_s) == (5e10, 1e-5)  # updated in place
    assert (c.links[Tier.DISK].read_Bps, c.links[Tier.DISK].latency_s) == (5e9, 1e-4)  # added


def test_capacity_zero_means_used_plus_free_and_absent_fields_keep_the_view() -> None:
    v = view()
    v.max_waiting = 9
    apply_report(v, report(blocks={"GPU": BlockCounts(used=30, free=10, capacity=0)}, max_waiting=None, speeds=None,
                           tiers={}))
    assert (v.gpu_free_blocks, v.gpu_capacity_blocks, v.max_waiting) == (10, 40, 9)
    assert v.cost.prefill_tokens_per_s == 1000.0 and v.cost.decode_step_s == 0.01 and not v.cost.links
    apply_report(v, report(blocks={}))
    assert (v.gpu_free_blocks, v.gpu_capacity_blocks) == (10, 40)  # no GPU entry: unchanged


def test_unmeasured_speeds_and_dead_links_are_not_applied() -> None:
    v = view(DISK=Link(7.0, 0.1))
    apply_report(v, report(speeds=Speeds(prefill_tokens_per_s=0.0),
                           tiers={"DISK": TierLink(0.0), "NVLINK": TierLink(9.0), "GPU": TierLink(9.0)}))
    c = v.cost
    assert c.prefill_tokens_per_s == 1000.0  # zero = not measured yet, never a speed to divide by
    assert (c.prefill_attn_s_per_token2, c.prefill_overhead_s, c.decode_step_s) == (1e-9, 0.002, 0.01)
    assert c.links == {Tier.DISK: Link(7.0, 0.1)}  # a zero link, an unknown tier and GPU are skipped


@pytest.mark.parametrize("field", ["prefill_tokens_per_s", "prefill_attn_s_per_token2", "prefill_overhead_s",
                                   "decode_step_s"])
def test_a_pinned_speed_beats_the_report(field: str) -> None:
    v = view()
    before = getattr(v.cost, field)
    apply_report(v, report(), Pins(speeds=frozenset({field})))
    assert getattr(v.cost, field) == before
    others = {"prefill_tokens_per_s": 5000.0, "prefill_attn_s_per_token2": 2e-9, "prefill_overhead_s": 0.004,
              "decode_step_s": 0.02}
    for f, want in others.items():
        if f != field:
            assert getattr(v.cost, f) == want


def test_a_pinned_tier_link_beats_the_report() -> None:
    v = view(CPU=Link(1.0, 0.5))
    apply_report(v, report(), Pins(tiers=frozenset({Tier.CPU})))
    assert v.cost.links[Tier.CPU] == Link(1.0, 0.5) and v.cost.links[Tier.DISK] == Link(5e9, 1e-4)


# --------------------------------------------------------------------------- FleetWorker


def test_fleet_worker_joins_report_and_ledger() -> None:
    fw = FleetWorker(view(), NO_PINS, InflightLedger("w"))
    assert fw.worker_id == "w" and fw.load_t is None
    fw.refresh(5.0)
    assert fw.view.report_age_s == 0.0  # no report yet: nothing to age
    t1 = fw.dispatched(1.0, 300, 400, None)
    t2 = fw.dispatched(2.0, 100, 200, None)
    fw.accepted(t1, 1.5)
    assert (fw.view.inflight_requests, fw.view.inflight_prefill_tokens, fw.view.active_kv_tokens) == (2, 400, 600)
    fw.on_report(report(), now=3.0, sent_at=1.8)  # asked for after t1 was accepted, before t2 was
    assert fw.load_t == 3.0 and fw.view.waiting_requests == 3
    assert (fw.view.inflight_since_report_requests, fw.view.inflight_since_report_prefill_tokens) == (1, 100)
    fw.refresh(3.25)
    assert fw.view.report_age_s == pytest.approx(0.25)
    fw.first_token(t2, 3.3)
    assert fw.view.inflight_prefill_tokens == 300 and fw.view.inflight_since_report_prefill_tokens == 0
    fw.finished(t1)
    fw.finished(t2)
    assert (fw.view.inflight_requests, fw.view.inflight_prefill_tokens, fw.view.active_kv_tokens) == (0, 0, 0)


# --------------------------------------------------------------------------- plan_prefetch


def _decision(k: int, peer: str | None = None) -> Decision:
    return Decision("w", "kv_cost", "min_ttft", prefetch_blocks=k, prefetch_from_peer=peer)


def _estimate(t_queue: float) -> Estimate:
    return Estimate(worker_id="w", recompute_tokens=0, t_queue=t_queue, t_prefill=0.0, t_ttft=t_queue)


RULE = PrefetchRule(enabled=True, min_blocks=2, margin_s=0.05, min_deadline_s=0.2)


def test_prefetch_skips_the_leading_gpu_run() -> None:
    m = PrefixMatch("w", 10, ((Tier.GPU, 4), (Tier.CPU, 6)))
    p = plan_prefetch(_decision(10), 10, m, _estimate(1.0), RULE, True)
    assert p is not None and (p.start, p.end, p.blocks) == (4, 10, 6)
    m2 = PrefixMatch("w", 10, ((Tier.CPU, 3), (Tier.GPU, 7)))  # GPU not leading: everything up to the cut
    p2 = plan_prefetch(_decision(10), 10, m2, _estimate(1.0), RULE, True)
    assert p2 is not None and (p2.start, p2.end) == (0, 10)


def test_prefetch_deadline_covers_the_queue_plus_margin_with_a_floor() -> None:
    p = plan_prefetch(_decision(5), 5, None, _estimate(1.0), RULE, True)
    assert p is not None and p.deadline_s == pytest.approx(1.05)
    p = plan_prefetch(_decision(5), 5, None, _estimate(0.01), RULE, True)
    assert p is not None and p.deadline_s == pytest.approx(0.2)
    p = plan_prefetch(_decision(5), 5, None, None, RULE, True)  # no estimate: no queue known
    assert p is not None and p.deadline_s == pytest.approx(0.2)
    p = plan_prefetch(_decision(5), 5, None, _estimate(0.3), PrefetchRule(margin_s=0.0, min_deadline_s=0.1), True)
    assert p is not None and p.deadline_s == pytest.approx(0.3)


def test_no_prefetch_when_off_unsupported_too_small_or_all_on_gpu() -> None:
    gpu4 = PrefixMatch("w", 5, ((Tier.GPU, 4), (Tier.CPU, 1)))
    assert plan_prefetch(_decision(5), 5, None, None, PrefetchRule(enabled=False), True) is None
    assert plan_prefetch(_decision(5), 5, None, None, RULE, False) is None
    assert plan_prefetch(_decision(1), 5, None, None, RULE, True) is None  # under min_blocks
    assert plan_prefetch(_decision(5), 5, gpu4, None, RULE, True) is None  # one block left to raise < 2
    assert plan_prefetch(_decision(0), 5, None, None, PrefetchRule(min_blocks=1), True) is None


def test_prefetch_is_capped_at_the_request_blocks_and_names_the_peer() -> None:
    p = plan_prefetch(_decision(9, peer="h"), 6, None, None, RULE, True)
    assert p is not None and (p.start, p.end, p.peer) == (0, 6, "h")


# --------------------------------------------------------------------------- the callers


def test_gateway_pins_come_from_the_worker_cost_block() -> None:
    from router.fleet.costs import pins
    from router.fleet.fleetconfig import CostConfig

    assert pins(None) == NO_PINS
    p = pins(CostConfig(prefill_tokens_per_s=123.0, decode_step_s=0.0, links={"disk": {"read_Bps": 1e9}}))
    assert p.speeds == frozenset({"prefill_tokens_per_s", "decode_step_s"}) and p.tiers == frozenset({Tier.DISK})


def test_the_simulator_views_take_the_engines_reported_speeds() -> None:
    from loadtest.router_model import RouterSettings, SimRouter
    from router.planner.registry import make_policy
    from workers.sim import SimEngine
    from workers.sim.profile import load_profile

    prof = load_profile("tiny-cpu")
    eng = SimEngine("w0", prof)
    r = SimRouter(make_policy("kv_cost"), prof.block_size, RouterSettings())
    r.join(eng, 0.0)
    rep = eng.load_report(0.0)
    v = r.workers["w0"].view
    assert rep.speeds is not None
    assert v.cost.prefill_tokens_per_s == rep.speeds.prefill_tokens_per_s
    assert v.cost.prefill_attn_s_per_token2 == rep.speeds.prefill_attn_s_per_token2
    assert v.cost.prefill_overhead_s == rep.speeds.prefill_overhead_s
    assert v.cost.decode_step_s == rep.speeds.decode_step_s and v.cost.decode_step_s > 0
    assert {t.name for t in v.cost.links} == set(rep.tiers)
    for name, link in rep.tiers.items():
        assert v.cost.links[Tier[name]] == Link(link.read_Bps, link.latency_s)


def test_matches_are_priced_in_whole_engine_blocks() -> None:
    from router.planner.fleet import whole_engine_blocks

    m = PrefixMatch("w", 7, ((Tier.GPU, 3), (Tier.CPU, 4)))
    assert whole_engine_blocks(m, 1) is m and whole_engine_blocks(PrefixMatch("w", 6, m.runs), 2).blocks == 6
    half = whole_engine_blocks(m, 2)
    assert half is not None and (half.blocks, half.runs) == (6, ((Tier.GPU, 3), (Tier.CPU, 3)))
    four = whole_engine_blocks(m, 4)
    assert four is not None and (four.blocks, four.runs) == (4, ((Tier.GPU, 3), (Tier.CPU, 1)))
    assert whole_engine_blocks(PrefixMatch("w", 1, ((Tier.GPU, 1),)), 2) is None
