"""Seed test 9: cold start with a burst.

Every cache is empty and a burst arrives within two seconds — before any load
report can show it. The router's own in-flight accounting must spread the burst;
full queues must answer 429 explicitly, never drop a request.
"""
from __future__ import annotations

from ..workloads import PrefixMix, burst_workload
from .base import Context, by_run, ms, settings, sized_profile, worker_shares

NAME = "cold-start-burst"
SUMMARY = "a burst on cold caches within 2 s: spread without herding, explicit 429s, nothing lost"


def run(ctx: Context) -> None:
    n = ctx.pick(300, 2500)
    workers = ctx.pick(4, 8)
    mix = PrefixMix(prefix_tokens=[4096] * 8, prefix_prob=0.8, zipf=1.0, suffix_tokens=(200, 3000),
                    output_tokens=(50, 300))
    trace = burst_workload(NAME, n, 2.0, mix, seed=ctx.seed)
    prof = sized_profile(max_waiting=ctx.pick(48, 256))
    st = settings(prof, workers=workers, seed=ctx.seed)
    for pol in ("round_robin", "least_loaded", "kv_cost"):
        ctx.simulate(trace, pol, st)
    s = by_run(ctx.runs)
    for run in ctx.runs:
        pol = run.meta.run
        bad = [r for r in run.results if not r.ok and r.status != 429]
        n429 = sum(1 for r in run.results if r.status == 429)
        ctx.check(f"{pol}: every request answered or refused explicitly", len(run.results) == n and not bad,
                  f"{len(run.results) - n429 - len(bad)} answered, {n429} refused with 429, {len(bad)} other")
        mw = int(run.meta.stats.get("max_waiting_seen", 0))
        ctx.check(f"{pol}: queues bounded", mw <= prof.scheduler.max_waiting,
                  f"longest waiting queue seen {mw} (max_waiting {prof.scheduler.max_waiting})")
    top = max(worker_shares(next(r for r in ctx.runs if r.meta.run == "kv_cost")).values())
    ctx.check("kv_cost spreads the burst", top <= 1.5 / workers,
              f"busiest worker took {top:.1%} (fair {1 / workers:.1%}, bound 1.5x)")
    kv, rr = s["kv_cost"], s["round_robin"]
    ctx.check("kv_cost p99 TTFT <= round_robin", kv.ttft["p99"] <= rr.ttft["p99"] * 1.05,
              f"{ms(kv.ttft['p99'])} vs {ms(rr.ttft['p99'])} (bound +5%)")
