"""The global prefix index: which worker holds which leading blocks, in which tier.

Layout (why it is compact and fast)
-----------------------------------
One dict maps a block's 64-bit digest to a single Python int used as a bitmap:
bit `t*S + slot` says worker `slot` holds the block in tier `t` (GPU, CPU, DISK),
and bit `3*S + group` says remote group `group` holds it (REMOTE is shared: every
member worker can load it). `S` is the slot capacity fixed at construction. A
second dict keeps the block's full 32-byte key, needed only to chain the keys of
children that later events store (keys are recomputed from `token_ids`, never
trusted from the engine). Each worker keeps a map engine-hash -> digest(s) so
`BlockRemoved` applies; it is skipped for engines that already publish our
digests (our own workers), which halves their footprint.

A query walks the request's digests in order and run-length encodes the bitmaps,
so the per-block cost is one dict lookup and one int compare; bit arithmetic only
happens where the holders change.

Removing or clearing a worker is O(1): its slot is retired (masked out of every
query at once) and a fresh one is handed out; retired bits are swept from the
dict in one pass only when they are a sizeable share of it (amortised O(1) per
entry).

Concurrency model
-----------------
Not thread-safe, by design: one owner mutates and queries it. In the gateway that
owner is the asyncio event loop thread; ingestion decodes and applies batches on
that loop and no method awaits, so each call is atomic with respect to every
other coroutine. A multi-threaded host must wrap calls in one lock.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch, KVEvent
from .keys import ROOT_KEY, BlockHasher, digests64
from .tiers import Tier, tier_of_medium

_LOCAL_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A worker's leading run of a request's blocks.

    `runs` lists (tier, count) in block order, adjacent equal tiers merged; each
    block counts in the fastest tier the worker can reach it in.
    """

    worker_id: str
    blocks: int
    runs: tuple[tuple[Tier, int], ...]

    def per_tier(self) -> dict[Tier, int]:
        out: dict[Tier, int] = {}
        for t, n in self.runs:
            out[t] = out.get(t, 0) + n
        return out


@dataclass(slots=True)
class ApplyStats:
    """What one batch did (all counters are also kept per worker)."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_removed: int = 0
    orphans: int = 0
    unknown_medium: int = 0
    bad_events: int = 0


@dataclass(slots=True)
class WorkerIndexStats:
    worker_id: str
    slot: int
    remote_group: str
    draining: bool
    blocks: dict[str, int]
    stored: int
    removed: int
    cleared: int
    unknown_removed: int
    orphans: int
    unknown_medium: int
    bad_events: int


@dataclass(slots=True)
class _Worker:
    worker_id: str
    slot: int
    group: str
    ns_digest: bytes
    block_size: int
    hasher: BlockHasher
    draining: bool = False
    # engine hash -> our digest (int) or digests (tuple) when the engine block spans several
    emap: dict[int | bytes, int | tuple[int, ...]] = field(default_factory=dict)
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    stats: ApplyStats = field(default_factory=ApplyStats)


class IndexError_(ValueError):
    """A lifecycle call that cannot be honoured (unknown worker, bad block size, full)."""


class PrefixIndex:
    """Blocks keyed by our chained keys, per worker and per tier; see the module doc."""

    def __init__(self, block_size: int, max_workers: int = 256) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if max_workers <= 0:
            raise ValueError("max_workers must be positive")
        self.block_size = block_size
        self._S = max_workers
        self._slot_all = (1 << max_workers) - 1
        self._masks: dict[int, int] = {}
        self._full: dict[int, bytes] = {}
        self._workers: dict[str, _Worker] = {}
        self._by_slot: dict[int, _Worker] = {}
        self._free_slots = list(range(max_workers - 1, -1, -1))
        self._retired: set[int] = set()
        self._retired_entries = 0
        self._groups: dict[str, int] = {}  # group name -> group slot
        self._group_members: dict[int, int] = {}  # group slot -> worker slot mask
        self._free_groups = list(range(max_workers - 1, -1, -1))
        self._remote_counts: dict[int, int] = {}
        self._active = 0  # slot mask of registered, non-retired workers
        self._routable = 0  # _active minus draining
        self._expand_cache: dict[int, int] = {}
        self._hashers: dict[tuple[bytes, int], BlockHasher] = {}
        self.sweeps = 0

    # ------------------------------------------------------------------ lifecycle

    def add_worker(
        self, worker_id: str, ns_digest: bytes, block_size: int | None = None, remote_group: str | None = None
    ) -> None:
        """Register a worker serving the model whose namespace digest is `ns_digest`.

        `block_size` is the worker's own (engine) block size; it must be a multiple
        of the index's, each engine block then being split into index blocks.
        """
        if worker_id in self._workers:
            raise IndexError_(f"worker {worker_id!r} is already registered")
        bs = block_size or self.block_size
        if bs % self.block_size:
            raise IndexError_(
                f"worker {worker_id!r} has block size {bs}, which is not a multiple of the "
                f"index block size {self.block_size}; configure the worker's engine with a "
                f"multiple of {self.block_size}"
            )
        slot = self._take_slot()
        group = remote_group or f"worker:{worker_id}"
        gslot = self._groups.get(group)
        if gslot is None:
            if not self._free_groups:
                self._free_slots.append(slot)
                raise IndexError_("no free remote-group slots")
            gslot = self._free_groups.pop()
            self._groups[group] = gslot
            self._group_members[gslot] = 0
        hk = (ns_digest, self.block_size)
        hasher = self._hashers.get(hk)
        if hasher is None:
            hasher = self._hashers[hk] = BlockHasher(ns_digest, self.block_size)
        w = _Worker(worker_id, slot, group, ns_digest, bs, hasher)
        self._workers[worker_id] = w
        self._by_slot[slot] = w
        self._group_members[gslot] |= 1 << slot
        self._active |= 1 << slot
        self._routable |= 1 << slot
        self._expand_cache.clear()

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and all its local entries (its remote group's blocks stay)."""
        w = self._get(worker_id)
        self._retire(w)
        del self._workers[worker_id]
        gslot = self._groups[w.group]
        if self._group_members[gslot] == 0 and self._remote_counts.get(gslot, 0) == 0:
            del self._groups[w.group]
            del self._group_members[gslot]
            self._free_groups.append(gslot)
        self._maybe_sweep()

    def clear_worker(self, worker_id: str) -> None:
        """Drop every local block of a worker (AllBlocksCleared, restart, lost sync)."""
        w = self._get(worker_id)
        self._retire(w)
        w.slot = self._take_slot()
        w.counts = [0, 0, 0]
        w.emap = {}
        self._by_slot[w.slot] = w
        self._group_members[self._groups[w.group]] |= 1 << w.slot
        self._active |= 1 << w.slot
        if not w.draining:
            self._routable |= 1 << w.slot
        self._expand_cache.clear()
        self._maybe_sweep()

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        """A draining worker keeps its entries current but is left out of matches."""
        w = self._get(worker_id)
        w.draining = draining
        if draining:
            self._routable &= ~(1 << w.slot)
        else:
            self._routable |= 1 << w.slot

    def workers(self) -> list[str]:
        return list(self._workers)

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def _get(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            raise IndexError_(f"unknown worker {worker_id!r}")
        return w

    def _take_slot(self) -> int:
        if not self._free_slots and self._retired:
            self.sweep()
        if not self._free_slots:
            raise IndexError_(f"index is full: {self._S} workers (raise max_workers)")
        return self._free_slots.pop()

    def _retire(self, w: _Worker) -> None:
        bit = 1 << w.slot
        self._active &= ~bit
        self._routable &= ~bit
        self._group_members[self._groups[w.group]] &= ~bit
        self._expand_cache.clear()
        self._retired.add(w.slot)
        self._retired_entries += sum(w.counts)
        del self._by_slot[w.slot]

    def _maybe_sweep(self) -> None:
        if self._retired and self._retired_entries * 4 >= max(len(self._masks), 1):
            self.sweep()

    def sweep(self) -> None:
        """Erase retired slots' bits in one pass and free those slots."""
        if not self._retired:
            return
        S = self._S
        r = 0
        for s in self._retired:
            r |= 1 << s
        retired = r | (r << S) | (r << (2 * S))
        keep = ~retired
        masks = self._masks
        full = self._full
        dead = []
        for d, v in masks.items():
            if v & retired:
                nv = v & keep
                if nv:
                    masks[d] = nv  # value update during iteration is allowed
                else:
                    dead.append(d)
        for d in dead:
            del masks[d]
            full.pop(d, None)
        self._free_slots.extend(sorted(self._retired, reverse=True))
        self._retired.clear()
        self._retired_entries = 0
        self.sweeps += 1

    # ------------------------------------------------------------------ events

    def apply(self, worker_id: str, batch: DecodedBatch | Sequence[KVEvent]) -> ApplyStats:
        """Apply one batch of a worker's events, in order. Never raises on bad events."""
        w = self._get(worker_id)
        events = batch.events if isinstance(batch, DecodedBatch) else batch
        st = ApplyStats()
        if isinstance(batch, DecodedBatch):
            st.bad_events += len(batch.errors)
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(w, ev, st)
            elif isinstance(ev, BlockRemoved):
                self._removed(w, ev, st)
            elif isinstance(ev, AllBlocksCleared):
                self.clear_worker(worker_id)
                st.cleared += 1
            else:
                st.bad_events += 1
        ws = w.stats
        ws.stored += st.stored
        ws.removed += st.removed
        ws.cleared += st.cleared
        ws.unknown_removed += st.unknown_removed
        ws.orphans += st.orphans
        ws.unknown_medium += st.unknown_medium
        ws.bad_events += st.bad_events
        return st

    def _tier_bit(self, w: _Worker, medium: str | None, st: ApplyStats) -> tuple[int, int]:
        """(bit to set, tier index into counts or 3 for REMOTE)."""
        tier, known = tier_of_medium(medium)
        if not known:
            st.unknown_medium += 1
        if tier is Tier.REMOTE:
            return 1 << (3 * self._S + self._groups[w.group]), 3
        return 1 << (int(tier) * self._S + w.slot), int(tier)

    def _parent_key(self, w: _Worker, parent: int | bytes | None) -> bytes | None:
        if parent is None:
            return ROOT_KEY
        m = w.emap.get(parent)
        if m is None:
            if isinstance(parent, int) and parent in self._full:
                return self._full[parent]  # engine publishes our digests
            return None
        last = m[-1] if isinstance(m, tuple) else m
        return self._full.get(last)

    def _stored(self, w: _Worker, ev: BlockStored, st: ApplyStats) -> None:
        ebs = ev.block_size
        hashes = ev.block_hashes
        n = len(hashes)
        B = self.block_size
        if ebs <= 0 or ebs % B or len(ev.token_ids) < n * ebs or not isinstance(ev.token_ids, list):
            st.bad_events += 1
            return
        parent = self._parent_key(w, ev.parent_block_hash)
        if parent is None:
            st.orphans += n
            return
        try:
            bit, ti = self._tier_bit(w, ev.medium, st)
        except KeyError:  # pragma: no cover - group always registered
            st.bad_events += 1
            return
        k = ebs // B
        extra = ev.extra_keys
        if extra is not None:
            if len(extra) != n:
                st.bad_events += 1
                return
            if k > 1:
                lora = ev.lora_name
                sub: list = []
                for e in extra:
                    rest = (lora,) if (lora and e and lora in e) else None
                    sub.append(e)
                    sub.extend([rest] * (k - 1))
                extra = sub
        try:
            keys = w.hasher.keys(ev.token_ids[: n * ebs], extra, parent)
        except (OverflowError, TypeError):
            st.bad_events += 1
            return
        ds = digests64(keys)
        masks = self._masks
        full = self._full
        counts = w.counts
        added = 0
        for d, key in zip(ds, keys):
            v = masks.get(d, 0)
            if not v & bit:
                masks[d] = v | bit
                added += 1
                if not v:
                    full[d] = key
        if ti == 3:
            g = self._groups[w.group]
            self._remote_counts[g] = self._remote_counts.get(g, 0) + added
        else:
            counts[ti] += added
        emap = w.emap
        if k == 1:
            for eh, d in zip(hashes, ds):
                if eh != d:
                    emap[eh] = d
        else:
            for i, eh in enumerate(hashes):
                emap[eh] = tuple(ds[i * k : (i + 1) * k])
        st.stored += n

    def _removed(self, w: _Worker, ev: BlockRemoved, st: ApplyStats) -> None:
        bit, ti = self._tier_bit(w, ev.medium, st)
        masks = self._masks
        full = self._full
        emap = w.emap
        S = self._S
        wbits = (1 << w.slot) | (1 << (S + w.slot)) | (1 << (2 * S + w.slot))
        gone = 0
        for eh in ev.block_hashes:
            m = emap.get(eh)
            if m is None:
                if isinstance(eh, int) and masks.get(eh, 0) & bit:
                    m = eh
                else:
                    st.unknown_removed += 1
                    continue
            ds = m if isinstance(m, tuple) else (m,)
            still = False
            for d in ds:
                v = masks.get(d)
                if v is None:
                    continue
                if v & bit:
                    gone += 1
                    v &= ~bit
                    if v:
                        masks[d] = v
                    else:
                        del masks[d]
                        full.pop(d, None)
                if v & wbits:
                    still = True
            if not still and ti != 3:
                emap.pop(eh, None)
            st.removed += 1
        if ti == 3:
            g = self._groups[w.group]
            self._remote_counts[g] = max(0, self._remote_counts.get(g, 0) - gone)
        else:
            w.counts[ti] = max(0, w.counts[ti] - gone)

    # ------------------------------------------------------------------ queries

    def _expand(self, v: int) -> int:
        """Slots that can reach a block whose bitmap is `v` (local tiers or remote group)."""
        S = self._S
        a = self._slot_all
        p = (v | (v >> S) | (v >> (2 * S))) & a
        r = v >> (3 * S)
        if r:
            e = self._expand_cache.get(r)
            if e is None:
                e = 0
                rr = r
                while rr:
                    low = rr & -rr
                    g = low.bit_length() - 1
                    e |= self._group_members.get(g, 0)
                    rr ^= low
                self._expand_cache[r] = e
            p |= e
        return p

    def _tier_for(self, v: int, slot: int) -> Tier:
        """Fastest tier of a block the worker in `slot` is known to reach."""
        S = self._S
        if v >> slot & 1:
            return Tier.GPU
        if v >> (S + slot) & 1:
            return Tier.CPU
        if v >> (2 * S + slot) & 1:
            return Tier.DISK
        return Tier.REMOTE

    def match(
        self, digests: Sequence[int], workers: Iterable[str] | None = None, include_draining: bool = False
    ) -> dict[str, PrefixMatch]:
        """Per worker, the leading blocks of `digests` it holds and the tier of each.

        Only workers holding at least the first block appear. `workers` narrows the
        candidates (e.g. those serving the request's model and healthy).
        """
        alive = self._active if include_draining else self._routable
        if workers is not None:
            sel = 0
            for wid in workers:
                w = self._workers.get(wid)
                if w is not None:
                    sel |= 1 << w.slot
            alive &= sel
        if not alive or not digests:
            return {}
        get = self._masks.get
        runs: list[tuple[int, int]] = []  # (bitmap, first block index)
        ends: list[tuple[int, int]] = []  # (slots that stopped, blocks matched)
        prev = -1
        i = 0
        for d in digests:
            v = get(d)
            if v is None:
                break
            if v != prev:
                na = alive & self._expand(v)
                if na != alive:
                    if i:
                        ends.append((alive & ~na, i))
                    alive = na
                    if not alive:
                        break
                runs.append((v, i))
                prev = v
            i += 1
        if alive and i:
            ends.append((alive, i))
        out: dict[str, PrefixMatch] = {}
        for slots, length in ends:
            while slots:
                low = slots & -slots
                slot = low.bit_length() - 1
                slots ^= low
                w = self._by_slot[slot]
                tiers: list[tuple[Tier, int]] = []
                for j, (v, start) in enumerate(runs):
                    if start >= length:
                        break
                    end = runs[j + 1][1] if j + 1 < len(runs) else length
                    end = min(end, length)
                    t = self._tier_for(v, slot)
                    if tiers and tiers[-1][0] is t:
                        tiers[-1] = (t, tiers[-1][1] + end - start)
                    else:
                        tiers.append((t, end - start))
                out[w.worker_id] = PrefixMatch(w.worker_id, length, tuple(tiers))
        return out

    # ------------------------------------------------------------------ stats

    def __len__(self) -> int:
        """Distinct blocks indexed (held by at least one worker, group or retired slot)."""
        return len(self._masks)

    def entries(self) -> int:
        """(block, worker, tier) entries currently held by live workers and groups."""
        return sum(sum(w.counts) for w in self._workers.values()) + sum(self._remote_counts.values())

    def worker_stats(self) -> list[WorkerIndexStats]:
        out = []
        for w in self._workers.values():
            blocks = {t.name: w.counts[int(t)] for t in _LOCAL_TIERS}
            blocks["REMOTE"] = self._remote_counts.get(self._groups[w.group], 0)
            s = w.stats
            out.append(
                WorkerIndexStats(
                    w.worker_id,
                    w.slot,
                    w.group,
                    w.draining,
                    blocks,
                    s.stored,
                    s.removed,
                    s.cleared,
                    s.unknown_removed,
                    s.orphans,
                    s.unknown_medium,
                    s.bad_events,
                )
            )
        return out

    def holders(self, digest: int) -> dict[str, list[Tier]]:
        """Which workers hold one block and in which tiers (for tests and debugging)."""
        v = self._masks.get(digest, 0)
        out: dict[str, list[Tier]] = {}
        S = self._S
        for w in self._workers.values():
            ts = [t for t in _LOCAL_TIERS if v >> (int(t) * S + w.slot) & 1]
            if v >> (3 * S + self._groups[w.group]) & 1:
                ts.append(Tier.REMOTE)
            if ts:
                out[w.worker_id] = ts
        return out
