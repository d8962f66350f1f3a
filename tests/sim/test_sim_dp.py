"""Data-parallel servers in the offline simulator (loadtest/dp_fleet.py): rank-aware
routing against worker-level routing through the server's own balancer."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from loadtest.cli import main
from loadtest.dp_fleet import DPBalancer, DPFleet, DPServer
from loadtest.fleet import FleetSpec
from loadtest.results import read_runs
from loadtest.scenarios.base import sized_profile
from loadtest.simulate import SimSettings, Simulation
from loadtest.summary import summarize
from loadtest.trace import Trace, TraceError, TraceRequest
from loadtest.tracefiles import MOONCAKE_SLICE

BLOCK = 64
PROMPT_BLOCKS = 32  # 2,048-token prompts


def _settings(servers: int, dp: int, routing: str) -> SimSettings:
    fleet = FleetSpec(workers=servers, profile=sized_profile(gpu_tokens=150_000), block_size=BLOCK, tiers="gpu",
                      dp=dp, dp_routing=routing)
    return SimSettings(fleet=fleet)


def _req(i: int, t: float, prompt: int) -> TraceRequest:
    ids = tuple(prompt * 1000 + b for b in range(PROMPT_BLOCKS))
    return TraceRequest(index=i, arrival_s=t, input_length=PROMPT_BLOCKS * BLOCK, output_length=8, hash_ids=ids)


def _trace(reqs: list[TraceRequest]) -> Trace:
    return Trace(name="dp", block_tokens=BLOCK, requests=reqs)


def _rounds(prompts: int, rounds: int, seed: int = 1) -> Trace:
    """`prompts` distinct prompts, each sent once per round, all of a round at one instant
    in a shuffled order, rounds 2 s apart."""
    rng = random.Random(seed)
    reqs: list[TraceRequest] = []
    for k in range(rounds):
        order = list(range(prompts))
        rng.shuffle(order)
        for p in order:
            reqs.append(_req(len(reqs), 2.0 * k, p))
    return _trace(reqs)


def _cached_share(run: object) -> float:
    res = run.results  # type: ignore[attr-defined]
    return sum(r.cached_tokens for r in res) / sum(r.prompt_tokens for r in res)


def test_rank_routing_returns_to_the_rank_holding_the_prompt() -> None:
    trace = _trace([_req(i, 1.0 * i, 7) for i in range(6)])
    sim = Simulation(trace, "kv_cost", _settings(1, 4, "rank"))
    run = sim.run()
    assert sorted(sim.router.workers) == ["w0.dp0", "w0.dp1", "w0.dp2", "w0.dp3"]
    assert all(r.ok for r in run.results)
    first = run.results[0].worker
    assert first is not None and first.startswith("w0.dp")
    for r in run.results[1:]:
        assert r.worker == first
        assert r.cached_tokens == (PROMPT_BLOCKS - 1) * BLOCK  # all but the block holding the last token


def test_server_routing_indexes_the_union_of_its_ranks() -> None:
    # two prompts at one instant: the balancer sends the second to the other rank
    trace = _trace([_req(0, 0.0, 1), _req(1, 0.0, 2)])
    sim = Simulation(trace, "kv_cost", _settings(1, 2, "server"))
    run = sim.run()
    assert sorted(sim.router.workers) == ["w0"]
    assert [r.worker for r in run.results] == ["w0.dp0", "w0.dp1"]  # the rank each one ran on
    fleet = sim.fleet
    assert isinstance(fleet, DPFleet)
    r0, r1 = fleet.ranks["w0.dp0"], fleet.ranks["w0.dp1"]
    for req, holder, other in ((trace.requests[0], r0, r1), (trace.requests[1], r1, r0)):
        keys, digests = sim.keys.get(req)
        assert all(t is not None for t in holder.match_tiers(keys[:PROMPT_BLOCKS - 1]))
        assert other.match_tiers(keys[:1]) == [None]
        m = sim.router.index.match(digests)
        assert set(m) == {"w0"} and m["w0"].blocks >= PROMPT_BLOCKS - 1  # one entry for both ranks


def test_server_index_loses_a_block_one_rank_removed_though_another_holds_it() -> None:
    trace = _trace([_req(0, 0.0, 3), _req(1, 0.0, 3)])  # the same prompt on both ranks at once
    sim = Simulation(trace, "kv_cost", _settings(1, 2, "server"))
    sim.run()
    fleet = sim.fleet
    assert isinstance(fleet, DPFleet)
    keys, digests = sim.keys.get(trace.requests[0])
    assert sim.router.index.match(digests)["w0"].blocks >= PROMPT_BLOCKS - 1
    assert fleet.ranks["w0.dp1"].purge(None, everything=True) > 0  # BlockRemoved from rank 1 only
    assert "w0" not in sim.router.index.match(digests)
    assert all(t is not None for t in fleet.ranks["w0.dp0"].match_tiers(keys[:PROMPT_BLOCKS - 1]))


def _rank(waiting: int, running: int) -> SimpleNamespace:
    return SimpleNamespace(sched=SimpleNamespace(waiting=[None] * waiting, loading=[], prefilling=[None] * running,
                                                 decoding=[]))


def test_balancer_picks_the_lowest_waiting_times_4_plus_running() -> None:
    ranks = [_rank(1, 0), _rank(0, 3), _rank(0, 5)]  # scores 4, 3, 5
    b = DPBalancer(ranks, publish_interval_s=0.1)  # type: ignore[arg-type]
    assert b.pick(0.0) == 1
    assert b.counts[1] == [1, 3]  # counted as waiting there until the next publication: 7
    assert b.pick(0.05) == 0  # 4 < 5 < 7
    assert b.pick(0.06) == 2  # 8, 7, 5
    ranks[1].sched.waiting = [None] * 3  # the truth moves; the balancer sees it only when published
    assert b.pick(0.07) == 1  # 8, 7, 9
    assert b.pick(0.2) == 0  # republished: 4, 15, 5
    ties = DPBalancer([_rank(0, 2), _rank(0, 2)])  # type: ignore[list-item]
    assert ties.pick(0.0) == 0


def test_a_server_reports_its_ranks_summed_and_offers_no_prefetch() -> None:
    fleet = DPFleet(_settings(2, 3, "server").fleet)
    assert sorted(fleet.engines) == ["w0", "w1"] and len(fleet.ranks) == 6
    srv = fleet.engines["w0"]
    assert isinstance(srv, DPServer)
    rep, one = srv.load_report(0.0), srv.ranks[0].load_report(0.0)
    assert rep.blocks["GPU"].free == 3 * one.blocks["GPU"].free
    assert rep.max_waiting == 3 * (one.max_waiting or 0)
    assert "prefetch" not in srv.info().capabilities
    with pytest.raises(TraceError):
        fleet.add()


def test_rank_routing_hits_more_than_server_routing_and_the_report_counts_both() -> None:
    trace = _rounds(prompts=8, rounds=5)
    hits = {}
    for routing in ("rank", "server"):
        run = Simulation(trace, "kv_cost", _settings(1, 4, routing)).run()
        assert all(r.ok for r in run.results)
        assert run.meta.params["dp_routing"] == routing and run.meta.workers == 4
        s = summarize(run)
        hits[routing] = s.hit_rate.get("GPU", 0.0)
        assert hits[routing] == pytest.approx(_cached_share(run), abs=1e-9)
    # rank-aware: every repeat finds its prompt; the balancer scatters them over the ranks
    assert hits["rank"] > 0.7
    assert hits["server"] < hits["rank"] - 0.2


def test_cli_dp_flags(tmp_path: object) -> None:
    out = f"{tmp_path}/o"
    rc = main(["simulate", "--trace", str(MOONCAKE_SLICE), "--limit", "40", "--workers", "2", "--dp", "2",
               "--dp-routing", "server", "--block-size", "64", "--policies", "kv_cost", "--no-ideal",
               "--out", out])
    assert rc == 0
    runs = read_runs(f"{out}/results.jsonl")
    run = [r for r in runs if r.meta.policy == "kv_cost"][0]
    assert run.meta.params["dp"] == 2 and run.meta.params["dp_routing"] == "server"
    assert {r.worker for r in run.results} <= {"w0.dp0", "w0.dp1", "w1.dp0", "w1.dp1"}
