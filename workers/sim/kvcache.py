"""The simulated worker's tiered KV cache: a vLLM-like GPU block pool with prefix caching
over inclusive CPU, DISK and REMOTE tiers, publishing every change as a KV event.

Why one object: placement, eviction cascades (GPU→CPU→DISK) and the events that describe
them must stay in step, so a subscriber applying the events holds exactly `snapshot()`.
Pool, tiers, eviction order and events: docs/sim-engine.md § The tiered KV cache.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from kvindex.events import AllBlocksCleared, BlockRemoved, KVEvent
from kvindex.tiers import Tier
from kvwire import BlockCounts
from workers.blockmeta import BlockMeta, block_hashes, stored_events

from .admission import AdmissionFilter
from .remote import RemoteStore


class TieredKV:
    """Block placement across tiers for one worker; see the module doc."""

    def __init__(
        self,
        *,
        block_size: int,
        block_bytes: int,
        gpu_blocks: int,
        cpu_blocks: int = 0,
        disk_blocks: int = 0,
        admission: AdmissionFilter | None = None,
        remote: RemoteStore | None = None,
        remote_write: str = "evict",
        events: bool = False,
    ) -> None:
        if gpu_blocks <= 0:
            raise ValueError("gpu_blocks must be positive")
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.capacity = gpu_blocks
        self.gpu: dict[bytes, int] = {}  # key -> reference count
        self.lru: OrderedDict[bytes, None] = OrderedDict()  # keyed blocks at refcount 0
        self.n_pinned = 0  # keyed blocks with refcount > 0
        self.n_anon = 0  # anonymous blocks reserved by scheduled requests
        # Pinned blocks purged while in use: key -> (holders left, anonymous slots they keep),
        # freed when the last holder finishes.
        self._orphans: dict[bytes, tuple[int, int]] = {}
        self.cpu: OrderedDict[bytes, None] | None = OrderedDict() if cpu_blocks > 0 else None
        self.disk: OrderedDict[bytes, None] | None = OrderedDict() if disk_blocks > 0 else None
        self.cpu_cap = cpu_blocks
        self.disk_cap = disk_blocks
        self._lower: list[tuple[Tier, OrderedDict[bytes, None], int]] = []
        if self.cpu is not None:
            self._lower.append((Tier.CPU, self.cpu, cpu_blocks))
        if self.disk is not None:
            self._lower.append((Tier.DISK, self.disk, disk_blocks))
        self.admission = admission
        self.remote = remote
        self.remote_on_compute = remote is not None and remote_write == "compute"
        self.remote_on_evict = remote is not None and remote_write == "evict"
        self.events_on = events
        self.meta: dict[bytes, BlockMeta] = {}
        self.events: list[KVEvent] = []
        # Blocks of salted chains (request cache_salt) and of LoRA adapters, for purge;
        # pruned lazily.
        self.tags: dict[str, dict[bytes, str]] = {"salt": {}, "lora": {}}
        # Blocks whose stored copy in a tier is damaged (injected): a load reads them, fails
        # verification, drops them and the request recomputes from there.
        self.corrupt: dict[Tier, set[bytes]] = {Tier.CPU: set(), Tier.DISK: set()}
        self.checksum_errors = 0
        self.remote_unavailable = 0  # lookups that found a block in a REMOTE store that is down
        self.remote_write_skipped = 0
        # Counters (metrics, /load).
        self.evicted: dict[Tier, int] = dict.fromkeys((Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE), 0)
        self.stored: dict[Tier, int] = dict.fromkeys((Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE), 0)
        self.disk_bytes_written = 0
        self.disk_rejected = 0

    # ------------------------------------------------------------------ GPU pool

    def used(self) -> int:
        return len(self.gpu) + self.n_anon

    def free(self) -> int:
        return self.capacity - len(self.gpu) - self.n_anon

    def available(self) -> int:
        """Blocks a new reservation could get now (free + evictable)."""
        return self.capacity - self.n_pinned - self.n_anon

    def gpu_prefix(self, keys: Sequence[bytes], limit: int) -> int:
        """How many leading keys (at most `limit`) sit in the GPU pool."""
        gpu = self.gpu
        i = 0
        while i < limit and keys[i] in gpu:
            i += 1
        return i

    def evictable_among(self, keys: Sequence[bytes]) -> int:
        gpu = self.gpu
        return sum(1 for k in keys if gpu[k] == 0)

    def pin(self, keys: Sequence[bytes]) -> None:
        gpu = self.gpu
        lru = self.lru
        for k in keys:
            rc = gpu[k]
            if rc == 0:
                del lru[k]
                self.n_pinned += 1
            gpu[k] = rc + 1

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Release a finished request's keyed blocks, tail first (parents stay most recent)."""
        if self._orphans:
            self._unpin_with_orphans(keys)
            return
        gpu = self.gpu
        lru = self.lru
        freed = 0
        for k in reversed(keys):
            rc = gpu[k]
            if rc == 1:
                gpu[k] = 0
                lru[k] = None
                freed += 1
            else:
                gpu[k] = rc - 1
        self.n_pinned -= freed

    def _unpin_with_orphans(self, keys: Sequence[bytes]) -> None:
        gpu = self.gpu
        orphans = self._orphans
        for k in reversed(keys):
            o = orphans.get(k)
            if o is not None:
                holders, slots = o
                if holders == 1:
                    del orphans[k]
                    self.n_anon -= slots
                else:
                    orphans[k] = (holders - 1, slots)
                continue
            rc = gpu[k] - 1
            gpu[k] = rc
            if rc == 0:
                self.lru[k] = None
                self.n_pinned -= 1

    def reserve(self, n: int) -> None:
        """Take `n` anonymous blocks, evicting cached blocks if the pool is full."""
        self.n_anon += n
        over = len(self.gpu) + self.n_anon - self.capacity
        if over > 0:
            self.evict_gpu(over)

    def release(self, n: int) -> None:
        self.n_anon -= n

    def land_pinned(self, keys: Sequence[bytes], compute: bool) -> int:
        """Blocks now present for a scheduled request (computed or loaded into its reserved
        slots). Returns how many reserved anonymous slots became keyed blocks."""
        gpu = self.gpu
        new: list[bytes] = []
        for k in keys:
            rc = gpu.get(k)
            if rc is None:
                gpu[k] = 1
                new.append(k)
            else:  # someone else put it there meanwhile: share it, keep our slot
                if rc == 0:
                    del self.lru[k]
                    self.n_pinned += 1
                gpu[k] = rc + 1
        n = len(new)
        self.n_pinned += n
        self.n_anon -= n
        if new:
            self.stored[Tier.GPU] += n
            if self.events_on:
                self._emit_stored(Tier.GPU, new)
            if compute and self.remote_on_compute:
                self.write_remote(new)
        return n

    def land_cached(self, keys: Sequence[bytes]) -> list[bytes]:
        """Blocks raised by a prefetch: cached (evictable) if there is room. Returns those landed."""
        gpu = self.gpu
        new = [k for k in keys if k not in gpu]
        if not new:
            return []
        room = self.free()
        if room < len(new):
            self.evict_gpu(min(len(new) - room, len(self.lru)))
            room = self.free()
        if room < len(new):
            new = new[:max(room, 0)]
        if self.events_on:
            # making room may have pushed a source copy out of the hierarchy (and its
            # metadata with it): land only the unbroken leading part of the chain
            meta = self.meta
            for i, k in enumerate(new):
                if k not in meta:
                    new = new[:i]
                    break
        if not new:
            return []
        lru = self.lru
        for k in reversed(new):  # children older: parents evicted last
            gpu[k] = 0
            lru[k] = None
        self.stored[Tier.GPU] += len(new)
        if self.events_on:
            self._emit_stored(Tier.GPU, new)
        return new

    def evict_gpu(self, n: int) -> None:
        """Evict the `n` least recently used cached blocks down the hierarchy."""
        if n <= 0:
            return
        lru = self.lru
        if n > len(lru):
            raise RuntimeError(f"GPU pool over-committed: need {n} evictions, {len(lru)} evictable")
        pop = lru.popitem
        victims = [pop(last=False)[0] for _ in range(n)]
        gpu = self.gpu
        for k in victims:
            del gpu[k]
        self.evicted[Tier.GPU] += n
        if self.remote_on_evict:
            self.write_remote(victims)
        self._place(0, victims)
        if self.events_on:
            self.events.append(BlockRemoved(block_hashes(victims), "GPU"))
            if not self._lower:
                self._forget(victims)

    # ------------------------------------------------------------------ lower tiers

    def _place(self, level: int, victims: list[bytes]) -> None:
        """Write blocks evicted from the level above into lower level `level` (or drop them)."""
        if level >= len(self._lower):
            if level > 0 and self.events_on:
                self._forget(victims)
            return
        tier, od, cap = self._lower[level]
        cand = victims
        if tier is Tier.DISK and self.admission is not None and self.admission.active:
            admits = self.admission.admits
            cand = [k for k in victims if admits(k)]
            self.disk_rejected += len(victims) - len(cand)
        new = []
        for k in cand:
            if k in od:
                od.move_to_end(k)
            else:
                od[k] = None
                new.append(k)
        if new:
            self.stored[tier] += len(new)
            if tier is Tier.DISK:
                self.disk_bytes_written += len(new) * self.block_bytes
            if self.events_on:
                self._emit_stored(tier, new)
        over = len(od) - cap
        if over > 0:
            pop = od.popitem
            ev = [pop(last=False)[0] for _ in range(over)]
            self.evicted[tier] += over
            damaged = self.corrupt.get(tier)
            if damaged:
                damaged.difference_update(ev)
            self._place(level + 1, ev)  # the lower copy is written before this one is freed
            if self.events_on:
                self.events.append(BlockRemoved(block_hashes(ev), tier.name))
        if self.events_on and len(cand) != len(victims):
            keep = set(cand)
            self._forget([k for k in victims if k not in keep])

    def _forget(self, keys: Sequence[bytes]) -> None:
        """Drop metadata of blocks no longer held in any local tier."""
        if not self.events_on:
            return
        meta = self.meta
        gpu = self.gpu
        cpu = self.cpu
        disk = self.disk
        for k in keys:
            if k in gpu or (cpu is not None and k in cpu) or (disk is not None and k in disk):
                continue
            meta.pop(k, None)

    def write_remote(self, keys: list[bytes]) -> None:
        remote = self.remote
        if remote is None:
            return
        if not remote.available:
            self.remote_write_skipped += len(keys)
            return
        new, evicted = remote.put(keys, self.meta if self.events_on else None, self.block_bytes)
        self.stored[Tier.REMOTE] += len(new)
        self.evicted[Tier.REMOTE] += len(evicted)
        if self.events_on:
            if new:
                self._emit_stored(Tier.REMOTE, new, remote.meta)
            if evicted:
                self.events.append(BlockRemoved(block_hashes(evicted), "REMOTE"))

    def tier_of(self, key: bytes) -> Tier | None:
        """Fastest tier holding a block."""
        if key in self.gpu:
            return Tier.GPU
        if self.cpu is not None and key in self.cpu:
            return Tier.CPU
        if self.disk is not None and key in self.disk:
            return Tier.DISK
        if self.remote is not None and key in self.remote and self.remote.available:
            return Tier.REMOTE
        return None

    def below_tier_of(self, key: bytes) -> Tier | None:
        """Fastest tier below GPU holding a block (a REMOTE store that is down holds nothing)."""
        if self.cpu is not None and key in self.cpu:
            return Tier.CPU
        if self.disk is not None and key in self.disk:
            return Tier.DISK
        remote = self.remote
        if remote is not None and key in remote:
            if remote.available:
                return Tier.REMOTE
            self.remote_unavailable += 1
        return None

    def touch(self, tier: Tier, keys: Sequence[bytes]) -> None:
        """A load read these blocks: most recent in their tier (children first)."""
        if tier is Tier.REMOTE:
            if self.remote is not None:
                self.remote.touch(list(keys))
            return
        od = self.cpu if tier is Tier.CPU else self.disk if tier is Tier.DISK else None
        if od is None:
            return
        for k in reversed(keys):
            if k in od:
                od.move_to_end(k)

    # ------------------------------------------------------------------ damaged copies

    def mark_corrupt(self, keys: Sequence[bytes], tier: Tier) -> int:
        """Damage the copies of `keys` held in `tier` (CPU, DISK or REMOTE); returns how many."""
        if tier is Tier.REMOTE:
            if self.remote is None:
                return 0
            held = [k for k in keys if k in self.remote]
            self.remote.corrupt.update(held)
            return len(held)
        od = self.cpu if tier is Tier.CPU else self.disk if tier is Tier.DISK else None
        if od is None:
            raise ValueError(f"cannot corrupt blocks in {tier.name}: only CPU, DISK and REMOTE copies are stored")
        held = [k for k in keys if k in od]
        self.corrupt[tier].update(held)
        return len(held)

    def verify(self, tier: Tier, keys: Sequence[bytes]) -> list[bytes]:
        """Blocks just read from `tier` that fail verification: each is dropped from that
        tier (BlockRemoved) and counted. Returns them (empty in the common case)."""
        if tier is Tier.REMOTE:
            bad_set = self.remote.corrupt if self.remote is not None else None
        else:
            bad_set = self.corrupt.get(tier)
        if not bad_set:
            return []
        bad = [k for k in keys if k in bad_set]
        if not bad:
            return bad
        bad_set.difference_update(bad)
        self.checksum_errors += len(bad)
        if tier is Tier.REMOTE:
            assert self.remote is not None
            gone = self.remote.remove(bad)
        else:
            od = self.cpu if tier is Tier.CPU else self.disk
            assert od is not None
            gone = [k for k in bad if k in od]
            for k in gone:
                del od[k]
        if gone and self.events_on:
            self.events.append(BlockRemoved(block_hashes(gone), tier.name))
        return bad

    # ------------------------------------------------------------------ metadata

    def add_meta(
        self,
        keys: Sequence[bytes],
        start: int,
        end: int,
        tokens: Sequence[int],
        extra: Sequence[tuple[Any, ...] | None] | None,
        lora: str | None,
    ) -> None:
        """Metadata of a request's blocks [start, end) (for events), if not known yet."""
        meta = self.meta
        bs = self.block_size
        new = tuple.__new__  # builds the NamedTuple in C, without its Python-level __new__
        for i in range(start, end):
            k = keys[i]
            if k not in meta:
                parent = keys[i - 1] if i else None
                meta[k] = new(BlockMeta, (parent, tokens, i * bs, extra[i] if extra else None, lora))

    def copy_meta(self, keys: Sequence[bytes], source: Mapping[bytes, BlockMeta]) -> bool:
        """Metadata from another holder (the remote store, a peer); False if any is missing."""
        meta = self.meta
        ok = True
        for k in keys:
            if k not in meta:
                m = source.get(k)
                if m is None:
                    ok = False
                else:
                    meta[k] = m
        return ok

    # ------------------------------------------------------------------ events

    def _emit_stored(self, tier: Tier, keys: list[bytes], meta: Mapping[bytes, BlockMeta] | None = None) -> None:
        """One BlockStored per chain run among `keys`."""
        self.events.extend(stored_events(tier, keys, meta if meta is not None else self.meta, self.block_size))

    def take_events(self) -> list[KVEvent]:
        ev = self.events
        self.events = []
        return ev

    # ------------------------------------------------------------------ purge / views

    def note_tag(self, kind: str, keys: Sequence[bytes], value: str) -> None:
        """Remember that these blocks belong to a salt / LoRA adapter (for purge)."""
        tags = self.tags[kind]
        tags.update(dict.fromkeys(keys, value))
        if len(tags) > 4 * (len(self.gpu) + len(self.cpu or ()) + len(self.disk or ())) + 65536:
            self.tags[kind] = {k: v for k, v in tags.items() if self._held(k)}

    def _held(self, k: bytes) -> bool:
        return (
            k in self.gpu
            or (self.cpu is not None and k in self.cpu)
            or (self.disk is not None and k in self.disk)
            or (self.remote is not None and k in self.remote)
        )

    def purge(self, cache_salt: str | None, everything: bool, lora: str | None = None) -> set[bytes]:
        """Drop blocks from every tier: those of chains salted with `cache_salt`, those of
        LoRA adapter `lora`, or all.

        Blocks pinned by running requests stop being findable at once and are freed when
        those requests finish. Returns the distinct blocks dropped.
        """
        if everything:
            victims = set(self.gpu)
            for _, od, _ in self._lower:
                victims.update(od)
            if self.remote is not None:
                victims.update(self.remote.blocks)
            for t in self.tags.values():
                t.clear()
        else:
            victims = set()
            for kind, value in (("salt", cache_salt), ("lora", lora)):
                if value:
                    tags = self.tags[kind]
                    hit = [k for k, v in tags.items() if v == value]
                    for k in hit:
                        del tags[k]
                    victims.update(hit)
        if not victims:
            return set()
        dropped: set[bytes] = set()
        gpu_gone = [k for k in self.gpu if k in victims] if not everything else list(self.gpu)
        for k in gpu_gone:
            rc = self.gpu.pop(k)
            if rc == 0:
                del self.lru[k]
            else:
                self.n_pinned -= 1
                self.n_anon += 1
                holders, slots = self._orphans.get(k, (0, 0))
                self._orphans[k] = (holders + rc, slots + 1)
        dropped.update(gpu_gone)
        removed_by_tier: list[tuple[Tier, list[bytes]]] = [(Tier.GPU, gpu_gone)]
        for tier, od, _ in self._lower:
            gone = [k for k in od if k in victims] if not everything else list(od)
            for k in gone:
                del od[k]
            if self.corrupt.get(tier):
                self.corrupt[tier].difference_update(gone)
            dropped.update(gone)
            removed_by_tier.append((tier, gone))
        remote_gone: list[bytes] = []
        if self.remote is not None:
            remote_gone = self.remote.remove(list(victims))
            dropped.update(remote_gone)
        if self.events_on:
            if everything:
                self.events.append(AllBlocksCleared())
            else:
                for tier, gone in removed_by_tier:
                    if gone:
                        self.events.append(BlockRemoved(block_hashes(gone), tier.name))
            if remote_gone:
                self.events.append(BlockRemoved(block_hashes(remote_gone), "REMOTE"))
            for k in dropped:
                self.meta.pop(k, None)
        return dropped

    def snapshot(self) -> dict[Tier, set[bytes]]:
        out = {Tier.GPU: set(self.gpu)}
        out[Tier.CPU] = set(self.cpu) if self.cpu is not None else set()
        out[Tier.DISK] = set(self.disk) if self.disk is not None else set()
        out[Tier.REMOTE] = set(self.remote.blocks) if self.remote is not None else set()
        return out

    def match_tiers(self, keys: Sequence[bytes]) -> list[Tier | None]:
        """Fastest tier of each leading key; None from the first block held nowhere on."""
        out: list[Tier | None] = []
        tier_of = self.tier_of
        for k in keys:
            t = tier_of(k)
            if t is None:
                break
            out.append(t)
        out.extend([None] * (len(keys) - len(out)))
        return out

    def blocks_report(self) -> dict[str, BlockCounts]:
        out = {"GPU": BlockCounts(self.used(), self.free(), self.capacity)}
        for tier, od, cap in self._lower:
            out[tier.name] = BlockCounts(len(od), cap - len(od), cap)
        if self.remote is not None:
            r = self.remote
            out["REMOTE"] = BlockCounts(len(r), r.capacity_blocks - len(r), r.capacity_blocks)
        return out
