"""Seed test 7: the offload backend stops — recompute takes over, load shedding holds.

The group-shared REMOTE store (the main tier below a small GPU here) loses its
content at 1/3 of the run: the index still lists the blocks (nobody published
their removal), so the planner keeps predicting loads that turn into misses. Every
request must still be answered by recomputing, the surge of prefill must be held by
bounded queues and explicit 429s (kv_cost with a TTFT SLO), and nothing may fail.

The backend stopped, then back: `RemoteStore.set_available(False)` at 1/3 of the run,
`True` at 2/3. While it is down the store keeps its data but answers nothing: lookups
miss (counted), writes are skipped (counted), requests recompute what they would have
loaded, and shedding must hold (a run with a TTFT SLO). When it comes back, REMOTE loads
resume and the blocks computed while it was down are written again as traffic touches
them, so the recompute share falls back from its outage level.
"""
from __future__ import annotations

from typing import Any

from ..simulate import Simulation
from ..summary import pct
from ..workloads import Sessions, session_workload
from .base import Context, ms, settings, sized_profile

NAME = "backend-outage"
SUMMARY = "the REMOTE store loses everything / stops and comes back: misses recompute, queues bounded, 429s, recovery"


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

    t_back = 2 * trace.span_s / 3
    down: dict[str, dict[str, int]] = {}

    def stop(sim: Simulation, now: float) -> None:
        for store in sim.fleet.remotes:
            store.set_available(False)
        down.setdefault(sim.label, {})["held_at_stop"] = sum(len(r) for r in sim.fleet.remotes)

    def restart(sim: Simulation, now: float) -> None:
        for store in sim.fleet.remotes:
            store.set_available(True)
        d = down.setdefault(sim.label, {})
        d["written_at_back"] = sum(r.blocks_written for r in sim.fleet.remotes)
        d["unavailable_at_back"] = sum(e.kv.remote_unavailable for e in sim.fleet.engines.values())
        d["skipped_at_back"] = sum(e.kv.remote_write_skipped for e in sim.fleet.engines.values())

    def counters(sim: Simulation) -> None:
        d = down.setdefault(sim.label, {})
        d["written_at_end"] = sum(r.blocks_written for r in sim.fleet.remotes)
        d["skipped_at_end"] = sum(e.kv.remote_write_skipped for e in sim.fleet.engines.values())

    slo = 2.0
    stop_back = [(t_out / st.speed, stop), (t_back / st.speed, restart)]
    ctx.simulate(trace, "kv_cost", st, label="kv_cost-no-outage")
    ctx.simulate(trace, "kv_cost", st, label="kv_cost-outage", actions=[(t_out / st.speed, outage)])
    ctx.simulate(trace, "kv_cost", st, label=f"kv_cost-outage-slo{slo:g}s", params={"max_ttft_s": slo},
                 actions=[(t_out / st.speed, outage)])
    ctx.simulate(trace, "kv_cost", st, label="kv_cost-backend-down", actions=stop_back, keep=counters)
    ctx.simulate(trace, "kv_cost", st, label=f"kv_cost-backend-down-slo{slo:g}s", params={"max_ttft_s": slo},
                 actions=stop_back, keep=counters)
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

    def after_stats(label: str, lo: float = after, hi: float = float("inf")) -> tuple[float, float]:
        """(p50 TTFT, share of prompt tokens recomputed) of the requests answered that
        arrived in [lo, hi) (default: after the outage)."""
        rs = [r for r in runs[label].results if r.ok and lo <= r.arrival_s < hi]
        prompt = sum(r.prompt_tokens for r in rs)
        ttft = [r.ttft_s for r in rs if r.ttft_s is not None]  # all of them: `ok` implies a TTFT
        return pct(ttft, 50), sum(r.recomputed_tokens or 0 for r in rs) / max(1, prompt)

    base_p50, base_re = after_stats("kv_cost-no-outage")
    out_p50, out_re = after_stats("kv_cost-outage")
    ctx.check("recompute takes over", out_re > base_re,
              f"after the outage {out_re:.1%} of prompt tokens recomputed vs {base_re:.1%} without it "
              f"(p50 TTFT {ms(out_p50)} vs {ms(base_p50)})")
    slo_run = runs[f"kv_cost-outage-slo{slo:g}s"]
    shed = [r for r in slo_run.results if r.status == 429]
    ctx.note(f"with a {slo:g} s TTFT SLO kv_cost shed {len(shed)} requests with 429 + retry-after")
    back = t_back / st.speed
    d = down.get("kv_cost-backend-down", {})
    ctx.check("backend down: lookups miss, writes skipped",
              d.get("held_at_stop", 0) > 0 and d.get("unavailable_at_back", 0) > 0 and d.get("skipped_at_back", 0) > 0,
              f"store held {d.get('held_at_stop', 0)} blocks when it stopped; while down "
              f"{d.get('unavailable_at_back', 0)} lookups found it unreachable, {d.get('skipped_at_back', 0)} "
              f"block writes skipped")

    def remote_tokens(label: str, lo: float, hi: float, *, scheduled: bool = False) -> tuple[int, int]:
        """REMOTE tokens loaded by the answered requests that arrived (or, with `scheduled`,
        left the queue and planned their loads) in [lo, hi), and how many there were."""
        rs = [r for r in runs[label].results if r.ok and (lo <= r.arrival_s or scheduled)
              and lo <= r.arrival_s + (((r.queue_ms or 0.0) / 1000.0) if scheduled else 0.0) < hi]
        return sum(r.loaded_tokens.get("REMOTE", 0) for r in rs), len(rs)

    grace = 1.0  # transfers already moving when it stopped complete
    rt_down, n_down = remote_tokens("kv_cost-backend-down", after + grace, back, scheduled=True)
    rt_base, _ = remote_tokens("kv_cost-no-outage", after + grace, back, scheduled=True)
    ctx.check("backend down: nothing is loaded from it", n_down > 0 and rt_down == 0 and rt_base > 0,
              f"{n_down} requests that arrived and were scheduled while it was down loaded {rt_down} REMOTE "
              f"tokens ({rt_base} in the same window without the outage)")
    b_p50, b_re = after_stats("kv_cost-no-outage", after, back)
    d_p50, d_re = after_stats("kv_cost-backend-down", after, back)
    ctx.check("backend down: recompute takes over", d_re > b_re,
              f"while down {d_re:.1%} of prompt tokens recomputed vs {b_re:.1%} without the outage "
              f"(p50 TTFT {ms(d_p50)} vs {ms(b_p50)})")
    slo_down = runs[f"kv_cost-backend-down-slo{slo:g}s"]
    shed_d = sum(1 for r in slo_down.results if r.status == 429)
    p99_d = pct([r.ttft_s for r in runs["kv_cost-backend-down"].results
                 if r.ok and r.ttft_s is not None and r.arrival_s >= after], 99)
    p99_s = pct([r.ttft_s for r in slo_down.results if r.ok and r.ttft_s is not None and r.arrival_s >= after], 99)
    ctx.check("backend down: load shedding holds", shed_d > 0 and p99_s < p99_d,
              f"with a {slo:g} s TTFT SLO kv_cost shed {shed_d} requests with 429 + retry-after; p99 TTFT of the "
              f"answered ones after the stop {ms(p99_s)} vs {ms(p99_d)} without shedding")
    rt_back, n_back = remote_tokens("kv_cost-backend-down", back, float("inf"))
    ctx.check("backend back: REMOTE loads resume", n_back > 0 and rt_back > 0,
              f"{n_back} requests arriving after it came back loaded {rt_back} REMOTE tokens")
    wrote = d.get("written_at_end", 0) - d.get("written_at_back", 0)
    skipped_after = d.get("skipped_at_end", 0) - d.get("skipped_at_back", 0)
    a_p50, a_re = after_stats("kv_cost-backend-down", back)
    end = max((r.arrival_s for r in runs["kv_cost-backend-down"].results), default=back)
    thirds = [after_stats("kv_cost-backend-down", back + (end - back) * i / 3, back + (end - back) * (i + 1) / 3
                          + (1e-9 if i == 2 else 0.0))[1] for i in range(3)]
    ctx.check("backend back: caches warm again, gradually",
              wrote > 0 and skipped_after == 0 and a_re < d_re and thirds[0] > thirds[2],
              f"{wrote} blocks written to the store after it came back ({skipped_after} skipped); recompute "
              f"share {a_re:.1%} after vs {d_re:.1%} while down (p50 TTFT {ms(a_p50)}), by thirds of the "
              f"recovery: " + ", ".join(f"{x:.1%}" for x in thirds))
