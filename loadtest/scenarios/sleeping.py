"""Extra seed test: sleeping sessions.

Conversations pause (here for minutes) between turns while other traffic flushes
their KV out of GPU memory; when they resume, the offloaded KV (CPU, SSD, remote,
or a peer) should make the resumed turn much cheaper than recomputing it, and the
router should find it.
"""
from __future__ import annotations

from ..results import Run
from ..summary import pct
from ..workloads import PrefixMix, Sessions, merge, prefix_workload, session_workload
from .base import Context, ms, settings, sized_profile

NAME = "sleeping-sessions"
SUMMARY = "conversations resume after a long idle, their KV gone from GPU: offload makes them cheap"


def _resumed(run: Run, resumed: set[int]) -> tuple[float, float, float]:
    """(p50 TTFT, share of prompt tokens cached, share of cached tokens from below GPU) of resumed turns."""
    rs = [r for r in run.results if r.index in resumed and r.ok]
    p = sum(r.prompt_tokens for r in rs)
    c = sum(r.cached_tokens for r in rs)
    below = sum(v for r in rs for k, v in r.loaded_tokens.items() if k != "GPU")
    ttft = [r.ttft_s for r in rs if r.ttft_s is not None]  # all of them: `ok` implies a TTFT
    return pct(ttft, 50), (c / p if p else 0.0), (below / c if c else 0.0)


def run(ctx: Context) -> None:
    workers = ctx.pick(4, 8)
    sleep_s = ctx.pick(150.0, 600.0)
    spec = Sessions(sessions=ctx.pick(16, 120), turns=4, first_tokens=(6000, 16000), turn_tokens=(200, 800),
                    think_s=(5.0, 20.0), sleepers=1.0, sleep_s=sleep_s)
    sessions = session_workload("sessions", spec, seed=ctx.seed, span_s=60.0)
    bg_rate = ctx.pick(1.2, 4.0)
    background = prefix_workload("background", int(bg_rate * (sleep_s + 120)), bg_rate,
                                 PrefixMix(prefix_tokens=[], prefix_prob=0.0, suffix_tokens=(2000, 8000)),
                                 seed=ctx.seed + 7)
    trace = merge(NAME, sessions, background)
    resumed = {r.index for r in trace.requests if r.session and r.session.endswith(":resumed")}
    gpu = ctx.pick(60_000, 120_000)
    prof = sized_profile(gpu_tokens=gpu, cpu_tokens=4 * gpu, disk_tokens=40 * gpu)
    runs = {}
    for tiers in ("gpu", "all"):
        st = settings(prof, workers=workers, tiers=tiers, seed=ctx.seed)
        runs[tiers] = ctx.simulate(trace, "kv_cost", st, label=f"kv_cost@{tiers}")
    ctx.check("every request answered", all(len([r for r in x.results if r.ok]) == len(trace) for x in runs.values()),
              f"{len(trace)} requests per run")
    g50, gshare, _ = _resumed(runs["gpu"], resumed)
    a50, ashare, abelow = _resumed(runs["all"], resumed)
    ctx.check("resumed turns find their KV", ashare >= 0.5,
              f"{len(resumed)} resumed turns: {ashare:.1%} of their prompt cached with offload, {gshare:.1%} GPU-only")
    ctx.check("that KV had left the GPU", abelow >= 0.5,
              f"{abelow:.1%} of the cached tokens of resumed turns came from CPU/SSD/remote/peer")
    ctx.check("offload makes resumed turns cheap", a50 <= 0.7 * g50,
              f"resumed-turn p50 TTFT {ms(a50)} with offload vs {ms(g50)} GPU-only (bound 0.7x)")
