"""The global prefix index: which worker holds which leading blocks, in which tier.

Layout (why it is compact and fast)
-----------------------------------
A dict (split in 256 shards, see `_SHARD_BITS`) maps a block's 64-bit digest to
a bitmap of its holders: bit `4*s + t` says the worker in slot `s` holds the
block in local tier `t` (0 GPU, 1 CPU, 2 DISK), and bit `4*g + 3` says remote
group `g` holds it (REMOTE is shared: every member worker can load it). Slots
are handed out lowest first, so a fleet of 64 workers keeps bitmaps within 256
bits, and bitmap values are interned: the many blocks with the same holders
share one int object, which a lookup then finds in cache. A second sharded dict
keeps the full 32-byte key of each block keyed through the verified path (below),
needed only to chain the keys of children that later events store. A block costs
about 200 bytes whatever the number of holders (bench/bench_index.py measures
it), less without a full key; a holder adds one bit. Each worker keeps a map
engine-hash -> digest(s) so `BlockRemoved` applies; it stays empty for engines
that publish our digests (our own workers). A block its worker already holds (a
copy to another tier) is recognised by its engine hash and not keyed again.

Two ways in: verified and trusted
---------------------------------
Verified (the default, and the only way for foreign engines such as vLLM, whose
hashes are seeded and algorithm-dependent): each `BlockStored` is keyed from its
`token_ids` with our chained SHA-256 keys under the worker's namespace, chaining
from the parent's full key (~1 us per block in Python), and the engine's hashes
are mapped to our digests.

Trusted (`add_worker(trusted_digests=True)`, for our own workers: they key blocks
with `kvindex.keys` and publish `digest64` of their keys as block hashes and the
parent's as `parent_block_hash`, docs/wire.md): a `BlockStored` at the index block
size whose hashes are 64-bit ints is applied as it is: no token decoding (with
`EventDecoder(lazy=True)`), no SHA-256, no engine-hash map, no full keys. Any other
event of that worker (a multiple block size, bytes hashes, anything unexpected)
takes the verified path. Orphans follow the verified path's rule (the parent must
be live unless the worker already holds every block), so both paths give the same
answers for a well-behaved worker.
A misconfigured worker (namespace drift: another model revision, dtype, block size
...) would publish digests the router never computes, so the first chain-root
event (`parent_block_hash` None: verifiable without any stored key) after the
registration and after every `clear_worker` (restart, resync, AllBlocksCleared),
and then 1 in `verify_every` of them (a deterministic count), are recomputed from
their tokens under the worker's namespace. On a mismatch `digest_mismatches` is counted, the
worker's entries are dropped (`clear_worker`) and the worker stays on the verified
path for good: still indexed, only slower. Non-root events are never verified.
Consequence of keeping no full keys: a verified child chains only from a parent
whose full key is stored, otherwise it is an orphan. Parents are per publisher: a
vLLM worker's parent is found through its own engine-hash map, so it is a block
that worker keyed itself through the verified path, which stores the full key of
every block it keys (even one a trusted worker indexed first) and keeps it while
the digest is indexed. So a vLLM chain never hangs from a block that only a
trusted worker stored; the one exception is a parent whose digest left the index
altogether (e.g. a REMOTE-only copy dropped) and was re-added by a trusted worker:
the child is then counted as an orphan. A non-trusted worker publishing our
digests (a mixed fleet) may chain from any live holder's block, and likewise not
from one that only trusted workers stored.

A query looks all the request's digests up in one comprehension, then walks the runs of
equal bitmaps (`groupby`) and only does bit arithmetic where the bitmap changes
(a few times per prompt): one fold tells which workers stop matching and one XOR
which workers change tier, so the cost grows with the number of changes, not
workers x blocks. At 10M blocks the lookups themselves dominate (a few dependent
cache misses each); shards cost some locality, the price of never stalling the
loop for seconds when CPython resizes a 10M-entry dict.

Removing or clearing a worker is O(1): its slot is retired (masked out of every
query at once) and a fresh one is handed out; retired bits are swept from the
dict incrementally, a bounded number of entries per `apply` call, in passes that
start only when retired bits are a sizeable share of the index or slots run low
(amortised O(1) per entry, no multi-second pause on a 10M-block index).

Concurrency model
-----------------
Not thread-safe, by design: one owner mutates and queries it. In the gateway that
owner is the asyncio event loop thread; ingestion decodes and applies batches on
that loop and no method awaits, so each call is atomic with respect to every
other coroutine. A multi-threaded host must wrap calls in one lock.
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import groupby, repeat
from typing import Any

from .events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    EventDecodeError,
    KVEvent,
    LazyBlockStored,
)
from .keys import KEY_BYTES, ROOT_KEY, BlockHasher, digests64, tokens_to_bytes
from .tiers import Tier, tier_of_medium

_LOCAL_TIERS = (Tier.GPU, Tier.CPU, Tier.DISK)
_REMOTE_BIT = 3  # nibble bit of a remote group
_INTERN_MAX = 1 << 20  # distinct bitmaps kept canonical before the table starts over
# Fastest tier present in a nibble (lowest set bit); index 0 means "none".
_NIBBLE_TIER: tuple[Tier | None, ...] = tuple(
    None if n == 0 else Tier(min(b for b in range(4) if n >> b & 1)) for n in range(16)
)
# The digest -> bitmap and digest -> key maps are each split over this many dicts by
# the digest's low bits, so that a dict resize (CPython rebuilds a dict's whole table
# when it grows or has used up its free slots) stalls the event loop for ~1/256 of the
# index: ~10 ms at 10M blocks instead of ~2 s.
_SHARD_BITS = 8
_SHARD_MASK = (1 << _SHARD_BITS) - 1
# Sweep work done per applied block while a pass is pending (plus a floor per call).
_SWEEP_PER_BLOCK = 8
_SWEEP_FLOOR = 2048
_MAX_DIGEST = (1 << 64) - 1
# A trusted worker's chain roots recomputed for verification: 1 in this many (the first always).
DEFAULT_VERIFY_EVERY = 32


# _lookup/_insert are plain comprehensions and loops on purpose: CPython 3.11+ specialises
# `shards[d & M].get(d)` and `shard[d] = v` in the interpreter, which is 2-4x faster than
# `map()` over the slot wrappers `list.__getitem__` / `dict.__setitem__`.
def _lookup(shards: list[dict[int, Any]], ds: Iterable[int]) -> list[Any]:
    """Values of many digests (None where absent)."""
    return [shards[d & _SHARD_MASK].get(d) for d in ds]


def _insert(shards: list[dict[int, Any]], ds: Iterable[int], values: Iterable[Any]) -> None:
    """Set many values."""
    for d, v in zip(ds, values):
        shards[d & _SHARD_MASK][d] = v


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
    """What one batch did (all counters are also kept per worker).

    `stored` / `removed` count engine blocks named by events; `ignored` counts
    events of other KV-cache groups (hybrid models: only group 0 is indexed).
    `digests_verified` counts a trusted worker's chain-root events recomputed from
    their tokens, `digest_mismatches` those whose digests differed (module doc).
    """

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    unknown_removed: int = 0
    orphans: int = 0
    unknown_medium: int = 0
    bad_events: int = 0
    ignored: int = 0
    digests_verified: int = 0
    digest_mismatches: int = 0

    def add(self, other: ApplyStats) -> None:
        self.stored += other.stored
        self.removed += other.removed
        self.cleared += other.cleared
        self.unknown_removed += other.unknown_removed
        self.orphans += other.orphans
        self.unknown_medium += other.unknown_medium
        self.bad_events += other.bad_events
        self.ignored += other.ignored
        self.digests_verified += other.digests_verified
        self.digest_mismatches += other.digest_mismatches


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
    ignored: int = 0
    engine_map: int = 0
    trusted_digests: bool = False  # now: False from the start, or since a mismatch
    digests_verified: int = 0
    digest_mismatches: int = 0


@dataclass(slots=True)
class _Worker:
    worker_id: str
    slot: int
    group: str
    gslot: int
    ns_digest: bytes
    block_size: int
    hasher: BlockHasher
    draining: bool = False
    trusted: bool = False  # block hashes are applied as our digests (module doc)
    verify_every: int = DEFAULT_VERIFY_EVERY
    until_verify: int = 0  # chain roots to let pass before the next verification
    # engine hash -> our digest (int), or digests (tuple) when the engine block spans several
    emap: dict[int | bytes, int | tuple[int, ...]] = field(default_factory=dict)
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    stats: ApplyStats = field(default_factory=ApplyStats)


@dataclass(slots=True)
class _SweepPass:
    """An incremental sweep, shard by shard, each over a snapshot of its digests.

    Digests added after a snapshot cannot carry the retired slots' bits.
    """

    slots: list[int]
    clear: int  # bitmap bits to erase (retired slots' nibbles)
    shard: int = 0  # next shard to snapshot
    digests: list[int] = field(default_factory=list)
    pos: int = 0


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
        nibbles = ((1 << (4 * max_workers)) - 1) // 15  # bit 0 of every nibble
        self._local_mask = nibbles * 7
        self._remote_mask = nibbles << _REMOTE_BIT
        self._shards: list[dict[int, int]] = [{} for _ in range(_SHARD_MASK + 1)]  # digest -> bitmap
        self._kshards: list[dict[int, bytes]] = [{} for _ in range(_SHARD_MASK + 1)]  # digest -> full key
        self._interned: dict[int, int] = {}  # one object per distinct bitmap value
        self._workers: dict[str, _Worker] = {}
        self._by_slot: dict[int, _Worker] = {}
        self._free_slots: list[int] = list(range(max_workers))  # a heap: lowest first
        self._retired: list[int] = []
        self._retired_entries = 0
        self._sweep: _SweepPass | None = None
        self._groups: dict[str, int] = {}  # group name -> group slot
        self._group_members: dict[int, int] = {}  # group slot -> members (bit 4*s)
        self._free_groups: list[int] = list(range(max_workers))  # a heap
        self._remote_counts: dict[int, int] = {}
        self._active = 0  # bit 4*s per registered, non-retired worker slot
        self._routable = 0  # _active minus draining
        self._live = 0  # bitmap bits of live holders (active slots' local bits, groups' remote bits)
        self._expand_cache: dict[int, int] = {}
        self._hashers: dict[bytes, BlockHasher] = {}
        self.sweeps = 0

    # ------------------------------------------------------------------ lifecycle

    def add_worker(
        self,
        worker_id: str,
        ns_digest: bytes,
        block_size: int | None = None,
        remote_group: str | None = None,
        trusted_digests: bool = False,
        verify_every: int = DEFAULT_VERIFY_EVERY,
    ) -> None:
        """Register a worker serving the model whose namespace digest is `ns_digest`.

        `block_size` is the worker's own (engine) block size; it must be a multiple
        of the index's, each engine block then being split into index blocks.
        Workers naming the same `remote_group` share its REMOTE tier.
        `trusted_digests`: the worker keys blocks with `kvindex.keys` and publishes
        `digest64` of its keys as block hashes (our engines, kind "kvroute"), so they
        are applied as they are; 1 in `verify_every` of its chain-root events is
        recomputed to catch a misconfigured worker (see the module doc).
        """
        if worker_id in self._workers:
            raise IndexError_(f"worker {worker_id!r} is already registered")
        if len(ns_digest) != KEY_BYTES:
            raise IndexError_(f"worker {worker_id!r}: the namespace digest must be {KEY_BYTES} bytes")
        if type(verify_every) is not int or verify_every < 1:
            raise IndexError_(f"worker {worker_id!r}: verify_every must be a positive int, got {verify_every!r}")
        bs = block_size or self.block_size
        if bs < 0 or bs % self.block_size:
            raise IndexError_(
                f"worker {worker_id!r} has block size {bs}, which is not a multiple of the "
                f"index block size {self.block_size}; configure the worker's engine with a "
                f"multiple of {self.block_size}"
            )
        group = remote_group or f"worker:{worker_id}"
        gslot = self._groups.get(group)
        slot = self._take_slot()
        if gslot is None and not self._free_groups:
            heapq.heappush(self._free_slots, slot)
            raise IndexError_(f"no free remote-group slots ({self._S}); raise max_workers")
        if gslot is None:
            gslot = heapq.heappop(self._free_groups)
            self._groups[group] = gslot
            self._group_members[gslot] = 0
        hasher = self._hashers.get(ns_digest)
        if hasher is None:
            hasher = self._hashers[ns_digest] = BlockHasher(ns_digest, self.block_size)
        w = _Worker(worker_id, slot, group, gslot, ns_digest, bs, hasher, trusted=bool(trusted_digests))
        w.verify_every = verify_every
        self._workers[worker_id] = w
        self._activate(w)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and all its local entries (its remote group's blocks stay)."""
        w = self._get(worker_id)
        self._retire(w)
        del self._workers[worker_id]
        g = w.gslot
        if self._group_members[g] == 0 and self._remote_counts.get(g, 0) == 0:
            del self._groups[w.group]
            del self._group_members[g]
            self._remote_counts.pop(g, None)
            heapq.heappush(self._free_groups, g)
            self._recompute_live()
        self._maybe_start_sweep()

    def clear_worker(self, worker_id: str) -> None:
        """Drop every local block of a worker (AllBlocksCleared, restart, lost sync).

        A trusted worker's next chain root is verified (a restart may bring a new config).
        """
        w = self._get(worker_id)
        w.emap = {}
        w.until_verify = 0
        if not any(w.counts):
            return  # no local bits anywhere: keep the slot
        self._retire(w)
        w.slot = self._take_slot()
        w.counts = [0, 0, 0]
        self._activate(w)
        self._maybe_start_sweep()

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        """A draining worker keeps its entries current but is left out of matches."""
        w = self._get(worker_id)
        w.draining = draining
        bit = 1 << (4 * w.slot)
        if draining:
            self._routable &= ~bit
        else:
            self._routable |= bit

    def workers(self) -> list[str]:
        return list(self._workers)

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def trusts_digests(self, worker_id: str) -> bool:
        """Whether the worker's block hashes are applied as digests now (False if unknown)."""
        w = self._workers.get(worker_id)
        return w is not None and w.trusted

    def _get(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            raise IndexError_(f"unknown worker {worker_id!r}")
        return w

    def _activate(self, w: _Worker) -> None:
        bit = 1 << (4 * w.slot)
        self._by_slot[w.slot] = w
        self._group_members[w.gslot] |= bit
        self._active |= bit
        if not w.draining:
            self._routable |= bit
        self._expand_cache.clear()
        self._recompute_live()

    def _take_slot(self) -> int:
        if not self._free_slots and (self._retired or self._sweep is not None):
            self._finish_sweeps()
        if not self._free_slots:
            raise IndexError_(f"index is full: {self._S} workers (raise max_workers)")
        return heapq.heappop(self._free_slots)

    def _retire(self, w: _Worker) -> None:
        bit = 1 << (4 * w.slot)
        self._active &= ~bit
        self._routable &= ~bit
        self._group_members[w.gslot] &= ~bit
        self._expand_cache.clear()
        self._retired.append(w.slot)
        self._retired_entries += sum(w.counts)
        del self._by_slot[w.slot]
        self._recompute_live()

    def _recompute_live(self) -> None:
        live = 0
        for w in self._by_slot.values():
            live |= 7 << (4 * w.slot)
        for g in self._group_members:
            live |= 1 << (4 * g + _REMOTE_BIT)
        self._live = live

    # ------------------------------------------------------------------ sweeping

    def _maybe_start_sweep(self) -> None:
        if self._sweep is not None or not self._retired:
            return
        if self._retired_entries * 4 >= max(len(self), 1) or len(self._free_slots) * 4 < self._S:
            self._start_sweep()

    def _start_sweep(self) -> None:
        slots = self._retired
        clear = 0
        for s in slots:
            clear |= 7 << (4 * s)
        self._sweep = _SweepPass(slots, clear)
        self._retired = []
        self._retired_entries = 0

    def sweep(self, max_entries: int | None = None) -> bool:
        """Erase retired slots' bits, at most `max_entries` digests' worth now.

        Returns True when nothing is left to sweep. Slots return to the free pool
        when their pass completes. Without a limit, runs every pending pass to the end.
        """
        if max_entries is None:
            self._finish_sweeps()
            return True
        if self._sweep is None:
            if not self._retired:
                return True
            self._start_sweep()
        self._sweep_step(max_entries)
        return self._sweep is None and not self._retired

    def _finish_sweeps(self) -> None:
        while self._sweep is not None or self._retired:
            if self._sweep is None:
                self._start_sweep()
            self._sweep_step(None)

    def _sweep_step(self, budget: int | None) -> None:
        sw = self._sweep
        if sw is None:
            return
        shards = self._shards
        clear = sw.clear
        keep = ~clear
        intern = self._intern
        while budget is None or budget > 0:
            if sw.pos >= len(sw.digests):
                if sw.shard > _SHARD_MASK:
                    for slot in sw.slots:
                        heapq.heappush(self._free_slots, slot)
                    self._sweep = None
                    self.sweeps += 1
                    return
                sw.digests = list(shards[sw.shard])
                sw.shard += 1
                sw.pos = 0
                continue
            end = len(sw.digests) if budget is None else min(len(sw.digests), sw.pos + budget)
            for d in sw.digests[sw.pos : end]:
                shard = shards[d & _SHARD_MASK]
                v = shard.get(d)
                if v is not None and v & clear:
                    v &= keep
                    if v:
                        shard[d] = intern(v)
                    else:
                        del shard[d]
                        self._kshards[d & _SHARD_MASK].pop(d, None)
            if budget is not None:
                budget -= end - sw.pos
            sw.pos = end

    # ------------------------------------------------------------------ events

    def apply(self, worker_id: str, batch: DecodedBatch | Sequence[KVEvent | LazyBlockStored]) -> ApplyStats:
        """Apply one batch of a worker's events, in order. Never raises on bad events.

        Raises IndexError_ only for an unknown worker.
        """
        w = self._get(worker_id)
        st = ApplyStats()
        if isinstance(batch, DecodedBatch):
            st.bad_events += len(batch.errors)
            events: Sequence[Any] = batch.events
        else:
            events = batch
        work = 0
        for ev in events:
            cls = type(ev)
            try:
                if cls is LazyBlockStored or cls is BlockStored:
                    work += self._stored(w, ev, st)
                elif cls is BlockRemoved:
                    work += self._removed(w, ev, st)
                elif cls is AllBlocksCleared:
                    self.clear_worker(worker_id)
                    st.cleared += 1
                else:
                    st.bad_events += 1
            except (TypeError, AttributeError):  # fields of the wrong type (built in Python, not decoded)
                st.bad_events += 1
        w.stats.add(st)
        if self._sweep is not None:
            self._sweep_step(_SWEEP_FLOOR + _SWEEP_PER_BLOCK * work)
        return st

    def _tier_bit(self, w: _Worker, medium: Any, st: ApplyStats) -> tuple[int, int]:
        """(bitmap bit, tier index into counts or 3 for REMOTE)."""
        if medium is not None and not isinstance(medium, str):
            medium = "?"  # not a medium at all: unknown, counted below
        tier, known = tier_of_medium(medium)
        if not known:
            st.unknown_medium += 1
        if tier is Tier.REMOTE:
            return 1 << (4 * w.gslot + _REMOTE_BIT), 3
        return 1 << (4 * w.slot + int(tier)), int(tier)

    def _intern(self, v: int) -> int:
        """The canonical object for a bitmap value: blocks share it, so a lookup
        finds it in cache instead of chasing one object per block."""
        interned = self._interned
        x = interned.get(v)
        if x is None:
            if len(interned) >= _INTERN_MAX:
                interned.clear()  # only an optimisation: values stay correct
            x = interned[v] = v
        return x

    def _parent_key(self, w: _Worker, parent: Any) -> bytes | None:
        """Full key of the parent block, or None when it is unknown (an orphan)."""
        if parent is None:
            return ROOT_KEY
        try:
            m = w.emap.get(parent)
        except TypeError:  # unhashable: a malformed event
            return None
        if m is None:
            if type(parent) is not int:
                return None
            d = parent  # an engine that publishes our digests
        else:
            d = m[-1] if type(m) is tuple else m
        v = self._shards[d & _SHARD_MASK].get(d)
        if v is None or not v & self._live:
            return None
        # None when only trusted workers stored it: they keep no full keys (module doc)
        return self._kshards[d & _SHARD_MASK].get(d)

    def _extras(self, ev: BlockStored, n: int, k: int) -> list[Any] | None | bool:
        """Per-index-block extra keys for a stored event (False: malformed)."""
        extra = ev.extra_keys
        lora = ev.lora_name
        if extra is None:
            if lora:
                return [(lora,)] * (n * k)
            if ev.lora_id is not None:  # old releases: no name; never mix with base-model keys
                return [(("lora_id", ev.lora_id),)] * (n * k)
            return None
        if type(extra) is not list or len(extra) != n:
            return False
        if k == 1:
            return extra
        rest = (lora,) if lora else None
        out: list[Any] = []
        for e in extra:
            out.append(e)
            # only the LoRA name (vLLM puts it first) carries over to the sub-blocks
            out.extend([rest if (rest and e and e[0] == lora) else None] * (k - 1))
        return out

    def _stored(self, w: _Worker, ev: BlockStored | LazyBlockStored, st: ApplyStats) -> int:
        if ev.group_idx:
            st.ignored += 1
            return 0
        if w.trusted:
            done = self._stored_trusted(w, ev, st)
            if done is not None:
                return done
        if type(ev) is LazyBlockStored:
            try:
                ev = ev.materialize()
            except EventDecodeError:
                st.bad_events += 1
                return 0
        return self._stored_verified(w, ev, st)

    def _stored_trusted(self, w: _Worker, ev: BlockStored | LazyBlockStored, st: ApplyStats) -> int | None:
        """A trusted worker's event applied as it is; None: take the verified path.

        Only events at the index block size whose hashes are all 64-bit ints qualify.
        The orphan rule is the verified path's (a parent must be live unless the
        worker already holds every block), so both paths give the same answers.
        """
        hashes = ev.block_hashes
        if ev.block_size != self.block_size or type(hashes) is not list:
            return None
        n = len(hashes)
        if not n:
            return 0
        try:
            lo = min(hashes)
            hi = max(hashes)
        except TypeError:  # ints mixed with bytes
            return None
        if type(lo) is not int or type(hi) is not int or lo < 0 or hi > _MAX_DIGEST:
            return None
        parent = ev.parent_block_hash
        if parent is None:
            if w.until_verify > 0:
                w.until_verify -= 1
            else:
                ok = self._verify_root(w, ev, st)
                if ok is None:
                    st.bad_events += 1
                    return 0
                if not ok:
                    return None  # the worker is on the verified path from now on
        bit, ti = self._tier_bit(w, ev.medium, st)
        if parent is not None and not self._parent_live(w, parent) and not self._holds_all(w, hashes):
            st.orphans += n
            return 0
        added = self._set_bits(hashes, None, bit, distinct=False)  # a publisher may repeat one
        if ti == 3:
            self._remote_counts[w.gslot] = self._remote_counts.get(w.gslot, 0) + added
        else:
            w.counts[ti] += added
        st.stored += n
        return n

    def _verify_root(self, w: _Worker, ev: BlockStored | LazyBlockStored, st: ApplyStats) -> bool | None:
        """Recompute a trusted worker's chain-root event from its tokens.

        True: the digests match. False: they do not; the worker's entries are dropped
        and it is switched to the verified path for good. None: the event is malformed
        (no verdict; the next chain root is checked instead).
        """
        if type(ev) is LazyBlockStored:
            try:
                ev = ev.materialize()
            except EventDecodeError:
                return None
        hashes = ev.block_hashes
        n = len(hashes)
        tokens = ev.token_ids
        B = self.block_size
        if type(tokens) is not list or len(tokens) < n * B:
            return None
        extras = self._extras(ev, n, 1)
        if extras is False:
            return None
        try:
            buf = tokens_to_bytes(tokens[: n * B])
            states = None if extras is None else w.hasher.states_for(extras, n)  # type: ignore[arg-type]
            keys = w.hasher.chain(buf, n, states, ROOT_KEY)
        except (OverflowError, TypeError, ValueError):
            return None
        w.until_verify = w.verify_every - 1
        st.digests_verified += 1
        if digests64(keys) == hashes:
            return True
        st.digest_mismatches += 1
        self.clear_worker(w.worker_id)
        w.trusted = False
        return False

    def _parent_live(self, w: _Worker, parent: Any) -> bool:
        """A trusted worker's parent is indexed and held by a live holder (no key needed)."""
        d = parent
        if w.emap:  # engine blocks it stored through the verified path
            try:
                m = w.emap.get(parent)
            except TypeError:
                return False
            if m is not None:
                d = m[-1] if type(m) is tuple else m
        if type(d) is not int:
            return False
        return bool(self._shards[d & _SHARD_MASK].get(d, 0) & self._live)

    def _holds_all(self, w: _Worker, ds: list[int]) -> bool:
        """The worker holds every one of these digests already (locally or in its group)."""
        recs = _lookup(self._shards, ds)
        if None in recs:
            return False
        held = (7 << (4 * w.slot)) | (1 << (4 * w.gslot + _REMOTE_BIT))
        return all([r & held for r in recs])

    def _stored_verified(self, w: _Worker, ev: BlockStored, st: ApplyStats) -> int:
        hashes = ev.block_hashes
        n = len(hashes)
        ebs = ev.block_size
        B = self.block_size
        tokens = ev.token_ids
        if type(ebs) is not int or ebs <= 0 or ebs % B or len(tokens) < n * ebs or type(hashes) not in (list, tuple):
            st.bad_events += 1
            return 0
        if not n:
            return 0
        k = ebs // B
        bit, ti = self._tier_bit(w, ev.medium, st)
        ds = self._known(w, hashes, k)
        if ds is not None:
            # The same worker stores blocks it already holds (a copy to another tier):
            # their content was verified when first stored, no keying needed.
            added = self._set_bits(ds, None, bit, distinct=False)
        else:
            extras = self._extras(ev, n, k)
            if extras is False:
                st.bad_events += 1
                return 0
            parent = self._parent_key(w, ev.parent_block_hash)
            if parent is None:
                st.orphans += n
                return 0
            hasher = w.hasher
            try:
                buf = tokens_to_bytes(tokens if len(tokens) == n * ebs else tokens[: n * ebs])
                if len(buf) < 4 * n * ebs:  # tokens given as packed bytes, too few of them
                    raise ValueError("too few tokens")
                states = None if extras is None else hasher.states_for(extras, n * k)  # type: ignore[arg-type]
                keys = hasher.chain(buf, n * k, states, parent)
            except (OverflowError, TypeError, ValueError):
                st.bad_events += 1
                return 0
            ds = digests64(keys)
            added = self._set_bits(ds, keys, bit)
            try:
                if k == 1:
                    if hashes != ds:
                        w.emap.update(zip(hashes, ds))
                else:
                    emap = w.emap
                    for i, eh in enumerate(hashes):
                        emap[eh] = tuple(ds[i * k : (i + 1) * k])
            except TypeError:  # unhashable engine hashes
                st.bad_events += 1
        if ti == 3:
            self._remote_counts[w.gslot] = self._remote_counts.get(w.gslot, 0) + added
        else:
            w.counts[ti] += added
        st.stored += n
        return n * k

    def _known(self, w: _Worker, hashes: list[Any], k: int) -> list[int] | None:
        """Our digests for engine blocks this worker already holds, if it holds them all."""
        shards = self._shards
        emap = w.emap
        if emap:
            try:
                if hashes[0] not in emap:  # the common fresh chain: one lookup, not n
                    return None
                vals = list(map(emap.get, hashes))
            except TypeError:
                return None
            if None in vals:
                return None
            ds: list[int] = vals if k == 1 else [d for t in vals for d in t]
            if None in _lookup(shards, ds):
                return None  # e.g. only its REMOTE copy was known, and it is gone
            return ds
        h0 = hashes[0]
        if type(h0) is not int or h0 not in shards[h0 & _SHARD_MASK]:
            return None
        try:
            recs = _lookup(shards, hashes)
        except TypeError:  # a non-int hash among ints
            return None
        if None in recs:
            return None
        # Our own workers publish our digests: trust them only where this worker holds them.
        held = (7 << (4 * w.slot)) | (1 << (4 * w.gslot + _REMOTE_BIT))
        if not all([r & held for r in recs]) or k != 1:
            return None
        return hashes

    def _set_bits(self, ds: list[int], keys: Sequence[bytes] | None, bit: int, distinct: bool = True) -> int:
        """Set `bit` on every digest, inserting new ones; returns bits added.

        `keys`: the digests' full keys, kept for the digests that have none yet (so
        every block keyed through the verified path can parent a verified child);
        None inserts new digests without one (a trusted worker's blocks, or copies
        of blocks known to be indexed). `distinct` says the digests cannot repeat
        (a key chain), which spares a check.
        """
        shards = self._shards
        vals = _lookup(shards, ds)
        n = len(ds)
        if keys is not None:
            kshards = self._kshards
            for d, key in zip(ds, keys):
                kshards[d & _SHARD_MASK].setdefault(d, key)
        if distinct or len(set(ds)) == n:
            missing = vals.count(None)
            if not missing:
                # all present: one interned object per distinct new bitmap
                had = len([v for v in vals if v & bit])
                if had < n:
                    interned = self._interned
                    if len(interned) >= _INTERN_MAX:
                        interned.clear()
                    setdefault = interned.setdefault
                    _insert(shards, ds, [setdefault(x, x) for x in [v | bit for v in vals]])
                return n - had
            if missing == n:
                # all new (a fresh chain): one shared bitmap object
                _insert(shards, ds, repeat(self._intern(bit), n))
                return n
        added = 0
        intern = self._intern
        for d in ds:
            shard = shards[d & _SHARD_MASK]
            v = shard.get(d)  # not vals[i]: a digest may repeat within one call
            if v is None:
                shard[d] = intern(bit)
                added += 1
            elif not v & bit:
                shard[d] = intern(v | bit)
                added += 1
        return added

    def _clear_bits(self, ds: Iterable[int], bit: int) -> int:
        """Clear `bit` on every digest (dropping blocks nobody holds); returns bits cleared."""
        shards = self._shards
        gone = 0
        for d in ds:
            shard = shards[d & _SHARD_MASK]
            v = shard.get(d)
            if v is not None and v & bit:
                v ^= bit
                gone += 1
                if v:
                    shard[d] = self._intern(v)
                else:
                    del shard[d]
                    self._kshards[d & _SHARD_MASK].pop(d, None)
        return gone

    def _removed(self, w: _Worker, ev: BlockRemoved, st: ApplyStats) -> int:
        if ev.group_idx:
            st.ignored += 1
            return 0
        bit, ti = self._tier_bit(w, ev.medium, st)
        if w.emap:
            gone = self._removed_mapped(w, ev.block_hashes, bit, ti, st)
        else:
            gone = self._removed_digests(ev.block_hashes, bit, st)
        if ti == 3:
            g = w.gslot
            self._remote_counts[g] = max(0, self._remote_counts.get(g, 0) - gone)
        else:
            w.counts[ti] = max(0, w.counts[ti] - gone)
        return gone

    def _removed_digests(self, hashes: Iterable[Any], bit: int, st: ApplyStats) -> int:
        """Removal for a worker without engine-hash map: its hashes are our digests."""
        shards = self._shards
        kshards = self._kshards
        intern = self._intern
        gone = 0
        for eh in hashes:
            if type(eh) is int:
                shard = shards[eh & _SHARD_MASK]
                v = shard.get(eh)
                if v is not None and v & bit:
                    v ^= bit
                    if v:
                        shard[eh] = intern(v)
                    else:
                        del shard[eh]
                        kshards[eh & _SHARD_MASK].pop(eh, None)
                    gone += 1
                    continue
            else:
                try:
                    hash(eh)
                except TypeError:
                    st.bad_events += 1
                    continue
            st.unknown_removed += 1
        st.removed += gone
        return gone

    def _removed_mapped(self, w: _Worker, hashes: Iterable[Any], bit: int, ti: int, st: ApplyStats) -> int:
        """Removal through the worker's engine-hash map (engines with their own hashes)."""
        shards = self._shards
        emap = w.emap
        wbits = 7 << (4 * w.slot)
        gone = 0
        for eh in hashes:
            try:
                m = emap.get(eh)
            except TypeError:
                st.bad_events += 1
                continue
            if m is None:
                if type(eh) is int and shards[eh & _SHARD_MASK].get(eh, 0) & bit:
                    m = eh
                else:
                    st.unknown_removed += 1
                    continue
            ds = m if type(m) is tuple else (m,)
            gone += self._clear_bits(ds, bit)
            if ti != 3 and m is not eh:
                if not any(shards[d & _SHARD_MASK].get(d, 0) & wbits for d in ds):
                    del emap[eh]
            st.removed += 1
        return gone

    # ------------------------------------------------------------------ direct access

    def store_keys(self, worker_id: str, keys: Sequence[bytes], tier: Tier = Tier.GPU) -> int:
        """Record that a worker holds blocks whose full keys are `keys` (no events).

        For callers that computed the keys themselves with `BlockHasher` (the
        offline simulator, benchmarks, bulk loads). Returns the entries added.
        """
        w = self._get(worker_id)
        if tier is Tier.PEER:
            raise ValueError("PEER is a planning tier, never stored")
        if any(len(k) != KEY_BYTES for k in keys):
            raise ValueError(f"keys must be {KEY_BYTES} bytes")
        if not keys:
            return 0
        ti = int(tier)
        bit = 1 << (4 * (w.gslot if ti == 3 else w.slot) + ti)
        added = self._set_bits(digests64(keys), keys, bit, distinct=False)
        if ti == 3:
            self._remote_counts[w.gslot] = self._remote_counts.get(w.gslot, 0) + added
        else:
            w.counts[ti] += added
        return added

    def remove_digests(self, worker_id: str, digests: Iterable[int], tier: Tier = Tier.GPU) -> int:
        """Forget that a worker holds these blocks in `tier`; returns the entries removed."""
        w = self._get(worker_id)
        if tier is Tier.PEER:
            raise ValueError("PEER is a planning tier, never stored")
        ti = int(tier)
        bit = 1 << (4 * (w.gslot if ti == 3 else w.slot) + ti)
        gone = self._clear_bits(digests, bit)
        if ti == 3:
            self._remote_counts[w.gslot] = max(0, self._remote_counts.get(w.gslot, 0) - gone)
        else:
            w.counts[ti] = max(0, w.counts[ti] - gone)
        return gone

    # ------------------------------------------------------------------ queries

    def _expand(self, remote: int) -> int:
        """Member slots' REMOTE nibble bits for a bitmap's remote-group bits (cached)."""
        e = self._expand_cache.get(remote)
        if e is None:
            e = 0
            r = remote
            while r:
                low = r & -r
                g = (low.bit_length() - 1) >> 2
                e |= self._group_members.get(g, 0)
                r ^= low
            e <<= _REMOTE_BIT
            if len(self._expand_cache) >= 4096:
                self._expand_cache.clear()
            self._expand_cache[remote] = e
        return e

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
                    sel |= 1 << (4 * w.slot)
            alive &= sel
        if not alive or not len(digests):
            return {}
        if type(digests) is not list:  # e.g. a numpy array: plain ints for the lookups
            digests = [int(d) for d in digests]
        shards = self._shards
        d0 = digests[0]
        if d0 not in shards[d0 & _SHARD_MASK]:
            return {}  # the common miss: one lookup
        # Every record in one comprehension, cut at the first miss; then one Python step per run
        # of equal bitmaps (groupby), not per block.
        recs = _lookup(shards, digests)
        try:
            recs = recs[: recs.index(None)]
        except ValueError:
            pass
        local_mask = self._local_mask
        remote_mask = self._remote_mask
        expand_cache = self._expand_cache
        nibble_tier = _NIBBLE_TIER
        # Per slot: [(tier, first block index), ...]; ends: (slots that stopped, blocks matched)
        tiers: dict[int, list[tuple[Tier | None, int]]] = {}
        ends: list[tuple[int, int]] = []
        prev_e = 0
        i = 0
        for b, run in groupby(recs):
            rb = b & remote_mask
            if rb:
                x = expand_cache.get(rb)
                e = (b & local_mask) | (self._expand(rb) if x is None else x)
            else:
                e = b & local_mask
            held = (e | e >> 1 | e >> 2 | e >> 3) & alive
            if held != alive:
                if i:
                    ends.append((alive & ~held, i))
                alive = held
                if not alive:
                    break
            ch = e ^ prev_e
            changed = (ch | ch >> 1 | ch >> 2 | ch >> 3) & alive
            prev_e = e
            while changed:
                low = changed & -changed
                pos = low.bit_length() - 1
                changed ^= low
                t = nibble_tier[e >> pos & 15]
                slot_runs = tiers.get(pos)
                if slot_runs is None:
                    tiers[pos] = [(t, i)]
                elif slot_runs[-1][0] is not t:
                    slot_runs.append((t, i))
            i += len(list(run))
        if alive and i:
            ends.append((alive, i))
        out: dict[str, PrefixMatch] = {}
        by_slot = self._by_slot
        for slots, length in ends:
            while slots:
                low = slots & -slots
                pos = low.bit_length() - 1
                slots ^= low
                wid = by_slot[pos >> 2].worker_id
                slot_runs = tiers[pos]
                packed = []
                t, start = slot_runs[0]
                for t2, start2 in slot_runs[1:]:
                    packed.append((t, start2 - start))
                    t, start = t2, start2
                packed.append((t, length - start))
                out[wid] = PrefixMatch(wid, length, tuple(packed))  # type: ignore[arg-type]
        return out

    # ------------------------------------------------------------------ stats

    def __len__(self) -> int:
        """Distinct blocks indexed (held by at least one worker, group or retired slot)."""
        return sum(map(len, self._shards))

    def entries(self) -> int:
        """(block, worker, tier) entries currently held by live workers and groups."""
        return sum(sum(w.counts) for w in self._workers.values()) + sum(self._remote_counts.values())

    def worker_stats(self) -> list[WorkerIndexStats]:
        out = []
        for w in self._workers.values():
            blocks = {t.name: w.counts[int(t)] for t in _LOCAL_TIERS}
            blocks["REMOTE"] = self._remote_counts.get(w.gslot, 0)
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
                    s.ignored,
                    len(w.emap),
                    w.trusted,
                    s.digests_verified,
                    s.digest_mismatches,
                )
            )
        return out

    def holders(self, digest: int) -> dict[str, list[Tier]]:
        """Which workers hold one block and in which tiers (for tests and debugging)."""
        b = self._shards[digest & _SHARD_MASK].get(digest, 0)
        out: dict[str, list[Tier]] = {}
        for w in self._workers.values():
            nib = b >> (4 * w.slot)
            ts = [t for t in _LOCAL_TIERS if nib >> int(t) & 1]
            if b >> (4 * w.gslot + _REMOTE_BIT) & 1:
                ts.append(Tier.REMOTE)
            if ts:
                out[w.worker_id] = ts
        return out
