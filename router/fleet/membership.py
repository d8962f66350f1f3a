"""Which workers the pool holds: those of the config file and those found by discovery.

Both sources change while the gateway runs (a SIGHUP re-reads the file, DNS answers
change), so the pool is reconciled to their union and each change logged as a diff.
Workers added through the admin API are the operator's: reconciling never touches
them, and a source's worker whose id one of them already uses is skipped (logged).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from .dp_ranks import expand_ranks
from .fleetconfig import WorkerConfig
from .pool import WorkerPool

log = logging.getLogger("kvroute.membership")


@dataclass(slots=True)
class Diff:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)

    def as_dict(self) -> dict[str, list[str]]:
        return {"added": self.added, "removed": self.removed, "changed": self.changed, "skipped": self.skipped}


class Membership:
    """Reconciles the pool to `static ∪ discovered` (static wins an id both name)."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self.static: dict[str, WorkerConfig] = {}
        self.discovered: dict[str, WorkerConfig] = {}
        self.managed: dict[str, WorkerConfig] = {}  # what this reconciler put in the pool
        self._lock = asyncio.Lock()

    async def set_static(self, workers: list[WorkerConfig], why: str) -> Diff:
        self.static = {r.id: r for w in workers for r in expand_ranks(w)}
        return await self.reconcile(why)

    def set_discovered(self, workers: dict[str, WorkerConfig]) -> None:
        """The latest discovered set; the next `reconcile` applies it."""
        self.discovered = {r.id: r for w in workers.values() for r in expand_ranks(w)}

    async def reconcile(self, why: str) -> Diff:
        async with self._lock:
            diff = await self._apply({**self.discovered, **self.static})
        if diff or diff.skipped:
            log.info("workers (%s): added %s, removed %s, changed %s%s", why, diff.added or "none",
                     diff.removed or "none", diff.changed or "none",
                     f", skipped (id taken by an admin-added worker) {diff.skipped}" if diff.skipped else "",
                     extra={"kv": {"reason": why, **diff.as_dict()}})
        return diff

    async def _apply(self, want: dict[str, WorkerConfig]) -> Diff:
        d = Diff()
        for wid, wc in list(self.managed.items()):
            if want.get(wid) != wc:
                if wid in self.pool.workers:  # (unless the admin API removed it meanwhile)
                    await self.pool.remove(wid)
                del self.managed[wid]
                (d.changed if wid in want else d.removed).append(wid)
        for wid, wc in want.items():
            if wid in self.managed:
                continue
            if wid in self.pool.workers:
                d.skipped.append(wid)
                continue
            self.pool.add(wc)
            self.managed[wid] = wc
            if wid not in d.changed:
                d.added.append(wid)
        return d
