"""Seed test 5: workers added and removed mid-run (cache locality changes).

Two workers join at 1/4 of the run, w0 dies at 1/2 (its requests get explicit
errors), w1 drains at 3/4 (takes no new work, finishes what it has). Every request
must end with an answer or an explicit error, the newcomers must get traffic, and
nothing may be routed to a dead or draining worker.
"""
from __future__ import annotations

from typing import Any

from ..simulate import Simulation
from ..workloads import PrefixMix, prefix_workload
from .base import Context, by_run, settings, sized_profile, worker_shares

NAME = "workers-churn"
SUMMARY = "2 workers join, one dies, one drains: all answered, newcomers used, dead/drained avoided"


def run(ctx: Context) -> None:
    n = ctx.pick(300, 2400)
    workers = ctx.pick(4, 8)
    rate = ctx.pick(8.0, 24.0)
    mix = PrefixMix(prefix_tokens=[4096] * 8, prefix_prob=0.8, zipf=0.8, suffix_tokens=(200, 2000),
                    output_tokens=(50, 300))
    trace = prefix_workload(NAME, n, rate, mix, seed=ctx.seed)
    T = trace.span_s
    t_add, t_fail, t_drain = T / 4, T / 2, 3 * T / 4
    st = settings(sized_profile(gpu_tokens=ctx.pick(60_000, 200_000)), workers=workers, seed=ctx.seed)
    facts: dict[str, dict[str, Any]] = {}
    for pol in ("round_robin", "kv_cost"):
        f: dict[str, Any] = {"added": []}
        facts[pol] = f

        def add(sim: Simulation, now: float, f: dict[str, Any] = f) -> None:
            f["added"] = [sim.add_worker(now), sim.add_worker(now)]

        def fail(sim: Simulation, now: float, f: dict[str, Any] = f) -> None:
            f["lost"] = sim.remove_worker(now, "w0", fail=True)

        def drain(sim: Simulation, now: float) -> None:
            sim.remove_worker(now, "w1", fail=False)

        def keep(sim: Simulation, f: dict[str, Any] = f) -> None:
            f["index_has_w0"] = sim.router.index.has_worker("w0")
            f["index_has_w1"] = sim.router.index.has_worker("w1")

        ctx.simulate(trace, pol, st, actions=[(t_add, add), (t_fail, fail), (t_drain, drain)], keep=keep)
    s = by_run(ctx.runs)
    for run in ctx.runs:
        pol = run.meta.run
        f = facts[pol]
        errs = [r for r in run.results if not r.ok]
        lost = [r for r in errs if (r.error or "").startswith("worker w0 failed")]
        other = [r for r in errs if r not in lost]
        ctx.check(f"{pol}: every request accounted for", len(run.results) == n and not other,
                  f"{len(run.results)}/{n} results, {len(lost)} lost with w0 (explicit errors), "
                  f"{len(other)} other errors")
        ctx.check(f"{pol}: only w0's in-flight requests lost", len(lost) == f.get("lost", -1),
                  f"{len(lost)} errors vs {f.get('lost')} in flight on w0 when it died")
        late = [r for r in run.results if (r.worker == "w0" and r.arrival_s > t_fail)
                or (r.worker == "w1" and r.arrival_s > t_drain)]
        ctx.check(f"{pol}: nothing routed to dead or draining workers", not late, f"{len(late)} requests")
        w1_failed = [r for r in errs if r.worker == "w1"]
        ctx.check(f"{pol}: the drained worker finished its work", not w1_failed, f"{len(w1_failed)} failed on w1")
        shares = worker_shares(run, since_s=t_add)
        alive_mid = workers + 2
        fair = 1.0 / alive_mid
        got = [shares.get(w, 0.0) for w in f["added"]]
        ctx.check(f"{pol}: newcomers get traffic", all(g >= 0.5 * fair for g in got),
                  f"shares after joining {', '.join(f'{g:.1%}' for g in got)} (fair ~{fair:.1%}, bound half)")
        ctx.check(f"{pol}: the index forgot the dead and drained workers",
                  not f["index_has_w0"] and not f["index_has_w1"],
                  f"w0 in index: {f['index_has_w0']}, w1 in index: {f['index_has_w1']}")
    ctx.note(f"join at {t_add:.0f}s, w0 fails at {t_fail:.0f}s, w1 drains from {t_drain:.0f}s; "
             f"p99 TTFT: " + ", ".join(f"{k} {v.ttft['p99'] * 1000:.0f} ms" for k, v in s.items()))
