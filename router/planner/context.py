"""What every worker's estimate for one request shares, computed once per decision.

The request's size and index matches, the candidate views, the two longest matches
(where a peer pull would come from) and the PEER segments already priced: most
workers that may pull share one holder, range and link.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvindex.index import PrefixMatch

from .terms.kv_load import Segment
from .terms.peer_pull import peer_segments
from .types import Link, RouteRequest, WorkerView


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
        if segs is None:
            h = self.matches[holder].runs
            segs = self._peer_memo[key] = peer_segments(h, self.views[holder].cost.links, start, end, link,
                                                        block_bytes, scale)
        return segs
