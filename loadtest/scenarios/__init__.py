"""The classic offload load tests (docs/design.md §9) plus sleeping sessions and an
SSD-filling run, each on the offline simulator with explicit PASS/FAIL checks.

`run_scenario(name, size="full"|"small")`: "small" runs in seconds (tests), "full" in
about a minute at most. See loadtest/scenarios/base.py for the conventions.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import (
    all_on,
    backend_outage,
    bad_blocks,
    bandwidth,
    churn,
    cold_burst,
    common_prefix,
    disk_fill,
    mixed_prefixes,
    sleeping,
    unique,
    version_switch,
)
from .base import Check, Context, ScenarioResult, finish


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    summary: str
    run: Callable[[Context], None]


def _from(m: ModuleType) -> Scenario:
    return Scenario(m.NAME, m.SUMMARY, m.run)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in map(
        _from,
        (
            common_prefix,
            unique,
            mixed_prefixes,
            bandwidth,
            churn,
            version_switch,
            backend_outage,
            bad_blocks,
            cold_burst,
            all_on,
            sleeping,
            disk_fill,
        ),
    )
}


def run_scenario(name: str, *, size: str = "full", out_dir: Path | None = None, seed: int = 0,
                 verbose: bool = True) -> ScenarioResult:
    sc = SCENARIOS[name]
    if size not in ("small", "full"):
        raise ValueError("size must be small or full")
    ctx = Context(name, size, seed, out_dir, verbose)
    if verbose:
        print(f"== scenario {name} ({size}): {sc.summary}", flush=True)
    t0 = time.perf_counter()
    sc.run(ctx)
    ctx.note(f"wall time {time.perf_counter() - t0:.1f} s")
    return finish(ctx)


__all__ = ["SCENARIOS", "Scenario", "run_scenario", "Check", "ScenarioResult"]
