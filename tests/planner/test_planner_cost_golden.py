"""The cost model's exact output over a fixed, seeded set of fleets and requests.

Every estimate (each term of every worker, every tier and the PEER pull, with and without
prefetch, calibrated scales, exact queues, invalid speeds) and the kv_cost decisions that
compose them with the interference, co-scheduling and GPU-memory terms are compared to
tests/data/planner_cost_golden.json exactly (floats round-trip through JSON). A change
that moves any number by one ulp fails here: a refactor must keep the arithmetic.

Regenerate (only for an intended change of the model, never to make a refactor pass):
`python tests/planner/test_planner_cost_golden.py --write` from the repository root.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from kvindex.index import PrefixMatch
from kvindex.tiers import Tier
from router.planner import explain, make_policy
from router.planner.cost import RequestContext, estimate_all, estimate_worker, ttft_lower_bound
from router.planner.kv_cost import KVCostPolicy
from router.planner.kv_cost_tuning import KVCostTuning
from router.planner.true_state import TrueStatePolicy
from router.planner.types import CostParams, Decision, Estimate, Link, RouteRequest, WorkerView

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "planner_cost_golden.json"
SEED = 2026
CASES = 48
LOCAL = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE)


def _tiers(d: dict[Tier, int]) -> dict[str, int]:
    return {t.name: n for t, n in d.items()}


def estimate_row(e: Estimate) -> list[Any]:
    return [
        e.worker_id, _tiers(e.matched_blocks), e.load_blocks, _tiers(e.load_blocks_by_tier),
        _tiers(e.prefetch_blocks), e.recompute_tokens, e.t_queue, e.t_load, e.t_load_total, e.t_prefill,
        e.t_ttft, e.eligible, e.note, e.peer_source, e.load, e.t_interference, e.score, e.t_coschedule,
        e.t_memory,
    ]


def decision_row(d: Decision) -> list[Any]:
    return [
        d.worker_id, d.policy, d.reason, d.predicted_ttft, d.prefetch_blocks, d.prefetch_from_peer, d.ranked,
        d.retry_after_s, d.recompute_tokens, [estimate_row(e) for e in d.estimates],
    ]


def _links(rng: random.Random) -> dict[Tier, Link]:
    links: dict[Tier, Link] = {}
    for t in (Tier.CPU, Tier.DISK, Tier.REMOTE, Tier.PEER):
        r = rng.random()
        if r < 0.2:
            continue  # no link: the match stops at this tier
        if r < 0.27:
            links[t] = Link(0.0, 0.001)  # a link that cannot carry anything
            continue
        links[t] = Link(rng.choice([2e6, 5e7, 1e9, 2.5e10]) * rng.uniform(0.5, 2.0),
                        rng.choice([0.0, 1e-5, 2e-4, 0.003]))
    return links


def _cost(rng: random.Random, block: int) -> CostParams:
    speed = rng.choice([0.0, 800.0, 5_000.0, 40_000.0]) if rng.random() < 0.06 else rng.uniform(500.0, 50_000.0)
    return CostParams(
        block_size=block if rng.random() > 0.03 else 0,
        block_bytes=rng.choice([1000, 65_536, 2 * 1024 * 1024]),
        prefill_tokens_per_s=speed,
        prefill_attn_s_per_token2=rng.choice([0.0, 1e-9, 1e-7]),
        prefill_overhead_s=rng.choice([0.0, 0.002, 0.01]),
        decode_step_s=rng.choice([0.0, 0.0, 0.015, 0.03]),
        max_batched_tokens=rng.choice([8192, 2048, 256, 16]),
        ride_per_running_s=rng.choice([0.0, 0.0, 0.0005]),
        queue_scale=rng.choice([1.0, 1.0, 0.8, 1.3]),
        links=_links(rng),
    )


def _view(rng: random.Random, wid: str, block: int) -> WorkerView:
    since = rng.random() < 0.5
    cap = rng.choice([0, 0, 64, 400, 5000])
    return WorkerView(
        wid,
        _cost(rng, block),
        waiting_requests=rng.randint(0, 6),
        waiting_prefill_tokens=rng.choice([0, 0, 300, 4000, 20_000]),
        running_requests=rng.randint(0, 40),
        est_queue_s=rng.choice([0.0, 0.0, 0.0, 0.05, 0.8]),
        gpu_free_blocks=rng.randint(0, cap) if cap else 0,
        gpu_capacity_blocks=cap,
        gpu_block_tokens=rng.choice([0, block, 2 * block]),
        report_age_s=rng.choice([0.0, 0.01, 0.3, 2.0]),
        inflight_requests=rng.randint(0, 8),
        inflight_prefill_tokens=rng.choice([0, 200, 3000]),
        max_waiting=rng.choice([None, None, 2, 8]),
        supports_prefetch=rng.random() < 0.8,
        supports_peer_pull=rng.random() < 0.6,
        running_prefill_tokens=rng.choice([0, 0, 512]),
        inflight_since_report_requests=rng.randint(0, 3) if since else None,
        inflight_since_report_prefill_tokens=rng.choice([0, 100, 2500]) if since else None,
        active_kv_tokens=rng.choice([None, 0, 1000, 60_000]),
        inflight_loads=[(rng.uniform(-0.05, 0.6), rng.uniform(0.0, 0.2)) for _ in range(rng.choice([0, 0, 1, 3]))],
        inflight_starts=[(rng.uniform(-0.02, 0.3), rng.choice([8, 100, 900, 5000]))
                         for _ in range(rng.choice([0, 0, 1, 2, 4]))],
    )


def _match(rng: random.Random, wid: str, n_blocks: int) -> PrefixMatch | None:
    if n_blocks <= 0 or rng.random() < 0.25:
        return None
    runs: list[tuple[Tier, int]] = []
    left = rng.randint(1, n_blocks)
    while left > 0:
        take = rng.randint(1, left)
        t = rng.choice(LOCAL)
        if runs and runs[-1][0] is t:
            runs[-1] = (t, runs[-1][1] + take)
        else:
            runs.append((t, take))
        left -= take
    return PrefixMatch(wid, sum(n for _, n in runs), tuple(runs))


def case(i: int) -> tuple[RouteRequest, list[WorkerView], list[tuple[float, dict[Tier, float] | None]]]:
    rng = random.Random(SEED * 1000 + i)
    block = rng.choice([4, 10, 16, 64])
    views = [_view(rng, f"w{j}", block) for j in range(rng.randint(1, 5))]
    tokens = rng.choice([0, 1, block, block + 1, rng.randint(2, 3000), rng.randint(3000, 40_000)])
    n_blocks = tokens // block if rng.random() < 0.9 else max(0, tokens // block - 2)
    matches = {}
    for v in views:
        m = _match(rng, v.worker_id, n_blocks)
        if m is not None:
            matches[v.worker_id] = m
    req = RouteRequest(tokens, list(range(n_blocks)), matches, max_tokens=rng.choice([0, 1, 256, 4096]))
    scales: list[tuple[float, dict[Tier, float] | None]] = []
    for _ in views:
        if rng.random() < 0.5:
            scales.append((1.0, None))
        else:
            scales.append((rng.choice([0.7, 1.0, 1.6]),
                           {t: rng.choice([0.5, 1.0, 2.0]) for t in (Tier.CPU, Tier.DISK, Tier.PEER)}))
    return req, views, scales


# (prefetch, peer, exact_queue) for estimate_worker and ttft_lower_bound
_FLAGS = ((True, True, False), (True, False, False), (False, True, False), (False, False, False), (True, True, True))
_COSCHEDULE = KVCostTuning(coschedule_weight=1.0, memory_weight=3.0, memory_bound=0.5, saturation_queue_s=0.0)
# (policy, tuning, every estimate): pruned and full evaluations, the default constants and
# one with the co-scheduling term weighed in and saturation reached at once.
_POLICIES = (
    (KVCostPolicy, KVCostTuning(), False),
    (KVCostPolicy, KVCostTuning(), True),
    (KVCostPolicy, _COSCHEDULE, True),
    (TrueStatePolicy, _COSCHEDULE, False),
)


def run_case(i: int) -> dict[str, Any]:
    req, views, scales = case(i)
    ctx = RequestContext.build(req, views)
    out: dict[str, Any] = {"estimates": [], "bounds": [], "decisions": []}
    for prefetch, peer, exact in _FLAGS:
        for w, (ps, ls) in zip(views, scales, strict=True):
            e = estimate_worker(ctx, w, prefetch, peer, exact, ps, ls)
            out["estimates"].append(estimate_row(e))
            out["bounds"].append(ttft_lower_bound(ctx, w, prefetch, peer, exact, ps))
    out["all"] = [estimate_row(e) for e in estimate_all(req, views)]
    slo = 0.5 if i % 3 == 0 else None
    for cls, tuning, everything in _POLICIES:
        p = cls(calibrate=False, max_ttft_s=slo, _tuning=tuning)
        p.all_estimates = everything
        out["decisions"].append(decision_row(p.choose(req, views)))
    out["decisions"].append(decision_row(explain(make_policy("least_loaded", calibrate=False), req, views)))
    return out


def compute() -> list[dict[str, Any]]:
    return [run_case(i) for i in range(CASES)]


def _normal(x: Any) -> Any:
    """JSON's view of a value (tuples become lists), for comparing with what it stored."""
    return json.loads(json.dumps(x))


def test_cost_model_matches_the_golden_record() -> None:
    want = json.loads(GOLDEN.read_text())
    assert len(want) == CASES
    got = compute()
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g = _normal(g)
        for part in ("estimates", "bounds", "all", "decisions"):
            assert g[part] == w[part], f"case {i}, {part}"


def test_the_golden_cases_cover_every_term() -> None:
    """The record is worth keeping only if it reaches every branch of the model."""
    seen: set[str] = set()
    for i in range(CASES):
        r = run_case(i)
        for row in r["estimates"] + [e for d in r["decisions"] for e in d[9]]:
            matched, by_tier, pre = row[1], row[3], row[4]
            seen.update(f"matched:{t}" for t in matched)
            seen.update(f"load:{t}" for t in by_tier)
            seen.update(f"prefetch:{t}" for t in pre)
            if row[13] is not None:
                seen.add("peer_source")
            if not row[11]:
                seen.add("ineligible")
            if row[12].startswith("invalid"):
                seen.add("invalid")
            if row[12].startswith("no "):
                seen.add("no_link")
            if row[15] > row[17]:
                seen.add("interference")
            if row[17] > 0.0:
                seen.add("coschedule")
            if row[18] > 0.0:
                seen.add("memory")
            if row[7] > 0.0 and row[7] < row[8]:
                seen.add("overlap")
    want = {f"{k}:{t.name}" for k in ("matched", "load", "prefetch") for t in Tier if t is not Tier.GPU}
    want |= {"matched:GPU", "load:GPU", "peer_source", "ineligible", "invalid", "no_link", "interference",
             "coschedule", "memory", "overlap"}
    assert want <= seen, sorted(want - seen)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/planner/test_planner_cost_golden.py --write")
    GOLDEN.write_text(json.dumps(compute(), separators=(",", ":")) + "\n")
    print(f"wrote {GOLDEN.stat().st_size} bytes")
