"""Seed test 1: a long common prefix reused often.

Four 16k-token prefixes (Zipf-popular) start 90% of the prompts. Routing by cache
must turn that into hits without herding the hot prefix onto one worker.
"""
from __future__ import annotations

from ..workloads import PrefixMix, prefix_workload
from .base import Context, by_run, ms, settings, sized_profile, worker_shares

NAME = "long-common-prefix"
SUMMARY = "four 16k-token prefixes reused by 90% of prompts: reuse without herding"


def run(ctx: Context) -> None:
    n = ctx.pick(240, 2000)
    workers = ctx.pick(4, 8)
    rate = ctx.pick(6.0, 18.0)
    mix = PrefixMix(prefix_tokens=[16384] * 4, prefix_prob=0.9, zipf=1.0, suffix_tokens=(200, 1500),
                    output_tokens=(50, 200))
    trace = prefix_workload(NAME, n, rate, mix, seed=ctx.seed)
    prof = sized_profile()
    st = settings(prof, workers=workers, seed=ctx.seed)
    for pol in ("round_robin", "cache_aware", "kv_cost"):
        ctx.simulate(trace, pol, st)
    s = by_run(ctx.runs)
    kv, rr = s["kv_cost"], s["round_robin"]
    ideal = trace.stats().ideal_token_reuse
    ctx.check("every request answered", all(x.ok == x.requests for x in s.values()),
              ", ".join(f"{k} {v.ok}/{v.requests}" for k, v in s.items()))
    ctx.check("prefix reused", kv.recompute_avoided >= 0.85 * ideal,
              f"kv_cost avoided {kv.recompute_avoided:.1%} of prompt tokens; ideal (one infinite cache) {ideal:.1%}")
    ctx.check("kv_cost p50 TTFT <= round_robin", kv.ttft["p50"] <= rr.ttft["p50"] * 1.02,
              f"{ms(kv.ttft['p50'])} vs {ms(rr.ttft['p50'])} (bound +2%)")
    ctx.check("kv_cost p99 TTFT <= round_robin", kv.ttft["p99"] <= rr.ttft["p99"] * 1.02,
              f"{ms(kv.ttft['p99'])} vs {ms(rr.ttft['p99'])} (bound +2%)")
    shares = worker_shares(next(r for r in ctx.runs if r.meta.run == "kv_cost"))
    top = max(shares.values()) if shares else 0.0
    ctx.check("no herding", top <= 2.0 / workers,
              f"busiest worker took {top:.1%} of kv_cost's requests (fair share {1 / workers:.1%}, bound 2x)")
