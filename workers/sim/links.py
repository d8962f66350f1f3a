"""Serialised transfer links into GPU memory (one per tier below GPU, plus PEER).

A link is one physical path (a PCIe direction, a disk, a NIC): transfers on it run one
after another, each costing `latency_s + bytes / read_Bps`, so two requests loading
over the same link really wait for each other. Demand loads (a scheduled request is
waiting for them) go before queued prefetches; a transfer already moving is never
interrupted. A prefetch whose deadline has passed when its turn comes is dropped
without using the link.

Passive like the engine: the engine asks `end` for the next completion time and calls
`complete(t)` at exactly that time.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvindex.tiers import Tier


@dataclass(slots=True, eq=False)
class Transfer:
    """Blocks moving from `tier` into GPU memory for one owner (a request or a prefetch)."""

    tier: Tier
    keys: list[bytes]
    nbytes: int
    owner: Any
    demand: bool
    deadline: float = math.inf
    start: float = math.nan
    end: float = math.nan
    cancelled: bool = False
    # Requests that found these blocks in flight and wait for them: (request, keys).
    waiters: list[tuple[Any, list[bytes]]] = field(default_factory=list)


class Link:
    """One serialised link; see the module doc."""

    __slots__ = ("tier", "read_Bps", "latency_s", "busy", "_demand", "_background", "bytes_moved", "busy_s", "dropped")

    def __init__(self, tier: Tier, read_Bps: float, latency_s: float) -> None:
        if read_Bps <= 0:
            raise ValueError(f"{tier.name} link: read_Bps must be positive")
        self.tier = tier
        self.read_Bps = read_Bps
        self.latency_s = latency_s
        self.busy: Transfer | None = None
        self._demand: deque[Transfer] = deque()
        self._background: deque[Transfer] = deque()
        self.bytes_moved = 0
        self.busy_s = 0.0
        self.dropped = 0

    def cost_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.read_Bps

    @property
    def end(self) -> float:
        """When the transfer now moving completes (inf when idle)."""
        return self.busy.end if self.busy is not None else math.inf

    def queued(self) -> int:
        return len(self._demand) + len(self._background)

    def enqueue(self, t: Transfer, now: float) -> list[Transfer]:
        """Queue a transfer; starts it at once if the link is idle. Returns dropped prefetches."""
        (self._demand if t.demand else self._background).append(t)
        if self.busy is None:
            return self._start_next(now)
        return []

    def complete(self, now: float) -> tuple[Transfer, list[Transfer]]:
        """Finish the moving transfer (at its `end`), start the next; returns (done, dropped)."""
        done = self.busy
        assert done is not None, "complete() on an idle link"
        self.busy = None
        self.bytes_moved += done.nbytes
        self.busy_s += done.end - done.start
        return done, self._start_next(now)

    def _start_next(self, now: float) -> list[Transfer]:
        dropped: list[Transfer] = []
        while self._demand or self._background:
            t = self._demand.popleft() if self._demand else self._background.popleft()
            if t.cancelled:
                continue
            if now > t.deadline:
                self.dropped += 1
                dropped.append(t)
                continue
            t.start = now
            t.end = now + self.cost_s(t.nbytes)
            self.busy = t
            break
        return dropped

    def wait_s(self, now: float) -> float:
        """How long a new demand transfer would wait before it starts."""
        w = max(0.0, self.end - now) if self.busy is not None else 0.0
        for t in self._demand:
            if not t.cancelled:
                w += self.cost_s(t.nbytes)
        return w

    def drop_owner(self, owner: Any) -> int:
        """Cancel the queued (not yet moving) transfers of one owner; returns how many."""
        n = 0
        for q in (self._demand, self._background):
            for t in q:
                if t.owner is owner and not t.cancelled:
                    t.cancelled = True
                    n += 1
        return n
