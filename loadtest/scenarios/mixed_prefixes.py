"""Seed test 3: short and long prefixes mixed.

Twenty 256-token prefixes and four 24k-token ones share the fleet; the GPU is small
enough that long prefixes fall to CPU/SSD. Long ones are worth routing to (and
loading), short ones hardly matter; the router must not trade the long hits away.
"""
from __future__ import annotations

import numpy as np

from ..results import Run
from ..summary import pct
from ..workloads import PrefixMix, prefix_workload
from .base import Context, by_run, ms, settings, sized_profile

NAME = "mixed-prefixes"
SUMMARY = "256-token and 24k-token prefixes mixed on a small GPU: long hits kept, short ones cheap"
LONG = 24576


def _long_hit(run: Run, long_ids: set[int]) -> tuple[float, float]:
    """(share of long-prefix tokens served from cache, p50 TTFT of long-prefix requests)."""
    got = want = 0
    ttft: list[float] = []
    for r in run.results:
        if r.index in long_ids and r.ok and r.ttft_s is not None:  # `ok` implies a TTFT
            want += LONG
            got += min(LONG, r.cached_tokens)
            ttft.append(r.ttft_s)
    return (got / want if want else 0.0), pct(ttft, 50)


def run(ctx: Context) -> None:
    n = ctx.pick(300, 2400)
    workers = ctx.pick(4, 8)
    rate = ctx.pick(5.0, 12.0)
    prefixes = [256] * 20 + [LONG] * 4
    mix = PrefixMix(prefix_tokens=prefixes, prefix_prob=1.0, zipf=0.3, suffix_tokens=(100, 800),
                    output_tokens=(50, 200))
    trace = prefix_workload(NAME, n, rate, mix, seed=ctx.seed)
    long_ids = {r.index for r in trace.requests if r.input_length > LONG}
    prof = sized_profile(gpu_tokens=ctx.pick(60_000, 50_000))
    for tiers in ("gpu", "all"):
        st = settings(prof, workers=workers, tiers=tiers, seed=ctx.seed)
        for pol in ("round_robin", "kv_cost"):
            ctx.simulate(trace, pol, st, label=f"{pol}@{tiers}")
    s = by_run(ctx.runs)
    runs = {r.meta.run: r for r in ctx.runs}
    ctx.check("every request answered", all(x.ok == x.requests for x in s.values()),
              ", ".join(f"{k} {v.ok}/{v.requests}" for k, v in s.items()))
    kv_hit, kv_p50 = _long_hit(runs["kv_cost@all"], long_ids)
    rr_hit, rr_p50 = _long_hit(runs["round_robin@all"], long_ids)
    ctx.check("long prefixes hit under kv_cost", kv_hit >= 0.8 and kv_hit >= rr_hit,
              f"kv_cost served {kv_hit:.1%} of long-prefix tokens from cache, round_robin {rr_hit:.1%}")
    ctx.check("long-prefix TTFT: kv_cost <= round_robin", kv_p50 <= rr_p50 * 1.02,
              f"p50 {ms(kv_p50)} vs {ms(rr_p50)} (bound +2%)")
    for q in ("p50", "p99"):
        a, b = s["kv_cost@all"].ttft[q], s["round_robin@all"].ttft[q]
        ctx.check(f"overall {q} TTFT: kv_cost <= round_robin", a <= b * 1.02, f"{ms(a)} vs {ms(b)} (bound +2%)")
    a, b = s["kv_cost@all"].ttft["p50"], s["kv_cost@gpu"].ttft["p50"]
    ctx.check("offload pays: kv_cost@all <= kv_cost@gpu (p50)", a <= b * 1.02, f"{ms(a)} vs {ms(b)} (bound +2%)")
    lens = np.array([r.input_length for r in trace.requests])
    ctx.note(f"{len(long_ids)} long-prefix requests of {len(lens)}; prompt p50 {np.median(lens):.0f} tokens")
