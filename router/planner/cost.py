"""The cost model (docs/design.md §5): per worker, the estimated time to first token.

`T_ttft = max(T_queue, T_load(k)) + T_prefill(k) + T_decode` with prefetch (`T_queue +
T_load + T_prefill + T_decode` without), where k is the cut between loading cached
blocks (from the tier each sits in, or pulled from a peer) and recomputing the rest.
Each term is its own module under terms/ (load.py for T_queue); this one composes
them per worker. The derivations: docs/planner.md.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from kvindex.tiers import Tier

from .context import RequestContext
from .load import queue_seconds
from .terms.cut import load_left, loaded_by_tier, scaled_best_cut, usable_blocks
from .terms.decode_ride import decode_ride_seconds, running_decodes
from .terms.kv_load import Segment, local_segments
from .types import Estimate, RouteRequest, WorkerView

__all__ = ["INF", "RequestContext", "estimate_all", "estimate_worker", "ttft_lower_bound"]

INF = math.inf
_PEER = Tier.PEER


def _invalid(w: WorkerView, why: str) -> Estimate:
    return Estimate(worker_id=w.worker_id, recompute_tokens=0, t_queue=INF, t_prefill=INF, t_ttft=INF,
                    eligible=False, note=f"invalid cost params: {why}")


class _Pull(NamedTuple):
    holder: str  # the worker to pull from
    blocks: int  # its match's length
    segs: list[Segment]  # the PEER segments to pull (none: nothing it can add)


def _peer_pull(
    ctx: RequestContext, w: WorkerView, own: int, loadable: bool, usable: int, link_scales: Mapping[Tier, float] | None
) -> _Pull | None:
    """The other worker holding the longest match past `own` blocks, its length, and the
    PEER segments of blocks [own, usable) to pull from it (none unless the worker's own
    segments reach all `own` blocks: `loadable`). None without a usable PEER link."""
    pl = w.cost.links.get(_PEER)
    holder = ctx.peer_for(w.worker_id, own) if pl is not None and pl.read_Bps > 0.0 else None
    if holder is None or pl is None:
        return None
    hid, hblocks = holder
    if not loadable or own >= usable:
        return _Pull(hid, hblocks, [])
    s = link_scales.get(_PEER, 1.0) if link_scales else 1.0
    return _Pull(hid, hblocks, ctx.peer_segments(hid, own, usable, pl, w.cost.block_bytes, s))


def estimate_worker(
    ctx: RequestContext,
    w: WorkerView,
    prefetch: bool = True,
    peer: bool = True,
    exact_queue: bool = False,
    prefill_scale: float = 1.0,
    link_scales: Mapping[Tier, float] | None = None,
) -> Estimate:
    """Every term of the model for one worker (what /admin/route/explain shows).

    `prefetch`/`peer` let a policy that plans no prefetch or peer pull (the baselines)
    price what the worker will really do (a peer pull is a prefetch, so it needs both);
    `prefill_scale` and `link_scales` are the calibrator's time multipliers for this
    worker (1.0 = profile as is). This runs once per worker per request: it works on
    tier runs only and keeps allocations few.
    """
    c = w.cost
    if not (c.prefill_tokens_per_s > 0.0 and c.block_size > 0 and c.block_bytes > 0):
        return _invalid(w, f"prefill_tokens_per_s={c.prefill_tokens_per_s}, block_size={c.block_size}, "
                           f"block_bytes={c.block_bytes}")
    q = queue_seconds(w, c, prefill_scale, exact_queue)
    u = usable_blocks(ctx.prompt_tokens, ctx.n_blocks, c.block_size)
    m = ctx.matches.get(w.worker_id)
    own = m.blocks if m is not None else 0
    matched = {} if m is None else {m.runs[0][0]: own} if len(m.runs) == 1 else m.per_tier()
    segs, reach, note = local_segments(m.runs if m is not None else (), u, c.links, c.block_bytes, link_scales)
    overlap = prefetch and w.supports_prefetch
    pull = _peer_pull(ctx, w, own, not note and reach == own, u, link_scales) \
        if peer and overlap and w.supports_peer_pull and ctx.top else None
    if pull is not None:
        matched[_PEER] = pull.blocks - own
        segs.extend(pull.segs)
    cut = scaled_best_cut(segs, ctx.prompt_tokens, c, q, overlap, prefill_scale)
    by_tier, pre = loaded_by_tier(segs, cut.k, overlap)
    peer_src = pull.holder if pull is not None and pull.segs and _PEER in by_tier else None
    n = ctx.prompt_tokens - cut.k * c.block_size
    ride = decode_ride_seconds(c, n, running_decodes(w))
    return Estimate(worker_id=w.worker_id, matched_blocks=matched, load_blocks_by_tier=by_tier, prefetch_blocks=pre,
                    recompute_tokens=n, t_queue=q, t_load=load_left(cut.t_load, q, overlap), t_load_total=cut.t_load,
                    t_prefill=cut.t_prefill + ride, t_ttft=cut.t_ttft + ride, note=note, peer_source=peer_src)


def ttft_lower_bound(
    ctx: RequestContext,
    w: WorkerView,
    prefetch: bool = True,
    peer: bool = True,
    exact_queue: bool = False,
    prefill_scale: float = 1.0,
) -> float:
    """A cheap bound with `lower <= estimate_worker(...).t_ttft`, for pruning.

    T_ttft >= T_queue + T_prefill(k) for every cut (loads only add), and T_prefill falls
    with k, so the most blocks w could possibly reuse (its own match, or the longest
    peer's when it may pull) give the bound. Infinite for invalid cost params.
    """
    c = w.cost
    B = c.block_size
    speed = c.prefill_tokens_per_s
    if not (speed > 0.0 and B > 0 and c.block_bytes > 0):
        return INF
    N = ctx.prompt_tokens
    u = (N - 1) // B if N > 0 else 0  # usable_blocks(), inlined: this runs for every worker
    if ctx.n_blocks < u:
        u = ctx.n_blocks
    m = ctx.matches.get(w.worker_id)
    k = m.blocks if m is not None else 0
    if peer and prefetch and ctx.top and w.supports_prefetch and w.supports_peer_pull and _PEER in c.links:
        h = ctx.peer_for(w.worker_id, k)
        if h is not None:
            k = h[1]
    if k > u:
        k = u
    cached = k * B
    n = N - cached
    pre = c.prefill_overhead_s + n / speed + c.prefill_attn_s_per_token2 * n * (cached + n * 0.5)
    return queue_seconds(w, c, prefill_scale, exact_queue) + pre * prefill_scale


def estimate_all(
    req: RouteRequest,
    workers: Sequence[WorkerView],
    *,
    prefetch: bool = True,
    peer: bool = True,
    exact_queue: bool = False,
    scales: Callable[[str], tuple[float, Mapping[Tier, float] | None]] | None = None,
) -> list[Estimate]:
    """One Estimate per worker, in `workers` order (explain, for any policy).

    `scales(worker_id)` gives the calibrator's (prefill scale, link scales) when set.
    """
    ctx = RequestContext.build(req, workers)
    out = []
    for w in workers:
        ps, ls = scales(w.worker_id) if scales else (1.0, None)
        out.append(estimate_worker(ctx, w, prefetch, peer, exact_queue, ps, ls))
    return out
