"""Held-out evaluation: each run's requests split by arrival time into the part the
router fitted on (`fit`) and the part it is judged on (`judged`).

The router learns online (the planner's calibration and per-worker speed fit), so one
simulation replays the whole trace and what it learned carries over: the requests
arriving in the first `judge_from` of the run's arrival span are the ones it fitted on,
the later ones are data it had not seen when its state was fitted. Anything tuned on a
trace is to be judged on the later part only, with both parts reported.

Each part is summarised like a whole run (summary.summarize: percentiles over its
successful requests, the prediction error of each request's predicted TTFT, slowdown
against the same ideal), so the parts and the whole-run tables read alike.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from .results import Run
from .summary import RunSummary, ideal_key, ideal_maps, summarize

FIT, JUDGED = "fit", "judged"
PARTS = (FIT, JUDGED)


@dataclass(frozen=True, slots=True)
class PartSummary:
    """One part of one run: its arrivals' first and last time and its numbers."""

    run: str
    part: str  # FIT | JUDGED
    first_s: float
    last_s: float
    summary: RunSummary


def check_fraction(judge_from: float) -> float:
    """`judge_from` if it leaves both parts a share of the span (0 < f < 1), else ValueError."""
    if not (math.isfinite(judge_from) and 0.0 < judge_from < 1.0):
        raise ValueError(f"judge_from must lie strictly between 0 and 1, not {judge_from}")
    return judge_from


def judge_cut_s(run: Run, judge_from: float) -> float:
    """The time from which arrivals are judged: `judge_from` of the way from the run's first
    arrival to its last (arrival times as the run scheduled them, so after --speed)."""
    check_fraction(judge_from)
    arrivals = [r.arrival_s for r in run.results]
    if not arrivals:
        return 0.0
    lo, hi = min(arrivals), max(arrivals)
    return lo + judge_from * (hi - lo)


def split_run(run: Run, judge_from: float) -> dict[str, Run]:
    """The run's requests by part: arrivals before the cut fit, the rest (the cut included)
    judged. Each part keeps the run's meta but not its run-wide counters or makespan,
    which belong to the whole run."""
    cut = judge_cut_s(run, judge_from)
    meta = msgspec.structs.replace(run.meta, duration_s=0.0, stats={})
    return {
        FIT: Run(meta, [r for r in run.results if r.arrival_s < cut]),
        JUDGED: Run(meta, [r for r in run.results if r.arrival_s >= cut]),
    }


def holdout_summaries(runs: Sequence[Run], judge_from: float) -> list[PartSummary]:
    """Both parts of every run, in run order, each against the ideal of the whole run's
    trace, profile and block size when `runs` hold one."""
    ideals = ideal_maps(runs)
    out: list[PartSummary] = []
    for run in runs:
        ideal = ideals.get(ideal_key(run))
        for part, sub in split_run(run, judge_from).items():
            arr = [r.arrival_s for r in sub.results]
            first, last = (min(arr), max(arr)) if arr else (math.nan, math.nan)
            out.append(PartSummary(run.meta.run, part, first, last, summarize(sub, ideal)))
    return out


def _num(x: float | None) -> float | None:
    """JSON has no NaN: a part without such numbers gets null."""
    return None if x is None or math.isnan(x) else round(x, 6)


def _nums(d: dict[str, float] | None) -> dict[str, float | None] | None:
    return None if d is None else {k: _num(v) for k, v in d.items()}


def part_dict(p: PartSummary) -> dict[str, Any]:
    """One part as plain JSON values (seconds; errors as fractions)."""
    s = p.summary
    return {
        "first_arrival_s": _num(p.first_s), "last_arrival_s": _num(p.last_s),
        "requests": s.requests, "ok": s.ok, "errors": s.errors, "utilisation": _num(s.utilisation),
        "ttft_s": _nums(s.ttft), "tpot_s": _nums(s.tpot), "goodput": _nums(s.goodput), "slowdown": _nums(s.slowdown),
        "pred_requests": s.pred_requests,
        "pred_abs_rel_err": {"p50": _num(s.pred_abs_rel_err_p50), "p90": _num(s.pred_abs_rel_err_p90)},
        "pred_bias_p50": _num(s.pred_bias),
    }


def holdout_dict(parts: Sequence[PartSummary], judge_from: float) -> dict[str, Any]:
    """{"judge_from": f, "runs": {run: {"fit": {...}, "judged": {...}}}}."""
    runs: dict[str, dict[str, Any]] = {}
    for p in parts:
        runs.setdefault(p.run, {})[p.part] = part_dict(p)
    return {"judge_from": judge_from, "runs": runs}


def write_holdout(parts: Sequence[PartSummary], judge_from: float, path: str | Path) -> Path:
    """holdout.json beside the results: both parts of every run."""
    out = Path(path)
    out.write_text(json.dumps(holdout_dict(parts, judge_from), indent=1) + "\n")
    return out
