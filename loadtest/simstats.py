"""What a simulated run reports besides its requests: counters of the fleet and the router,
the gateway queue's holds, prediction errors, and the load time a prefetch hid.

Pure functions over what the simulator kept (simulate.py), so that the event loop's
module holds only the loop; summary.py derives the per-request statistics.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvindex.tiers import Tier
from router.planner.types import CostParams, Estimate
from workers.sim import SimEngine

from .results import RequestResult
from .router_model import RouterCounters
from .summary import pct


def error_stats(prefix: str, errs: Iterable[float]) -> dict[str, float]:
    """p50 and p90 of relative prediction errors, as `<prefix>_p50` / `_p90`; {} when none.
    Percentiles as every other column of the reports (summary.pct)."""
    xs = list(errs)
    if not xs:
        return {}
    return {f"{prefix}_p50": round(pct(xs, 50), 4), f"{prefix}_p90": round(pct(xs, 90), 4)}


def gateway_stats(holds: Sequence[float], results: Iterable[RequestResult]) -> dict[str, Any]:
    """The gateway queue's holds, and the prediction error measured from binding (the
    prediction less the hold, against the TTFT less the hold)."""
    h = sorted(holds)
    out: dict[str, Any] = {
        "gateway_held": sum(1 for x in h if x > 0.0),
        "gateway_hold_p99_s": round(pct(h, 99), 4) if h else 0.0,
    }
    rel: list[float] = []
    for r in results:
        if r.ok and r.ttft_s is not None and r.predicted_ttft_s is not None:
            a = r.ttft_s - r.client_queue_s
            if a > 0.0:
                rel.append((r.predicted_ttft_s - r.client_queue_s - a) / a)
    if rel:
        out.update(error_stats("pred_err_bind", (abs(x) for x in rel)))
        out["pred_bias_bind_p50"] = round(pct(rel, 50), 4)
    return out


def fleet_stats(engines: Iterable[SimEngine], remotes: Iterable[Any]) -> dict[str, Any]:
    """Blocks loaded per tier, prefetch outcomes, bytes written below GPU and 429s, summed
    over every engine that took part (removed ones included)."""
    loaded = {"CPU": 0, "DISK": 0, "REMOTE": 0, "PEER": 0}
    pf = {"prefetch_blocks_accepted": 0, "prefetch_blocks_landed": 0, "prefetch_transfers_dropped": 0}
    disk_written = rejected = 0
    for e in engines:
        for k, v in e.stats.loaded_blocks.items():
            loaded[k] = loaded.get(k, 0) + v
        for k in pf:
            pf[k] += getattr(e.stats, k)
        disk_written += e.kv.disk_bytes_written
        rejected += e.stats.rejected_queue_full
    return {
        **pf,
        **{f"loaded_blocks_{k}": v for k, v in loaded.items()},
        "disk_bytes_written": disk_written,
        "remote_bytes_written": sum(r.bytes_written for r in remotes),
        "worker_429s": rejected,
    }


def router_stats(rc: RouterCounters) -> dict[str, Any]:
    """The simulated router's counters."""
    return {
        "events_applied": rc.events_applied,
        "polls": rc.polls,
        "prefetches_sent": rc.prefetches_sent,
        "prefetch_blocks_sent": rc.prefetch_blocks_sent,
        "prefetches_refused": rc.prefetches_refused,
        "max_waiting_seen": rc.max_waiting_seen,
    }


def prefetch_hidden_s(est: Estimate, cost: CostParams, prefetched_tokens: int) -> float | None:
    """The load time of the KV a prefetch had raised before the request was scheduled,
    priced at the bandwidth of the tiers the estimate planned to prefetch from (shared
    in the plan's proportions); None when the plan had nothing below GPU."""
    plan = {t: n for t, n in est.prefetch_blocks.items() if n > 0 and t is not Tier.GPU}
    total = sum(plan.values())
    if not total:
        return None
    blocks = prefetched_tokens / cost.block_size
    s = 0.0
    for t, n in plan.items():
        link = cost.links.get(t)
        if link is not None and link.read_Bps > 0:
            s += blocks * (n / total) * cost.block_bytes / link.read_Bps
    return s
