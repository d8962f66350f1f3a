"""Seed test 4: CPU, SSD and network bandwidth squeezed.

The same multi-turn workload runs with the profile's links and with links 25-60x
slower (CPU 2 GB/s, SSD 0.25 GB/s, remote store and peers 0.2 GB/s). A cost model
that prices loads must then fall back to recompute where loading no longer pays, so
the slow tiers may stop helping but must never make TTFT worse than having no
offload at all.
"""
from __future__ import annotations

from typing import TypedDict

from ..summary import RunSummary
from ..workloads import Sessions, session_workload
from .base import Context, by_run, ms, settings, sized_profile

NAME = "bandwidth-squeeze"
SUMMARY = "links 25-60x slower: offload may stop paying but never costs more than no offload"


class _Links(TypedDict):
    cpu_Bps: float
    disk_Bps: float
    remote_Bps: float
    peer_Bps: float


SLOW: _Links = {"cpu_Bps": 2.0e9, "disk_Bps": 0.25e9, "remote_Bps": 0.2e9, "peer_Bps": 0.2e9}


def _below_gpu(s: RunSummary) -> float:
    return sum(v for k, v in s.hit_rate.items() if k != "GPU")


def run(ctx: Context) -> None:
    workers = ctx.pick(4, 8)
    spec = Sessions(sessions=ctx.pick(40, 240), turns=4, first_tokens=(4000, 12000), turn_tokens=(200, 1000),
                    think_s=(10.0, 40.0), sleepers=0.0)
    trace = session_workload(NAME, spec, seed=ctx.seed, span_s=ctx.pick(60.0, 240.0))
    gpu = ctx.pick(40_000, 60_000)
    fast = sized_profile(gpu_tokens=gpu, cpu_tokens=4 * gpu)
    slow = sized_profile(gpu_tokens=gpu, cpu_tokens=4 * gpu, **SLOW)
    ctx.simulate(trace, "kv_cost", settings(fast, workers=workers, tiers="gpu", seed=ctx.seed), label="kv_cost@gpu")
    ctx.simulate(trace, "kv_cost", settings(fast, workers=workers, seed=ctx.seed), label="kv_cost@all")
    ctx.simulate(trace, "kv_cost", settings(slow, workers=workers, seed=ctx.seed), label="kv_cost@all-squeezed")
    ctx.simulate(trace, "round_robin", settings(slow, workers=workers, seed=ctx.seed),
                 label="round_robin@all-squeezed")
    s = by_run(ctx.runs)
    gpu_s, fast_s, slow_s = s["kv_cost@gpu"], s["kv_cost@all"], s["kv_cost@all-squeezed"]
    ctx.check("every request answered", all(x.ok == x.requests for x in s.values()),
              ", ".join(f"{k} {v.ok}/{v.requests}" for k, v in s.items()))
    ctx.check("fast links: offload helps (p50)", fast_s.ttft["p50"] <= gpu_s.ttft["p50"] * 1.02,
              f"kv_cost@all {ms(fast_s.ttft['p50'])} vs GPU-only {ms(gpu_s.ttft['p50'])} (bound +2%)")
    for q in ("p50", "p99"):
        ctx.check(f"squeezed links never worse than no offload ({q})",
                  slow_s.ttft[q] <= gpu_s.ttft[q] * 1.05,
                  f"kv_cost squeezed {ms(slow_s.ttft[q])} vs GPU-only {ms(gpu_s.ttft[q])} (bound +5%)")
    ctx.check("squeezed links: fewer tokens loaded from below GPU", _below_gpu(slow_s) < _below_gpu(fast_s),
              f"{_below_gpu(slow_s):.1%} vs {_below_gpu(fast_s):.1%} of prompt tokens")
