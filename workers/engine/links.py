"""Transfer links into the device pool: one thread per source tier (CPU, DISK, REMOTE, PEER).

A link moves one `Transfer` at a time (blocks of one request or one prefetch from one
tier), demand loads (a scheduled request waits) before prefetches, as the simulated
engine's links do (workers/sim/links.py); two requests loading over the same link wait
for each other, loads from different tiers run side by side. Queues live under the
engine lock, the copy itself runs outside it. A transfer not yet started can be taken
back (`remove`: its owner was cancelled); a prefetch past its deadline when its turn
comes is finished at once, without moving anything.

`LinkMeter` measures each link from its own transfers (what /load reports as `tiers`):
`latency_s` an exponential mean of the time to the first block of a transfer (minus
that block's bytes at the measured bandwidth), `read_Bps` one of the bytes per second
over the rest of the transfer's blocks. Until a link has moved anything it reports the
prior it was given.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvindex.tiers import Tier

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Transfer:
    """Blocks moving from `tier` into pool blocks for one owner (a request's load or a prefetch).

    `keys[j]` goes into pool block `dst[j]`; the link sets `ok[j]` when it landed intact,
    and `metas[j]` (the record's metadata, for prefetches that publish it) when known."""

    tier: Tier
    keys: list[bytes]
    dst: list[int]
    owner: Any
    demand: bool
    deadline: float = math.inf
    after: Any = None  # CUDA event the copies into the pool must wait for (offloads of these blocks)
    source: Any = None  # tier-specific: CPU slots pinned for it, the peer's URL
    cancelled: bool = False
    started: bool = False
    ok: list[bool] = field(default_factory=list)
    metas: list[Any] = field(default_factory=list)
    absent_from: int | None = None  # blocks from here on were simply not there (REMOTE, PEER): no fault
    seconds: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.keys)
        self.ok = [False] * n
        self.metas = [None] * n


class LinkMeter:
    """Measured latency and bandwidth of one link (see the module doc)."""

    def __init__(self, read_Bps: float, latency_s: float, alpha: float = 0.2) -> None:
        self.read_Bps = read_Bps
        self.latency_s = latency_s
        self.alpha = alpha
        self.samples = 0
        self.bytes = 0
        self.busy_s = 0.0

    def add(self, first_s: float, first_bytes: int, rest_s: float, rest_bytes: int) -> None:
        """One transfer: its first block took `first_s`, the others `rest_s` for `rest_bytes`."""
        a = self.alpha if self.samples else 1.0
        if rest_bytes > 0 and rest_s > 0:
            self.read_Bps += a * (rest_bytes / rest_s - self.read_Bps)
        lat = max(0.0, first_s - first_bytes / self.read_Bps)
        self.latency_s += a * (lat - self.latency_s)
        self.samples += 1
        self.bytes += first_bytes + rest_bytes
        self.busy_s += first_s + rest_s

    def cost_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.read_Bps


class Link:
    """One source tier's queue and thread. `run(t)` moves a transfer (outside the lock);
    `done(t)` lands it (called with the lock held)."""

    def __init__(self, tier: Tier, lock: threading.RLock, meter: LinkMeter,
                 run: Callable[[Transfer], None], done: Callable[[Transfer], None]) -> None:
        self.tier = tier
        self.meter = meter
        self._cond = threading.Condition(lock)
        self._run = run
        self._done = done
        self._demand: deque[Transfer] = deque()
        self._background: deque[Transfer] = deque()
        self.busy: Transfer | None = None
        self.dropped = 0  # prefetch transfers past their deadline when their turn came
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=f"kv-link-{tier.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ under the lock

    def enqueue(self, t: Transfer) -> None:
        (self._demand if t.demand else self._background).append(t)
        self._cond.notify()

    def remove(self, t: Transfer) -> bool:
        """Take back a transfer not started yet (the caller finishes it). False if moving or gone."""
        for q in (self._demand, self._background):
            try:
                q.remove(t)
                return True
            except ValueError:
                continue
        return False

    def queued(self) -> int:
        return len(self._demand) + len(self._background)

    def idle(self) -> bool:
        return self.busy is None and not self._demand and not self._background

    def stop(self) -> None:
        self._stopping = True
        self._cond.notify()

    # ------------------------------------------------------------------ thread

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _loop(self) -> None:
        cond = self._cond
        while True:
            with cond:
                t = self._next()
                while t is None:
                    if self._stopping:
                        return
                    cond.wait()
                    t = self._next()
                self.busy = t
            try:
                t0 = time.perf_counter()
                self._run(t)
                t.seconds = time.perf_counter() - t0
            except Exception:  # a bug or a device error: the blocks not landed are recomputed
                log.exception("KV link %s: transfer failed", self.tier.name)
            with cond:
                self.busy = None
                try:
                    self._done(t)
                except Exception:
                    log.exception("KV link %s: landing a transfer failed", self.tier.name)

    def _next(self) -> Transfer | None:
        """The next transfer to move; finishes (under the lock) those cancelled or expired."""
        while self._demand or self._background:
            t = self._demand.popleft() if self._demand else self._background.popleft()
            if t.cancelled or time.monotonic() > t.deadline:
                if not t.cancelled:
                    self.dropped += 1
                try:
                    self._done(t)
                except Exception:
                    log.exception("KV link %s: finishing a dropped transfer failed", self.tier.name)
                continue
            t.started = True
            return t
        return None
