"""Prefill/decode disaggregation in the simulator: roles, the KV moved from the prefill
worker to the decode worker, the bypass, TPOT and goodput in the report."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvindex.tiers import Tier
from loadtest.cli import main
from loadtest.fleet import Fleet, FleetSpec
from loadtest.scenarios.base import sized_profile
from loadtest.simulate import SimSettings, Simulation
from loadtest.summary import summarize
from loadtest.trace import Trace, TraceError, TraceRequest
from loadtest.tracefiles import MOONCAKE_SLICE


def _settings(pd: tuple[int, int] | None = (1, 1), workers: int = 2, **kw: object) -> SimSettings:
    fleet = FleetSpec(workers=workers, profile=sized_profile(gpu_tokens=150_000), block_size=64, pd=pd)
    return replace(SimSettings(fleet=fleet), **kw)  # type: ignore[arg-type]


def _conversation() -> Trace:
    """Two turns: the second extends the first's prompt by 600 tokens."""
    first = TraceRequest(0, 0.0, 4000, 50, tuple(range(1, 9)))
    second = TraceRequest(1, 5.0, 4600, 50, tuple(range(1, 10)))
    return Trace("conversation", 512, [first, second])


def test_roles_of_a_disaggregated_fleet():
    fleet = Fleet(FleetSpec(workers=5, profile=sized_profile(gpu_tokens=150_000), pd=(2, 3)))
    assert [e.role for e in fleet.engines.values()] == ["prefill", "prefill", "decode", "decode", "decode"]
    with pytest.raises(TraceError, match="at least one worker of each role"):
        Fleet(FleetSpec(workers=4, profile=sized_profile(gpu_tokens=150_000), pd=(4, 0)))
    with pytest.raises(TraceError, match="keep `peer` in --tiers"):
        FleetSpec(workers=2, tiers="gpu,cpu", pd=(1, 1)).resolved_profile()
    with pytest.raises(TraceError, match="routed by the pair policies"):
        Simulation(_conversation(), "kv_cost", _settings())


def test_the_kv_moves_to_the_decode_worker_which_then_holds_it_and_serves_the_next_turn_itself():
    sim = Simulation(_conversation(), "pd_cost", _settings())
    run = sim.run()
    r0, r1 = run.results
    assert r0.ok and r1.ok
    p, d = sim.fleet.engines["w0"], sim.fleet.engines["w1"]
    assert (p.role, d.role) == ("prefill", "decode")
    # turn 1: prefilled on w0 (max_tokens 1), its 62 full blocks pulled by w1 over the PEER link
    assert sim.counters["pd_pair"] == 1 and sim.counters["pd_transfer_blocks"] == 4000 // 64
    assert r0.worker == "w1" and r0.loaded_tokens.get("PEER") == 4000 // 64 * 64
    assert r0.recomputed_tokens == 4000 - 4000 // 64 * 64
    assert r0.output_tokens == 50 and r0.tpot_s is not None and r0.tpot_s > 0
    # both engines hold the prompt's blocks, and the index learnt it from w1's events
    keys, digests = sim.keys.get(_conversation().requests[0])
    assert all(t is Tier.GPU for t in d.match_tiers(keys))
    assert all(t is Tier.GPU for t in p.match_tiers(keys))
    assert sim.router.index.match(digests)["w1"].blocks == len(keys)
    # turn 2: w1 holds all but 600 tokens: the bypass, no remote prefill
    assert sim.counters["pd_bypass"] == 1
    assert r1.worker == "w1" and r1.recomputed_tokens <= 4600 - 62 * 64
    assert p.stats.submitted == 1  # the prefill worker saw turn 1 only
    # the pair's TTFT pays the prefill, the transfer and the decode worker's first step
    assert r0.ttft_s > r0.prefill_ms / 1000.0


def test_without_the_bypass_every_turn_is_prefilled_remotely():
    sim = Simulation(_conversation(), "pd_round_robin", _settings())
    run = sim.run()
    assert all(r.ok for r in run.results)
    assert sim.counters["pd_pair"] == 2 and sim.counters["pd_bypass"] == 0
    assert sim.fleet.engines["w0"].stats.submitted == 2


@pytest.mark.parametrize("policy", ["pd_cost", "pd_round_robin", "pd_prefix"])
def test_pair_policies_serve_a_trace_slice_on_both_kinds_of_fleet(policy: str):
    from loadtest.traces import load_trace
    trace = load_trace(str(MOONCAKE_SLICE)).window(limit=40)
    for settings in (_settings((2, 2), 4), _settings(None, 4)):
        sim = Simulation(trace, policy, settings)
        run = sim.run()
        assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok]
        if settings.fleet.pd is None:
            assert sim.counters["pd_single"] == 40
        else:
            assert sim.counters["pd_single"] == 0 and sim.counters["pd_pair"] > 0
            assert all(r.worker in ("w2", "w3") for r in run.results)  # the client's stream: a decode worker
        s = summarize(run)
        assert s.tpot["p50"] > 0 and 0.0 <= s.goodput["share"] <= 1.0


def test_goodput_counts_requests_within_both_slos():
    run = Simulation(_conversation(), "pd_cost", _settings(slo_ttft_s=10.0, slo_tpot_s=1.0)).run()
    assert summarize(run).goodput["share"] == 1.0
    run = Simulation(_conversation(), "pd_cost", _settings(slo_ttft_s=10.0, slo_tpot_s=1e-6)).run()
    g = summarize(run).goodput
    assert g["share"] == 0.0 and g["slo_tpot_s"] == 1e-6


def test_cli_pd_reports_tpot_and_goodput(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "o"
    rc = main(["simulate", "--trace", str(MOONCAKE_SLICE), "--limit", "30", "--pd", "1:1",
               "--block-size", "64", "--policies", "pd_cost,pd_prefix", "--no-plots", "--judge-from", "0.6",
               "--slo-ttft", "3", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "(1 prefill + 1 decode)" in (out / "report.md").read_text()
    assert "goodput (TTFT <= 3 s, TPOT <= 0.1 s)" in text and "TPOT p50 ms" in text
    parts = json.loads((out / "holdout.json").read_text())["runs"]["pd_cost"]
    assert parts["judged"]["goodput"]["slo_ttft_s"] == 3.0 and parts["fit"]["tpot_s"]["p99"] > 0
    rc = main(["simulate", "--trace", str(MOONCAKE_SLICE), "--limit", "5", "--pd", "1:1",
               "--policies", "kv_cost", "--no-plots", "--out", str(tmp_path / "x")])
    assert rc != 0 and "only the pair policies" in capsys.readouterr().err
