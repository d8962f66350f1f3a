"""What the HTTP path of the host it runs on does to request arrivals: the numbers behind the offline
simulator's `local-http` transport (loadtest/router_model.py TRANSPORTS).

    .venv/bin/python bench/transport_probe.py [--trace FILE] [--limit 300] [--workers 4]
        [--policy round_robin] [--out DIR] [--from-run DIR]

One HTTP replay of a trace slice, run as `loadtest compare` runs it (a sim cluster,
here with `--arrival-log`, the gateway, the replay client), then per request: when
the trace issued it, when its worker accepted it (the arrival log, same monotonic
clock), and the client's TTFT against the worker's own. Printed:

  intake   spacing of consecutive small bodies of one burst at the workers
  lag      how far a body over FREE tokens falls behind its place, per token over FREE
           (FREE: the candidate whose model orders bursts most like the measurement)
  order    share of same-burst pairs that reached the workers out of issue order,
           measured and as the fitted model predicts (issue order alone: 0)
  jitter   the uniform jitter that brings the model's share to the measured one
  burst    how unevenly late whole bursts start (p90 − p10 of their start over 0.8:
           the width of a uniform draw shared by a burst)
  fixed    client TTFT − worker TTFT, minus what the model's intake, lag and mean
           jitters explain (the send delay)

and the `local-http` entry in use beside them. The route/send split of the lag is
not measured here: routing order (round-robin's assignments) showed most of it on
the gateway → worker leg, and the entry keeps ~5% on the route leg.
`--from-run DIR` re-analyses an earlier probe's results.jsonl and arrivals.log.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadtest.cliargs import out_dir  # noqa: E402
from loadtest.compare import CompareConfig, http_run  # noqa: E402
from loadtest.results import ResultsWriter, read_runs  # noqa: E402
from loadtest.router_model import TRANSPORTS  # noqa: E402
from loadtest.tokens import TokenSynth  # noqa: E402
from loadtest.trace import TraceError  # noqa: E402
from loadtest.tracefiles import resolve_trace  # noqa: E402
from loadtest.traces import load_trace  # noqa: E402

FREE_CANDIDATES = (8_000, 16_000, 24_000, 32_000, 48_000)
JITTER_CANDIDATES = (0.0, 0.001, 0.002, 0.003, 0.005, 0.008, 0.012, 0.02)


@dataclass(slots=True)
class Req:
    index: int
    issue: float  # trace time (s, from the replay's start)
    accepted: float  # worker accepted it (same origin)
    prompt: int
    overhead_ms: float  # client TTFT − worker TTFT


def load(run_dir: Path) -> list[Req]:
    """Join the replay's results with the arrival log: by worker and prompt length, in
    send order (lengths repeat rarely on one worker; the earliest unused line wins)."""
    runs = [r for r in read_runs(run_dir / "results.jsonl") if r.meta.mode == "replay"]
    if not runs:
        raise SystemExit(f"no replay run in {run_dir / 'results.jsonl'}")
    run = runs[0]
    t0 = float(run.meta.params.get("t0_monotonic_s", 0.0))
    if not t0:
        raise SystemExit("the replay did not record t0_monotonic_s (an older results file)")
    lines: dict[tuple[str, int], list[float]] = defaultdict(list)
    for ln in (run_dir / "arrivals.log").read_text().splitlines():
        t, wid, _rid, p = ln.split()
        lines[(wid, int(p))].append(float(t) - t0)
    out = []
    for x in sorted(run.results, key=lambda r: r.start_s or 0.0):
        if not x.ok or x.worker is None or x.queue_ms is None or x.ttft_s is None:
            continue
        got = lines.get((x.worker, x.prompt_tokens))
        if not got:
            continue
        worker_ttft_ms = x.queue_ms + (x.load_ms or 0.0) + (x.prefill_ms or 0.0)
        out.append(Req(x.index, x.arrival_s, got.pop(0), x.prompt_tokens, x.ttft_s * 1000.0 - worker_ttft_ms))
    out.sort(key=lambda r: r.index)
    return out


def bursts(reqs: list[Req]) -> list[list[Req]]:
    by: dict[float, list[Req]] = defaultdict(list)
    for r in reqs:
        by[r.issue].append(r)
    return [sorted(b, key=lambda r: r.index) for b in by.values() if len(b) > 1]


def _burst_line(b: list[Req], free: int, slope: float) -> float | None:
    """The burst's intercept: where its small bodies sit once `slope` per rank is taken out."""
    small = [(rank, r) for rank, r in enumerate(b) if r.prompt <= free]
    if not small:
        return None
    return statistics.fmean(r.accepted - slope * rank for rank, r in small)


def intake_spacing(bs: list[list[Req]], free: int) -> float:
    """Seconds per place in issue order: the pooled slope of small bodies' acceptance
    times over their rank in the burst (every request, small or large, takes a place)."""
    num = den = 0.0
    for b in bs:
        small = [(rank, r.accepted) for rank, r in enumerate(b) if r.prompt <= free]
        if len(small) < 2:
            continue
        mr = statistics.fmean(x for x, _ in small)
        mt = statistics.fmean(t for _, t in small)
        num += sum((x - mr) * (t - mt) for x, t in small)
        den += sum((x - mr) ** 2 for x, _ in small)
    return max(num / den, 0.0) if den else 0.0


def lag_per_token(bs: list[list[Req]], free: int, intake: float) -> float:
    """Median of (how late a large body is against its burst's line) / (tokens over free)."""
    ratios = []
    for b in bs:
        base = _burst_line(b, free, intake)
        if base is None:
            continue
        for rank, r in enumerate(b):
            if r.prompt > free:
                ratios.append((r.accepted - (base + intake * rank)) / (r.prompt - free))
    return max(statistics.median(ratios), 0.0) if ratios else 0.0


def model_times(reqs: list[Req], intake: float, free: int, per_token: float, jitter: float = 0.0,
                seed: int = 0) -> dict[int, float]:
    """When the model has each request reach its worker, its burst's shared delay left out
    (that moves a whole burst and no pair inside it)."""
    rng = random.Random(seed)
    t_free = float("-inf")
    out = {}
    for r in sorted(reqs, key=lambda r: (r.issue, r.index)):
        t_free = max(r.issue, t_free) + intake
        out[r.index] = t_free + per_token * max(0, r.prompt - free) + (rng.random() * jitter if jitter else 0.0)
    return out


def _pairs(bs: list[list[Req]]) -> Iterator[tuple[Req, Req]]:
    """Every pair of one burst, the earlier-issued first."""
    for b in bs:
        for i, x in enumerate(b):
            for y in b[i + 1:]:
                yield x, y


def out_of_order(bs: list[list[Req]], when: dict[int, float]) -> float:
    pairs = list(_pairs(bs))
    return sum(when[y.index] < when[x.index] for x, y in pairs) / len(pairs) if pairs else 0.0


def agreement(bs: list[list[Req]], when: dict[int, float]) -> float:
    pairs = list(_pairs(bs))
    same = sum((when[y.index] < when[x.index]) == (y.accepted < x.accepted) for x, y in pairs)
    return same / len(pairs) if pairs else 1.0


def analyse(reqs: list[Req]) -> dict[str, float]:
    bs = bursts(reqs)
    measured = {r.index: r.accepted for r in reqs}
    best: tuple[float, int, float, float] | None = None
    for free in FREE_CANDIDATES:
        intake = intake_spacing(bs, free)
        per_token = lag_per_token(bs, free, intake)
        a = agreement(bs, model_times(reqs, intake, free, per_token))
        if best is None or a > best[0]:
            best = (a, free, intake, per_token)
    assert best is not None
    a, free, intake, per_token = best
    when = model_times(reqs, intake, free, per_token)
    target = out_of_order(bs, measured)
    # the jitter that puts as many same-burst pairs out of order as measured (mean of 5 draws)
    jitter = min(JITTER_CANDIDATES, key=lambda j: abs(statistics.fmean(
        out_of_order(bs, model_times(reqs, intake, free, per_token, j, seed)) for seed in range(5)) - target))
    # how late each burst starts, relative to the others: a uniform [0, B) has p90 - p10 = 0.8 B
    starts = [x - b[0].issue for b in bs if (x := _burst_line(b, free, intake)) is not None]
    deciles = statistics.quantiles(starts, n=10) if len(starts) >= 2 else [0.0] * 9
    burst = max(deciles[8] - deciles[0], 0.0) / 0.8
    explained = [(when[r.index] - r.issue + jitter / 2 + burst / 2) * 1000.0 for r in reqs]
    fixed = statistics.median(r.overhead_ms - e for r, e in zip(reqs, explained, strict=True))
    return {"requests": len(reqs), "bursts": len(bs), "delay_free_tokens": free, "intake_ms": intake * 1000,
            "lag_us_per_token": per_token * 1e6, "jitter_ms": jitter * 1000, "burst_jitter_ms": burst * 1000,
            "out_of_order_measured": target,
            "out_of_order_model": out_of_order(bs, when), "order_agreement": a,
            "client_minus_worker_ttft_p50_ms": statistics.median(r.overhead_ms for r in reqs),
            "fixed_ms": fixed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=None, help="trace file (default: $LOADTEST_TRACES/mooncake_...jsonl)")
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--out", default=None, help="a new or empty folder (default: a new one in the system's "
                                                "temporary directory)")
    ap.add_argument("--from-run", default=None, help="analyse an earlier probe's directory instead of running")
    args = ap.parse_args()
    if args.from_run:
        out = Path(args.from_run)
    else:
        try:
            trace = load_trace(resolve_trace(args.trace)).window(limit=args.limit)
        except TraceError as e:
            raise SystemExit(f"error: {e}") from None
        try:
            out = out_dir(args.out, "transport-probe")
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        print(f"output: {out}", flush=True)
        cfg = CompareConfig(policies=[args.policy], workers=args.workers, arrival_log=str(out / "arrivals.log"))
        synth = TokenSynth.for_trace(trace, vocab_size=cfg.vocab_size, seed=cfg.seed)
        with ResultsWriter(out / "results.jsonl") as w:
            http_run(trace, cfg, args.policy, synth, out, w)
    m = analyse(load(out))
    cur = TRANSPORTS["local-http"]
    print(f"{m['requests']} requests in {m['bursts']} bursts of identical timestamps")
    print(f"intake     {m['intake_ms']:.2f} ms apart            (local-http: {float(cur['intake_s']) * 1000:.2f} ms)")
    print(f"free       {m['delay_free_tokens']} tokens                (local-http: {cur['delay_free_tokens']})")
    lag = (float(cur["route_delay_s_per_token"]) + float(cur["send_delay_s_per_token"])) * 1e6
    print(f"lag        {m['lag_us_per_token']:.2f} us per token over  (local-http: {lag:.2f} us, route + send)")
    print(f"order      {m['out_of_order_measured']:.1%} of same-burst pairs out of issue order; the model "
          f"{m['out_of_order_model']:.1%} without jitter (agrees on {m['order_agreement']:.1%} of pairs)")
    print(f"jitter     {m['jitter_ms']:.0f} ms puts as many out of order   (local-http: "
          f"{float(cur['route_jitter_s']) * 1000:.0f} ms)")
    print(f"burst      {m['burst_jitter_ms']:.0f} ms: bursts start that unevenly late   (local-http: "
          f"{float(cur['burst_jitter_s']) * 1000:.0f} ms)")
    print(f"fixed      {m['fixed_ms']:.1f} ms (client − worker TTFT p50 {m['client_minus_worker_ttft_p50_ms']:.1f} ms)"
          f"   (local-http: send {float(cur['send_delay_s']) * 1000:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
