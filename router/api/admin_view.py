"""What the admin API and `/metrics` read from the gateway's live objects.

Nothing here is on a request's path: the explain breakdown, tenant purge across
workers, index statistics, and the gauges computed at scrape time.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Any

import aiohttp
import msgspec
from prometheus_client.core import GaugeMetricFamily, Metric

from ..fleet.costs import speeds_stated
from ..fleet.ingest_adapter import PoolIngest
from ..fleet.pool import WorkerPool
from ..fleet.worker import State, Worker
from ..intake.model import ModelTable
from ..intake.prepare import Prepared
from ..intake.tenancy import Tenancy
from ..planner.types import Decision, Estimate, RouteRequest
from .errors import ApiError, bad_request

_enc = msgspec.json.Encoder()


def explain_dict(prep: Prepared, policy_name: str, d: Decision, rr: RouteRequest,
                 params: dict[str, Any]) -> dict[str, Any]:
    """`POST /admin/route/explain`: the decision, every worker's cost breakdown, and the
    policy's parameters in effect (its defaults with the config's `routing.params`)."""
    return {
        "model": prep.model.id,
        "policy": policy_name,
        "policy_params": params,
        "prompt_tokens": len(prep.ids),
        "full_blocks": len(prep.plan.digests),
        "block_size": prep.model.block_size,
        "shared_prefix_blocks": prep.plan.shared_blocks,
        "salted": prep.plan.wire_salt is not None,
        "decision": {
            "worker_id": d.worker_id,
            "reason": d.reason,
            "predicted_ttft_s": d.predicted_ttft,
            "prefetch_blocks": d.prefetch_blocks,
            "prefetch_from_peer": d.prefetch_from_peer,
            "ranked": d.ranked,
            "retry_after_s": d.retry_after_s,
            # a pair policy's record: the chosen option (single, pair or bypass) with each
            # term, the best alternatives and why they lost (router/planner/pd.py)
            "prefill_worker_id": d.prefill_worker_id,
            "pd": d.pd.to_dict() if d.pd is not None else None,
        },
        "matches": {
            wid: {"blocks": m.blocks, "runs": [[t.name, n] for t, n in m.runs]} for wid, m in rr.matches.items()
        },
        "workers": [estimate_dict(e) for e in d.estimates],
    }


def estimate_dict(e: Estimate) -> dict[str, Any]:
    return {
        "worker_id": e.worker_id,
        "eligible": e.eligible,
        "note": e.note,
        "matched_blocks": {t.name: n for t, n in e.matched_blocks.items()},
        "load_blocks": e.load_blocks,
        "load_blocks_by_tier": {t.name: n for t, n in e.load_blocks_by_tier.items()},
        "prefetch_blocks": {t.name: n for t, n in e.prefetch_blocks.items()},
        "recompute_tokens": e.recompute_tokens,
        "t_queue_s": e.t_queue,
        "t_load_s": e.t_load,
        "t_load_total_s": e.t_load_total,
        "t_prefill_s": e.t_prefill,
        "t_ttft_s": e.t_ttft,
        "t_interference_s": e.t_interference,
        "t_memory_s": e.t_memory,
        "score": e.t_ttft if e.score is None else e.score,
        "load": e.load,
        "peer_source": e.peer_source,
    }


async def purge_tenant(
    tenancy: Tenancy, pool: WorkerPool, session: aiohttp.ClientSession, tenant_id: str, timeout: aiohttp.ClientTimeout
) -> dict[str, Any]:
    """Ask every live worker of ours to drop the tenant's blocks (each of its wire salts)."""
    t = tenancy.tenants.get(tenant_id)
    if t is None:
        raise ApiError(404, f"Unknown tenant {tenant_id!r}.", "invalid_request_error", "tenant", "not_found")
    salts = tenancy.wire_salts(t)
    if not salts:
        raise bad_request(f"Tenant {tenant_id!r} has no isolation salt; there is nothing of its own to purge.")
    targets = [w for w in pool.workers.values() if w.kind == "kvroute" and w.state in (State.HEALTHY, State.DRAINING)]
    results = await asyncio.gather(*(_purge_one(session, w, salts, timeout) for w in targets))
    return {"tenant": tenant_id, "wire_salts": len(salts), "workers": dict(zip([w.id for w in targets], results,
                                                                               strict=True)),
            "note": "request cache_salts unknown to this process (before its start or evicted) are not covered"}


async def _purge_one(
    session: aiohttp.ClientSession, w: Worker, salts: list[str], timeout: aiohttp.ClientTimeout
) -> dict[str, Any]:
    total = 0
    errors = []
    for s in salts:
        try:
            async with session.post(
                w.url + "/kv/purge", data=_enc.encode({"cache_salt": s}),
                headers={"content-type": "application/json", **w.call_headers}, timeout=timeout,
            ) as r:
                body = await r.read()
                if r.status == 200:
                    total += int(msgspec.json.decode(body).get("purged_blocks", 0))
                else:
                    errors.append(f"HTTP {r.status}")
        except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError, AttributeError) as e:
            errors.append(type(e).__name__)
    return {"purged_blocks": total, "errors": errors}


def index_stats(models: ModelTable, ingest: PoolIngest | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rt in models.by_id.values():
        out[rt.id] = {
            "blocks": len(rt.index),
            "entries": rt.index.entries(),
            "workers": [asdict(s) for s in rt.index.worker_stats()],
        }
    if ingest is not None:
        out["_ingest"] = ingest.health()
    return out


def state_gauges(pool: WorkerPool, models: ModelTable, ingest: PoolIngest | None) -> list[Metric]:
    """Scrape-time gauges read from the live objects (nothing updates them per request)."""
    health = GaugeMetricFamily("kvroute_worker_healthy", "1 if the worker is routable", labels=["worker", "model"])
    state = GaugeMetricFamily("kvroute_worker_state", "Worker state (1 for its current state)",
                              labels=["worker", "state"])
    inflight = GaugeMetricFamily("kvroute_worker_inflight", "Router-tracked in-flight requests", labels=["worker"])
    speed = GaugeMetricFamily("kvroute_worker_speed_state",
                              "Where the worker's speeds stand (1 for its state: probing, fitted, drifting)",
                              labels=["worker", "state", "source"])
    conf = GaugeMetricFamily("kvroute_worker_speed_confidence", "Confidence in the fitted speeds (0..1)",
                             labels=["worker"])
    for w in pool.workers.values():
        health.add_metric([w.id, w.model.id], 1.0 if w.state is State.HEALTHY else 0.0)
        state.add_metric([w.id, w.state.value], 1.0)
        inflight.add_metric([w.id], float(len(w.inflight)))
        sp = speeds_summary(w)
        speed.add_metric([w.id, str(sp["state"]), str(sp["source"])], 1.0)
        conf.add_metric([w.id], float(sp["confidence"]))
    blocks = GaugeMetricFamily("kvroute_index_blocks", "Distinct blocks in the prefix index", labels=["model"])
    entries = GaugeMetricFamily("kvroute_index_entries", "(block, worker, tier) index entries", labels=["model"])
    cache = GaugeMetricFamily("kvroute_tokenize_cache_tokens", "Tokens held by the prefix-tokenization cache",
                              labels=["model"])
    hits = GaugeMetricFamily("kvroute_tokenize_cache_hit_tokens", "Tokens served from the tokenization cache",
                             labels=["model"])
    for rt in models.by_id.values():
        blocks.add_metric([rt.id], float(len(rt.index)))
        entries.add_metric([rt.id], float(rt.index.entries()))
        cache.add_metric([rt.id], float(rt.tokenizer.cache.tokens))
        hits.add_metric([rt.id], float(rt.tokenizer.cache.stats.hit_tokens))
    fams: list[Metric] = [health, state, inflight, speed, conf, blocks, entries, cache, hits]
    if ingest is not None:
        fams += list(ingest.metric_families())
    return fams


def speeds_summary(w: Any) -> dict[str, Any]:
    """Where a worker's speeds come from and how sure the router is of them."""
    sp = w.fleet.speed
    out: dict[str, Any] = sp.summary() if sp is not None else {"state": "probing", "confidence": 0.0, "samples": 0}
    out["source"] = "fitted" if w.view.speeds_fitted else "stated" if speeds_stated(w.model, w.cfg.cost, w.kind) \
        else "defaults"
    c = w.view.cost
    out["in_use"] = {"prefill_tokens_per_s": round(c.prefill_tokens_per_s, 1),
                     "prefill_overhead_ms": round(c.prefill_overhead_s * 1e3, 3),
                     "decode_step_ms": round(c.decode_step_s * 1e3, 3),
                     "ride_per_running_ms": round(c.ride_per_running_s * 1e3, 3)}
    return out
