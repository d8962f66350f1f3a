"""Worker slots: which bits of a block's holder bitmap belong to which worker and group.

Bit `4*s + t` says the worker in slot `s` holds the block in local tier `t` (0 GPU,
1 CPU, 2 DISK); bit `4*g + 3` says remote group `g` holds it (REMOTE is shared by
the group's members). Slots are handed out lowest first so that bitmaps stay short.
A removed or cleared worker's slot is retired (masked out of every query at once)
and comes back to the pool only after a sweep has erased its bits.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from .engine_hashes import EngineHashes
from .groups import WorkerGroups
from .keys import BlockHasher
from .page_chain import PageChain
from .stats import ApplyStats
from .tiers import Tier

REMOTE_BIT = 3  # nibble bit of a remote group
REMOTE = 3  # tier index of REMOTE (the others index `WorkerSlot.counts`)
LOCAL_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)


@dataclass(slots=True)
class WorkerSlot:
    """One registered worker: its bits, its namespace and its event-application state."""

    worker_id: str
    slot: int
    group: str
    gslot: int
    ns_digest: bytes
    block_size: int  # the engine's: a multiple of the index's, or a page size dividing it
    hasher: BlockHasher
    verify_every: int  # a trusted worker's chain roots: 1 in this many recomputed
    trusted: bool = False  # block hashes are applied as our digests (docs/prefix-index.md)
    draining: bool = False
    until_verify: int = 0  # chain roots to let pass before the next verification
    engine_hashes: EngineHashes = field(default_factory=EngineHashes)
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])  # entries per local tier
    stats: ApplyStats = field(default_factory=ApplyStats)
    groups: WorkerGroups | None = None  # hybrid models only (docs/kv-groups.md)
    pages: PageChain | None = None  # pages smaller than the index block (kvindex/page_chain.py)

    def bit(self, ti: int) -> int:
        """Its bitmap bit for tier index `ti` (REMOTE: its group's)."""
        if ti == REMOTE:
            return 1 << (4 * self.gslot + REMOTE_BIT)
        return 1 << (4 * self.slot + ti)

    def local_bits(self) -> int:
        """Its bits of the three local tiers."""
        return 7 << (4 * self.slot)

    def held_mask(self) -> int:
        """Every bit through which it holds a block: its local tiers and its group's REMOTE."""
        return self.local_bits() | (1 << (4 * self.gslot + REMOTE_BIT))


class SlotTable:
    """Workers by id and by slot, remote groups, and the masks queries use.

    `active`: bit 4*s per registered, non-retired slot; `routable`: the same minus
    draining workers; `hybrid`: bit 4*s per worker whose matches follow the hybrid
    rule (it has KV-cache groups, docs/kv-groups.md); `live`: every bitmap bit of a live holder (active slots' local
    bits, existing groups' remote bits).
    """

    def __init__(self, max_workers: int) -> None:
        self.size = max_workers
        nibbles = ((1 << (4 * max_workers)) - 1) // 15  # bit 0 of every nibble
        self.local_mask = nibbles * 7
        self.remote_mask = nibbles << REMOTE_BIT
        self.workers: dict[str, WorkerSlot] = {}
        self.by_slot: dict[int, WorkerSlot] = {}
        self.free: list[int] = list(range(max_workers))  # a heap: lowest first
        self.retired: list[int] = []  # awaiting a sweep
        self.retired_entries = 0
        self.groups: dict[str, int] = {}  # group name -> group slot
        self.members: dict[int, int] = {}  # group slot -> members (bit 4*s)
        self.free_groups: list[int] = list(range(max_workers))  # a heap
        self.remote_counts: dict[int, int] = {}  # group slot -> REMOTE entries
        self.active = 0
        self.routable = 0
        self.hybrid = 0
        self.live = 0
        self.expand_cache: dict[int, int] = {}

    # ------------------------------------------------------------------ slots and groups

    def take_slot(self) -> int | None:
        return heapq.heappop(self.free) if self.free else None

    def give_back(self, slots: list[int]) -> None:
        """Swept slots return to the pool."""
        for s in slots:
            heapq.heappush(self.free, s)

    def join_group(self, group: str) -> int | None:
        """The group's slot, taken now if the group is new; None when none is free."""
        g = self.groups.get(group)
        if g is None and self.free_groups:
            g = self.groups[group] = heapq.heappop(self.free_groups)
            self.members[g] = 0
        return g

    def leave_group(self, w: WorkerSlot) -> None:
        """After `w` left: the group goes once it has neither members nor REMOTE entries."""
        g = w.gslot
        if self.members[g] == 0 and self.remote_counts.get(g, 0) == 0:
            del self.groups[w.group]
            del self.members[g]
            self.remote_counts.pop(g, None)
            heapq.heappush(self.free_groups, g)
            self._recompute_live()

    def activate(self, w: WorkerSlot) -> None:
        bit = 1 << (4 * w.slot)
        self.by_slot[w.slot] = w
        self.members[w.gslot] |= bit
        self.active |= bit
        if not w.draining:
            self.routable |= bit
        if w.groups is not None:
            self.hybrid |= bit
        self.expand_cache.clear()
        self._recompute_live()

    def retire(self, w: WorkerSlot) -> None:
        """Mask `w`'s slot out of every query; its bits wait for a sweep."""
        bit = 1 << (4 * w.slot)
        self.active &= ~bit
        self.routable &= ~bit
        self.hybrid &= ~bit
        self.members[w.gslot] &= ~bit
        self.expand_cache.clear()
        self.retired.append(w.slot)
        self.retired_entries += sum(w.counts)
        del self.by_slot[w.slot]
        self._recompute_live()

    def mark_hybrid(self, w: WorkerSlot) -> None:
        """`w`'s matches follow the hybrid rule from now on (it has KV-cache groups)."""
        if w.slot in self.by_slot and self.by_slot[w.slot] is w:
            self.hybrid |= 1 << (4 * w.slot)

    def set_draining(self, w: WorkerSlot, draining: bool) -> None:
        w.draining = draining
        bit = 1 << (4 * w.slot)
        if draining:
            self.routable &= ~bit
        else:
            self.routable |= bit

    def _recompute_live(self) -> None:
        live = 0
        for w in self.by_slot.values():
            live |= w.local_bits()
        for g in self.members:
            live |= 1 << (4 * g + REMOTE_BIT)
        self.live = live

    # ------------------------------------------------------------------ entry counts

    def count_added(self, w: WorkerSlot, ti: int, n: int) -> None:
        if ti == REMOTE:
            self.remote_counts[w.gslot] = self.remote_counts.get(w.gslot, 0) + n
        else:
            w.counts[ti] += n

    def count_removed(self, w: WorkerSlot, ti: int, n: int) -> None:
        if ti == REMOTE:
            self.remote_counts[w.gslot] = max(0, self.remote_counts.get(w.gslot, 0) - n)
        else:
            w.counts[ti] = max(0, w.counts[ti] - n)

    def remote_entries(self, w: WorkerSlot) -> int:
        return self.remote_counts.get(w.gslot, 0)

    def entries(self) -> int:
        """(block, worker, tier) entries held by live workers and groups."""
        return sum(sum(w.counts) for w in self.workers.values()) + sum(self.remote_counts.values())

    # ------------------------------------------------------------------ queries

    def expand(self, remote: int) -> int:
        """Member slots' REMOTE nibble bits for a bitmap's remote-group bits (cached)."""
        e = self.expand_cache.get(remote)
        if e is None:
            e = 0
            r = remote
            while r:
                low = r & -r
                g = (low.bit_length() - 1) >> 2
                e |= self.members.get(g, 0)
                r ^= low
            e <<= REMOTE_BIT
            if len(self.expand_cache) >= 4096:
                self.expand_cache.clear()
            self.expand_cache[remote] = e
        return e

    def holders(self, b: int) -> dict[str, list[Tier]]:
        """Which workers a bitmap names and in which tiers."""
        out: dict[str, list[Tier]] = {}
        for w in self.workers.values():
            nib = b >> (4 * w.slot)
            ts = [t for t in LOCAL_TIERS if nib >> int(t) & 1]
            if b >> (4 * w.gslot + REMOTE_BIT) & 1:
                ts.append(Tier.REMOTE)
            if ts:
                out[w.worker_id] = ts
        return out
