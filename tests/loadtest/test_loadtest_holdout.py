"""Held-out evaluation (loadtest/holdout.py): each run's requests split by arrival time
into fit and judged, both reported in the tables and in holdout.json."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.holdout import FIT, JUDGED, holdout_summaries, judge_cut_s, split_run
from loadtest.ideal import IDEAL
from loadtest.report import holdout_table, markdown
from loadtest.results import RequestResult, Run, RunMeta, read_runs
from loadtest.tracefiles import MOONCAKE_SLICE
from loadtest.traces import load_trace

MOONCAKE = str(MOONCAKE_SLICE)


def _res(i: int, arrival: float, ttft: float, predicted: float | None = None, run: str = "r") -> RequestResult:
    return RequestResult(run=run, index=i, arrival_s=arrival, start_s=arrival, ttft_s=ttft,
                         predicted_ttft_s=predicted)


def _run(results: list[RequestResult], name: str = "r", mode: str = "sim") -> Run:
    return Run(RunMeta(run=name, mode=mode, trace="t", duration_s=99.0, stats={"polls": 7}), results)


def test_the_cut_lies_at_the_fraction_of_the_arrival_span_and_belongs_to_judged() -> None:
    # arrivals 2..12 s: the span is 10 s, 60% of it ends at 8 s; 8 s itself is judged
    run = _run([_res(i, 2.0 + i, 0.1) for i in range(11)])
    assert judge_cut_s(run, 0.6) == pytest.approx(8.0)
    parts = split_run(run, 0.6)
    assert [r.arrival_s for r in parts[FIT].results] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert [r.arrival_s for r in parts[JUDGED].results] == [8.0, 9.0, 10.0, 11.0, 12.0]
    # the split is by arrival, whatever order the results come in
    shuffled = _run(list(reversed(run.results)))
    assert sorted(r.index for r in split_run(shuffled, 0.6)[FIT].results) == [0, 1, 2, 3, 4, 5]
    # the run-wide makespan and counters are not the parts'
    assert parts[FIT].meta.duration_s == 0.0 and parts[FIT].meta.stats == {}
    for bad in (0.0, 1.0, -0.5, math.nan):
        with pytest.raises(ValueError, match="judge_from"):
            split_run(run, bad)


def test_each_part_is_summarised_from_its_own_requests_against_the_whole_ideal() -> None:
    # fit: TTFT 1 s, predicted 10% high; judged: TTFT 2 s, predicted 50% low
    results = [_res(i, float(i), 1.0, 1.1) for i in range(6)] + [_res(i, float(i), 2.0, 1.0) for i in range(6, 10)]
    ideal = _run([_res(i, float(i), 0.5, run=IDEAL) for i in range(10)], IDEAL, IDEAL)
    parts = holdout_summaries([ideal, _run(results)], 0.6)
    assert [(p.run, p.part) for p in parts] == [(IDEAL, FIT), (IDEAL, JUDGED), ("r", FIT), ("r", JUDGED)]
    fit, judged = parts[2], parts[3]
    assert (fit.summary.requests, judged.summary.requests) == (6, 4)
    assert (fit.first_s, fit.last_s, judged.first_s, judged.last_s) == (0.0, 5.0, 6.0, 9.0)
    assert fit.summary.ttft["p90"] == pytest.approx(1.0) and judged.summary.ttft["mean"] == pytest.approx(2.0)
    assert fit.summary.pred_abs_rel_err_p90 == pytest.approx(0.1)
    assert judged.summary.pred_abs_rel_err_p50 == pytest.approx(0.5)
    assert fit.summary.slowdown is not None and fit.summary.slowdown["p50"] == pytest.approx(2.0)
    assert judged.summary.slowdown is not None and judged.summary.slowdown["p99"] == pytest.approx(4.0)
    table = holdout_table(parts)
    row = next(x for x in table.splitlines() if x.startswith("| r | judged |")).split(" | ")
    assert row[2:4] == ["6.0–9.0", "4/4"] and row[-3:-1] == ["50.0%", "50.0%"]
    md = markdown([ideal, _run(results)], holdout=parts)
    assert "## Held-out split: fit and judged" in md and "| r | fit |" in md
    assert "Held-out" not in markdown([ideal, _run(results)])


def _trace_split(limit: int, judge_from: float) -> tuple[set[int], set[int]]:
    """Request indices of the slice's first `limit` requests by part, from the trace's own times."""
    reqs = load_trace(MOONCAKE).window(limit=limit).requests
    cut = reqs[0].arrival_s + judge_from * (reqs[-1].arrival_s - reqs[0].arrival_s)
    return {r.index for r in reqs if r.arrival_s < cut}, {r.index for r in reqs if r.arrival_s >= cut}


def test_cli_simulate_reports_both_parts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    rc = main(["simulate", "--trace", MOONCAKE, "--limit", "40", "--workers", "2", "--block-size", "64",
               "--speed", "2", "--policies", "round_robin,kv_cost", "--out", str(out), "--no-plots",
               "--judge-from", "0.6"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| kv_cost | fit |" in text and "| kv_cost | judged |" in text
    data = json.loads((out / "holdout.json").read_text())
    assert data["judge_from"] == 0.6 and set(data["runs"]) == {"ideal", "round_robin", "kv_cost"}
    fit_ids, judged_ids = _trace_split(40, 0.6)
    assert fit_ids and judged_ids
    for parts in data["runs"].values():
        assert (parts[FIT]["requests"], parts[JUDGED]["requests"]) == (len(fit_ids), len(judged_ids))
        assert parts[FIT]["last_arrival_s"] < parts[JUDGED]["first_arrival_s"]
        assert set(parts[JUDGED]["ttft_s"]) >= {"p50", "p90", "p99", "mean"}
    kv = data["runs"]["kv_cost"]
    assert kv[JUDGED]["pred_requests"] == len(judged_ids) and kv[JUDGED]["pred_abs_rel_err"]["p90"] is not None
    md = (out / "report.md").read_text()
    assert "| round_robin | judged |" in md and "held-out split: fit = arrivals before 60%" in md
    # the results file alone re-renders the same split
    runs = read_runs(out / "results.jsonl")
    assert {r.index for r in split_run(runs[2], 0.6)[FIT].results} == fit_ids
    assert main(["report", str(out / "results.jsonl"), "--out", str(tmp_path / "rep"), "--no-plots",
                 "--judge-from", "0.6"]) == 0
    assert json.loads((tmp_path / "rep" / "holdout.json").read_text()) == data


def test_cli_without_judge_from_keeps_todays_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim"
    assert main(["simulate", "--trace", MOONCAKE, "--limit", "10", "--workers", "2", "--policies", "round_robin",
                 "--out", str(out), "--no-plots"]) == 0
    assert "| fit |" not in capsys.readouterr().out
    assert not (out / "holdout.json").exists() and "Held-out" not in (out / "report.md").read_text()


@pytest.mark.parametrize("value", ["1", "0", "1.5", "x"])
def test_a_fraction_outside_the_span_is_refused(value: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["simulate", "--trace", MOONCAKE, "--limit", "5", "--policies", "round_robin", "--out", str(tmp_path),
              "--judge-from", value])
    assert ei.value.code == 2 and "--judge-from" in capsys.readouterr().err
