"""The offline simulator on small slices: completeness, the router model, tiers, CLI."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.fleet import FleetSpec, parse_tiers, profile_with_tiers, tiers_label
from loadtest.results import read_runs
from loadtest.router_model import RouterSettings
from loadtest.scenarios.base import sized_profile
from loadtest.simulate import SimSettings, Simulation
from loadtest.summary import summarize
from loadtest.sweep import find_load, plan_jobs, run_matrix
from loadtest.trace import TraceError
from loadtest.tracefiles import AZURE_SLICE, MOONCAKE_SLICE
from loadtest.traces import load_trace
from loadtest.workloads import PrefixMix, Sessions, prefix_workload, session_workload
from workers.sim import load_profile

MOONCAKE = str(MOONCAKE_SLICE)  # the first 339 requests, shipped in tests/data/traces/


@pytest.fixture(scope="module")
def slice_() -> object:
    return load_trace(MOONCAKE).window(limit=60)


def _settings(**kw: object) -> SimSettings:
    fleet = FleetSpec(workers=4, profile=sized_profile(gpu_tokens=150_000), block_size=64)
    return replace(SimSettings(fleet=fleet), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix_hash", "cache_aware", "dynamo",
                                    "kv_cost", "kv_cost_true_state"])
def test_every_policy_answers_every_request(slice_: object, policy: str) -> None:
    run = Simulation(slice_, policy, _settings()).run()  # type: ignore[arg-type]
    assert [r.index for r in run.results] == list(range(60))
    assert all(r.ok for r in run.results), [r.error for r in run.results if not r.ok]
    for r in run.results:
        assert r.ttft_s > 0 and r.e2e_s >= r.ttft_s and r.worker is not None
        assert r.cached_tokens + r.recomputed_tokens == r.prompt_tokens
    s = summarize(run)
    assert s.ttft["p99"] >= s.ttft["p50"] > 0
    if policy not in ("round_robin", "least_loaded", "prefix_hash"):
        assert s.pred_abs_rel_err_p50 < 1.0  # planners that predict TTFT give a prediction


def test_deterministic(slice_: object) -> None:
    a = Simulation(slice_, "kv_cost", _settings()).run()  # type: ignore[arg-type]
    b = Simulation(slice_, "kv_cost", _settings()).run()  # type: ignore[arg-type]
    assert [(r.ttft_s, r.worker) for r in a.results] == [(r.ttft_s, r.worker) for r in b.results]


def test_index_fed_by_events_matches_the_engines(slice_: object) -> None:
    kept: dict[str, Simulation] = {}

    for lag in (0.0, 0.5):
        st = _settings(router=RouterSettings(event_lag_s=lag))
        sim = Simulation(slice_, "kv_cost", st)  # type: ignore[arg-type]
        sim.run()
        kept[str(lag)] = sim
        sim.router.deliver(float("inf"))  # what lagged events were still on the way
        checked = 0
        for req in slice_.requests[::7]:  # type: ignore[attr-defined]
            keys, digests = sim.keys.get(req)
            m = sim.router.index.match(digests)
            for wid, eng in sim.fleet.engines.items():
                truth = eng.match_tiers(keys)
                n = sum(1 for t in truth if t is not None)
                got = m.get(wid)
                assert (got.blocks if got else 0) == n, (lag, wid)
                if got:
                    flat = [t for t, c in got.runs for _ in range(c)]
                    assert flat == truth[:n]
                    checked += 1
        assert checked > 0
    assert kept["0.0"].router.counters.events_applied > 0


def test_gpu_only_tiers_load_nothing_from_below() -> None:
    trace = session_workload("s", Sessions(sessions=12, turns=3, first_tokens=(3000, 6000)), seed=1, span_s=20)
    prof = sized_profile(gpu_tokens=20_000, cpu_tokens=80_000)
    gpu = Simulation(trace, "kv_cost", _settings(fleet=FleetSpec(workers=2, profile=prof, tiers="gpu",
                                                                  block_size=64))).run()
    allt = Simulation(trace, "kv_cost", _settings(fleet=FleetSpec(workers=2, profile=prof, tiers="all",
                                                                   block_size=64))).run()
    assert all(set(r.loaded_tokens) <= {"GPU"} for r in gpu.results)
    assert summarize(allt).hit_rate["CPU"] + summarize(allt).hit_rate["REMOTE"] > 0
    assert gpu.meta.tiers == "gpu" and allt.meta.tiers == "all"


def test_prefetch_is_issued_when_blocks_sit_below_gpu() -> None:
    trace = session_workload("s", Sessions(sessions=16, turns=4, first_tokens=(4000, 8000), think_s=(20, 40)),
                             seed=2, span_s=20)
    prof = sized_profile(gpu_tokens=20_000, cpu_tokens=200_000)
    run = Simulation(trace, "kv_cost", _settings(fleet=FleetSpec(workers=2, profile=prof, block_size=64))).run()
    assert run.meta.stats["prefetches_sent"] > 0
    assert any(r.prefetch_blocks > 0 for r in run.results)
    no = Simulation(trace, "kv_cost", _settings(fleet=FleetSpec(workers=2, profile=prof, block_size=64),
                                                router=RouterSettings(prefetch=False))).run()
    assert no.meta.stats["prefetches_sent"] == 0


def test_nothing_is_dropped_silently() -> None:
    trace = prefix_workload("w", 40, 50.0, PrefixMix(prefix_tokens=[], prefix_prob=0.0,
                                                     suffix_tokens=(20000, 30000)))
    run = Simulation(trace, "round_robin", _settings(max_drain_s=0.5)).run()
    assert len(run.results) == 40
    unfinished = [r for r in run.results if r.error and "unfinished" in r.error]
    assert unfinished and run.meta.stats["unfinished"] == len(unfinished)
    shed = Simulation(trace, "kv_cost", _settings(), policy_params={"max_ttft_s": 1e-4}).run()
    assert all(r.status == 429 and "shed" in (r.error or "") for r in shed.results)
    big = trace.with_requests([replace(trace.requests[0], input_length=120_000,
                                       hash_ids=tuple(range(-(-120_000 // 64))))])
    small_gpu = FleetSpec(workers=2, profile=sized_profile(gpu_tokens=100_000), block_size=64)
    too_large = Simulation(big, "kv_cost", _settings(fleet=small_gpu)).run()
    assert too_large.results[0].status == 400 and "KV blocks" in (too_large.results[0].error or "")


def test_tier_specs() -> None:
    assert parse_tiers("gpu,cpu") == frozenset({"gpu", "cpu"})
    assert tiers_label(parse_tiers("GPU, CPU, DISK")) == "gpu,cpu,disk"
    with pytest.raises(TraceError):
        parse_tiers("cpu")
    with pytest.raises(TraceError):
        parse_tiers("gpu,tape")
    p = profile_with_tiers(load_profile("h200-llama3.1-8b"), parse_tiers("gpu,cpu"))
    assert p.cpu is not None and p.disk is None and p.remote is None and p.peer is None


def test_sweep_and_load_search(slice_: object) -> None:
    jobs = plan_jobs(["round_robin", "kv_cost"], ["gpu", "all"], {"kv_cost": {"balance_eps": 0.5}})
    assert [j.label for j in jobs] == ["round_robin@gpu", "kv_cost@gpu", "round_robin@all", "kv_cost@all"]
    assert jobs[1].params == {"balance_eps": 0.5}
    runs = run_matrix(slice_, _settings(), jobs[:2])  # type: ignore[arg-type]
    assert [r.meta.run for r in runs] == ["round_robin@gpu", "kv_cost@gpu"]
    speed, probes = find_load(slice_, _settings(), ratio=1.5, ladder=(1.0, 4.0))  # type: ignore[arg-type]
    assert probes and probes[0].speed == 1.0
    assert speed is None or probes[-1].ratio >= 1.5


def test_cli_simulate_report_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the calls without --out write there
    out = tmp_path / "sim"
    rc = main(["simulate", "--trace", MOONCAKE, "--limit", "30", "--workers", "2", "--block-size", "64",
               "--policies", "round_robin,kv_cost", "--out", str(out), "--no-plots",
               "--param", "kv_cost.balance_eps=0.5"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| kv_cost |" in text and "TTFT p50" in text and "slowdown p50" in text and "utilisation" in text
    runs = read_runs(out / "results.jsonl")
    assert [r.meta.run for r in runs] == ["ideal", "round_robin", "kv_cost"]  # the physical limit first
    assert runs[2].meta.params["policy"] == {"balance_eps": 0.5}
    assert (out / "report.md").exists()
    assert main(["report", str(out / "results.jsonl"), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "ttft_cdf.png").exists()
    assert main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--policies", "nope"]) == 2
    assert main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--profile", "nope"]) == 2
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--param", "kv_cost.bogus=1",
                 "--policies", "kv_cost"]) == 2
    capsys.readouterr()
    assert main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--param", "kv_cost.tie_margin=0.05",
                 "--policies", "kv_cost"]) == 2  # a former setting, now a constant
    assert "'tie_margin' is no longer a setting" in capsys.readouterr().err
    assert main(["trace", "stats", "--trace", MOONCAKE, "--limit", "10"]) == 0
    conv = tmp_path / "az.jsonl"
    assert main(["trace", "convert", "--trace", str(AZURE_SLICE),
                 "--limit", "50", "--to", str(conv)]) == 0
    back = load_trace(conv, block_tokens=16)
    assert len(back) == 50
    assert main(["scenario", "list"]) == 0
    assert main(["scenario", "nope"]) == 2


def test_cli_without_the_loadtest_extra_says_how_to_install_it(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["trace", "stats", "--trace", MOONCAKE, "--limit", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "matplotlib missing" in err and "pip install 'kvroute[loadtest]'" in err


def _two_at_once(first_tokens: int, second_tokens: int) -> object:
    from loadtest.trace import Trace, TraceRequest

    a = TraceRequest(0, 0.0, first_tokens, 4, tuple(range(1000, 1000 + -(-first_tokens // 512))))
    b = TraceRequest(1, 0.0, second_tokens, 4, tuple(range(5000, 5000 + -(-second_tokens // 512))))
    return Trace("pair", 512, [a, b])


def test_transport_delays_are_paid_and_reorder_arrivals_at_the_worker() -> None:
    """Issued together, a long prompt first: with no transport the worker starts the long
    one and the short one waits for its whole prefill; with a per-token delay the short
    one gets there first (as over HTTP), and both TTFTs include what the path costs."""
    trace = _two_at_once(60_000, 1_000)
    one = FleetSpec(workers=1, profile=sized_profile(gpu_tokens=150_000), block_size=64)
    pure = Simulation(trace, "round_robin", _settings(fleet=one)).run()  # type: ignore[arg-type]
    rs = RouterSettings(route_delay_s=0.002, route_delay_s_per_token=1e-7, send_delay_s=0.003,
                        send_delay_s_per_token=2e-7)
    http = Simulation(trace, "round_robin", _settings(fleet=one, router=rs)).run()  # type: ignore[arg-type]
    long_p, short_p = pure.results
    long_h, short_h = http.results
    assert short_p.ttft_s > long_p.ttft_s * 0.9  # waited behind the long prefill
    assert short_h.ttft_s < long_h.ttft_s / 5  # overtook it
    assert short_h.queue_ms < 1.0
    # alone, a request pays exactly both delays on top of the pure model
    solo = trace.with_requests([trace.requests[1]])
    a = Simulation(solo, "round_robin", _settings(fleet=one)).run().results[0]  # type: ignore[arg-type]
    b = Simulation(solo, "round_robin", _settings(fleet=one, router=rs)).run().results[0]  # type: ignore[arg-type]
    assert b.ttft_s - a.ttft_s == pytest.approx(0.005 + 3e-7 * 1_000, abs=1e-9)


def test_a_request_in_transit_counts_for_its_worker_until_a_report_has_it() -> None:
    """Polls taken while a request is on its way cannot know it: the router keeps counting
    it, so a cold prompt 100 ms later does not pile onto the same "most room" worker."""
    pair = _two_at_once(2_000, 2_000)
    trace = pair.with_requests([pair.requests[0], replace(pair.requests[1], arrival_s=0.1)])  # type: ignore[attr-defined]
    two = FleetSpec(workers=2, profile=sized_profile(gpu_tokens=150_000), block_size=64)
    rs = RouterSettings(send_delay_s=0.5, poll_interval_s=0.01)
    run = Simulation(trace, "cache_aware", _settings(fleet=two, router=rs)).run()  # type: ignore[arg-type]
    assert [r.worker for r in run.results] == ["w0", "w1"]


def test_cli_delay_flags(tmp_path: Path) -> None:
    out = tmp_path / "d"
    assert main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--workers", "2", "--policies", "round_robin",
                 "--route-delay", "0.001,1e-7", "--send-delay", "0.002", "--out", str(out), "--no-plots"]) == 0
    r = read_runs(out / "results.jsonl")[1].meta.params["router"]
    assert (r["route_delay_s"], r["route_delay_s_per_token"], r["send_delay_s"], r["send_delay_s_per_token"]) == (
        0.001, 1e-7, 0.002, 0.0)
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--send-delay", "-1"])
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--send-delay", "1,2,3"])



def test_intake_keeps_a_burst_in_order_and_only_large_bodies_fall_behind() -> None:
    """The gateway's intake takes one request at a time (issue order, `intake_s` apart);
    per-token delays count only the tokens beyond `delay_free_tokens`, so a body that
    fits keeps its place and only a larger one is overtaken."""
    trace = _two_at_once(30_000, 1_000)
    one = FleetSpec(workers=1, profile=sized_profile(gpu_tokens=150_000), block_size=64)
    keep = RouterSettings(intake_s=0.004, route_delay_s_per_token=1e-6, delay_free_tokens=40_000)
    long_k, short_k = Simulation(trace, "round_robin", _settings(fleet=one, router=keep)).run().results  # type: ignore[arg-type]
    assert short_k.ttft_s > long_k.ttft_s * 0.9  # 30k tokens are under the free part: still first
    assert long_k.queue_ms < 1.0
    lag = replace(keep, delay_free_tokens=20_000)
    long_l, short_l = Simulation(trace, "round_robin", _settings(fleet=one, router=lag)).run().results  # type: ignore[arg-type]
    assert short_l.ttft_s < long_l.ttft_s / 5  # 10k tokens over it (10 ms) let the short one pass
    # alone: intake + the delay of the tokens over the free part, exactly
    solo = trace.with_requests([trace.requests[0]])
    a = Simulation(solo, "round_robin", _settings(fleet=one)).run().results[0]  # type: ignore[arg-type]
    b = Simulation(solo, "round_robin", _settings(fleet=one, router=lag)).run().results[0]  # type: ignore[arg-type]
    assert b.ttft_s - a.ttft_s == pytest.approx(0.004 + 1e-6 * 10_000, abs=1e-9)
    # the second of the burst waits for the intake behind the first
    pair = Simulation(trace, "round_robin", _settings(fleet=one, router=replace(keep, intake_s=0.5))).run()  # type: ignore[arg-type]
    assert pair.results[1].ttft_s >= 1.0


def test_route_jitter_is_bounded_and_seeded() -> None:
    trace = _two_at_once(1_000, 1_000)
    one = FleetSpec(workers=1, profile=sized_profile(gpu_tokens=150_000), block_size=64)
    base = Simulation(trace.with_requests([trace.requests[0]]), "round_robin", _settings(fleet=one)).run()  # type: ignore[arg-type]
    t0 = base.results[0].ttft_s

    def ttft(seed: int) -> float:
        rs = RouterSettings(route_jitter_s=0.05, transport_seed=seed)
        solo = trace.with_requests([trace.requests[0]])
        return Simulation(solo, "round_robin", _settings(fleet=one, router=rs)).run().results[0].ttft_s  # type: ignore[arg-type]

    draws = [ttft(s) - t0 for s in range(6)]
    assert all(0.0 <= d < 0.05 for d in draws)
    assert len({round(d, 9) for d in draws}) > 1  # seeds differ
    assert ttft(3) == ttft(3)  # and each is reproducible


def test_transport_presets_and_cli() -> None:
    rs = RouterSettings().with_transport("local-http", 7)
    assert rs.transport_seed == 7 and rs.intake_s > 0 and rs.send_delay_s > 0 and rs.delay_free_tokens > 0
    assert RouterSettings().with_transport("none") == RouterSettings()
    with pytest.raises(ValueError, match="unknown transport"):
        RouterSettings().with_transport("carrier-pigeon")
    assert main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--transport", "carrier-pigeon"]) == 2


def test_burst_jitter_is_shared_by_requests_issued_together() -> None:
    """Everything issued at one instant is late by the same draw; the next burst draws anew."""
    pair = _two_at_once(1_000, 1_000)
    later = replace(pair.requests[1], index=2, arrival_s=5.0)  # type: ignore[attr-defined]
    trace = pair.with_requests([*pair.requests, later])
    three = FleetSpec(workers=3, profile=sized_profile(gpu_tokens=150_000), block_size=64)
    pure = Simulation(trace, "round_robin", _settings(fleet=three)).run()  # type: ignore[arg-type]
    rs = RouterSettings(burst_jitter_s=0.5, transport_seed=3)
    late = Simulation(trace, "round_robin", _settings(fleet=three, router=rs)).run()  # type: ignore[arg-type]
    extra = [b.ttft_s - a.ttft_s for a, b in zip(pure.results, late.results, strict=True)]
    assert extra[0] == pytest.approx(extra[1], abs=1e-9)  # one draw for the burst at t=0
    assert 0.0 < extra[0] < 0.5 and 0.0 <= extra[2] < 0.5
    assert extra[2] != pytest.approx(extra[0], abs=1e-6)  # a new draw at t=5


@pytest.mark.parametrize("speed", ["0", "-2", "nan"])
def test_a_speed_that_is_no_rate_is_refused_by_the_arguments(speed: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`--speed 0` divided arrival times (a ZeroDivisionError traceback): exit 2 with the reason."""
    with pytest.raises(SystemExit) as ei:
        main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--workers", "2", "--policies", "round_robin",
              "--speed", speed, "--out", str(tmp_path)])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "--speed" in err and "above 0" in err and "Traceback" not in err


_SMALL = ["simulate", "--trace", MOONCAKE, "--limit", "5", "--workers", "2", "--policies", "round_robin",
          "--no-plots"]


def test_simulate_without_out_writes_a_new_temporary_folder_not_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import tempfile

    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    assert main(_SMALL) == 0
    assert main(_SMALL) == 0
    assert list(cwd.iterdir()) == []  # nothing written where the command ran (it wrote runs/ there)
    made = sorted(tmp.iterdir())
    assert len(made) == 2 and all(p.name.startswith("kvroute-simulate-") for p in made)  # one new folder a run
    text = capsys.readouterr().out
    for p in made:
        assert f"results: {p / 'results.jsonl'}" in text
        assert [r.meta.run for r in read_runs(p / "results.jsonl")] == ["ideal", "round_robin"]


def test_a_reused_out_folder_is_refused_not_appended_to(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    out.mkdir()  # an empty folder is fine
    assert main([*_SMALL, "--out", str(out)]) == 0
    before = (out / "results.jsonl").read_bytes()
    capsys.readouterr()
    assert main([*_SMALL, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "not empty" in err
    assert (out / "results.jsonl").read_bytes() == before  # the first run's results, alone
    assert main(["report", str(out / "results.jsonl"), "--out", str(out)]) == 2  # report too
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main([*_SMALL, "--out", str(a_file)]) == 2
    assert "not a folder" in capsys.readouterr().err and a_file.read_text() == "x"
