"""Seed test 6: a LoRA (model) version switched mid-run.

Halfway through, every request moves from adapter `v1` to `v2`. The adapter is part
of every block key (kvindex.Namespace extra keys), so from then on no request may
hit a `v1` block, the first `v2` request of each prefix must recompute, and the old
version's blocks must leave the GPU as the new traffic needs the room (run 1, LRU only).
Run 2 retires the old adapter on a deadline (1/8 of the run after the switch):
`SimEngine.purge(None, lora="v1")` on every worker must find v1 blocks still cached,
drop them all from every tier and publish the removals, so the router's index lists
no v1 block afterwards.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvindex.keys import digest64
from kvindex.tiers import Tier

from ..simulate import Simulation
from ..trace import TraceRequest
from ..workloads import BT, PrefixMix, prefix_workload
from .base import Context, settings, sized_profile

NAME = "version-switch"
SUMMARY = "LoRA v1 -> v2 halfway: no v1 hit afterwards, first v2 turn recomputes, v1 evicted, then purged on a deadline"


def _v1_gpu_blocks(sim: Simulation, v1_keys: set[bytes]) -> int:
    n = 0
    for eng in sim.fleet.engines.values():
        n += len(eng.tiers_snapshot()[Tier.GPU] & v1_keys)
    return n


def _v1_held(sim: Simulation, v1_keys: set[bytes]) -> int:
    """v1 copies in any tier of any engine (the truth)."""
    n = 0
    for eng in sim.fleet.engines.values():
        for keys in eng.tiers_snapshot().values():
            n += len(keys & v1_keys)
    return n


def _v1_indexed(sim: Simulation, v1_keys: set[bytes]) -> int:
    """v1 blocks the router's index still lists on some worker (what it routes on)."""
    idx = sim.router.index
    return sum(1 for k in v1_keys if idx.holders(digest64(k)))


def _v1_keys(sim: Simulation, reqs: list[TraceRequest]) -> set[bytes]:
    keys: set[bytes] = set()
    for r in reqs:
        keys.update(sim.keys.get(replace(r, lora="v1"))[0])
    return keys


def run(ctx: Context) -> None:
    n = ctx.pick(300, 2400)
    workers = ctx.pick(4, 8)
    rate = ctx.pick(8.0, 24.0)
    mix = PrefixMix(prefix_tokens=[8192] * 4, prefix_prob=0.9, zipf=0.5, suffix_tokens=(500, 3000),
                    output_tokens=(50, 200))
    trace = prefix_workload(NAME, n, rate, mix, seed=ctx.seed)
    t_switch = trace.span_s / 2

    def hook(req: TraceRequest, now: float) -> TraceRequest:
        return replace(req, lora="v2" if now >= t_switch else "v1")

    st = settings(sized_profile(gpu_tokens=ctx.pick(40_000, 100_000)), workers=workers, tiers="gpu", seed=ctx.seed)
    facts: dict[str, Any] = {}

    before = [r for r in trace.requests if r.arrival_s < t_switch]

    def snap(sim: Simulation, now: float) -> None:
        keys = _v1_keys(sim, before)
        facts["v1_keys"] = keys
        facts["at_switch"] = _v1_gpu_blocks(sim, keys)

    def keep(sim: Simulation) -> None:
        facts["at_end"] = _v1_gpu_blocks(sim, facts["v1_keys"])

    t_deadline = t_switch + trace.span_s / 8
    purge: dict[str, Any] = {}

    def retire(sim: Simulation, now: float) -> None:
        keys = _v1_keys(sim, before)
        purge["keys"] = keys
        purge["held_before"] = _v1_held(sim, keys)
        purge["indexed_before"] = _v1_indexed(sim, keys)
        purge["dropped"] = sum(eng.purge(None, lora="v1") for eng in sim.fleet.engines.values())
        purge["held_after"] = _v1_held(sim, keys)
        purge["indexed_after"] = _v1_indexed(sim, keys)

    def keep_purged(sim: Simulation) -> None:
        keys = purge.get("keys", set())
        purge["held_end"] = _v1_held(sim, keys)
        purge["indexed_end"] = _v1_indexed(sim, keys)

    run_ = ctx.simulate(trace, "kv_cost", st, label="kv_cost-lru", actions=[(t_switch, snap)], request_hook=hook,
                        keep=keep)
    run_p = ctx.simulate(trace, "kv_cost", st, label="kv_cost-purge", actions=[(t_deadline, retire)],
                         request_hook=hook, keep=keep_purged)
    ok = [r for r in run_.results if r.ok]
    ctx.check("every request answered", len(ok) == n, f"{len(ok)}/{n}")
    # The most a v2 request may find cached: what it shares with earlier v2 requests.
    v1_ids = {h for r in trace.requests if r.arrival_s < t_switch for h in r.hash_ids}
    seen: set[int] = set()
    over = []
    firsts = []
    shareable_of: dict[int, int] = {}
    by_index = {r.index: r for r in run_.results}
    for req in trace.requests:
        if req.arrival_s < t_switch:
            continue
        j = 0
        for h in req.hash_ids:
            if h not in seen:
                break
            j += 1
        shareable = min(j * BT, req.input_length - 1)
        shareable_of[req.index] = shareable
        res = by_index[req.index]
        if res.ok and res.cached_tokens > shareable:
            over.append((req.index, res.cached_tokens, shareable))
        if j == 0 and req.hash_ids[0] in v1_ids and res.ok:  # its prefix exists, but only as v1
            firsts.append(res.cached_tokens)
        seen.update(req.hash_ids)
    ctx.check("no v2 request hits a v1 block", not over,
              f"{len(over)} v2 requests found more cached tokens than v2 traffic had produced" +
              (f", e.g. {over[:3]}" if over else ""))
    ctx.check("first v2 request of each v1 prefix recomputes", bool(firsts) and max(firsts) == 0,
              f"{len(firsts)} such requests; most cached tokens among them: {max(firsts) if firsts else '-'}")
    a, b = facts.get("at_switch", 0), facts.get("at_end", 0)
    ctx.check("v1 blocks leave the GPU", a > 0 and b <= 0.1 * a,
              f"{a} v1 blocks in GPU at the switch, {b} at the end (bound 10%)")
    ok_p = [r for r in run_p.results if r.ok]
    over_p = [r.index for r in run_p.results if r.ok and r.arrival_s >= t_switch
              and r.cached_tokens > shareable_of[r.index]]
    ctx.check("purge run: every request answered, no v1 hit", len(ok_p) == n and not over_p,
              f"{len(ok_p)}/{n} answered, {len(over_p)} v2 requests over their v2-shareable prefix")
    hb, d, ha, he = (purge.get(k, 0) for k in ("held_before", "dropped", "held_after", "held_end"))
    ctx.check("v1 purged on a deadline", hb > 0 and d > 0 and ha == 0 and he == 0,
              f"at the deadline (+{t_deadline - t_switch:.1f} s) {hb} v1 copies still cached, purge(lora='v1') "
              f"dropped {d} blocks, {ha} v1 copies left after it, {he} at the end")
    ib, ia, ie = (purge.get(k, 0) for k in ("indexed_before", "indexed_after", "indexed_end"))
    ctx.check("the index forgets v1 (BlockRemoved published)", ib > 0 and ia == 0 and ie == 0,
              f"index listed {ib} v1 blocks before the purge, {ia} right after, {ie} at the end")
