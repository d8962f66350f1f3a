"""Seed test 8: metadata-only and corrupt blocks.

Metadata without data: at 1/4 of the run the index is told (a forged `BlockStored`
on the wire, as a buggy or restarted worker might leave behind) that worker w0 holds
every hot prefix in GPU. w0 holds none of those it did not compute itself, so
requests routed there on the strength of it must recompute — a miss, never a wrong
answer — and the damage must stay bounded (the planner's predicted-vs-actual error
shows it).

Corrupt blocks (data present, checksum wrong): on a fleet whose GPUs are too small for
the hot prefixes (so they also live in CPU / DISK / REMOTE), at the same instant every
copy the engines hold below GPU is damaged with `SimEngine.corrupt(keys, tier)`. The
copies stay listed, so the planner keeps routing to them; a load reads them,
verification fails, they are dropped with `BlockRemoved` and the request recomputes
from the first damaged block. Checked against a clean run of the same fleet: no request
fails, the damage is detected (checksum-error counter), recompute rises, damage stays
bounded, and in eight audits after the injection the router's index agrees with the
engines on every damaged copy (the removals reached it before the copy came back).
"""
from __future__ import annotations

from typing import Any

from kvindex.events import BlockStored
from kvindex.keys import digest64, digests64
from kvindex.tiers import Tier

from ..results import Run
from ..simulate import Simulation
from ..workloads import PrefixMix, prefix_workload
from .base import Context, by_run, ms, settings, sized_profile

NAME = "bad-blocks"
SUMMARY = "forged index entries, corrupt stored copies: misses recompute, damage detected and bounded, index fixed"
PREFIX = 8192


def run(ctx: Context) -> None:
    n = ctx.pick(300, 2400)
    workers = ctx.pick(4, 8)
    rate = ctx.pick(8.0, 20.0)
    mix = PrefixMix(prefix_tokens=[PREFIX] * 8, prefix_prob=0.9, zipf=0.7, suffix_tokens=(200, 2000),
                    output_tokens=(50, 200))
    trace = prefix_workload(NAME, n, rate, mix, seed=ctx.seed)
    t_inj = trace.span_s / 4
    st = settings(sized_profile(gpu_tokens=ctx.pick(80_000, 200_000)), workers=workers, seed=ctx.seed)
    facts: dict[str, Any] = {"forged": {}}

    def forge(sim: Simulation, now: float) -> None:
        eng = sim.fleet.engines["w0"]
        bs = sim.fleet.block_size
        n_pre = PREFIX // bs
        done: set[int] = set()
        for req in trace.requests:
            first = req.hash_ids[0]
            if first in done or req.input_length <= PREFIX:
                continue
            done.add(first)
            keys = sim.keys.get(req)[0][:n_pre]
            held = eng.match_tiers(keys)
            if held and held[0] is not None:
                continue  # w0 really has this prefix: nothing forged
            toks = sim.synth.token_list(req)[: n_pre * bs]
            hashes: list[int | bytes] = list(digests64(keys))  # BlockStored's field takes either kind
            ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=toks,
                             block_size=bs, medium="GPU")
            sim.router.index.apply("w0", [ev])
            facts["forged"][first] = digest64(keys[0])

    damaged: dict[str, list[tuple[bytes, Tier]]] = {}
    seen: dict[str, Any] = {}

    def corrupt(sim: Simulation, now: float) -> None:
        done_remote: set[int] = set()
        for wid, eng in sim.fleet.engines.items():
            snap = eng.tiers_snapshot()
            hits: list[tuple[bytes, Tier]] = []
            for tier in (Tier.CPU, Tier.DISK, Tier.REMOTE):
                keys = list(snap[tier])
                if tier is Tier.REMOTE:
                    if eng.remote is None or id(eng.remote) in done_remote:
                        continue
                    done_remote.add(id(eng.remote))
                if keys:
                    n_bad = eng.corrupt(keys, tier)
                    hits.extend((k, tier) for k in keys[:n_bad])
            damaged[wid] = hits

    def audit(sim: Simulation, now: float) -> None:
        """Index vs engines on every damaged copy (run a few times after the injection, so
        copies dropped and not yet re-stored are caught)."""
        idx = sim.router.index
        for wid, hits in damaged.items():
            eng = sim.fleet.engines.get(wid)
            if eng is None:
                continue
            snap = eng.tiers_snapshot()
            for key, tier in hits:
                held = key in snap[tier]
                listed = tier in idx.holders(digest64(key)).get(wid, [])
                seen["gone"] = seen.get("gone", 0) + (not held)
                seen["mismatch"] = seen.get("mismatch", 0) + (held != listed)
        seen["audits"] = seen.get("audits", 0) + 1

    def count_errors(sim: Simulation) -> None:
        """The engines' checksum-error counters, summed (read when the run is over)."""
        seen["checksum_errors"] = sum(e.kv.checksum_errors for e in sim.fleet.engines.values())

    def clean_errors(sim: Simulation) -> None:
        seen["clean_checksum_errors"] = sum(e.kv.checksum_errors for e in sim.fleet.engines.values())

    ctx.simulate(trace, "kv_cost", st, label="kv_cost-clean")
    run_ = ctx.simulate(trace, "kv_cost", st, label="kv_cost-forged", actions=[(t_inj, forge)])
    # A GPU too small for the hot prefixes, so that they also live in CPU / DISK / REMOTE.
    st_c = settings(sized_profile(gpu_tokens=24_000), workers=workers, seed=ctx.seed)
    clean_run = ctx.simulate(trace, "kv_cost", st_c, label="kv_cost-clean-small-gpu", keep=clean_errors)
    audits = [(t_inj + (trace.span_s - t_inj) * i / 8, audit) for i in range(1, 9)]
    run_c = ctx.simulate(trace, "kv_cost", st_c, label="kv_cost-corrupt", actions=[(t_inj, corrupt), *audits],
                         keep=count_errors)
    s = by_run(ctx.runs)
    clean, bad = s["kv_cost-clean"], s["kv_cost-forged"]
    forged = facts["forged"]
    ctx.check("entries were forged", bool(forged), f"{len(forged)} prefixes forged onto w0")
    ctx.check("no request failed", bad.ok == bad.requests, f"{bad.ok}/{bad.requests}")
    req_by = {r.index: r for r in trace.requests}
    lured = [r for r in run_.results if r.worker == "w0" and r.arrival_s >= t_inj and r.ok
             and req_by[r.index].hash_ids[0] in forged]
    first_lured: dict[int, Any] = {}
    for r in sorted(lured, key=lambda x: x.arrival_s):
        first_lured.setdefault(req_by[r.index].hash_ids[0], r)
    gpu_hits = sorted(r.loaded_tokens.get("GPU", 0) for r in first_lured.values())
    ctx.check("a forged entry never becomes a hit", bool(first_lured) and all(g < PREFIX for g in gpu_hits),
              f"{len(first_lured)} first requests lured to w0 found GPU tokens {gpu_hits[:8]} "
              f"(the forged entries claimed {PREFIX})")
    errs = [abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s for r in first_lured.values()
            if r.predicted_ttft_s is not None and r.ttft_s]
    ctx.check("the misprediction is visible", bool(errs) and max(errs) > 0.5,
              f"predicted-vs-actual error of lured requests up to {max(errs, default=0):.0%}")
    ctx.check("damage bounded", bad.ttft["p99"] <= clean.ttft["p99"] * 1.5,
              f"p99 {ms(bad.ttft['p99'])} vs clean {ms(clean.ttft['p99'])} (bound +50%)")
    bad_c, clean_c = s["kv_cost-corrupt"], s["kv_cost-clean-small-gpu"]
    n_dam = sum(len(h) for h in damaged.values())
    per_tier = {t.name: sum(1 for h in damaged.values() for _, tt in h if tt is t)
                for t in (Tier.CPU, Tier.DISK, Tier.REMOTE)}
    ctx.check("corrupt copies injected", n_dam > 0, f"{n_dam} stored copies damaged at {t_inj:.1f} s {per_tier}")
    ctx.check("corrupt: no request failed", bad_c.ok == bad_c.requests, f"{bad_c.ok}/{bad_c.requests}")
    errs_c = seen.get("checksum_errors", 0)
    ctx.check("corrupt copies are read and rejected", errs_c > 0 and seen.get("clean_checksum_errors", 0) == 0,
              f"{errs_c} checksum errors counted by the engines ({seen.get('clean_checksum_errors', 0)} in the "
              f"clean run)")

    def recomputed_after(run: Run) -> float:
        rs = [r for r in run.results if r.ok and r.arrival_s >= t_inj]
        return sum(r.recomputed_tokens or 0 for r in rs) / max(1, sum(r.prompt_tokens for r in rs))

    re_clean, re_bad = recomputed_after(clean_run), recomputed_after(run_c)
    ctx.check("rejected copies fall back to recompute", re_bad > re_clean,
              f"after the injection {re_bad:.1%} of prompt tokens recomputed vs {re_clean:.1%} clean")
    mism, gone = seen.get("mismatch", -1), seen.get("gone", 0)
    ctx.check("index corrected by the removal events", mism == 0 and gone > 0,
              f"over {seen.get('audits', 0)} audits after the injection: {gone} damaged copies found gone from "
              f"their tier, {mism} copies where the index disagreed with the engine")
    ctx.check("corrupt: damage bounded", bad_c.ttft["p99"] <= clean_c.ttft["p99"] * 1.5,
              f"p99 {ms(bad_c.ttft['p99'])} vs clean {ms(clean_c.ttft['p99'])} (bound +50%)")
