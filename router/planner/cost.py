"""The cost model (docs/design.md §5): per worker, the estimated time to first token.

`T_ttft = max(T_queue, T_load(k)) + T_prefill(k)` with prefetch (`T_queue + T_load +
T_prefill` without), where k is the cut between loading cached blocks (from the tier
each sits in, or pulled from a peer) and recomputing the rest; `best_cut` evaluates
only run ends and the prefetch kink, which is exact because the step is monotone
within a run. `interference_delays` prices the delay a new prefill imposes on
requests still loading their KV on that worker, `coschedule_delay` the delay its first
chunk imposes on requests waiting for the step it would share. The derivations:
docs/planner.md.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvindex.index import PrefixMatch
from kvindex.tiers import Tier

from .load import queue_seconds
from .types import CostParams, Estimate, Link, RouteRequest, WorkerView

INF = math.inf
# (tier, blocks, seconds per block, latency, latency key): the latency is paid when the
# first segment with that key (0..63) is loaded; local tiers use int(tier) as key.
Segment = tuple[Tier, int, float, float, int]
_PEER_KEY0 = 8  # PEER blocks read from the holder's tier t use key _PEER_KEY0 + t
_GPU = Tier.GPU
_PEER = Tier.PEER
_KEY = {t: int(t) for t in Tier}


def prefill_seconds(cost: CostParams, new_tokens: int, cached_tokens: int, scale: float = 1.0) -> float:
    """The wire formula (docs/wire.md /load speeds): prefill `new_tokens` after `cached_tokens`."""
    n = new_tokens
    t = cost.prefill_overhead_s + n / cost.prefill_tokens_per_s
    t += cost.prefill_attn_s_per_token2 * n * (cached_tokens + n * 0.5)
    return t * scale


def decode_ride_seconds(cost: CostParams, prefill_tokens: int, decodes: int) -> float:
    """Decode time the steps of a prefill carry: each step of a chunked prefill also runs
    the worker's `decodes` sequences (one token each, from the same token budget), so a
    prefill spanning `s` steps on a busy worker takes `s` decode steps longer than on an
    idle one. `decode_step_s` is the step time the worker last reported for its batch."""
    if decodes <= 0 or prefill_tokens <= 0:
        return 0.0
    measured = cost.ride_per_running_s * decodes  # a SpeedFit's own measure (speedfit.py)
    if cost.decode_step_s <= 0.0:
        return measured
    # A report with more decodes than the budget (not a sane engine) leaves an eighth of it.
    per_step = max(cost.max_batched_tokens - decodes, cost.max_batched_tokens // 8, 1)
    return -(-prefill_tokens // per_step) * cost.decode_step_s + measured


def running_decodes(w: WorkerView) -> int:
    """The worker's running requests as of its report, bounded by the router's own
    in-flight count there once its ledger is in use: a report taken while a request ran
    must not price decode steps after it ended. (With gateway replicas, or clients that
    reach the worker directly, this undercounts: the ride is then priced low, as before
    the term existed.)"""
    n = w.running_requests
    if w.inflight_since_report_requests is not None and w.inflight_requests < n:
        return w.inflight_requests
    return n


def memory_seconds(ctx: RequestContext, w: WorkerView, gpu_held: int, bound: float = 1.0) -> float:
    """GPU memory this request would take on `w` beyond what it has, in decode time.

    Committed: the KV of the router's requests in flight there (prompt + output tokens;
    the report's used blocks when the router has no count). New: this request's prompt and
    output blocks less the `gpu_held` leading blocks it would share. The part of the new
    blocks that pushes the committed ones past `bound` x the GPU's capacity C has to wait
    for running requests to finish; they free about C blocks per decode lifetime
    (max_tokens x decode step), so that excess costs excess / C lifetimes. Zero while it
    fits, and for a worker whose GPU block size is unknown (`gpu_block_tokens` 0: vLLM)
    or that has no decode speed (docs/planner.md, "Saturation"). Counted in tokens: the
    worker's blocks may be larger than the index's. Output is counted at `max_tokens`, the
    client's budget, which over-declaring clients make larger than what they use."""
    gbt = w.gpu_block_tokens
    c = w.cost
    cap = w.gpu_capacity_blocks * gbt * bound  # in tokens from here on
    if cap <= 0.0 or c.decode_step_s <= 0.0:
        return 0.0
    if w.active_kv_tokens is not None:
        used = float(w.active_kv_tokens)
    else:
        used = float((w.gpu_capacity_blocks - w.gpu_free_blocks) * gbt)
    new = ctx.prompt_tokens + ctx.max_tokens - gpu_held * c.block_size
    if new <= 0 or used + new <= cap:
        return 0.0
    excess = new if used > cap else used + new - cap  # only what this request adds past capacity
    return excess / cap * max(ctx.max_tokens, 1) * c.decode_step_s


def interference_delays(
    loads: Sequence[tuple[float, float]],
    queue_s: float,
    own_load_s: float,
    prefill_s: float,
    overlap: bool,
    slack_s: float = 0.0,
) -> list[float]:
    """Delay a new request imposes on each request still loading on a worker (the module doc).

    `loads`: `(ready_s, prefill_s)` of each (WorkerView.inflight_loads); `queue_s`,
    `own_load_s` (total, no overlap) and `prefill_s`: the new request's terms. Its queue
    counts those requests' own prefill work, which it does not really wait for (they are
    not prefilling yet), so that work is taken off to find when it starts prefilling.
    `slack_s`: a load counts as not landed until `ready_s + slack_s` (predicted landings
    are uncertain, and one a millisecond late costs the whole new prefill).
    """
    q = queue_s
    for _, p in loads:
        q -= p
    if q < 0.0:
        q = 0.0
    if overlap:
        start = own_load_s if own_load_s > q else q
    else:
        start = q + own_load_s
    end = start + prefill_s
    return [(end - ready if ready > start else prefill_s) if start < ready + slack_s and ready < end else 0.0
            for ready, _ in loads]


COSCHEDULE_SLACK_S = 0.02  # how late a newcomer may start and still ride in their step (a prediction)


def may_coschedule(e: Estimate, overlap: bool) -> bool:
    """Could this estimate's request ride in the step of requests waiting there? An
    eligible one that loads no KV first, or whose load is predicted to land while it
    queues (`overlap`: the worker prefetches, and `t_load`, the load left on the critical
    path, is zero). The engine passes over a request only while its KV is still arriving;
    a short prefetched load lands before the step boundary it waits for."""
    return e.eligible and (e.t_load_total <= 0.0 or (overlap and e.t_load <= 0.0))


def coschedule_load_s(e: Estimate, overlap: bool) -> float:
    """When a request that may ride (`may_coschedule`) has its KV: with prefetch, its
    whole load counts from dispatch."""
    return e.t_load_total if overlap else 0.0


def coschedule_delay(
    starts: Sequence[tuple[float, int]],
    cost: CostParams,
    queue_s: float,
    recompute_tokens: int,
    cached_tokens: int,
    decodes: int,
    slack_s: float = 0.0,
    scale: float = 1.0,
    load_s: float = 0.0,
) -> float:
    """Delay a new request imposes on EACH of the requests waiting, on the same worker, for
    the step it would start in (the module doc, "co-scheduling").

    `starts`: `(start_s, prefill_tokens)` of each (WorkerView.inflight_starts). The engine
    admits in order while the step's token budget (`max_batched_tokens` less one token
    per running decode) lasts, and a step ends when all its chunks are computed: when
    those requests leave budget over in the step where their work ends (`step_spare`),
    the newcomer's first chunk rides in that step and each of them gets its first token
    that chunk later. That happens when the newcomer starts no later than they do (plus
    `slack_s`: the start is a prediction). Its `queue_s` counts their prefill work, which
    it does not wait for when it rides along, so that is taken off first (as for loads);
    `load_s`: it cannot start before its prefetched KV lands (`coschedule_load_s`).
    """
    if not starts or recompute_tokens <= 0:
        return 0.0
    latest = -INF
    q = queue_s
    for start, tokens in starts:
        q -= prefill_seconds(cost, tokens, 0, scale)
        if start > latest:
            latest = start
    # Its KV must be on GPU when their step starts: at `latest` if they still queue, else at
    # the end of the step in progress (half a decode step away, on average).
    if load_s > max(latest, 0.0) + 0.5 * cost.decode_step_s:
        return 0.0
    spare = step_spare(starts, cost.max_batched_tokens - decodes)
    if spare <= 0 or q > latest + slack_s:
        return 0.0
    n = recompute_tokens if recompute_tokens < spare else spare
    return prefill_seconds(cost, n, cached_tokens, scale)


def step_spare(starts: Sequence[tuple[float, int]], budget: int) -> int:
    """The budget left in the step where the work of `starts` ends, `budget` tokens a step.
    One request longer than a step ends in a later step, with what its last chunk leaves
    (none when it fills it exactly). Several must fit in one step: where the steps fall
    among several depends on which of them have started, itself a prediction, and
    counting across it misplaced the boundary on a trace of many short prompts."""
    if budget <= 0:
        return 0
    total = sum(tokens for _, tokens in starts)
    if len(starts) == 1 and total > budget:
        return (budget - total % budget) % budget
    return budget - total


def coschedule_seconds(
    starts: Sequence[tuple[float, int]],
    cost: CostParams,
    queue_s: float,
    recompute_tokens: int,
    cached_tokens: int,
    decodes: int,
    slack_s: float = 0.0,
    scale: float = 1.0,
    load_s: float = 0.0,
) -> float:
    """The total of `coschedule_delay` over the requests it delays."""
    d = coschedule_delay(starts, cost, queue_s, recompute_tokens, cached_tokens, decodes, slack_s, scale, load_s)
    return len(starts) * d if d > 0.0 else 0.0


def load_seconds(link: Link, blocks: int, block_bytes: int, scale: float = 1.0) -> float:
    """Loading `blocks` over one link: one latency plus bytes over bandwidth."""
    if blocks <= 0:
        return 0.0
    return (link.latency_s + blocks * block_bytes / link.read_Bps) * scale


def usable_blocks(prompt_tokens: int, n_blocks: int, block_size: int) -> int:
    """Leading blocks that may come from cache (at least one prompt token is computed)."""
    if prompt_tokens <= 0 or block_size <= 0:
        return 0
    u = (prompt_tokens - 1) // block_size
    return n_blocks if n_blocks < u else u


@dataclass(slots=True)
class Cut:
    """The chosen split: load blocks 1..k, recompute the rest."""

    k: int
    t_load: float  # total load time of blocks 1..k (no overlap)
    t_prefill: float
    t_ttft: float  # including the queue, with prefetch overlap when it applies


def ttft_at(
    segs: Sequence[Segment],
    k: int,
    prompt_tokens: int,
    block_size: int,
    speed: float,
    attn: float,
    overhead: float,
    queue_s: float,
    overlap: bool,
) -> Cut:
    """T_ttft for one given cut k, by walking the segments (reference for tests, explain)."""
    load = 0.0
    paid = 0
    left = k
    for _tier, count, block_s, lat, key in segs:
        if left <= 0:
            break
        take = count if count < left else left
        bit = 1 << key
        if not paid & bit:
            paid |= bit
            load += lat
        load += take * block_s
        left -= take
    if left > 0:
        raise ValueError(f"cut {k} is beyond the {k - left} loadable blocks")
    c = k * block_size
    n = prompt_tokens - c
    pre = overhead + n / speed + attn * n * (c + n * 0.5)
    if overlap:
        return Cut(k, load, pre, (load if load > queue_s else queue_s) + pre)
    return Cut(k, load, pre, queue_s + load + pre)


def best_cut(
    segs: Sequence[Segment],
    prompt_tokens: int,
    block_size: int,
    speed: float,
    attn: float,
    overhead: float,
    queue_s: float,
    overlap: bool,
) -> Cut:
    """The cut minimising T_ttft, from run boundaries only (see the module doc)."""
    N = prompt_tokens
    B = block_size
    inv = 1.0 / speed
    half = 0.5 * attn
    NN = N * N
    Q = queue_s
    best_k = 0
    best_load = 0.0
    best_pre = overhead + N * inv + half * NN
    best_f = Q + best_pre
    k0 = 0
    L0 = 0.0
    paid = 0
    for _tier, count, bs, lat, key in segs:
        if count <= 0:
            continue
        bit = 1 << key
        lam = 0.0 if paid & bit else lat
        paid |= bit
        e = k0 + count
        base = L0 + lam - bs * k0  # L(k) = base + bs * k for k in (k0, e]
        Le = base + bs * e
        if overlap and L0 < Q < Le:
            # T_load crosses T_queue inside this run: c = first k with L(k) >= Q
            x = (Q - base) / bs if bs > 0.0 else 0.0
            c = k0 + 1 if x <= k0 + 1 else e if x >= e else math.ceil(x)
            cands: tuple[int, ...] = (c - 1, c, e) if c - 1 > k0 else (c, e)
        else:
            cands = (e,)
        for k in cands:
            L = base + bs * k
            c = k * B
            pre = overhead + (N - c) * inv + half * (NN - c * c)
            if overlap:
                f = (L if L > Q else Q) + pre
            else:
                f = Q + L + pre
            if f < best_f or (f == best_f and k > best_k):
                best_f = f
                best_k = k
                best_load = L
                best_pre = pre
        k0 = e
        L0 = Le
    return Cut(best_k, best_load, best_pre, best_f)


def split_by_tier(segs: Sequence[Segment], k: int) -> dict[Tier, int]:
    """How many of blocks 1..k each tier supplies."""
    out: dict[Tier, int] = {}
    left = k
    for tier, count, _, _, _ in segs:
        if left <= 0:
            break
        take = count if count < left else left
        out[tier] = out.get(tier, 0) + take
        left -= take
    return out


@dataclass(slots=True)
class RequestContext:
    """Per-request facts every worker's estimate shares (computed once per decision)."""

    prompt_tokens: int
    n_blocks: int
    matches: Mapping[str, PrefixMatch]
    views: dict[str, WorkerView]
    # The two longest matches among the candidate workers: (blocks, worker_id).
    top: list[tuple[int, str]]
    max_tokens: int = 0  # the request's output budget (its KV grows by that much)
    # PEER segments already priced in this decision, by (holder, start, end, link, scale).
    _peer_memo: dict[tuple[str, int, int, float, float, int, float], list[Segment]] = field(default_factory=dict)

    @classmethod
    def build(cls, req: RouteRequest, workers: Sequence[WorkerView]) -> RequestContext:
        views = {w.worker_id: w for w in workers}
        a: tuple[int, str] = (0, "")
        b: tuple[int, str] = (0, "")
        for wid, m in req.matches.items():
            if m.blocks > b[0] and wid in views:
                if m.blocks > a[0]:
                    a, b = (m.blocks, wid), a
                else:
                    b = (m.blocks, wid)
        top = [t for t in (a, b) if t[0] > 0]
        return cls(req.prompt_tokens, len(req.digests), req.matches, views, top, req.max_tokens)

    def peer_for(self, worker_id: str, own_blocks: int) -> tuple[str, int] | None:
        """The other worker holding the longest match, if longer than `own_blocks`."""
        for blocks, wid in self.top:
            if wid != worker_id:
                return (wid, blocks) if blocks > own_blocks else None
        return None

    def peer_segments(
        self, holder: str, start: int, end: int, link: Link, block_bytes: int, scale: float
    ) -> list[Segment]:
        """Blocks [start, end) pulled from `holder` over `link`: PEER segments priced at the
        bottleneck of the PEER link and the holder's read link of each of its tiers.
        Memoised per decision: most pullers share the same holder, range and link."""
        key = (holder, start, end, link.read_Bps, link.latency_s, block_bytes, scale)
        segs = self._peer_memo.get(key)
        if segs is not None:
            return segs
        out: list[Segment] = []
        hlinks = self.views[holder].cost.links
        pos = 0
        lat0 = link.latency_s  # the PEER link's latency, on the first PEER segment
        for tier, count in self.matches[holder].runs:
            lo, hi = pos, pos + count
            pos = hi
            if hi <= start:
                continue
            lo = lo if lo > start else start
            hi = hi if hi < end else end
            if hi <= lo:
                break
            bw = link.read_Bps
            lat = lat0
            lat0 = 0.0
            if tier is not _GPU:
                hl = hlinks.get(tier)
                if hl is None or hl.read_Bps <= 0.0:
                    break
                if hl.read_Bps < bw:
                    bw = hl.read_Bps
                lat += hl.latency_s
            out.append((_PEER, hi - lo, block_bytes / bw * scale, lat * scale, _PEER_KEY0 + _KEY[tier]))
        self._peer_memo[key] = out
        return out


def _invalid(w: WorkerView, why: str) -> Estimate:
    return Estimate(worker_id=w.worker_id, recompute_tokens=0, t_queue=INF, t_prefill=INF, t_ttft=INF,
                    eligible=False, note=f"invalid cost params: {why}")


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
    B = c.block_size
    speed = c.prefill_tokens_per_s
    bb = c.block_bytes
    if not (speed > 0.0 and B > 0 and bb > 0):
        return _invalid(w, f"prefill_tokens_per_s={speed}, block_size={B}, block_bytes={bb}")
    N = ctx.prompt_tokens
    q = queue_seconds(w, c, prefill_scale, exact_queue)
    u = usable_blocks(N, ctx.n_blocks, B)
    links = c.links
    segs: list[Segment] = []
    note = ""
    wid = w.worker_id
    m = ctx.matches.get(wid)
    own = 0
    reach = 0  # blocks the segments cover
    stopped = False
    if m is not None:
        own = m.blocks
        runs = m.runs
        matched = {runs[0][0]: own} if len(runs) == 1 else m.per_tier()
        for tier, count in runs:
            if reach >= u:
                break
            take = count if reach + count <= u else u - reach
            if tier is _GPU:
                segs.append((tier, take, 0.0, 0.0, 0))
            else:
                link = links.get(tier)
                if link is None or link.read_Bps <= 0.0:
                    stopped = True
                    note = f"no {tier.name} link: blocks from {reach} on are recomputed"
                    break
                s = link_scales.get(tier, 1.0) if link_scales else 1.0
                segs.append((tier, take, bb / link.read_Bps * s, link.latency_s * s, _KEY[tier]))
            reach += take
    else:
        matched = {}
    peer_src: str | None = None
    overlap = prefetch and w.supports_prefetch
    if peer and overlap and w.supports_peer_pull and ctx.top:
        pl = links.get(_PEER)
        holder = ctx.peer_for(wid, own) if pl is not None and pl.read_Bps > 0.0 else None
        if holder is not None and pl is not None:
            hid, hblocks = holder
            matched[_PEER] = hblocks - own
            if not stopped and reach == own and reach < u:
                s = link_scales.get(_PEER, 1.0) if link_scales else 1.0
                ext = ctx.peer_segments(hid, own, u, pl, bb, s)
                if ext:
                    segs.extend(ext)
                    peer_src = hid
    ps = prefill_scale
    if ps == 1.0:
        cut = best_cut(segs, N, B, speed, c.prefill_attn_s_per_token2, c.prefill_overhead_s, q, overlap)
    else:
        cut = best_cut(segs, N, B, speed / ps, c.prefill_attn_s_per_token2 * ps, c.prefill_overhead_s * ps, q, overlap)
    k = cut.k
    pre: dict[Tier, int]
    if not k:
        by_tier = {}
        pre = {}
    elif len(segs) == 1:
        t0 = segs[0][0]
        by_tier = {t0: k}
        pre = {t0: k} if overlap and t0 is not _GPU else {}
    else:
        by_tier = split_by_tier(segs, k)
        pre = {t: n for t, n in by_tier.items() if t is not _GPU} if overlap else {}
    if peer_src is not None and _PEER not in by_tier:
        peer_src = None
    t_load = cut.t_load
    if overlap:
        crit = t_load - q if t_load > q else 0.0
    else:
        crit = t_load
    n = N - k * B
    ride = decode_ride_seconds(c, n, running_decodes(w))
    return Estimate(worker_id=wid, matched_blocks=matched, load_blocks_by_tier=by_tier, prefetch_blocks=pre,
                    recompute_tokens=n, t_queue=q, t_load=crit, t_load_total=t_load, t_prefill=cut.t_prefill + ride,
                    t_ttft=cut.t_ttft + ride, note=note, peer_source=peer_src)


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
