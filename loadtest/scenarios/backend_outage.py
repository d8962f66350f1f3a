"""Seed test 7: the offload backend stops — recompute takes over, load shedding holds.

The group-shared REMOTE store (the main tier below a small GPU here) loses its
content at 1/3 of the run: the index still lists the blocks (nobody published
their removal), so the planner keeps predicting loads that turn into misses. Every
request must still be answered by recomputing, the surge of prefill must be held by
bounded queues and explicit 429s (kv_cost with a TTFT SLO), and nothing may fail.
"""
from __future__ import annotations

from typing import Any

from ..simulate import Simulation
from ..summary import pct
from ..workloads import Sessions, session_workload
from .base import Context, ms, settings, sized_profile

NAME = "backend-outage"
SUMMARY = "the REMOTE store loses everything mid-run: misses recompute, queues bounded, explicit 429s"


def run(ctx: Context) -> None:
    workers = ctx.pick(4, 8)
    spec = Sessions(sessions=ctx.pick(40, 300), turns=5, first_tokens=(4000, 12000), turn_tokens=(200, 1000),
                    think_s=(5.0, 20.0), sleepers=0.0)
    trace = session_workload(NAME, spec, seed=ctx.seed, span_s=ctx.pick(60.0, 200.0))
    t_out = trace.span_s / 3
    gpu = ctx.pick(30_000, 60_000)
    max_waiting = ctx.pick(24, 64)
    prof = sized_profile(gpu_tokens=gpu, cpu_tokens=gpu // 2, disk_tokens=0, max_waiting=max_waiting)
    st = settings(prof, workers=workers, tiers="gpu,cpu,disk,remote", seed=ctx.seed, speed=3.0)
    facts: dict[str, Any] = {}

    def outage(sim: Simulation, now: float) -> None:
        n = 0
        for store in sim.fleet.remotes:
            n += len(store.remove(list(store.blocks)))
        facts.setdefault(sim.label, {})["wiped"] = n

    slo = 2.0
    ctx.simulate(trace, "kv_cost", st, label="kv_cost-no-outage")
    ctx.simulate(trace, "kv_cost", st, label="kv_cost-outage", actions=[(t_out / st.speed, outage)])
    ctx.simulate(trace, "kv_cost", st, label=f"kv_cost-outage-slo{slo:g}s", params={"max_ttft_s": slo},
                 actions=[(t_out / st.speed, outage)])
    for run in ctx.runs:
        name = run.meta.run
        bad = [r for r in run.results if not r.ok and r.status != 429]
        n429 = sum(1 for r in run.results if r.status == 429)
        ctx.check(f"{name}: no request failed", not bad and len(run.results) == len(trace),
                  f"{len(run.results) - n429 - len(bad)} answered, {n429} explicit 429s, {len(bad)} failures")
        mw = int(run.meta.stats.get("max_waiting_seen", 0))
        ctx.check(f"{name}: queues bounded", mw <= max_waiting, f"longest queue {mw} (max_waiting {max_waiting})")
    runs = {r.meta.run: r for r in ctx.runs}
    wiped = facts.get("kv_cost-outage", {}).get("wiped", 0)
    ctx.check("the outage hit stored blocks", wiped > 0, f"{wiped} blocks lost from the REMOTE store")
    after = t_out / st.speed

    def after_stats(label: str) -> tuple[float, float]:
        """(p50 TTFT, share of prompt tokens recomputed) of the requests answered after the outage."""
        rs = [r for r in runs[label].results if r.ok and r.arrival_s >= after]
        prompt = sum(r.prompt_tokens for r in rs)
        return pct([r.ttft_s for r in rs], 50), sum(r.recomputed_tokens or 0 for r in rs) / max(1, prompt)

    base_p50, base_re = after_stats("kv_cost-no-outage")
    out_p50, out_re = after_stats("kv_cost-outage")
    ctx.check("recompute takes over", out_re > base_re,
              f"after the outage {out_re:.1%} of prompt tokens recomputed vs {base_re:.1%} without it "
              f"(p50 TTFT {ms(out_p50)} vs {ms(base_p50)})")
    slo_run = runs[f"kv_cost-outage-slo{slo:g}s"]
    shed = [r for r in slo_run.results if r.status == 429]
    ctx.note(f"with a {slo:g} s TTFT SLO kv_cost shed {len(shed)} requests with 429 + retry-after")
    ctx.pending("backend unreachable, then back",
                "the simulated REMOTE store can only lose data (RemoteStore.remove); a stopped backend needs "
                "RemoteStore.set_available(False/True): while down, engine loads from it fail fast (counted, "
                "recomputed), writes are skipped, its links time out, and it warms up gradually after recovery")
