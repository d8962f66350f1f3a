"""Sweeps: several simulations of one trace (policies × tier sets), and the search for a load.

`run_matrix` runs every (policy, tiers) pair on a fresh fleet (engines start cold
each time), optionally in parallel processes (`parallel`); keys are computed once per
run sequence (once per job in a pool process). `find_load` answers "at which speed factor is round-robin's p99 TTFT at
least `ratio`× its p50?": it simulates round_robin at speeds 1, 1.5, 2, 3, 4, 6, 8,
12, 16, ... (×1.5 then ×4/3 alternately) and returns the first that qualifies, with
every probe's numbers so the report shows how the load was chosen.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from .blockkeys import TraceKeyer
from .fleet import parse_tiers, tiers_label
from .results import Run
from .simulate import KeyCache, SimSettings, Simulation
from .summary import summarize
from .tokens import TokenSynth
from .trace import Trace

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
