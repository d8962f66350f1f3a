"""The global prefix index: which worker holds which leading blocks, in which tier.

A block's 64-bit digest maps to a bitmap of its holders (`kvindex.blockmap`), four
bits per worker slot (`kvindex.slots`), so one lookup per block answers for every
worker and a query only does bit arithmetic where the holders change. Events are
applied by `kvindex.apply`. Not thread-safe, by design: one owner (the gateway's
event loop) mutates and queries it, and no method awaits. docs/prefix-index.md explains
the layout, the verified and trusted ways in, sweeping and the concurrency model.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from .apply import DEFAULT_VERIFY_EVERY, EventApplier
from .blockmap import SHARD_MASK, BlockMap, SweepPass, lookup
from .errors import (
    BadBlockSize,
    BadNamespace,
    BadVerifyEvery,
    IndexError_,
    IndexFull,
    UnknownWorker,
    WorkerAlreadyRegistered,
)
from .events import DecodedBatch, KVEvent, LazyBlockStored
from .group_match import group_counters, group_specs, hybrid_match
from .keys import KEY_BYTES, BlockHasher, digests64
from .page_chain import DEFAULT_MAX_PAGES, PageChain
from .slots import LOCAL_TIERS, SlotTable, WorkerSlot
from .stats import ApplyStats, WorkerIndexStats
from .tiers import Tier

__all__ = ["DEFAULT_VERIFY_EVERY", "ApplyStats", "IndexError_", "PrefixIndex", "PrefixMatch", "WorkerIndexStats"]

# Fastest tier present in a nibble (lowest set bit); index 0 means "none".
_NIBBLE_TIER: tuple[Tier | None, ...] = tuple(
    None if n == 0 else Tier(min(b for b in range(4) if n >> b & 1)) for n in range(16)
)
# Per slot: [(tier, first block index), ...] at each change of tier along a match
_TierRuns = dict[int, list[tuple[Tier | None, int]]]
# Sweep work done per applied block while a pass is pending (plus a floor per call).
_SWEEP_PER_BLOCK = 8
_SWEEP_FLOOR = 2048


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


class PrefixIndex:
    """Blocks keyed by our chained keys, per worker and per tier; see the module doc."""

    def __init__(self, block_size: int, max_workers: int = 256) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if max_workers <= 0:
            raise ValueError("max_workers must be positive")
        self.block_size = block_size
        self._blocks = BlockMap()
        self._slots = SlotTable(max_workers)
        self._sweep: SweepPass | None = None
        self._hashers: dict[bytes, BlockHasher] = {}
        self._applier = EventApplier(block_size, self._blocks, self._slots, self.clear_worker)
        self.sweeps = 0  # sweep passes completed

    # ------------------------------------------------------------------ lifecycle

    def add_worker(
        self,
        worker_id: str,
        ns_digest: bytes,
        block_size: int | None = None,
        remote_group: str | None = None,
        trusted_digests: bool = False,
        verify_every: int = DEFAULT_VERIFY_EVERY,
        max_pages: int = DEFAULT_MAX_PAGES,
    ) -> None:
        """Register a worker serving the model whose namespace digest is `ns_digest`.

        `block_size` is the worker's own (engine) block size: a multiple of the
        index's, each engine block then being split into index blocks, or a page size
        that divides it (SGLang's pages of 1 token), the pages then being assembled
        along their chain into index blocks, at most `max_pages` of them remembered
        (kvindex/page_chain.py; such a worker is never trusted).
        Workers naming the same `remote_group` share its REMOTE tier.
        `trusted_digests`: the worker keys blocks with `kvindex.keys` and publishes
        `digest64` of its keys as block hashes (our engines, kind "kvroute"), so they
        are applied as they are; 1 in `verify_every` of its chain-root events is
        recomputed to catch a misconfigured worker (docs/prefix-index.md).
        Raises WorkerAlreadyRegistered, BadNamespace, BadVerifyEvery, BadBlockSize or
        IndexFull (kvindex/errors.py), each an IndexError_.
        """
        if worker_id in self._slots.workers:
            raise WorkerAlreadyRegistered(worker_id)
        if len(ns_digest) != KEY_BYTES:
            raise BadNamespace(worker_id, len(ns_digest), KEY_BYTES)
        if type(verify_every) is not int or verify_every < 1:
            raise BadVerifyEvery(worker_id, verify_every)
        bs = block_size or self.block_size
        paged = 0 < bs < self.block_size and self.block_size % bs == 0
        if bs < 0 or (bs % self.block_size and not paged):
            raise BadBlockSize(worker_id, bs, self.block_size)
        group = remote_group or f"worker:{worker_id}"
        slot = self._take_slot(worker_id)
        gslot = self._slots.join_group(group)
        if gslot is None:
            self._slots.give_back([slot])
            raise IndexFull(worker_id, self._slots.size, groups=True)
        hasher = self._hashers.get(ns_digest)
        if hasher is None:
            hasher = self._hashers[ns_digest] = BlockHasher(ns_digest, self.block_size)
        trusted = bool(trusted_digests) and not paged
        w = WorkerSlot(worker_id, slot, group, gslot, ns_digest, bs, hasher, verify_every, trusted)
        if paged:
            w.pages = PageChain(bs, self.block_size, hasher, max_pages)
        self._slots.workers[worker_id] = w
        self._slots.activate(w)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and all its local entries (its remote group's blocks stay)."""
        w = self._get(worker_id)
        self._slots.retire(w)
        del self._slots.workers[worker_id]
        self._slots.leave_group(w)
        self._maybe_start_sweep()

    def clear_worker(self, worker_id: str) -> None:
        """Drop every local block of a worker (AllBlocksCleared, restart, lost sync).

        A trusted worker's next chain root is verified (a restart may bring a new config).
        """
        w = self._get(worker_id)
        w.engine_hashes.clear()
        if w.pages is not None:
            w.pages.clear()
        if w.groups is not None:
            w.groups.clear_blocks()
        w.until_verify = 0
        if not any(w.counts):
            return  # no local bits anywhere: keep the slot
        self._slots.retire(w)
        w.slot = self._take_slot(worker_id)
        w.counts = [0, 0, 0]
        self._slots.activate(w)
        self._maybe_start_sweep()

    def set_draining(self, worker_id: str, draining: bool = True) -> None:
        """A draining worker keeps its entries current but is left out of matches."""
        self._slots.set_draining(self._get(worker_id), draining)

    def workers(self) -> list[str]:
        return list(self._slots.workers)

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._slots.workers

    def trusts_digests(self, worker_id: str) -> bool:
        """Whether the worker's block hashes are applied as digests now (False if unknown)."""
        w = self._slots.workers.get(worker_id)
        return w is not None and w.trusted

    def _get(self, worker_id: str) -> WorkerSlot:
        w = self._slots.workers.get(worker_id)
        if w is None:
            raise UnknownWorker(worker_id)
        return w

    def _take_slot(self, worker_id: str) -> int:
        if not self._slots.free and (self._slots.retired or self._sweep is not None):
            self._finish_sweeps()
        slot = self._slots.take_slot()
        if slot is None:
            raise IndexFull(worker_id, self._slots.size)
        return slot

    # ------------------------------------------------------------------ sweeping

    def _maybe_start_sweep(self) -> None:
        """Sweep once retired bits are a sizeable share of the index or slots run low."""
        t = self._slots
        if self._sweep is not None or not t.retired:
            return
        if t.retired_entries * 4 >= max(len(self), 1) or len(t.free) * 4 < t.size:
            self._start_sweep()

    def _start_sweep(self) -> None:
        t = self._slots
        clear = 0
        for s in t.retired:
            clear |= 7 << (4 * s)
        self._sweep = SweepPass(t.retired, clear)
        t.retired = []
        t.retired_entries = 0

    def sweep(self, max_entries: int | None = None) -> bool:
        """Erase retired slots' bits, at most `max_entries` digests' worth now.

        Returns True when nothing is left to sweep. Slots return to the free pool
        when their pass completes. Without a limit, runs every pending pass to the end.
        """
        if max_entries is None:
            self._finish_sweeps()
            return True
        if self._sweep is None:
            if not self._slots.retired:
                return True
            self._start_sweep()
        self._sweep_step(max_entries)
        return self._sweep is None and not self._slots.retired

    def _finish_sweeps(self) -> None:
        while self._sweep is not None or self._slots.retired:
            if self._sweep is None:
                self._start_sweep()
            self._sweep_step(None)

    def _sweep_step(self, budget: int | None) -> None:
        sw = self._sweep
        if sw is not None and self._blocks.erase(sw, budget):
            self._slots.give_back(sw.slots)
            self._sweep = None
            self.sweeps += 1

    # ------------------------------------------------------------------ events

    def apply(self, worker_id: str, batch: DecodedBatch | Sequence[KVEvent | LazyBlockStored]) -> ApplyStats:
        """Apply one batch of a worker's events, in order. Never raises on bad events.

        Raises UnknownWorker (an IndexError_) only.
        """
        w = self._get(worker_id)
        st = ApplyStats()
        if isinstance(batch, DecodedBatch):
            st.bad_events += len(batch.errors)
            events: Sequence[Any] = batch.events
        else:
            events = batch
        work = self._applier.apply(w, events, st)
        w.stats.add(st)
        if self._sweep is not None:
            self._sweep_step(_SWEEP_FLOOR + _SWEEP_PER_BLOCK * work)
        return st

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
        added = self._blocks.set_bits(digests64(keys), keys, w.bit(ti), distinct=False)
        self._slots.count_added(w, ti, added)
        return added

    def remove_digests(self, worker_id: str, digests: Iterable[int], tier: Tier = Tier.GPU) -> int:
        """Forget that a worker holds these blocks in `tier`; returns the entries removed."""
        w = self._get(worker_id)
        if tier is Tier.PEER:
            raise ValueError("PEER is a planning tier, never stored")
        ti = int(tier)
        gone = self._blocks.clear_bits(digests, w.bit(ti))
        self._slots.count_removed(w, ti, gone)
        return gone

    # ------------------------------------------------------------------ queries

    def match(
        self,
        digests: Sequence[int],
        workers: Iterable[str] | None = None,
        include_draining: bool = False,
        max_blocks: int | None = None,
    ) -> dict[str, PrefixMatch]:
        """Per worker, the leading blocks of `digests` it holds and the tier of each.

        Only workers holding at least the first block appear. `workers` narrows the
        candidates (e.g. those serving the request's model and healthy). A worker with
        KV-cache groups (hybrid models) is credited what the engine's hybrid rule would
        serve, no longer than `max_blocks` (`(prompt_tokens - 1) // block_size`, the
        blocks an engine may reuse: a window must end there), see docs/kv-groups.md; a
        single-group worker's leading run is reported whole (the planner caps its use).
        """
        t = self._slots
        alive = t.active if include_draining else t.routable
        if workers is not None:
            sel = 0
            for wid in workers:
                w = t.workers.get(wid)
                if w is not None:
                    sel |= 1 << (4 * w.slot)
            alive &= sel
        if not alive or not len(digests):
            return {}
        if type(digests) is not list:  # e.g. a numpy array: plain ints for the lookups
            digests = [int(d) for d in digests]
        hybrid = alive & t.hybrid
        if hybrid:
            out = self._match_leading(alive ^ hybrid, digests) if alive ^ hybrid else {}
            # only a hybrid worker's match depends on where the prompt's reuse ends (its windows
            # must end there); a single-group worker's leading run is the same either way
            capped = digests if max_blocks is None or max_blocks >= len(digests) else digests[: max(0, max_blocks)]
            if capped:
                out.update(self._match_hybrid(hybrid, capped))
            return out
        return self._match_leading(alive, digests)

    def _match_leading(self, alive: int, digests: list[int]) -> dict[str, PrefixMatch]:
        """`match` for the slots in `alive`, by their holder bits (group 0)."""
        t = self._slots
        shards = self._blocks.bitmaps
        d0 = digests[0]
        if d0 not in shards[d0 & SHARD_MASK]:
            return {}  # the common miss: one lookup
        # Every record in one comprehension, cut at the first miss; then one Python step per run
        # of equal bitmaps (groupby), not per block.
        recs = lookup(shards, digests)
        try:
            recs = recs[: recs.index(None)]
        except ValueError:
            pass
        local_mask = t.local_mask
        remote_mask = t.remote_mask
        expand_cache = t.expand_cache
        nibble_tier = _NIBBLE_TIER
        # ends: (slots that stopped, blocks matched)
        tiers: _TierRuns = {}
        ends: list[tuple[int, int]] = []
        prev_e = 0
        i = 0
        for b, run in groupby(recs):
            rb = b & remote_mask
            if rb:
                x = expand_cache.get(rb)
                e = (b & local_mask) | (t.expand(rb) if x is None else x)
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
                tier = nibble_tier[e >> pos & 15]
                slot_runs = tiers.get(pos)
                if slot_runs is None:
                    tiers[pos] = [(tier, i)]
                elif slot_runs[-1][0] is not tier:
                    slot_runs.append((tier, i))
            i += len(list(run))
        if alive and i:
            ends.append((alive, i))
        return self._matches(ends, tiers)

    def _match_hybrid(self, hybrid: int, digests: list[int]) -> dict[str, PrefixMatch]:
        """`match` for workers with KV-cache groups: the engine's hybrid rule per worker."""
        by_group0 = self._match_leading(hybrid, digests)
        bitmap = self._blocks.bitmap
        out: dict[str, PrefixMatch] = {}
        by_slot = self._slots.by_slot
        B = self.block_size
        while hybrid:
            low = hybrid & -hybrid
            hybrid ^= low
            w = by_slot[(low.bit_length() - 1) >> 2]
            g0 = by_group0.get(w.worker_id)
            m = hybrid_match(w, digests, bitmap, B, None if g0 is None else (g0.blocks, g0.runs))
            if m is not None:
                out[w.worker_id] = PrefixMatch(w.worker_id, m[0], m[1])
        return out

    def _matches(self, ends: list[tuple[int, int]], tiers: _TierRuns) -> dict[str, PrefixMatch]:
        """PrefixMatch per worker from the slots that stopped at each length and their tier changes."""
        out: dict[str, PrefixMatch] = {}
        by_slot = self._slots.by_slot
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
        return len(self._blocks)

    def entries(self) -> int:
        """(block, worker, tier) entries currently held by live workers and groups."""
        return self._slots.entries()

    def local_blocks(self, worker_id: str, tier: Tier = Tier.GPU) -> int:
        """Index blocks the worker holds in a local tier (a cheap count, kept as events apply)."""
        if tier is Tier.REMOTE or tier is Tier.PEER:
            raise ValueError("local tiers only: GPU, CPU, DISK")
        return self._get(worker_id).counts[int(tier)]

    def worker_stats(self) -> list[WorkerIndexStats]:
        return [self._worker_stats(w) for w in self._slots.workers.values()]

    def _worker_stats(self, w: WorkerSlot) -> WorkerIndexStats:
        blocks = {t.name: w.counts[int(t)] for t in LOCAL_TIERS}
        blocks[Tier.REMOTE.name] = self._slots.remote_entries(w)
        return WorkerIndexStats(
            **w.stats.counters(),
            worker_id=w.worker_id,
            slot=w.slot,
            remote_group=w.group,
            draining=w.draining,
            blocks=blocks,
            engine_map=len(w.engine_hashes),
            trusted_digests=w.trusted,
            kv_groups=group_specs(w),
            **group_counters(w),
        )

    def holders(self, digest: int) -> dict[str, list[Tier]]:
        """Which workers hold one block and in which tiers (for tests and debugging)."""
        return self._slots.holders(self._blocks.bitmap(digest))
