"""Seed test 2: every prompt unique — nothing to reuse.

The cache must cost nothing here: no hits are claimed, no prefetch is sent, the SSD
admission filter writes nothing, and kv_cost balances like a load balancer.
"""
from __future__ import annotations

from ..workloads import PrefixMix, prefix_workload
from .base import Context, by_run, ms, settings, sized_profile

NAME = "all-unique"
SUMMARY = "no prompt shares a prefix: no false hits, no prefetch, no SSD writes, balanced"


def run(ctx: Context) -> None:
    n = ctx.pick(240, 2000)
    workers = ctx.pick(4, 8)
    rate = ctx.pick(8.0, 30.0)
    mix = PrefixMix(prefix_tokens=[], prefix_prob=0.0, suffix_tokens=(1000, 8000), output_tokens=(50, 300))
    trace = prefix_workload(NAME, n, rate, mix, seed=ctx.seed)
    st = settings(sized_profile(gpu_tokens=ctx.pick(60_000, 200_000)), workers=workers, seed=ctx.seed)
    for pol in ("round_robin", "least_loaded", "kv_cost"):
        ctx.simulate(trace, pol, st)
    s = by_run(ctx.runs)
    kv, ll = s["kv_cost"], s["least_loaded"]
    ctx.check("every request answered", all(x.ok == x.requests for x in s.values()),
              ", ".join(f"{k} {v.ok}/{v.requests}" for k, v in s.items()))
    hit = max(x.cached_tokens / max(1, x.prompt_tokens) for x in s.values())
    ctx.check("no false hits", hit == 0.0, f"largest cached share {hit:.3%}")
    pf = kv.stats.get("prefetches_sent", 0)
    ctx.check("no prefetch", pf == 0, f"kv_cost sent {pf} prefetches")
    disk = max(int(x.stats.get("disk_bytes_written", 0)) for x in s.values())
    ctx.check("SSD admission filter writes nothing", disk == 0,
              f"{disk} bytes written to DISK (blocks are admitted only once used twice)")
    ctx.check("kv_cost balances like least_loaded", kv.ttft["p99"] <= ll.ttft["p99"] * 1.10,
              f"p99 {ms(kv.ttft['p99'])} vs least_loaded {ms(ll.ttft['p99'])} (bound +10%)")
