"""Sweeps: several simulations of one trace (policies × tier sets), and the search for a load.

`run_matrix` runs every (policy, tiers) pair on a fresh fleet (engines start cold
each time), optionally in parallel processes (`parallel`); keys are computed once per
run sequence (once per job in a pool process). `ideal_for` adds the `ideal` run
(loadtest/ideal.py) every report shows beside them.

Load: `find_util_speed` picks the speed factor at which a reference policy keeps the
fleet's prefill busy fraction (loadtest/summary.py) at a target (~0.8, ~0.95): it
starts from 0.7× the speed at which the ideal's work alone would fill that share of
the fleet, then rescales the speed by target / measured (utilisation is close to linear
in the arrival rate below saturation; a saturated probe halves the step) until a
probe lands within `tol`, printing every probe. `find_load` (the older rule) answers
"at which speed factor is round-robin's p99 TTFT at least `ratio`× its p50?" on a
ladder of speeds; it can accept an idle fleet on a trace whose p99/p50 is wide by
itself (the Azure code trace did at speed 1), which is why utilisation is preferred.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from .blockkeys import KeyCache, TraceKeyer
from .fleet import parse_tiers, tiers_label
from .ideal import ideal_run
from .results import Run
from .simulate import SimSettings, Simulation
from .summary import summarize
from .tokens import TokenSynth
from .trace import Trace

FIRST_GUESS = 0.7
SPEED_LADDER: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)


@dataclass(slots=True)
class Job:
    policy: str
    tiers: str
    label: str
    params: dict[str, Any]


def _label(policy: str, tiers: str, multi_tiers: bool) -> str:
    return f"{policy}@{tiers}" if multi_tiers else policy


def plan_jobs(policies: Sequence[str], tier_sets: Sequence[str], params: dict[str, dict[str, Any]]) -> list[Job]:
    labels = [tiers_label(parse_tiers(t)) for t in tier_sets]
    multi = len(labels) > 1
    return [Job(p, t, _label(p, t, multi), dict(params.get(p, {}))) for t in labels for p in policies]


class _Runner:
    """Per-process state: the synthesiser and one key cache per block size."""

    def __init__(self, trace: Trace, settings: SimSettings) -> None:
        self.trace = trace
        self.settings = settings
        self.synth = TokenSynth.for_trace(trace, vocab_size=settings.vocab_size, seed=settings.seed)
        self._keys: dict[int, KeyCache] = {}

    def run(self, job: Job) -> Run:
        st = replace(self.settings, fleet=replace(self.settings.fleet, tiers=job.tiers))
        profile = st.fleet.resolved_profile()
        kc = self._keys.get(profile.block_size)
        if kc is None:
            kc = self._keys[profile.block_size] = KeyCache(TraceKeyer(self.synth, profile.namespace()))
        sim = Simulation(self.trace, job.policy, st, policy_params=job.params, label=job.label, synth=self.synth,
                         keys=kc)
        return sim.run()


def _run_one(trace: Trace, settings: SimSettings, job: Job) -> Run:
    """One job in a pool process (the trace and settings travel pickled; keys are recomputed)."""
    return _Runner(trace, settings).run(job)


def run_matrix(trace: Trace, settings: SimSettings, jobs: Sequence[Job], parallel: int = 1,
               on_run: Any = None) -> list[Run]:
    """Every job's run, in job order."""
    if parallel <= 1 or len(jobs) <= 1:
        runner = _Runner(trace, settings)
        out = []
        for j in jobs:
            r = runner.run(j)
            if on_run is not None:
                on_run(r)
            out.append(r)
        return out
    n = min(parallel, len(jobs), os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=n) as ex:
        out = []
        for r in ex.map(_run_one, [trace] * len(jobs), [settings] * len(jobs), jobs):
            if on_run is not None:
                on_run(r)
            out.append(r)
        return out


@dataclass(slots=True)
class LoadProbe:
    speed: float
    p50: float
    p99: float
    ratio: float
    errors: int


def find_load(trace: Trace, settings: SimSettings, ratio: float = 5.0,
              ladder: Sequence[float] = SPEED_LADDER) -> tuple[float | None, list[LoadProbe]]:
    """The first speed on the ladder where round_robin's p99 TTFT ≥ ratio × its p50."""
    runner = _Runner(trace, settings)
    probes: list[LoadProbe] = []
    for sp in ladder:
        runner.settings = replace(settings, speed=sp)
        run = runner.run(Job("round_robin", settings.fleet.tiers, f"round_robin@x{sp:g}", {}))
        s = summarize(run)
        r = s.ttft["p99"] / s.ttft["p50"] if s.ttft["p50"] > 0 else float("inf")
        probes.append(LoadProbe(sp, s.ttft["p50"], s.ttft["p99"], r, s.requests - s.ok))
        if r >= ratio:
            return sp, probes
    return None, probes


def ideal_for(trace: Trace, settings: SimSettings) -> Run:
    """The `ideal` run of `trace` on the settings' fleet profile (tiers do not matter)."""
    profile = settings.fleet.resolved_profile()
    synth = TokenSynth.for_trace(trace, vocab_size=settings.vocab_size, seed=settings.seed)
    kc = KeyCache(TraceKeyer(synth, profile.namespace()))
    return ideal_run(trace, profile, lambda r: kc.get(r)[0], speed=settings.speed,
                     workers=settings.fleet.workers, tiers=tiers_label(parse_tiers(settings.fleet.tiers)))


@dataclass(slots=True)
class UtilProbe:
    speed: float
    utilisation: float
    p50: float
    p99: float
    errors: int


def find_util_speed(
    trace: Trace,
    settings: SimSettings,
    target: float,
    *,
    policy: str = "round_robin",
    params: dict[str, Any] | None = None,
    tol: float = 0.02,
    max_probes: int = 7,
    on_probe: Any = None,
) -> tuple[float, list[UtilProbe]]:
    """The speed at which `policy` runs the fleet at `target` prefill busy fraction (module
    doc); returns the probe closest to the target and every probe."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"target utilisation must be in (0, 1), got {target}")
    ideal = ideal_for(trace, replace(settings, speed=1.0))
    work = sum(r.ttft_s or 0.0 for r in ideal.results)
    arr = [r.arrival_s for r in trace.requests]
    span = (max(arr) - min(arr)) if arr else 0.0
    workers = settings.fleet.workers
    # The ideal's work fills `target` of the fleet at this speed; real runs do more work
    # (misses, decode steps sharing the prefill steps, queues stuck on KV memory), so
    # start lower.
    speed = FIRST_GUESS * target * workers * span / work if work > 0 and span > 0 else 1.0
    runner = _Runner(trace, settings)
    probes: list[UtilProbe] = []
    lo, hi = 0.0, math.inf  # speeds known to give utilisation below / above the target
    for _ in range(max_probes):
        runner.settings = replace(settings, speed=speed)
        run = runner.run(Job(policy, settings.fleet.tiers, f"{policy}@x{speed:.3g}", dict(params or {})))
        s = summarize(run)
        u = s.utilisation
        pr = UtilProbe(speed, u, s.ttft["p50"], s.ttft["p99"], s.requests - s.ok)
        probes.append(pr)
        if on_probe is not None:
            on_probe(pr)
        if not math.isfinite(u) or abs(u - target) <= tol:
            break
        if u < target:
            lo = max(lo, speed)
        else:
            hi = min(hi, speed)
        nxt = speed * target / u if u > 0 else speed * 2.0
        if u > 0.985:  # saturated: the ratio says little, step back
            nxt = speed * 0.6 if lo == 0.0 else (lo + speed) / 2.0
        if nxt <= lo or nxt >= hi:  # keep inside the bracket
            nxt = (lo + hi) / 2.0 if hi < math.inf else speed * 1.5
        speed = nxt
    best = min(probes, key=lambda p: abs(p.utilisation - target) if math.isfinite(p.utilisation) else math.inf)
    return best.speed, probes
