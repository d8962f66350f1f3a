"""What a run amounts to: tail latencies, throughput, per-tier hits, recompute
avoided, prefetch hidden time, the planner's prediction error (docs/design.md §9), the
slowdown against the `ideal` run (loadtest/ideal.py) and the fleet's utilisation.

Percentiles are over successful requests (linear interpolation); failed requests
are counted, never folded into latencies.

Utilisation = the prefill busy fraction: per worker, the share of the arrival window
(first to last arrival) during which it held at least one request that had not had its
first token yet (from the request's arrival at the worker to its first token: `[first
token - (queue_ms + load_ms + prefill_ms), first token]`), averaged over the workers:
the busy fraction of the worker's prefill queue, as a queueing model counts a server
busy while work is waiting for it. (Time only with a request prefilling would miss a
worker whose queue is stuck on GPU memory: at Mooncake's lengths the KV pool, not the
prefill compute, is what saturates first.) It needs the workers' `usage.kv` timings
(our engines); a run without them has none.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .ideal import IDEAL
from .results import RequestResult, Run

TIERS = ("GPU", "CPU", "DISK", "REMOTE", "PEER")


def pct(values: Sequence[float] | np.ndarray, q: float) -> float:
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return float("nan")
    return float(np.percentile(a, q))


@dataclass(slots=True)
class RunSummary:
    run: str
    mode: str
    policy: str | None
    tiers: str
    requests: int
    ok: int
    errors: dict[str, int]
    ttft: dict[str, float]  # p50 / p90 / p95 / p99 / mean, seconds
    tpot: dict[str, float]
    e2e: dict[str, float]
    client_queue_p99: float
    duration_s: float
    throughput_rps: float
    output_tps: float
    prompt_tokens: int
    cached_tokens: int
    hit_rate: dict[str, float]  # share of prompt tokens served from each tier
    recompute_avoided: float  # share of prompt tokens not recomputed
    prefetch_requests: int
    prefetch_hidden_s: float  # total load time moved off critical paths
    pred_abs_rel_err_p50: float
    pred_abs_rel_err_p90: float
    pred_bias: float  # median (predicted - actual) / actual: > 0 means over-estimates
    stats: dict[str, Any] = field(default_factory=dict)
    # TTFT / ideal TTFT per request (p50 / p90 / p95 / p99 / mean), when an ideal run is known
    slowdown: dict[str, float] | None = None
    utilisation: float = float("nan")  # prefill busy fraction of the fleet (module doc)
    pred_requests: int = 0  # requests with a prediction
    # Requests within the TTFT and TPOT SLOs: share of all, per second, and the SLOs (goodput()).
    goodput: dict[str, float] = field(default_factory=dict)


# Goodput's default SLOs: time to first token within 2 s (Mooncake's prompts are long:
# the ideal p99 is 5.7 s at 8 x H200) and time per output token within 100 ms (DistServe's
# chatbot TPOT SLO; a reader keeps up at ~10 tokens/s). `loadtest simulate --slo-ttft/--slo-tpot`
# change them; a run keeps its own in `meta.params["slo"]`.
SLO_TTFT_S = 2.0
SLO_TPOT_S = 0.1


def goodput(run: Run, duration_s: float) -> dict[str, float]:
    """Requests that succeeded within both SLOs (the run's own, else the defaults): their share
    of all requests, and per second of the run. A one-token answer has no TPOT: its TTFT decides."""
    slo = run.meta.params.get("slo") if isinstance(run.meta.params, dict) else None
    ttft_slo = float(slo["ttft_s"]) if isinstance(slo, dict) and "ttft_s" in slo else SLO_TTFT_S
    tpot_slo = float(slo["tpot_s"]) if isinstance(slo, dict) and "tpot_s" in slo else SLO_TPOT_S
    good = sum(1 for r in run.results if r.ok and r.ttft_s is not None and r.ttft_s <= ttft_slo
               and (r.tpot_s is None or r.tpot_s <= tpot_slo))
    n = len(run.results)
    return {"share": good / n if n else float("nan"), "rps": good / duration_s if duration_s > 0 else float("nan"),
            "slo_ttft_s": ttft_slo, "slo_tpot_s": tpot_slo}


def _lat(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p95": float("nan"), "p99": float("nan"),
                "mean": float("nan")}
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p95, p99 = np.percentile(a, [50, 90, 95, 99])
    return {"p50": float(p50), "p90": float(p90), "p95": float(p95), "p99": float(p99), "mean": float(a.mean())}


def prefill_busy_fraction(run: Run) -> float:
    """The fleet's prefill busy fraction over the arrival window (module doc); NaN when
    the run has no per-request prefill timings."""
    rs = run.results
    if not rs:
        return float("nan")
    lo = min(r.arrival_s for r in rs)
    hi = max(r.arrival_s for r in rs)
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in rs:
        if not r.ok or r.prefill_ms is None or r.worker is None or r.ttft_s is None:
            continue
        end = (r.start_s if r.start_s is not None else r.arrival_s) + r.ttft_s
        at_worker = (r.queue_ms or 0.0) + (r.load_ms or 0.0) + r.prefill_ms
        spans.setdefault(r.worker, []).append((end - at_worker / 1000.0, end))
    if not spans or hi <= lo:
        return float("nan")
    busy = 0.0
    for iv in spans.values():
        iv.sort()
        cur_a, cur_b = iv[0]
        for a, b in iv[1:]:
            if a > cur_b:
                busy += _clip(cur_a, cur_b, lo, hi)
                cur_a, cur_b = a, b
            elif b > cur_b:
                cur_b = b
        busy += _clip(cur_a, cur_b, lo, hi)
    workers = max(run.meta.workers or 0, len(spans))
    return busy / (workers * (hi - lo))


def _clip(a: float, b: float, lo: float, hi: float) -> float:
    a = a if a > lo else lo
    b = b if b < hi else hi
    return b - a if b > a else 0.0


def slowdowns(run: Run, ideal: Mapping[int, float]) -> list[float]:
    """TTFT / ideal TTFT of each successful request that has an ideal."""
    out = []
    for r in run.results:
        if r.ok and r.ttft_s is not None:
            i = ideal.get(r.index)
            if i is not None and i > 0.0:
                out.append(r.ttft_s / i)
    return out


def ideal_by_index(run: Run) -> dict[int, float]:
    return {r.index: r.ttft_s for r in run.results if r.ttft_s is not None}


IdealKey = tuple[str, str | None, object]


def ideal_key(run: Run) -> IdealKey:
    """Which ideal bounds a run: the one of the same trace, profile and block size."""
    return (run.meta.trace, run.meta.profile, run.meta.params.get("block_size"))


def ideal_maps(runs: Sequence[Run]) -> dict[IdealKey, dict[int, float]]:
    """The ideal runs among `runs` (mode "ideal"), each as request index -> ideal TTFT."""
    return {ideal_key(r): ideal_by_index(r) for r in runs if r.meta.mode == IDEAL}


def summarize(run: Run, ideal: Mapping[int, float] | None = None) -> RunSummary:
    """The run's numbers; `ideal` (request index -> ideal TTFT) adds the slowdown."""
    rs: list[RequestResult] = run.results
    ok = [r for r in rs if r.ok]
    errors = Counter(str(r.status) if r.status != 200 else "error" for r in rs if not r.ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    ends = [(r.start_s if r.start_s is not None else r.arrival_s) + (r.e2e_s or 0.0) for r in ok]
    first = min((r.arrival_s for r in rs), default=0.0)
    duration = run.meta.duration_s or (max(ends) - first if ends else 0.0)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_tier = {t: 0 for t in TIERS}
    recomputed = 0
    have_kv = False
    for r in ok:
        for t, n in r.loaded_tokens.items():
            per_tier[t] = per_tier.get(t, 0) + n
        if r.recomputed_tokens is not None:
            have_kv = True
            recomputed += r.recomputed_tokens
    hit = {t: (n / prompt if prompt else 0.0) for t, n in per_tier.items()}
    if have_kv:
        avoided = 1.0 - recomputed / prompt if prompt else 0.0
    else:  # a peer engine without our `kv` extension: cached_tokens is all we know
        avoided = cached / prompt if prompt else 0.0
    pf = [r for r in ok if r.prefetch_blocks > 0]
    hidden = sum(r.prefetch_hidden_s or 0.0 for r in ok)
    rel = [
        (r.predicted_ttft_s - r.ttft_s) / r.ttft_s
        for r in ok
        if r.predicted_ttft_s is not None and r.ttft_s is not None and r.ttft_s > 0
    ]
    absrel = np.abs(np.asarray(rel)) if rel else np.asarray([])
    slow = _lat(slowdowns(run, ideal)) if ideal else None
    return RunSummary(
        run=run.meta.run,
        mode=run.meta.mode,
        policy=run.meta.policy,
        tiers=run.meta.tiers,
        requests=len(rs),
        ok=len(ok),
        errors=dict(errors),
        ttft=_lat(ttft),
        tpot=_lat(tpot),
        e2e=_lat(e2e),
        client_queue_p99=pct([r.client_queue_s for r in rs], 99) if rs else float("nan"),
        duration_s=duration,
        throughput_rps=len(ok) / duration if duration > 0 else float("nan"),
        output_tps=sum(r.output_tokens for r in ok) / duration if duration > 0 else float("nan"),
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=hit,
        recompute_avoided=avoided,
        prefetch_requests=len(pf),
        prefetch_hidden_s=hidden,
        pred_abs_rel_err_p50=pct(absrel, 50),
        pred_abs_rel_err_p90=pct(absrel, 90),
        pred_bias=pct(rel, 50),
        stats=dict(run.meta.stats),
        slowdown=slow,
        utilisation=prefill_busy_fraction(run),
        pred_requests=len(rel),
        goodput=goodput(run, duration),
    )
