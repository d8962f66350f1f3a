"""Report rendering: tables, baseline ratios, plots, and re-rendering from JSONL."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from loadtest.report import baseline_table, markdown, write_report
from loadtest.results import RequestResult, ResultsWriter, Run, RunMeta, read_runs
from loadtest.summary import summarize


def _run(name: str, policy: str, tiers: str, ttft_scale: float, n: int = 200) -> Run:
    rng = np.random.default_rng(1)
    ttfts = rng.lognormal(np.log(0.1), 0.8, n) * ttft_scale
    res = []
    for i, t in enumerate(ttfts):
        res.append(
            RequestResult(
                run=name, index=i, arrival_s=i * 0.1, start_s=i * 0.1, ttft_s=float(t), tpot_s=0.01,
                e2e_s=float(t) + 1.0, prompt_tokens=1000, output_tokens=100, cached_tokens=400,
                loaded_tokens={"GPU": 300, "CPU": 100}, recomputed_tokens=600, prefetch_blocks=2 if i % 2 else 0,
                prefetch_hidden_s=0.01 if i % 2 else None, predicted_ttft_s=float(t) * 1.2, worker=f"w{i % 4}",
            )
        )
    res.append(RequestResult(run=name, index=n, arrival_s=n * 0.1, status=429, error="shed"))
    return Run(RunMeta(run=name, mode="sim", policy=policy, tiers=tiers, trace="t", workers=4,
                       stats={"events": 10}), res)


def test_summary_numbers() -> None:
    r = _run("kv_cost", "kv_cost", "all", 1.0)
    s = summarize(r)
    ok = [x.ttft_s for x in r.results if x.ok]
    assert s.ok == 200 and s.errors == {"429": 1}
    assert s.ttft["p50"] == pytest.approx(float(np.percentile(ok, 50)))
    assert s.ttft["p99"] == pytest.approx(float(np.percentile(ok, 99)))
    assert s.hit_rate["GPU"] == pytest.approx(0.3) and s.hit_rate["CPU"] == pytest.approx(0.1)
    assert s.recompute_avoided == pytest.approx(0.4)
    assert s.prefetch_requests == 100 and s.prefetch_hidden_s == pytest.approx(1.0)
    assert s.pred_abs_rel_err_p50 == pytest.approx(0.2) and s.pred_bias == pytest.approx(0.2)


def test_baselines_are_ratios() -> None:
    runs = [_run("rr", "round_robin", "all", 2.0), _run("kv", "kv_cost", "all", 1.0),
            _run("kv-gpu", "kv_cost", "gpu", 4.0)]
    table = baseline_table([summarize(r) for r in runs])
    kv_line = next(line for line in table.splitlines() if line.startswith("| kv |"))
    assert "0.50×" in kv_line and "0.25×" in kv_line


def test_write_report_and_rerender(tmp_path: Path) -> None:
    runs = [_run("rr", "round_robin", "all", 2.0), _run("kv", "kv_cost", "all", 1.0)]
    res = tmp_path / "results.jsonl"
    with ResultsWriter(res) as w:
        for r in runs:
            w.write_run(r.meta, r.results)
    back = read_runs(res)
    assert [r.meta.run for r in back] == ["rr", "kv"] and len(back[1].results) == 201
    md = write_report(back, tmp_path / "rep", title="T", notes=["a note"])
    text = md.read_text()
    assert text.startswith("# T") and "a note" in text
    assert "| kv | 200/201 |" in text
    for png in ("ttft_cdf.png", "ttft_percentiles.png", "tiers.png", "predicted_vs_actual.png"):
        p = tmp_path / "rep" / png
        assert p.exists() and p.read_bytes()[:4] == b"\x89PNG"
        assert f"]({png})" in text


def test_empty_and_failed_runs_render() -> None:
    r = Run(RunMeta(run="dead", mode="replay"), [RequestResult(run="dead", index=0, arrival_s=0.0, status=0,
                                                               error="refused")])
    s = summarize(r)
    assert s.ok == 0 and math.isnan(s.ttft["p50"])
    assert "| dead | 0/1 |" in markdown([r])
