"""Matching a prompt against a worker with KV-cache groups (hybrid models).

The index's usual query answers for group 0 (the holder bitmaps); for a worker with
groups it is combined with the other groups' blocks by the engine's hybrid rule
(`kvindex.groups.hybrid_blocks`, docs/kv-groups.md), and the query counts where the
groups cut what group 0 alone holds or disagree among themselves.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .groups import hybrid_blocks
from .tiers import Tier

if TYPE_CHECKING:
    from .slots import WorkerSlot

Runs = tuple[tuple[Tier, int], ...]
_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE)


def hybrid_match(
    w: WorkerSlot,
    digests: list[int],
    bitmap: Callable[[int], int],
    block_size: int,
    group0: tuple[int, Runs] | None,
) -> tuple[int, Runs] | None:
    """(blocks, tier runs) the engine would serve `w` from `digests`, or None for none.

    `bitmap(d)`: a digest's holder bitmap (0 when absent); `group0`: group 0's own leading match (blocks,
    runs), if any. A worker with a group whose kind the rule does not cover gets None.
    Tiers are group 0's; where group 0 does not hold a block (it lies before a window
    of group 0 that does not need it), the fastest tier another group holds it in.
    """
    gs = w.groups
    assert gs is not None
    order = gs.order(w.block_size, block_size)
    if order is None:
        return None
    mask0 = w.held_mask()
    held = gs.held

    def holds(g: int, i: int) -> bool:
        if g:
            return digests[i] in held[g]
        return bool(bitmap(digests[i]) & mask0)

    g0 = group0[0] if group0 is not None else 0

    def leading(g: int, limit: int) -> int:
        if not g:
            return min(g0, limit)
        h = held[g]
        return next((i for i in range(limit) if digests[i] not in h), limit)

    def span_held(g: int, k: int, lo: int, hi: int) -> bool:
        last = digests[lo * k + k - 1 : hi * k : k]  # each engine block's last index block
        if g:
            return all(map(held[g].__contains__, last))
        return all([bitmap(d) & mask0 for d in last])

    n, runs = hybrid_blocks(order, holds, len(digests), block_size, leading, span_held)
    if len(set(runs)) > 1:
        gs.disagreements += 1
    if n < g0:
        gs.cuts += 1
        gs.cut_blocks += g0 - n
    if not n:
        return None
    if group0 is not None and g0 >= n:
        return n, _truncate(group0[1], n)
    return n, _runs([_tier_at(w, gs.held, digests[i], bitmap(digests[i])) for i in range(n)])


def _tier_at(w: WorkerSlot, held: dict[int, dict[int, int]], d: int, r: int) -> Tier:
    bits = r >> (4 * w.slot) & 7 | (r >> (4 * w.gslot + 3) & 1) << 3
    if not bits:
        for h in held.values():
            bits |= h.get(d, 0)
    if not bits:
        return Tier.GPU  # only a window's unneeded block: never loaded
    return _TIERS[(bits & -bits).bit_length() - 1]


def _truncate(runs: Runs, n: int) -> Runs:
    out = []
    left = n
    for t, c in runs:
        if left <= 0:
            break
        out.append((t, min(c, left)))
        left -= c
    return tuple(out)


def _runs(tiers: list[Tier]) -> Runs:
    out: list[tuple[Tier, int]] = []
    for t in tiers:
        if out and out[-1][0] is t:
            out[-1] = (t, out[-1][1] + 1)
        else:
            out.append((t, 1))
    return tuple(out)


def group_specs(w: WorkerSlot) -> dict[str, str]:
    """A worker's KV-cache groups: group -> "kind/block size[/window=W]" (empty without groups)."""
    gs = w.groups
    return {} if gs is None else {str(g): s.describe() for g, s in sorted(gs.all_specs(w.block_size).items())}


def group_counters(w: WorkerSlot) -> dict[str, int]:
    """The hybrid rule's counters of a worker's `WorkerIndexStats` (none without groups)."""
    gs = w.groups
    if gs is None:
        return {}
    return {"group_cuts": gs.cuts, "group_cut_blocks": gs.cut_blocks, "group_disagreements": gs.disagreements}
