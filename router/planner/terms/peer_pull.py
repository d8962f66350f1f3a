"""The PEER tier: blocks beyond a worker's own match that another worker holds.

A worker that can pull from peers (it prefetches, and has a PEER link) may load the
longest match among the others past its own, over the PEER link; each block then
costs the bottleneck of that link and the holder's read link of the tier the holder
keeps it in. The PEER link's latency is paid once, each holder tier's latency once.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvindex.tiers import Tier

from ..types import Link
from .kv_load import KEY, Segment

# PEER blocks read from the holder's tier t use latency key PEER_KEY0 + t
PEER_KEY0 = 8
_GPU = Tier.GPU
_PEER = Tier.PEER


def peer_segments(
    runs: Sequence[tuple[Tier, int]],
    holder_links: Mapping[Tier, Link],
    start: int,
    end: int,
    link: Link,
    block_bytes: int,
    scale: float,
) -> list[Segment]:
    """Blocks [start, end) of the holder's tier `runs` pulled over the PEER `link`: PEER
    segments priced at the bottleneck of that link and the holder's read link of each of
    its tiers; they stop at a holder tier it cannot read (no link)."""
    out: list[Segment] = []
    pos = 0
    lat0 = link.latency_s  # the PEER link's latency, on the first PEER segment
    for tier, count in runs:
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
            hl = holder_links.get(tier)
            if hl is None or hl.read_Bps <= 0.0:
                break
            if hl.read_Bps < bw:
                bw = hl.read_Bps
            lat += hl.latency_s
        out.append((_PEER, hi - lo, block_bytes / bw * scale, lat * scale, PEER_KEY0 + KEY[tier]))
    return out
