"""The cut: load blocks 1..k from cache, recompute the rest, with the k that minimises T_ttft.

Loading block j instead of recomputing it saves more the later j sits (attention),
while loading costs the same per block of one run, so within a run the T_ttft step is
monotone and only run ends (and, with prefetch, the two blocks around the point where
the load overtakes the queue) need evaluating: `best_cut` is exact without per-block
work. With prefetch the load overlaps the queue: T_ttft = max(T_queue, T_load) +
T_prefill, else T_queue + T_load + T_prefill (docs/planner.md, "The cost model").
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvindex.tiers import Tier

from ..types import CostParams
from .kv_load import Segment

_GPU = Tier.GPU


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


def scaled_best_cut(
    segs: Sequence[Segment], prompt_tokens: int, cost: CostParams, queue_s: float, overlap: bool, scale: float
) -> Cut:
    """`best_cut` with the worker's speeds, its prefill times multiplied by the calibrator's `scale`."""
    c = cost
    if scale == 1.0:
        return best_cut(segs, prompt_tokens, c.block_size, c.prefill_tokens_per_s, c.prefill_attn_s_per_token2,
                        c.prefill_overhead_s, queue_s, overlap)
    return best_cut(segs, prompt_tokens, c.block_size, c.prefill_tokens_per_s / scale,
                    c.prefill_attn_s_per_token2 * scale, c.prefill_overhead_s * scale, queue_s, overlap)


def loaded_by_tier(segs: Sequence[Segment], k: int, overlap: bool) -> tuple[dict[Tier, int], dict[Tier, int]]:
    """Blocks 1..k per tier, and of those what is raised toward GPU while the request
    queues (everything below GPU when the load overlaps the queue, else nothing)."""
    if not k:
        return {}, {}
    if len(segs) == 1:
        t0 = segs[0][0]
        return {t0: k}, ({t0: k} if overlap and t0 is not _GPU else {})
    by_tier = split_by_tier(segs, k)
    return by_tier, ({t: n for t, n in by_tier.items() if t is not _GPU} if overlap else {})


def load_left(t_load: float, queue_s: float, overlap: bool) -> float:
    """The load time left on the critical path: with prefetch, what outlasts the queue."""
    if overlap:
        return t_load - queue_s if t_load > queue_s else 0.0
    return t_load
