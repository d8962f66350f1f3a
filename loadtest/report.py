"""Markdown report + PNG plots for one or more runs (replays and/or simulations).

Tables: TTFT (p50-p95-p99 and mean) / TPOT / E2E, throughput; TTFT and slowdown
(TTFT / ideal TTFT) p50-p95-p99-mean per run beside the `ideal` run (the physical
limit, loadtest/ideal.py) with each run's utilisation (prefill busy fraction); hit
rate per tier, recompute avoided, prefetch hidden time; the planner's prediction
error per run (|actual - predicted| / actual for the chosen worker); and each run
against its baselines — no routing (`round_robin`, same tiers and mode) and no
offload (same policy, GPU-only tiers) — as ratios of p50 and p99, not averages alone;
with a held-out split (loadtest/holdout.py), each run's fit and judged parts.
Plots (matplotlib, Agg backend: no display needed): TTFT CDF per run, TTFT
percentiles per run, prompt tokens served per tier, predicted vs actual TTFT (all
runs together, and one plot per run).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .holdout import PartSummary
from .ideal import IDEAL
from .results import Run
from .summary import TIERS, RunSummary, ideal_key, ideal_maps, summarize


def _ms(x: float) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1000:.1f}"


def _pct(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x * 100:.1f}%"


def _ratio(a: float, b: float) -> str:
    if any(v is None or math.isnan(v) for v in (a, b)) or b <= 0:
        return "–"
    return f"{a / b:.2f}×"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    rule = "|".join(" --- " if i == 0 else " ---: " for i in range(len(header)))
    out = ["| " + " | ".join(header) + " |", "|" + rule + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _x(x: float | None) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.2f}"


def summaries(runs: Sequence[Run]) -> list[RunSummary]:
    """Every run's summary, with the slowdown against the ideal run of the same trace,
    profile and block size when the runs include one."""
    ideals = ideal_maps(runs)
    return [summarize(r, ideals.get(ideal_key(r))) for r in runs]


def latency_table(sums: Sequence[RunSummary]) -> str:
    rows = []
    for s in sums:
        rows.append(
            [s.run, f"{s.ok}/{s.requests}"]
            + [_ms(s.ttft[k]) for k in ("p50", "p95", "p99", "mean")]
            + [_ms(s.tpot[k]) for k in ("p50", "p95", "p99")]
            + [_ms(s.e2e[k]) for k in ("p50", "p95", "p99")]
            + [f"{s.throughput_rps:.2f}", f"{s.output_tps:.0f}", _ms(s.client_queue_p99)]
        )
    return _table(
        ["run", "ok", "TTFT p50 ms", "p95", "p99", "mean", "TPOT p50 ms", "p95", "p99", "E2E p50 ms", "p95", "p99",
         "req/s", "out tok/s", "client queue p99 ms"],
        rows,
    )


def slowdown_table(sums: Sequence[RunSummary]) -> str:
    """TTFT and slowdown (TTFT / ideal TTFT) p50/p95/p99/mean per run, with utilisation."""
    rows = []
    for s in sums:
        sl = s.slowdown or {}
        rows.append(
            [s.run, _pct(s.utilisation)]
            + [_ms(s.ttft[k]) for k in ("p50", "p95", "p99", "mean")]
            + [_x(sl.get(k)) for k in ("p50", "p95", "p99", "mean")]
        )
    return _table(
        ["run", "utilisation", "TTFT p50 ms", "p95", "p99", "mean", "slowdown p50", "p95", "p99", "mean"], rows
    )


def prediction_table(sums: Sequence[RunSummary]) -> str:
    """The planner's TTFT prediction for the chosen worker: |actual - predicted| / actual.
    `from bind`: both measured from the moment the request was bound to its worker (what
    the cost model predicts; it differs from the TTFT columns only when a gateway queue
    held the request first)."""
    rows = []
    for s in sums:
        if s.mode == IDEAL:
            continue
        st = s.stats
        rows.append([
            s.run, str(s.pred_requests), _pct(s.pred_abs_rel_err_p50), _pct(s.pred_abs_rel_err_p90),
            _pct(s.pred_bias),
            _pct(st.get("pred_err_bind_p50", math.nan)), _pct(st.get("pred_err_bind_p90", math.nan)),
            _pct(st.get("pred_bias_bind_p50", math.nan)),
        ])
    return _table(["run", "predicted", "|err| p50", "p90", "bias p50", "from bind |err| p50", "p90", "bias p50"],
                  rows)


def holdout_table(parts: Sequence[PartSummary]) -> str:
    """Each run's fit and judged parts (loadtest/holdout.py): arrivals, TTFT, slowdown and
    the prediction |error| of each part's own requests."""
    rows = []
    for p in parts:
        s, sl = p.summary, p.summary.slowdown or {}
        rows.append(
            [p.run, p.part, f"{p.first_s:.1f}–{p.last_s:.1f}", f"{s.ok}/{s.requests}", _pct(s.utilisation)]
            + [_ms(s.ttft[k]) for k in ("p50", "p90", "p99", "mean")]
            + [_x(sl.get(k)) for k in ("p50", "p99", "mean")]
            + [_pct(s.pred_abs_rel_err_p50), _pct(s.pred_abs_rel_err_p90), _pct(s.pred_bias)]
        )
    return _table(
        ["run", "part", "arrivals s", "ok", "utilisation", "TTFT p50 ms", "p90", "p99", "mean", "slowdown p50",
         "p99", "mean", "|err| p50", "p90", "bias p50"],
        rows,
    )


def cache_table(sums: Sequence[RunSummary]) -> str:
    rows = []
    for s in sums:
        if s.mode == IDEAL:
            continue
        rows.append(
            [s.run]
            + [_pct(s.hit_rate.get(t, 0.0)) for t in TIERS]
            + [_pct(s.recompute_avoided), str(s.prefetch_requests), f"{s.prefetch_hidden_s:.2f}"]
        )
    return _table(
        ["run"] + [f"hit {t}" for t in TIERS] + ["recompute avoided", "prefetched reqs", "prefetch hidden s"],
        rows,
    )


def baseline_table(sums: Sequence[RunSummary]) -> str:
    """Each run's TTFT p50/p99 as a ratio of its no-routing and no-offload baselines (< 1 = better)."""
    by_key = {(s.mode, s.policy, s.tiers): s for s in sums}
    rows = []
    for s in sums:
        rr = by_key.get((s.mode, "round_robin", s.tiers))
        gpu = by_key.get((s.mode, s.policy, "gpu"))
        rows.append(
            [
                s.run,
                _ratio(s.ttft["p50"], rr.ttft["p50"]) if rr and rr is not s else "–",
                _ratio(s.ttft["p99"], rr.ttft["p99"]) if rr and rr is not s else "–",
                _ratio(s.ttft["p50"], gpu.ttft["p50"]) if gpu and gpu is not s else "–",
                _ratio(s.ttft["p99"], gpu.ttft["p99"]) if gpu and gpu is not s else "–",
            ]
        )
    return _table(
        ["run", "TTFT p50 vs round_robin", "p99 vs round_robin", "p50 vs GPU-only", "p99 vs GPU-only"], rows
    )


def serving_table(rows_in: Sequence[tuple[str, str, RunSummary]]) -> str:
    """What serving is judged by (prefill/decode disaggregation): TTFT and TPOT p50 / p99 and
    goodput (requests within both SLOs: share of all, per second), per run or part."""
    rows = []
    for run, part, s in rows_in:
        g = s.goodput
        rows.append([run, part, f"{s.ok}/{s.requests}", _ms(s.ttft["p50"]), _ms(s.ttft["p99"]), _ms(s.tpot["p50"]),
                     _ms(s.tpot["p99"]), _pct(g.get("share", math.nan)), f"{g.get('rps', math.nan):.2f}"])
    slo = next((r[2].goodput for r in rows_in if r[2].goodput), {})
    head = f"goodput (TTFT <= {slo.get('slo_ttft_s', math.nan):g} s, TPOT <= {slo.get('slo_tpot_s', math.nan):g} s)"
    return _table(["run", "part", "ok", "TTFT p50 ms", "p99", "TPOT p50 ms", "p99", head, "good req/s"], rows)


def markdown(runs: Sequence[Run], title: str = "kvroute load test", notes: Sequence[str] = (),
             plots: Sequence[str] = (), holdout: Sequence[PartSummary] = ()) -> str:
    sums = summaries(runs)
    parts = [f"# {title}", ""]
    for n in notes:
        parts.append(f"- {n}")
    if notes:
        parts.append("")
    parts += ["## Runs", ""]
    parts.append(_table(
        ["run", "mode", "policy", "tiers", "trace", "speed", "workers", "profile", "utilisation", "errors"],
        [[r.meta.run, r.meta.mode, r.meta.policy or "–", r.meta.tiers, r.meta.trace, f"{r.meta.speed:g}",
          str(r.meta.workers or "–"), r.meta.profile or "–", _pct(s.utilisation),
          ", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "0"] for r, s in zip(runs, sums, strict=True)],
    ))
    parts += ["", "## Latency (ms) and throughput", "", latency_table(sums)]
    parts += ["", "## TTFT and slowdown against the ideal", "",
              "Slowdown = TTFT / ideal TTFT per request; `ideal` = each request alone on an idle worker with every "
              "block it could reuse already on GPU (the physical limit: no run can beat it). Utilisation = the "
              "fleet's prefill busy fraction over the arrival window.", "", slowdown_table(sums)]
    parts += ["", "## Prediction (chosen worker)", "",
              "|err| = |actual − predicted| / actual TTFT of the planner's estimate for the worker it chose "
              "(targets: p50 <= 10%, p90 <= 25%); bias = median (predicted − actual) / actual.", "",
              prediction_table(sums)]
    serving = [(s.run, "whole", s) for s in sums if s.mode != IDEAL]
    serving += [(p.run, p.part, p.summary) for p in holdout if p.summary.mode != IDEAL]
    parts += ["", "## TTFT, TPOT and goodput", "", serving_table(serving)]
    if holdout:
        parts += ["", "## Held-out split: fit and judged", "", _HOLDOUT_NOTE, "", holdout_table(holdout)]
    parts += ["", "## Against the baselines (TTFT ratio, < 1 is better)", "", baseline_table(sums)]
    parts += ["", "## Cache and prefetch", "",
              "Hit = share of prompt tokens served from each tier; recompute avoided = share not prefilled; "
              "prefetch hidden = load seconds taken off critical paths.", "", cache_table(sums)]
    stat_runs = [(s.run, s.stats) for s in sums if s.stats]
    if stat_runs:
        parts += ["", "## Run counters", ""]
        for name, st in stat_runs:
            parts.append(f"- **{name}**: " + ", ".join(f"{k}={_fmt(v)}" for k, v in st.items()))
    if plots:
        parts += ["", "## Plots", ""]
        parts += [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(parts) + "\n"


_HOLDOUT_NOTE = ("One simulation of the whole trace; `fit` = the requests arriving in the first part of its "
                 "arrival span (what the router's online calibration and speed fit learned from), `judged` = the "
                 "rest, data it had not seen. Tuned or fitted results are judged on `judged` only.")


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def plot_all(runs: Sequence[Run], out_dir: Path) -> list[Path]:
    """Write the PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    sums = summaries(runs)
    paths: list[Path] = []

    def save(fig: Any, name: str) -> None:
        paths.append(out_dir / name)
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in runs:
        t = np.sort([x.ttft_s for x in r.results if x.ok and x.ttft_s is not None])
        if t.size:
            ax.plot(t * 1000, np.arange(1, t.size + 1) / t.size, label=r.meta.run)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "ttft_cdf.png")

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(sums) + 2), 4.5))
    x = np.arange(len(sums))
    for k, w in (("p50", -0.27), ("p95", 0.0), ("p99", 0.27)):
        ax.bar(x + w, [s.ttft[k] * 1000 for s in sums], width=0.27, label=k)
    ax.set_xticks(x, [s.run for s in sums], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("TTFT percentiles per run")
    ax.legend()
    save(fig, "ttft_percentiles.png")

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(sums) + 2), 4.5))
    bottom = np.zeros(len(sums))
    for tier in TIERS:
        v = np.array([s.hit_rate.get(tier, 0.0) for s in sums])
        if v.any():
            ax.bar(x, v * 100, bottom=bottom * 100, label=tier)
            bottom += v
    ax.bar(x, (1 - np.clip(bottom, 0, 1)) * 100, bottom=bottom * 100, label="recomputed", color="#cccccc")
    ax.set_xticks(x, [s.run for s in sums], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% of prompt tokens")
    ax.set_title("Where prompt tokens came from")
    ax.legend(fontsize=8)
    save(fig, "tiers.png")

    pred_runs = [r for r in runs if any(x.predicted_ttft_s is not None and x.ok for x in r.results)]
    if pred_runs:
        fig, ax = plt.subplots(figsize=(6, 6))
        if _scatter_pred(ax, pred_runs, np):
            ax.set_title("Planner prediction vs actual")
            save(fig, "predicted_vs_actual.png")
        else:
            plt.close(fig)
        for r in pred_runs:
            fig, ax = plt.subplots(figsize=(5.5, 5.5))
            if _scatter_pred(ax, [r], np):
                s = next(x for x in sums if x.run == r.meta.run)
                ax.set_title(f"{r.meta.run}: predicted vs actual TTFT\n|err| p50 {_pct(s.pred_abs_rel_err_p50)}, "
                             f"p90 {_pct(s.pred_abs_rel_err_p90)}", fontsize=9)
                save(fig, f"predicted_vs_actual_{_safe(r.meta.run)}.png")
            else:
                plt.close(fig)
    return paths


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _scatter_pred(ax: Any, runs: Sequence[Run], np: Any) -> bool:
    """Predicted vs actual TTFT of `runs` on `ax` (log-log, with the diagonal); False if empty."""
    lo, hi = math.inf, 0.0
    for r in runs:
        pts = [(x.ttft_s, x.predicted_ttft_s) for x in r.results if x.ok and x.predicted_ttft_s is not None]
        a = np.array(pts, dtype=float).reshape(-1, 2) * 1000
        a = a[(a > 0).all(axis=1)]
        if a.size:
            ax.scatter(a[:, 0], a[:, 1], s=4, alpha=0.5, label=r.meta.run)
            lo, hi = min(lo, a.min()), max(hi, a.max())
    if hi <= 0:
        return False
    ax.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("actual TTFT (ms)")
    ax.set_ylabel("predicted TTFT (ms)")
    ax.legend(fontsize=8)
    return True


def write_report(runs: Sequence[Run], out_dir: str | Path, *, title: str = "kvroute load test",
                 notes: Sequence[str] = (), plots: bool = True, holdout: Sequence[PartSummary] = ()) -> Path:
    """report.md (+ PNGs) in `out_dir`; returns the Markdown path. `holdout`: the runs'
    fit and judged parts (loadtest/holdout.py), a section of their own."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot_all(runs, out) if plots and runs else []
    md = out / "report.md"
    md.write_text(markdown(runs, title, notes, [str(p) for p in pngs], holdout))
    return md
