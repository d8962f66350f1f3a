"""The gateway's own queue: late binding and ordering (docs/planner.md, "Scheduling").

Routing on arrival binds a request to a worker at once; the worker then serves its queue
first come, first served, so a short prompt that lands behind a long one waits for the
whole long prefill. Holding requests at the gateway instead lets it
  * order them: the fewest predicted tokens to compute first (`order="spf"`), or in
    arrival order (`"fifo"`), per tenant fair (the tenant that got the least prefill
    work served so far goes first);
  * bind late (`hold_target_s`): while every worker's predicted queue exceeds the target,
    nothing is bound; a request is bound when a worker drains below it, to the worker the
    policy picks then (with the index and the queues of that moment);
  * bound the wait (`max_wait_s`): a request held that long goes first and is bound even
    when every worker is over the target, so nothing waits forever (aging).

Pure bookkeeping: callers pass `now` and the workers' predicted queues; the simulator
drives it (loadtest/simulate.py) with the planner's own queue estimates.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .terms.cut import usable_blocks

T = TypeVar("T")
ORDERS = ("fifo", "spf")


@dataclass(slots=True)
class _Held(Generic[T]):
    item: T
    size: float
    arrived: float
    tenant: str
    seq: int
    taken: bool = False


@dataclass(slots=True)
class GatewayQueue(Generic[T]):
    """Requests held at the gateway (module doc). Not thread-safe (one owner)."""

    order: str = "spf"
    hold_target_s: float | None = None
    max_wait_s: float = 2.0
    _by_tenant: dict[str, list[tuple[float, float, int, _Held[T]]]] = field(default_factory=dict)
    _fifo: list[tuple[float, int, _Held[T]]] = field(default_factory=list)
    _served: dict[str, float] = field(default_factory=dict)
    _seq: itertools.count[int] = field(default_factory=itertools.count)
    _n: int = 0

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.hold_target_s is not None and not (self.hold_target_s >= 0.0 and math.isfinite(self.hold_target_s)):
            raise ValueError(f"hold_target_s must be >= 0 or None, got {self.hold_target_s}")
        if not self.max_wait_s >= 0.0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")

    def __len__(self) -> int:
        return self._n

    def push(self, item: T, size: float, now: float, tenant: str = "") -> _Held[T]:
        """Hold `item`; `size`: its predicted prefill (tokens to compute, or seconds).
        Returns the handle `drop` takes."""
        h = _Held(item, size, now, tenant, next(self._seq))
        key = size if self.order == "spf" else 0.0
        heapq.heappush(self._by_tenant.setdefault(tenant, []), (key, now, h.seq, h))
        heapq.heappush(self._fifo, (now, h.seq, h))
        self._n += 1
        return h

    def drop(self, h: _Held[T]) -> None:
        """Forget a held request that will not be bound (its client left); not counted as
        served. Its heap entries go lazily, as taken ones do."""
        if not h.taken:
            h.taken = True
            self._n -= 1

    def oldest_arrival(self) -> float | None:
        """When the longest-held request arrived (None when nothing is held)."""
        old = self._oldest()
        return old.arrived if old is not None else None

    def over_target(self, queues: Sequence[float]) -> bool:
        """Late binding is on and every worker's predicted queue exceeds the target (never
        with no worker at all: there is nothing to wait for, routing answers that)."""
        target = self.hold_target_s
        return target is not None and bool(queues) and all(q > target for q in queues)

    def should_hold(self, queues: Sequence[float], now: float) -> bool:
        """True while nothing may be bound: every worker is over the target
        (`over_target`) and no request has waited `max_wait_s`."""
        if not self._n:
            return False
        old = self._oldest()
        if old is not None and now - old.arrived >= self.max_wait_s:
            return False
        return self.over_target(queues)

    def pop(self, now: float) -> T | None:
        """The next request to bind: one that waited `max_wait_s` (oldest first), else the
        tenant served least so far, its head by the order."""
        if not self._n:
            return None
        old = self._oldest()
        if old is not None and now - old.arrived >= self.max_wait_s:
            return self._take(old)
        best: tuple[float, float, float, int] | None = None
        pick: _Held[T] | None = None
        empty: list[str] = []
        for tenant, heap in self._by_tenant.items():
            while heap and heap[0][3].taken:
                heapq.heappop(heap)
            if not heap:  # every request of the tenant was dropped
                empty.append(tenant)
                continue
            key, arrived, seq, head = heap[0]
            cand = (self._served.get(tenant, 0.0), key, arrived, seq)
            if best is None or cand < best:
                best, pick = cand, head
        for tenant in empty:
            del self._by_tenant[tenant]
        assert pick is not None
        return self._take(pick)

    def _oldest(self) -> _Held[T] | None:
        f = self._fifo
        while f and f[0][2].taken:
            heapq.heappop(f)
        return f[0][2] if f else None

    def _take(self, h: _Held[T]) -> T:
        h.taken = True
        self._n -= 1
        self._served[h.tenant] = self._served.get(h.tenant, 0.0) + h.size
        heap = self._by_tenant[h.tenant]
        while heap and heap[0][3].taken:
            heapq.heappop(heap)
        if not heap:
            del self._by_tenant[h.tenant]
        return h.item


def prefill_size(prompt_tokens: int, held_blocks: int, block_size: int) -> float:
    """A request's size for the shortest-first order: the tokens left to compute after the
    longest prefix any worker holds (at least one: engines compute the last token)."""
    return float(max(1, prompt_tokens - usable_blocks(prompt_tokens, held_blocks, block_size) * block_size))
