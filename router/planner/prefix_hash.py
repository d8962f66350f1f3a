"""`prefix_hash`: consistent hashing of the prompt's prefix, with bounded loads.

The key is the chained block digest of block `min(prefix_blocks, n) - 1`: since keys
chain, it names the whole prefix up to there, so requests sharing that prefix map to
the same point of a ring of `vnodes` points per worker. Bounded loads (Mirrokni,
Thorup, Zadimoghaddam 2018): a worker takes the request only while its outstanding
requests stay under `ceil((1 + balance_eps) * (total + 1) / n)`; otherwise the walk
moves on clockwise, so a hot prefix spills to the same next workers every time
(their caches warm up too) instead of overloading one.
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

from .base import PolicyBase, check_int, check_number
from .load import outstanding_requests
from .types import Decision, RouteRequest, WorkerView

_M64 = (1 << 64) - 1


def _point(label: str) -> int:
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little")


def _mix(x: int) -> int:
    """splitmix64's finaliser: spreads any 64-bit key evenly over the ring (digests from
    SHA-256 already are, engine-provided ints need not be)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class PrefixHashPolicy(PolicyBase):
    name = "prefix_hash"

    def __init__(
        self, *, prefix_blocks: int = 8, vnodes: int = 64, balance_eps: float = 0.25, calibrate: bool = True
    ) -> None:
        super().__init__(calibrate=calibrate)
        self.prefix_blocks = check_int("prefix_blocks", prefix_blocks, lo=1, hi=1 << 20)
        self.vnodes = check_int("vnodes", vnodes, lo=1, hi=4096)
        self.balance_eps = check_number("balance_eps", balance_eps, lo=0.0, lo_open=True)
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, ids: tuple[str, ...]) -> None:
        if ids == self._ring_for:
            return
        pts = sorted((_point(f"{wid}#{i}"), wid) for wid in set(ids) for i in range(self.vnodes))
        self._points = [p for p, _ in pts]
        self._owners = [o for _, o in pts]
        self._ring_for = ids

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        ok = self._split_capped(workers)
        if not ok:
            return self._shed_capped(workers)
        loads = {w.worker_id: outstanding_requests(w) for w in ok}
        by_id = {w.worker_id: w for w in ok}
        if not req.digests:
            order = sorted(ok, key=lambda w: loads[w.worker_id])
            return self._decide(req, order[0], [w.worker_id for w in order], "short_prompt")
        self._ring(tuple(w.worker_id for w in workers))
        cap = math.ceil((1.0 + self.balance_eps) * (sum(loads.values()) + 1) / len(ok))
        key = _mix(req.digests[min(self.prefix_blocks, len(req.digests)) - 1])
        pts, owners = self._points, self._owners
        n = len(pts)
        i = bisect.bisect_left(pts, key)
        seen: set[str] = set()
        ranked: list[str] = []
        first = ""
        for j in range(n):
            wid = owners[(i + j) % n]
            if wid in seen:
                continue
            seen.add(wid)
            if wid not in loads:
                continue  # capped
            if not first:
                first = wid
            if loads[wid] < cap:
                ranked.append(wid)
                if len(ranked) == 2:
                    break
        if not ranked:  # unreachable: the least loaded worker is always under the cap
            ranked = [first]
        reason = "hash" if ranked[0] == first else "hash_overflow"
        return self._decide(req, by_id[ranked[0]], ranked, reason)
