"""Extra seed test: a long run that fills the SSD tier to capacity.

Many reusable prefixes (each seen at least twice, so the SSD admission filter lets
them in) on a fleet with a small SSD: the DISK tier must fill up, stay within its
capacity (LRU evicts), keep serving hits, and the run reports the bytes written —
the SSD's wear.
"""
from __future__ import annotations

from typing import Any

from kvwire import BlockCounts

from ..simulate import Simulation
from ..workloads import PrefixMix, prefix_workload
from .base import Context, settings, sized_profile

NAME = "disk-fill"
SUMMARY = "many reusable prefixes on a small SSD: fills to capacity, stays within it, write volume reported"


def run(ctx: Context) -> None:
    n = ctx.pick(600, 4000)
    workers = ctx.pick(2, 4)
    gpu = ctx.pick(30_000, 60_000)
    disk = ctx.pick(120_000, 250_000)
    mix = PrefixMix(prefix_tokens=[3072] * ctx.pick(240, 600), prefix_prob=1.0, zipf=0.4,
                    suffix_tokens=(64, 512), output_tokens=(16, 64))
    trace = prefix_workload(NAME, n, ctx.pick(10.0, 20.0), mix, seed=ctx.seed)
    prof = sized_profile(gpu_tokens=gpu, cpu_tokens=gpu, disk_tokens=disk, disk_admit_after=2)
    st = settings(prof, workers=workers, tiers="gpu,cpu,disk", seed=ctx.seed)
    samples: list[tuple[float, int, int]] = []  # (t, max used, capacity) of DISK over workers

    def sample(sim: Simulation, now: float) -> None:
        used = cap = 0
        for eng in sim.fleet.engines.values():
            b = eng.load_report(now).blocks.get("DISK", BlockCounts())
            used = max(used, b.used)
            cap = b.capacity
        samples.append((now, used, cap))

    period = trace.span_s / 40
    facts: dict[str, Any] = {}

    def keep(sim: Simulation) -> None:
        sample(sim, sim.now)
        facts["disk_blocks"] = [eng.load_report(sim.now).blocks["DISK"] for eng in sim.fleet.engines.values()]

    run_ = ctx.simulate(trace, "kv_cost", st, actions=[(i * period, sample) for i in range(1, 41)], keep=keep)
    ok = sum(1 for r in run_.results if r.ok)
    ctx.check("every request answered", ok == n, f"{ok}/{n}")
    blocks = facts["disk_blocks"]
    fill = min(b.used / b.capacity for b in blocks)
    ctx.check("the SSD fills to capacity", fill >= 0.95,
              "DISK used/capacity per worker at the end: " + ", ".join(f"{b.used}/{b.capacity}" for b in blocks))
    over = [s for s in samples if s[1] > s[2]]
    ctx.check("never above capacity", not over and bool(samples),
              f"{len(samples)} samples, {len(over)} above capacity")
    written = int(run_.meta.stats.get("disk_bytes_written", 0))
    cap_bytes = sum(b.capacity for b in blocks) * prof.geometry.bytes_per_token * st.fleet.block_size
    ctx.check("write volume reported (turnover past capacity)", written > cap_bytes,
              f"{written / 1e9:.1f} GB written to SSD for {cap_bytes / 1e9:.1f} GB of capacity "
              f"({written / cap_bytes:.1f} drive fills)")
    disk_hits = sum(r.loaded_tokens.get("DISK", 0) for r in run_.results)
    ctx.check("the full SSD still serves hits", disk_hits > 0, f"{disk_hits} prompt tokens loaded from DISK")
