"""T_load: loading a worker's own cached blocks into GPU memory, tier by tier.

A block counts in the fastest tier the worker holds it in; GPU blocks cost nothing,
a block below costs `block_bytes / bandwidth` of its tier's link, and each tier's
latency is paid once, with its first block. The blocks are kept as segments (one per
tier run), so the cut works per run, never per block. A tier with no usable link
cannot be loaded: the match stops there and the rest is recomputed.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvindex.tiers import Tier

from ..types import Link

# (tier, blocks, seconds per block, latency, latency key): the latency is paid when the
# first segment with that key (0..63) is loaded; local tiers use int(tier) as key.
Segment = tuple[Tier, int, float, float, int]
KEY = {t: int(t) for t in Tier}
_GPU = Tier.GPU


def load_seconds(link: Link, blocks: int, block_bytes: int, scale: float = 1.0) -> float:
    """Loading `blocks` over one link: one latency plus bytes over bandwidth."""
    if blocks <= 0:
        return 0.0
    return (link.latency_s + blocks * block_bytes / link.read_Bps) * scale


def local_segments(
    runs: Sequence[tuple[Tier, int]],
    usable: int,
    links: Mapping[Tier, Link],
    block_bytes: int,
    link_scales: Mapping[Tier, float] | None,
) -> tuple[list[Segment], int, str]:
    """The segments of a worker's own tier runs (`PrefixMatch.runs`) up to `usable` blocks,
    the blocks they cover, and a note ("" unless a tier without a link stopped them).
    `link_scales`: the calibrator's time multiplier per tier (None: 1.0)."""
    segs: list[Segment] = []
    note = ""
    reach = 0
    for tier, count in runs:
        if reach >= usable:
            break
        take = count if reach + count <= usable else usable - reach
        if tier is _GPU:
            segs.append((tier, take, 0.0, 0.0, 0))
        else:
            link = links.get(tier)
            if link is None or link.read_Bps <= 0.0:
                note = f"no {tier.name} link: blocks from {reach} on are recomputed"
                break
            s = link_scales.get(tier, 1.0) if link_scales else 1.0
            segs.append((tier, take, block_bytes / link.read_Bps * s, link.latency_s * s, KEY[tier]))
        reach += take
    return segs, reach, note
