"""The KV tiers below the device pool: CPU DRAM, DISK and REMOTE, and the peers' memory.

`KVTiers` owns the CPU pool (hostpool.py), the DISK and REMOTE stores (store/), one
transfer link per source tier (links.py) and a writer thread, and keeps what the engine
publishes about them in step with what they hold. Design and numbers: docs/engine.md
§ Tiers. In short:

- **Offload** (`offload`, the block manager's `on_evict`, engine thread, under the engine
  lock): an evicted device block is copied into a CPU slot before its pool slot is reused:
  on CUDA on the offload stream (an event the next forward and every load wait for), on
  a CPU device a memcpy. `BlockStored(CPU)` comes before the eviction's `BlockRemoved(GPU)`.
  Everything slower runs on the writer thread, in batches, overlapped with compute: REMOTE
  puts (as a block leaves GPU, or CPU, as configured) and DISK writes of the oldest CPU
  blocks (write-behind: the CPU copy stays, clean, and goes at once when room is needed).
  CPU eviction is LRU; a dirty block at the LRU head leaves only after its DISK write.
- **Loads** (`plan`/`start`, at admission, under the lock): a request's next blocks after
  its device prefix, from the in-flight prefetch moving them (it joins that transfer),
  CPU, DISK, or REMOTE (speculative: the link asks the server which exist, then reads
  them), up to the cut where loading stops beating recompute. One transfer per source
  tier, each into the request's own pool blocks; when all have landed the leading intact
  run is registered and the rest recomputed.
- **Prefetch** (`prefetch`, the /kv/prefetch handler, under the lock): the same from a
  bounded queue, into pool blocks the prefetch holds, landed as cached blocks in chain
  order when its transfers are done; `source_peer` pulls from a peer's /kv/blocks.
- **Failure is a miss**: a block that does not arrive intact cuts the load there; the
  stores drop what they find bad (`on_drop`) and the removal is published; every case is
  counted (`counters`).

Locking: every bookkeeping structure here is guarded by the engine lock (`lock`), the
same the engine thread holds for `schedule`/`commit`. Store and network calls are never
made with it held (the stores call `on_drop` from inside `get`/`put`, which takes it).
Methods say whether they expect the lock held ("under the lock") or take it.

Why one module of ~1,400 lines, for now: `KVTiers` is the one owner of what the tiers
hold and what the engine has published about them, every method changing that state under
the engine lock, and a block's life crosses every path (offload, load, prefetch, peer
pull, failure); the parts without that state already live apart (hostpool.py, links.py,
store/). Splitting the class along those paths (offload, loads, prefetch) behind one
shared bookkeeping object is the next change to this file; it was not done in the change
that grew it.
"""
from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

import torch

from kvindex.events import AllBlocksCleared, BlockRemoved
from kvindex.keys import Namespace
from kvindex.tiers import Tier
from kvwire import BlockCounts, TierLink
from workers.errors import BadRequest, PrefetchQueueFull
from workers.sim.blockmeta import BlockMeta, block_hashes, stored_events

from .blockio import RECORDS_MEDIA_TYPE, BadMeta, block_bytes_of, decode_meta, encode_meta, read_records, write_block
from .blocks import BlockManager, EvictedBlock
from .hostpool import HostPool, Slot
from .kvpool import KVPool
from .links import Link, LinkMeter, Transfer
from .sequence import Sequence
from .store.base import BlockStore
from .store.disk import DiskConfig, DiskStore
from .store.record import HEADER_SIZE, RecordError

log = logging.getLogger(__name__)

RemoteWrite = Literal["gpu-evict", "cpu-evict"]
# Until a link has moved anything, /load reports these (this 2-core CPU machine's orders
# of magnitude; replaced by the link's own measurements after its first transfer).
PRIORS: dict[Tier, tuple[float, float]] = {
    Tier.CPU: (5.0e9, 1.0e-4),
    Tier.DISK: (1.0e9, 1.0e-3),
    Tier.REMOTE: (5.0e8, 1.0e-3),
    Tier.PEER: (5.0e8, 2.0e-3),
}
_WRITE_BATCH = 64
MIN_FIT_SAMPLES = 8  # prefill timings before the load-or-recompute cut trusts the fit (calibration gives 8)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """What lies below the device pool. `cpu_bytes` 0: no tiers at all (stage 1's engine).
    DISK and REMOTE need a CPU tier (it stages their writes). `remote` is completed by the
    engine: its key namespace derives from the model namespace."""

    cpu_bytes: int = 0
    disk: DiskConfig | None = None
    remote: Any = None  # store.remote.RedisConfig (redis-py is an optional dependency)
    remote_write: RemoteWrite = "gpu-evict"
    prefetch_queue: int = 16
    peer_token: str | None = None  # bearer token for pulling from peers (and their exports)
    peer_timeout_s: float = 5.0
    clean_fraction: float = 0.25  # the oldest CPU blocks kept written to DISK ahead of need
    remote_audit_s: float = 30.0  # how often the REMOTE blocks we published are checked on the server

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0:
            raise ValueError("cpu_bytes must be >= 0")
        if (self.disk is not None or self.remote is not None) and not self.cpu_bytes:
            raise ValueError("DISK and REMOTE tiers need a CPU tier (--cpu-bytes): it stages their writes")
        if self.remote_write not in ("gpu-evict", "cpu-evict"):
            raise ValueError("remote_write is gpu-evict or cpu-evict")
        if self.prefetch_queue < 0:
            raise ValueError("prefetch_queue must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or self.peer_token is not None


def remote_namespace(ns: Namespace) -> str:
    """REMOTE key prefix of a model namespace (model, revision, dtype, parallelism, block size)."""
    return "kvroute-" + ns.digest.hex()[:24]


@dataclass(slots=True)
class TierStats:
    loaded_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("CPU", "DISK", "REMOTE", "PEER"), 0))
    load_fallback_blocks: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("CPU", "DISK", "REMOTE", "PEER"), 0))
    stored: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("CPU", "DISK", "REMOTE"), 0))
    evicted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("CPU", "DISK", "REMOTE"), 0))
    offload_dropped: int = 0  # evicted GPU blocks not kept: no CPU slot free of readers/writers
    sync_writes: int = 0  # CPU evictions that had to write below first, in line (a burst)
    written_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("DISK", "REMOTE"), 0))
    bad_meta: int = 0
    peer_errors: int = 0
    peer_exported_blocks: int = 0
    prefetch_requests: int = 0
    prefetch_blocks_accepted: int = 0
    prefetch_blocks_landed: int = 0
    prefetch_cancelled: int = 0


@dataclass(slots=True, eq=False)
class Load:
    """A request's blocks [start, start + len(sources)) moving up before its prefill."""

    seq: Sequence
    start: int
    sources: list[Tier | Prefetch]
    t0: float
    ok: list[bool] = field(default_factory=list)
    absent: set[int] = field(default_factory=set)  # positions the source did not have (not a fault)
    pins: dict[int, int] = field(default_factory=dict)  # position -> prefetched pool block held for it
    cpu: dict[int, Slot] = field(default_factory=dict)  # position -> CPU slot pinned as its source
    transfers: list[Transfer] = field(default_factory=list)
    pending: int = 0
    done: bool = False


@dataclass(slots=True, eq=False)
class Prefetch:
    pid: str
    keys: list[bytes]
    tiers: list[Tier]
    dst: list[int]
    deadline: float
    pos: dict[bytes, int] = field(default_factory=dict)  # key -> index in keys
    transfers: list[Transfer] = field(default_factory=list)
    ok: list[bool] = field(default_factory=list)
    metas: list[Any] = field(default_factory=list)
    waiters: list[tuple[Load, list[int]]] = field(default_factory=list)
    pending: int = 0
    cancelled: bool = False
    void: bool = False  # a purge happened meanwhile: land nothing


@dataclass(slots=True, eq=False)
class _Write:
    slot: Slot | None
    tier: Tier  # DISK or REMOTE
    keys: list[bytes] = field(default_factory=list)  # discard jobs (slot None)
    ok: bool = False
    meta: bytes = b""  # the record's meta, as written


class Held(NamedTuple):
    """What the engine knows of a block it published in DISK or REMOTE: its salt (purges)
    and its encoded metadata (a republish describes it without reading the store)."""

    salt: str | None
    meta: bytes


class KVTiers:
    """See the module doc."""

    def __init__(
        self,
        cfg: TierConfig,
        *,
        pool: KVPool,
        blocks: BlockManager,
        namespace: Namespace,
        lock: threading.RLock,
        wake: threading.Condition,
        on_loaded: Callable[[Sequence, int, dict[Tier, int], int], None],
        prefill_cost: Callable[[int, int], float | None],
        prefill_samples: Callable[[], int] = lambda: 1 << 30,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.blocks = blocks
        self.bs = pool.block_size
        self.block_bytes = pool.block_bytes
        self.lock = lock
        self.wake = wake
        self.on_loaded = on_loaded
        self.prefill_cost = prefill_cost
        self.prefill_samples = prefill_samples
        self.on_change: Callable[[], None] | None = None  # set by the engine: events to publish
        self._clock = clock
        self.cuda = pool.device.type == "cuda"
        self.stats = TierStats()
        self.host = (HostPool(pool.shape, cfg.cpu_bytes // self.block_bytes, self.bs, pinned=self.cuda)
                     if cfg.cpu_bytes else None)
        self.disk: DiskStore | None = None
        self.remote: Any = None
        self.remote_group: str | None = None
        self.disk_keys: dict[bytes, Held] = {}  # what we published as held on DISK
        self.remote_keys: dict[bytes, Held] = {}  # what we put into REMOTE (and published)
        self.inflight: dict[bytes, Prefetch] = {}
        self.prefetches: dict[str, Prefetch] = {}
        self.prefetched: dict[bytes, Tier] = {}  # landed by a prefetch, not used yet -> source tier
        self.offload_event: Any = None  # CUDA: the last offload copy (writers of pool blocks wait for it)
        self._offload_stream: Any = None
        self._export_stream: Any = None
        if self.cuda:
            self._offload_stream = torch.cuda.Stream(pool.device)  # type: ignore[no-untyped-call]
            self._export_stream = torch.cuda.Stream(pool.device)  # type: ignore[no-untyped-call]
        self._copiers: dict[Tier, _Copier] = {}
        self._writes: deque[_Write] = deque()
        self._writing = False
        self._write_cond = threading.Condition(lock)
        self._stopping = False
        self._clean_target = 0
        self._arriving: set[bytes] = set()  # evicted blocks `offload` has not placed in CPU yet
        self._arrival_kept: dict[bytes, list[tuple[Tier, bytes]]] = {}  # their children written below meanwhile
        if self.host is not None:
            self._clean_target = max(1, int(self.host.capacity * cfg.clean_fraction))
        if cfg.disk is not None:
            self.disk = DiskStore(cfg.disk, on_drop=lambda keys: self._store_dropped(Tier.DISK, keys))
        if cfg.remote is not None:
            from .store.remote import RedisStore

            rcfg = replace(cfg.remote, namespace=remote_namespace(namespace))
            self.remote = RedisStore(rcfg, on_drop=lambda keys: self._store_dropped(Tier.REMOTE, keys))
            self.remote_group = rcfg.group
        self.links: dict[Tier, Link] = {}
        runs: dict[Tier, Callable[[Transfer], None]] = {}
        if self.host is not None:
            runs[Tier.CPU] = self._run_cpu
        if self.disk is not None:
            runs[Tier.DISK] = self._run_disk
        if self.remote is not None:
            runs[Tier.REMOTE] = self._run_remote
        if cfg.peer_token is not None:
            runs[Tier.PEER] = self._run_peer
        for tier, run in runs.items():
            bw, lat = PRIORS[tier]
            self.links[tier] = Link(tier, lock, LinkMeter(bw, lat), run, self._transfer_done)
        self._writer = threading.Thread(target=self._write_loop, name="kv-writer", daemon=True)
        self._writer.start()
        if self.disk is not None:
            self._publish_disk_scan()

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout: float = 10.0) -> None:
        """Finish the writes queued (so a restart finds them), stop the threads, close the stores.
        Takes the lock. Idempotent."""
        if self._stopping:
            return
        self.drain(timeout)
        with self.lock:
            self._stopping = True
            self._write_cond.notify_all()
            for link in self.links.values():
                link.stop()
        self._writer.join(timeout)
        for link in self.links.values():
            link.join(timeout)
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until no write, load or prefetch is queued or moving. Takes the lock."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.idle():
                    return True
            time.sleep(0.002)
        return False

    def demote_all(self, timeout: float = 30.0) -> None:
        """Push every CPU block down now (written below first where needed), then wait for
        the writes. Benchmarks and tests use it to place blocks on DISK / REMOTE only."""
        with self.lock:
            host = self.host
            if host is None:
                return
            for k in list(host.lru):
                s = host.by_key[k]
                if self._dirty(s):
                    host.start_leaving(s)
                    self._queue_writes(s)
                elif not s.pins:
                    self._remove_cpu([s])
        self.drain(timeout)

    def idle(self) -> bool:
        """Nothing queued or moving (under the lock)."""
        return (not self._writes and not self._writing and not self.prefetches
                and all(link.idle() for link in self.links.values()))

    def before_compute(self) -> None:
        """CUDA: the next forward waits for the offload copies of the blocks it may overwrite."""
        ev = self.offload_event
        if ev is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(ev)

    # ------------------------------------------------------------------ offload (under the lock)

    def offload(self, evicted: list[EvictedBlock]) -> None:
        """`BlockManager.on_evict`: copy evicted device blocks into the CPU tier before their
        slots are reused, publish them there, queue what goes further down."""
        host = self.host
        if host is None:
            return
        chain = _parents_first(evicted)
        # Making room writes the oldest CPU blocks below in line, maybe children of blocks of
        # this batch (a chain leaving the pool over several evictions, children first): out
        # of the pool and not yet in CPU, those parents count as held while they are on
        # their way (`_writes_done`); a child kept so is taken back if its parent is dropped.
        self._arriving = {e.key for e in chain}
        self._arrival_kept = {}
        try:
            self._offload(chain)
        finally:
            self._arriving, self._arrival_kept = set(), {}
        self._keep_clean()

    def _offload(self, chain: list[EvictedBlock]) -> None:
        host = self.host
        assert host is not None
        copies: list[tuple[int, Slot]] = []
        for e in chain:
            s = host.get(e.key)
            if s is not None:  # inclusive tiers: the CPU copy is still there
                self._arriving.discard(e.key)
                self._queue_remote_on_gpu_evict(s)
                continue
            if not host.free and copies:
                # making room evicts CPU blocks, maybe one added by this batch: its copy and
                # its BlockStored must come first
                self._place(copies)
                copies = []
            parent = e.meta.parent
            sid = None
            if parent is None or self.held(parent):  # else an orphan: its parent is held nowhere
                sid = self._free_slot()  # (may evict CPU blocks: the parent check comes again after)
            self._arriving.discard(e.key)
            if sid is None or (parent is not None and not self.held(parent)):
                if sid is not None:  # its parent went to make room, and was not kept below
                    host.free.append(sid)
                self._retract(self._arrival_kept.pop(e.key, []))  # its children kept below: orphans now
                self.stats.offload_dropped += 1
                continue
            copies.append((e.block_id, host.add(sid, e.key, e.meta, e.salt)))
        if copies:
            self._place(copies)

    def _place(self, copies: list[tuple[int, Slot]]) -> None:
        """Copy evicted blocks into their new CPU slots, publish them, queue REMOTE writes."""
        assert self.host is not None
        self._copy_out(copies)
        new = [s.key for _, s in copies]
        self.stats.stored["CPU"] += len(new)
        self.blocks.events.extend(stored_events(Tier.CPU, new, {s.key: s.meta for _, s in copies}, self.bs))
        self.host.touch(new)
        for _, s in copies:
            self._queue_remote_on_gpu_evict(s)

    def _copy_out(self, copies: list[tuple[int, Slot]]) -> None:
        host = self.host
        assert host is not None
        data = self.pool.data
        if not self.cuda:
            for bid, s in copies:
                host.data[s.id].copy_(data[bid])
            return
        stream = self._offload_stream
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(stream):
            for bid, s in copies:
                host.data[s.id].copy_(data[bid], non_blocking=True)
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(stream)
        self.offload_event = ev
        for _, s in copies:
            s.ready = ev

    def _free_slot(self) -> int | None:
        """A CPU slot for a new block: a free one, else the LRU block's (nobody reading it).
        A clean LRU block (its DISK copy written ahead by the writer) goes at once; a dirty
        one is written below first, here and now (the rare case of a burst the write-behind
        did not cover: exact LRU cascade order, at the cost of I/O under the lock)."""
        host = self.host
        assert host is not None
        sid = host.take_free()
        if sid is not None:
            return sid
        s = host.oldest()
        if s is None:
            return None
        if self._dirty(s):
            self._write_now(s)
        if not s.dropped:
            self._remove_cpu([s])
        return host.take_free()

    def _write_now(self, s: Slot) -> None:
        """The writes a dirty slot needs, synchronously (under the lock: the stores' `on_drop`
        re-enters it, which the engine's RLock allows)."""
        jobs = []
        if self.disk is not None and s.key not in self.disk_keys and not s.disk_tried:
            s.writing_disk = True
            jobs.append(_Write(s, Tier.DISK))
        if (self.remote is not None and self.cfg.remote_write == "cpu-evict" and s.key not in self.remote_keys
                and not s.remote_tried):
            s.writing_remote = True
            jobs.append(_Write(s, Tier.REMOTE))
        assert self.host is not None
        for w in jobs:
            self.host.pin(s)
            self._write(w)
        self.stats.sync_writes += len(jobs)
        self._writes_done(jobs)

    def _dirty(self, s: Slot) -> bool:
        """Must the block be written below before its CPU copy goes?"""
        if self.disk is not None and s.key not in self.disk_keys and not s.disk_tried:
            return True
        return (self.remote is not None and self.cfg.remote_write == "cpu-evict"
                and s.key not in self.remote_keys and not s.remote_tried)

    def _queue_writes(self, s: Slot) -> None:
        """Queue the writes a dirty slot still needs (each pins it)."""
        if self.disk is not None and s.key not in self.disk_keys and not s.writing_disk and not s.disk_tried:
            s.writing_disk = True
            self._push_write(_Write(s, Tier.DISK))
        if (self.remote is not None and self.cfg.remote_write == "cpu-evict" and s.key not in self.remote_keys
                and not s.writing_remote and not s.remote_tried):
            s.writing_remote = True
            self._push_write(_Write(s, Tier.REMOTE))

    def _queue_remote_on_gpu_evict(self, s: Slot) -> None:
        if (self.remote is not None and self.cfg.remote_write == "gpu-evict" and s.key not in self.remote_keys
                and not s.writing_remote and not s.dropped):
            s.writing_remote = True
            self._push_write(_Write(s, Tier.REMOTE))

    def _push_write(self, w: _Write) -> None:
        if w.slot is not None:
            assert self.host is not None
            self.host.pin(w.slot)
        self._writes.append(w)
        self._write_cond.notify()

    def _keep_clean(self) -> None:
        """Write-behind: once the CPU tier is nearly full, keep its oldest blocks (a quarter
        of it) written below ahead of need, so that making room never waits for the disk."""
        host = self.host
        if host is None or (self.disk is None and self.cfg.remote_write != "cpu-evict"):
            return
        if len(host.free) >= self._clean_target:
            return  # room enough: nothing leaves CPU soon, nothing is written ahead
        n = queued = 0
        for k in host.lru:
            if n >= self._clean_target or queued >= 2 * _WRITE_BATCH:
                break
            n += 1
            s = host.by_key[k]
            if self._dirty(s) and not s.writing_disk and not s.writing_remote:
                self._queue_writes(s)
                queued += 1

    def _remove_cpu(self, slots: list[Slot]) -> None:
        host = self.host
        assert host is not None
        gone = [s.key for s in slots if host.remove(s)]
        if gone:
            self.stats.evicted["CPU"] += len(gone)
            self.blocks.events.append(BlockRemoved(block_hashes(gone), "CPU"))

    def local(self, key: bytes) -> bool:
        """On this worker's GPU, CPU or DISK (under the lock)."""
        return (key in self.blocks.by_key or (self.host is not None and key in self.host.by_key)
                or key in self.disk_keys)

    def held(self, key: bytes) -> bool:
        """In some tier of this worker (under the lock): a block's parent must be, for its
        BlockStored to name a parent the subscriber knows."""
        return (key in self.blocks.by_key or (self.host is not None and key in self.host.by_key)
                or key in self.disk_keys or key in self.remote_keys)

    # ------------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        cond = self._write_cond
        audit = self.cfg.remote_audit_s if self.remote is not None else None
        next_audit = time.monotonic() + audit if audit else None
        while True:
            with cond:
                while not self._writes:
                    if self._stopping:
                        return
                    if next_audit is not None and time.monotonic() >= next_audit:
                        break
                    cond.wait(None if next_audit is None else max(0.0, next_audit - time.monotonic()))
                batch = [self._writes.popleft() for _ in range(min(_WRITE_BATCH, len(self._writes)))]
                self._writing = bool(batch)
            if not batch:
                assert audit is not None
                next_audit = time.monotonic() + audit
                try:
                    self.reconcile_remote()
                except Exception:
                    log.exception("REMOTE audit failed")
                continue
            try:
                for w in batch:
                    self._write(w)
            except Exception:
                log.exception("KV writer failed on a batch")
            with cond:
                try:
                    self._writes_done(batch)
                except Exception:
                    log.exception("KV writer could not commit a batch")
                finally:
                    self._writing = False
            self._changed()

    def reconcile_remote(self) -> int:
        """Ask the REMOTE server which of the blocks we published it still holds (the group's
        TTLs, its own evictions and deletes happen behind our back) and publish the removal of
        the others. No verdict while the server is unavailable. Takes the lock; returns how
        many were gone."""
        remote = self.remote
        if remote is None:
            return 0
        with self.lock:
            keys = list(self.remote_keys)
        gone: list[bytes] = []
        st = remote.stats
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            failures = st.io_errors + st.breaker_skips
            present = remote.contains(batch)
            if st.io_errors + st.breaker_skips != failures:
                return 0
            gone += [k for k, f in zip(batch, present, strict=True) if not f]
        self._store_dropped(Tier.REMOTE, gone)
        return len(gone)

    def _write(self, w: _Write) -> None:
        """One write or discard, outside the lock."""
        if w.slot is None:  # a purge's discard
            store: BlockStore | None = self.disk if w.tier is Tier.DISK else self.remote
            if store is not None:
                store.discard(w.keys)
            return
        s = w.slot
        if s.ready is not None:
            s.ready.synchronize()
        assert self.host is not None
        payload = block_bytes_of(self.host.block(s))
        w.meta = encode_meta(s.meta, s.salt, self.bs)
        store = self.disk if w.tier is Tier.DISK else self.remote
        assert store is not None
        w.ok = store.put(s.key, w.meta, payload)

    def _writes_done(self, batch: list[_Write]) -> None:
        """Commit a batch (under the lock): publish what was stored, let leaving slots go."""
        host = self.host
        stored: dict[Tier, list[bytes]] = {Tier.DISK: [], Tier.REMOTE: []}
        metas: dict[bytes, BlockMeta] = {}
        undo: dict[Tier, list[bytes]] = {Tier.DISK: [], Tier.REMOTE: []}
        leaving: list[Slot] = []
        for w in batch:
            s = w.slot
            if s is None or host is None:
                continue
            key = s.key
            mirror = self.disk_keys if w.tier is Tier.DISK else self.remote_keys
            if w.tier is Tier.DISK:
                s.writing_disk = False
                s.disk_tried = True
            else:
                s.writing_remote = False
                s.remote_tried = True
            if w.ok:
                self.stats.written_bytes[w.tier.name] += self.block_bytes
                parent = s.meta.parent
                if s.purged or (parent is not None and not self.held(parent) and parent not in stored[w.tier]
                                and parent not in self._arriving):
                    undo[w.tier].append(key)  # purged meanwhile, or an orphan: take it back
                elif key not in mirror:
                    mirror[key] = Held(s.salt, w.meta)
                    stored[w.tier].append(key)
                    metas[key] = s.meta
                    if parent is not None and parent in self._arriving:
                        self._arrival_kept.setdefault(parent, []).append((w.tier, key))
            host.unpin(s)
            if s.leaving and not s.writing_disk and not s.writing_remote:
                leaving.append(s)
        for tier, keys in stored.items():
            if keys:
                self.stats.stored[tier.name] += len(keys)
                self.blocks.events.extend(stored_events(tier, keys, metas, self.bs))
        if leaving:
            self._remove_cpu(leaving)
        for tier, keys in undo.items():
            if keys:
                self._writes.append(_Write(None, tier, keys))
                self._write_cond.notify()

    def _retract(self, kept: list[tuple[Tier, bytes]]) -> None:
        """Take back blocks written below and published (under the lock): forget them,
        publish their removal, queue their discard."""
        for tier in (Tier.DISK, Tier.REMOTE):
            mirror = self.disk_keys if tier is Tier.DISK else self.remote_keys
            keys = [k for t, k in kept if t is tier and mirror.pop(k, None) is not None]
            if keys:
                self.stats.evicted[tier.name] += len(keys)
                self.blocks.events.append(BlockRemoved(block_hashes(keys), tier.name))
                self._writes.append(_Write(None, tier, keys))
                self._write_cond.notify()

    def _store_dropped(self, tier: Tier, keys: list[bytes]) -> None:
        """A store lost keys on its own (evicted segment, bad record, expired): publish it.
        Called by the stores from inside their calls, never with the lock held."""
        with self.lock:
            mirror = self.disk_keys if tier is Tier.DISK else self.remote_keys
            gone = [k for k in keys if k in mirror]
            for k in gone:
                del mirror[k]
            if not gone:
                return
            if self.host is not None:
                for k in gone:
                    s = self.host.get(k)
                    if s is not None:  # its CPU copy is dirty again
                        if tier is Tier.DISK:
                            s.disk_tried = False
                        else:
                            s.remote_tried = False
            self.stats.evicted[tier.name] += len(gone)
            self.blocks.events.append(BlockRemoved(block_hashes(gone), tier.name))
        self._changed()

    def _publish_disk_scan(self) -> None:
        """A restart over an existing DISK directory: what the store found, published (whole
        chains only: a block whose parent is held nowhere is discarded, as an orphan)."""
        assert self.disk is not None
        found: dict[bytes, tuple[BlockMeta, str | None]] = {}
        raws: dict[bytes, bytes] = {}
        bad: list[bytes] = []
        for key, raw in self.disk.scan():
            try:
                found[key] = decode_meta(raw, self.bs)
                raws[key] = raw
            except BadMeta:
                bad.append(key)
        keep: list[bytes] = []
        reach: dict[bytes, bool] = {}

        def reachable(k: bytes) -> bool:
            path: list[bytes] = []
            ok = False
            while True:
                if k in reach:
                    ok = reach[k]
                    break
                m = found.get(k)
                if m is None:
                    break
                path.append(k)
                parent = m[0].parent
                if parent is None:
                    ok = True
                    break
                k = parent
            for p in path:
                reach[p] = ok
            return ok

        for k in found:
            if reachable(k):
                keep.append(k)
            else:
                bad.append(k)
        with self.lock:
            for k in keep:
                self.disk_keys[k] = Held(found[k][1], raws[k])
            if keep:
                self.blocks.events.extend(stored_events(Tier.DISK, keep, {k: found[k][0] for k in keep}, self.bs))
        if bad:
            self.stats.bad_meta += len(bad) - sum(1 for k in bad if k in found)
            self.disk.discard(bad)
        if keep:
            log.info("DISK tier: %d blocks found at start, %d discarded", len(keep), len(bad))

    # ------------------------------------------------------------------ loads (under the lock)

    def plan(self, seq: Sequence, gpu_blocks: int) -> Load | None:
        """The blocks after the device prefix that lower tiers (or a prefetch) can provide,
        up to the cut where loading stops paying; None when nothing is worth loading."""
        cap = seq.cacheable_blocks
        host = self.host
        remote_ok = self.remote is not None and not self.remote.breaker.is_open
        srcs: list[Tier | Prefetch] = []
        for i in range(gpu_blocks, cap):
            k = seq.key(i)
            src: Tier | Prefetch | None = self.inflight.get(k)
            if src is None:
                if host is not None and k in host.by_key:
                    src = Tier.CPU
                elif k in self.disk_keys:
                    src = Tier.DISK
                elif remote_ok:
                    src = Tier.REMOTE
                else:
                    break
            srcs.append(src)
        if not srcs:
            return None
        cut = self._best_cut(seq, gpu_blocks, srcs)
        if not cut:
            return None
        load = Load(seq, gpu_blocks, srcs[:cut], self._clock())
        if host is not None:  # pinned now: admitting the request makes room, which may evict CPU blocks
            for j, src in enumerate(load.sources):
                if src is Tier.CPU:
                    s = host.by_key[seq.key(gpu_blocks + j)]
                    host.pin(s)
                    load.cpu[j] = s
        return load

    def abandon(self, load: Load) -> None:
        """A planned load the scheduler could not admit (no room yet): unpin its sources."""
        if self.host is not None:
            for s in load.cpu.values():
                self.host.unpin(s)
        load.cpu.clear()

    def load_blocks(self, load: Load) -> int:
        return len(load.sources)

    def _best_cut(self, seq: Sequence, g: int, srcs: list[Tier | Prefetch]) -> int:
        """How many blocks to load so that the first token comes earliest: each tier's link
        loads its share (latency + bytes / bandwidth, links side by side), the rest is
        prefilled after them. Only run boundaries are candidates (load time is linear within
        a run, recompute concave)."""
        bs = self.bs
        n = seq.num_tokens
        base = self.prefill_cost(n - g * bs, g * bs)
        if base is None or self.prefill_samples() < MIN_FIT_SAMPLES:
            return len(srcs)  # the prefill fit is not to be trusted yet: load everything
        best, best_k = base, 0
        count: dict[Tier, int] = {}
        for j, src in enumerate(srcs):
            if isinstance(src, Tier):
                count[src] = count.get(src, 0) + 1
            if j + 1 < len(srcs) and srcs[j + 1] is src:
                continue
            load_s = max((self.links[t].meter.cost_s(c * self.block_bytes) for t, c in count.items()), default=0.0)
            pos = g + j + 1
            cost = load_s + (self.prefill_cost(n - pos * bs, pos * bs) or 0.0)
            if cost <= best:
                best, best_k = cost, j + 1
        return best_k

    def start(self, load: Load) -> None:
        """Start the loads of an admitted request into its pool blocks (it holds them now)."""
        seq = load.seq
        load.ok = [False] * len(load.sources)
        seq.loading = load
        groups: dict[Tier, list[int]] = {}
        joined: dict[int, list[int]] = {}
        pfs: dict[int, Prefetch] = {}
        for j, src in enumerate(load.sources):
            if isinstance(src, Prefetch):
                joined.setdefault(id(src), []).append(j)
                pfs[id(src)] = src
            else:
                groups.setdefault(src, []).append(j)
        for pid, js in joined.items():
            pfs[pid].waiters.append((load, js))
            load.pending += 1
        for tier, js in groups.items():
            keys = [seq.key(load.start + j) for j in js]
            dst = [seq.block_table[load.start + j] for j in js]
            t = Transfer(tier, keys, dst, (load, js), True, after=self.offload_event)
            if tier is Tier.CPU:
                t.source = [load.cpu[j] for j in js]  # pinned by `plan`, unpinned when it lands
                assert self.host is not None
                self.host.touch(keys)
            load.transfers.append(t)
            load.pending += 1
            self.links[tier].enqueue(t)

    def _pin_cpu(self, keys: list[bytes]) -> list[Slot]:
        host = self.host
        assert host is not None
        slots = [host.by_key[k] for k in keys]
        for s in slots:
            host.pin(s)
        host.touch(keys)
        return slots

    def cancel(self, seq: Sequence) -> None:
        """The request went away while loading: its transfers not started are dropped (those
        moving land; the request is released when all are done)."""
        load: Load | None = seq.loading
        if load is None:
            return
        for t in list(load.transfers):
            if not t.started and self.links[t.tier].remove(t):
                t.cancelled = True
                self._transfer_done(t)

    def _transfer_done(self, t: Transfer) -> None:
        """A transfer ended (landed, failed, cancelled or expired): under the lock."""
        if t.tier is Tier.CPU and t.source is not None:
            assert self.host is not None
            for s in t.source:
                self.host.unpin(s)
            t.source = None
        owner, js = t.owner
        if isinstance(owner, Prefetch):
            for j, ok, m in zip(js, t.ok, t.metas, strict=True):
                owner.ok[j] = ok
                owner.metas[j] = m
            owner.pending -= 1
            if owner.pending == 0:
                self._land_prefetch(owner)
        else:
            for j, ok in zip(js, t.ok, strict=True):
                owner.ok[j] = ok
            if t.absent_from is not None:
                owner.absent.update(js[t.absent_from:])
            owner.pending -= 1
            if owner.pending == 0:
                self._finish_load(owner)
        self._changed()

    def _finish_load(self, load: Load) -> None:
        seq = load.seq
        landed = 0
        while landed < len(load.ok) and load.ok[landed]:
            landed += 1
        for j, owner in load.pins.items():
            pos = load.start + j
            if j < landed:
                mine = seq.block_table[pos]
                seq.block_table[pos] = owner
                self.blocks.release_block(mine)
            else:
                self.blocks.release_block(owner)
        load.pins.clear()
        by_tier: dict[Tier, int] = {}
        prefetched = 0
        for j, src in enumerate(load.sources):
            if isinstance(src, Tier):
                tier = src
            else:
                tier = src.tiers[src.pos[seq.key(load.start + j)]]
                prefetched += j < landed
            if j < landed:
                by_tier[tier] = by_tier.get(tier, 0) + 1
                self.stats.loaded_blocks[tier.name] += 1
            elif j not in load.absent:
                self.stats.load_fallback_blocks[tier.name] += 1  # there, recomputed: a load before it failed
        if self.host is not None:
            self.host.touch([seq.key(load.start + j) for j in range(landed) if load.sources[j] is Tier.CPU])
        load.done = True
        seq.loading = None
        self.on_loaded(seq, landed, by_tier, prefetched)
        self.wake.notify_all()

    def credit_gpu_hits(self, keys: list[bytes]) -> dict[Tier, int]:
        """Of a request's leading device blocks, those a prefetch landed (not used since):
        counted as loaded from the prefetch's source tier (under the lock)."""
        out: dict[Tier, int] = {}
        pfd = self.prefetched
        if not pfd:
            return out
        for k in keys:
            t = pfd.pop(k, None)
            if t is not None:
                out[t] = out.get(t, 0) + 1
        if len(pfd) > 2 * self.blocks.num_blocks:
            self.prefetched = {k: t for k, t in pfd.items() if k in self.blocks.by_key}
        return out

    # ------------------------------------------------------------------ link transfers (outside the lock)

    def _copier(self, tier: Tier) -> _Copier:
        c = self._copiers.get(tier)
        if c is None:
            c = self._copiers[tier] = _Copier(self.pool)
        return c

    def _stop_early(self, t: Transfer) -> bool:
        return t.cancelled or (not t.demand and time.monotonic() > t.deadline)

    def _run_cpu(self, t: Transfer) -> None:
        host = self.host
        assert host is not None
        c = self._copier(Tier.CPU)
        c.begin(t.after)
        marks = [time.perf_counter()]
        slots: list[Slot] = t.source
        for j, s in enumerate(slots):
            if self._stop_early(t):
                break
            if s.ready is not None:
                s.ready.synchronize()
            c.from_host(t.dst[j], host.block(s))
            if not t.demand:
                t.metas[j] = (s.meta, s.salt)
            t.ok[j] = True
            marks.append(time.perf_counter())
        c.finish()
        self._measure(Tier.CPU, marks)

    def _run_disk(self, t: Transfer) -> None:
        disk = self.disk
        assert disk is not None
        c = self._copier(Tier.DISK)
        c.begin(t.after)
        marks = [time.perf_counter()]
        for j, key in enumerate(t.keys):
            if self._stop_early(t):
                break
            rec = disk.get(key)
            if rec is None:
                if not disk.contains([key])[0]:  # gone without a word (a purge's discard raced a rewrite)
                    self._store_dropped(Tier.DISK, [key])
                break
            if not self._land_bytes(t, j, c, Tier.DISK, key, rec.meta, rec.payload):
                break
            marks.append(time.perf_counter())
        c.finish()
        self._measure(Tier.DISK, marks)

    def _run_remote(self, t: Transfer) -> None:
        remote = self.remote
        c = self._copier(Tier.REMOTE)
        c.begin(t.after)
        marks = [time.perf_counter()]
        st = remote.stats
        failures = st.io_errors + st.breaker_skips
        present = remote.contains(t.keys)
        if st.io_errors + st.breaker_skips == failures:  # the server answered: what it lacks is gone
            self._store_dropped(Tier.REMOTE, [k for k, f in zip(t.keys, present, strict=True) if not f])
        n = 0
        while n < len(present) and present[n]:
            n += 1
        t.absent_from = n
        for j in range(n):
            if self._stop_early(t):
                break
            rec = remote.get(t.keys[j])
            if rec is None or not self._land_bytes(t, j, c, Tier.REMOTE, t.keys[j], rec.meta, rec.payload):
                break
            marks.append(time.perf_counter())
        c.finish()
        self._measure(Tier.REMOTE, marks)

    def _run_peer(self, t: Transfer) -> None:
        c = self._copier(Tier.PEER)
        c.begin(t.after)
        marks = [time.perf_counter()]
        try:
            with _PeerStream(t.source, self.cfg.peer_token or "", t.keys, self.cfg.peer_timeout_s) as stream:
                for j, (key, meta, payload) in enumerate(read_records(stream.read, t.keys)):
                    if self._stop_early(t):
                        break
                    if not self._land_bytes(t, j, c, Tier.PEER, key, meta, payload):
                        break
                    marks.append(time.perf_counter())
        except (OSError, http.client.HTTPException, RecordError, ValueError) as e:
            with self.lock:
                self.stats.peer_errors += 1
            log.warning("peer pull from %s failed: %s", t.source, e)
        c.finish()
        self._measure(Tier.PEER, marks)

    def _land_bytes(self, t: Transfer, j: int, c: _Copier, tier: Tier, key: bytes, meta: bytes,
                    payload: bytes) -> bool:
        """One block's verified record into its pool block; False (and the block dropped
        where it came from) when its payload or meta is not what this engine stores. A
        demand load does not decode the meta (the request has its own; the key, checked
        with the record's crc, says which block it is); a prefetch needs it to publish."""
        try:
            m = decode_meta(meta, self.bs) if not t.demand else None
            if len(payload) != self.block_bytes:
                raise BadMeta(f"payload of {len(payload)} bytes, blocks are {self.block_bytes}")
        except BadMeta as e:
            log.warning("%s block %s rejected: %s", tier.name, key.hex()[:16], e)
            with self.lock:
                self.stats.bad_meta += 1
            if tier in (Tier.DISK, Tier.REMOTE):
                store: BlockStore | None = self.disk if tier is Tier.DISK else self.remote
                if store is not None:
                    store.discard([key])
                self._store_dropped(tier, [key])
            return False
        c.from_bytes(t.dst[j], payload)
        t.metas[j] = m
        t.ok[j] = True
        return True

    def _measure(self, tier: Tier, marks: list[float]) -> None:
        if len(marks) < 2:
            return
        meter = self.links[tier].meter
        n = len(marks) - 1
        with self.lock:
            meter.add(marks[1] - marks[0], self.block_bytes, marks[-1] - marks[1], (n - 1) * self.block_bytes)

    # ------------------------------------------------------------------ prefetch (under the lock)

    def prefetch(self, pid: str, keys: list[bytes], deadline_s: float, *, remote_present: set[bytes] | None = None,
                 peer_url: str | None = None, peer_held: set[bytes] | None = None) -> int:
        """Raise the leading `keys` toward the device pool from wherever they sit (REMOTE:
        those the server said it holds; PEER: those the peer said it holds). Returns the
        blocks accepted (not counting those on the device or moving already)."""
        if pid in self.prefetches:
            raise BadRequest(f"prefetch {pid!r} is already in flight", param="prefetch_id")
        if len(self.prefetches) >= self.cfg.prefetch_queue:
            raise PrefetchQueueFull(f"{len(self.prefetches)} prefetches in flight (the queue holds "
                                    f"{self.cfg.prefetch_queue})", retry_after=1.0)
        self.stats.prefetch_requests += 1
        host = self.host
        plan: list[tuple[bytes, Tier]] = []
        on_gpu: list[int] = []
        for k in keys:
            bid = self.blocks.by_key.get(k)
            if bid is not None:
                on_gpu.append(bid)
                continue
            if k in self.inflight:
                continue
            if host is not None and k in host.by_key:
                tier = Tier.CPU
            elif k in self.disk_keys:
                tier = Tier.DISK
            elif remote_present is not None and k in remote_present and Tier.REMOTE in self.links:
                tier = Tier.REMOTE
            elif peer_held is not None and k in peer_held and Tier.PEER in self.links:
                tier = Tier.PEER
            else:
                break
            plan.append((k, tier))
        for bid in on_gpu:  # the chain's device blocks must survive the room made below
            self.blocks.acquire(bid)
        plan = plan[: self.blocks.available()]
        if not plan:
            for bid in reversed(on_gpu):
                self.blocks.release_block(bid)
            return 0
        pkeys = [k for k, _ in plan]
        pf = Prefetch(pid, pkeys, [t for _, t in plan], [], time.monotonic() + deadline_s)
        pf.pos = {k: j for j, k in enumerate(pkeys)}
        pf.ok = [False] * len(plan)
        pf.metas = [None] * len(plan)
        cpu_keys = [k for k, t in plan if t is Tier.CPU]
        cpu_slots = self._pin_cpu(cpu_keys) if cpu_keys else []  # before making room (which may evict them)
        pf.dst = self.blocks.take(len(plan))
        for bid in reversed(on_gpu):
            self.blocks.release_block(bid)
        for k in pkeys:
            self.inflight[k] = pf
        self.prefetches[pid] = pf
        self.stats.prefetch_blocks_accepted += len(plan)
        for tier in dict.fromkeys(t for _, t in plan):
            js = [j for j, (_, t) in enumerate(plan) if t is tier]
            t = Transfer(tier, [pkeys[j] for j in js], [pf.dst[j] for j in js], (pf, js), False, pf.deadline,
                         after=self.offload_event)
            if tier is Tier.CPU:
                t.source = cpu_slots
            elif tier is Tier.PEER:
                t.source = peer_url
            pf.transfers.append(t)
            pf.pending += 1
            self.links[tier].enqueue(t)
        return len(plan)

    def cancel_prefetch(self, pid: str) -> bool:
        """Drop a prefetch's transfers not started (moving ones land). False when unknown or done."""
        pf = self.prefetches.get(pid)
        if pf is None or pf.cancelled:
            return False
        pf.cancelled = True
        self.stats.prefetch_cancelled += 1
        for t in pf.transfers:
            t.cancelled = True
            if not t.started and self.links[t.tier].remove(t):
                self._transfer_done(t)
        return True

    def _land_prefetch(self, pf: Prefetch) -> None:
        """All of a prefetch's transfers ended: register what arrived, in chain order, as
        cached device blocks; hand them to the requests that joined it."""
        if self.prefetches.get(pf.pid) is pf:
            del self.prefetches[pf.pid]
        for k in pf.keys:
            if self.inflight.get(k) is pf:
                del self.inflight[k]
        items: list[tuple[int, bytes, BlockMeta, str | None]] = []
        idx: list[int] = []
        for j, k in enumerate(pf.keys):
            m = pf.metas[j]
            if pf.ok[j] and m is not None and not pf.void:
                items.append((pf.dst[j], k, m[0], m[1]))
                idx.append(j)
        registered = [False] * len(pf.keys)
        for j, ok in zip(idx, self.blocks.adopt(items), strict=True):
            registered[j] = ok
            if ok:
                self.prefetched[pf.keys[j]] = pf.tiers[j]
        self.stats.prefetch_blocks_landed += sum(registered)
        for load, js in pf.waiters:
            for j in js:
                bid = self.blocks.by_key.get(load.seq.key(load.start + j))
                if bid is not None:
                    self.blocks.acquire(bid)
                    load.pins[j] = bid
                    load.ok[j] = True
                    self.prefetched.pop(load.seq.key(load.start + j), None)
            load.pending -= 1
        for bid in reversed(pf.dst):  # tail first: parents stay the most recent
            self.blocks.release_block(bid)
        for load, _ in pf.waiters:
            if load.pending == 0 and not load.done:
                self._finish_load(load)
        self.wake.notify_all()  # its blocks are cached now: a request waiting for room may go

    # ------------------------------------------------------------------ purge (under the lock)

    def purge(self, salt: str | None, everything: bool, gpu_dropped: list[bytes]) -> int:
        """Drop the salt's blocks (or all) from CPU, DISK and REMOTE; the device pool was
        purged by the caller (`gpu_dropped`). Store I/O goes to the writer thread. Returns
        the distinct blocks dropped over every tier."""
        dropped = set(gpu_dropped)
        removed: dict[str, list[bytes]] = {}
        host = self.host
        if host is not None:
            victims = [s for s in list(host.by_key.values()) if everything or (salt and s.salt == salt)]
            for s in victims:
                s.purged = True
                host.remove(s)
            removed["CPU"] = [s.key for s in victims]
        for tier, mirror in ((Tier.DISK, self.disk_keys), (Tier.REMOTE, self.remote_keys)):
            keys = [k for k, v in mirror.items() if everything or (salt and v.salt == salt)]
            for k in keys:
                del mirror[k]
            removed[tier.name] = keys
            if keys:
                self._writes.append(_Write(None, tier, keys))
                self._write_cond.notify()
        for pf in self.prefetches.values():
            pf.void = True
        if everything:
            self.prefetched.clear()
        else:
            self.prefetched = {k: t for k, t in self.prefetched.items() if k in self.blocks.by_key}
        for keys in removed.values():
            dropped.update(keys)
        if everything:
            if not gpu_dropped and any(removed.get(t) for t in ("CPU", "DISK")):
                self.blocks.events.append(AllBlocksCleared())
            if removed.get("REMOTE"):
                self.blocks.events.append(BlockRemoved(block_hashes(removed["REMOTE"]), "REMOTE"))
        else:
            for name in ("CPU", "DISK", "REMOTE"):
                if removed.get(name):
                    self.blocks.events.append(BlockRemoved(block_hashes(removed[name]), name))
        return len(dropped)

    # ------------------------------------------------------------------ peer export

    def locate(self, keys: list[bytes]) -> list[tuple[bytes, Tier, BlockMeta | None]]:
        """Which keys this worker can export, each in its fastest local tier, with metadata
        when at hand (under the lock). REMOTE blocks are not exported: a peer reads them itself."""
        out = []
        host = self.host
        for k in keys:
            bid = self.blocks.by_key.get(k)
            if bid is not None:
                out.append((k, Tier.GPU, self.blocks.blocks[bid].meta))
            elif host is not None and k in host.by_key:
                out.append((k, Tier.CPU, host.by_key[k].meta))
            elif k in self.disk_keys:
                out.append((k, Tier.DISK, None))
        return out

    def export(self, keys: list[bytes]) -> list[tuple[bytes, bytes, bytes]]:
        """(key, meta, payload) of the leading `keys` this worker holds, read outside the lock
        while each source is pinned (device blocks referenced, released tail first so that
        the LRU order of a chain is kept). Takes the lock."""
        from .blocks import Block

        srcs: list[tuple[bytes, Block | Slot | None]] = []
        with self.lock:
            for k in keys:
                bid = self.blocks.by_key.get(k)
                if bid is not None:
                    self.blocks.acquire(bid)
                    srcs.append((k, self.blocks.blocks[bid]))
                elif self.host is not None and k in self.host.by_key:
                    slot = self.host.by_key[k]
                    self.host.pin(slot)
                    srcs.append((k, slot))
                elif k in self.disk_keys:
                    srcs.append((k, None))
                else:
                    break
        out: list[tuple[bytes, bytes, bytes]] = []
        try:
            for k, src in srcs:
                if isinstance(src, Slot):
                    if src.ready is not None:
                        src.ready.synchronize()
                    assert self.host is not None
                    out.append((k, encode_meta(src.meta, src.salt, self.bs), block_bytes_of(self.host.block(src))))
                elif src is not None:
                    assert src.meta is not None
                    out.append((k, encode_meta(src.meta, src.salt, self.bs), self._device_bytes(src.id)))
                else:
                    assert self.disk is not None
                    rec = self.disk.get(k)
                    if rec is None:
                        break
                    out.append((k, rec.meta, rec.payload))
        finally:
            with self.lock:
                for _, src in reversed(srcs):
                    if isinstance(src, Slot):
                        if self.host is not None:
                            self.host.unpin(src)
                    elif src is not None:
                        self.blocks.release_block(src.id)
                self.stats.peer_exported_blocks += len(out)
        return out

    def _device_bytes(self, bid: int) -> bytes:
        block = self.pool.data[bid]
        if not self.cuda:
            return block_bytes_of(block)
        with torch.cuda.stream(self._export_stream):
            host = block.to("cpu", non_blocking=False)
        return block_bytes_of(host)

    # ------------------------------------------------------------------ reports (under the lock)

    def snapshot(self) -> dict[Tier, set[bytes]]:
        return {
            Tier.CPU: set(self.host.by_key) if self.host is not None else set(),
            Tier.DISK: set(self.disk_keys),
            Tier.REMOTE: set(self.remote_keys),
        }

    def metas(self) -> dict[bytes, BlockMeta]:
        """Metadata of every block held below the pool (under the lock): a republish's."""
        out: dict[bytes, BlockMeta] = {}
        for mirror in (self.remote_keys, self.disk_keys):
            for k, h in mirror.items():
                try:
                    out[k] = decode_meta(h.meta, self.bs)[0]
                except BadMeta:
                    continue
        if self.host is not None:
            out.update((k, s.meta) for k, s in self.host.by_key.items())
        return out

    def blocks_report(self) -> dict[str, BlockCounts]:
        out: dict[str, BlockCounts] = {}
        if self.host is not None:
            used = len(self.host.by_key)
            out["CPU"] = BlockCounts(used, self.host.capacity - used, self.host.capacity)
        if self.disk is not None and self.cfg.disk is not None:
            cap = self.cfg.disk.capacity_bytes // (HEADER_SIZE + 96 + self.block_bytes)
            used = len(self.disk_keys)
            out["DISK"] = BlockCounts(used, max(0, cap - used), cap)
        if self.remote is not None:
            out["REMOTE"] = BlockCounts(len(self.remote_keys), 0, 0)
        return out

    def links_report(self) -> dict[str, TierLink]:
        return {t.name: TierLink(link.meter.read_Bps, link.meter.latency_s) for t, link in self.links.items()}

    def counters(self) -> dict[str, dict[str, float]]:
        s = self.stats
        out: dict[str, dict[str, float]] = {
            "loaded_blocks": {k: float(v) for k, v in s.loaded_blocks.items() if k in self._tier_names()},
            "load_fallback_blocks": {k: float(v) for k, v in s.load_fallback_blocks.items()
                                     if k in self._tier_names()},
            "offload_dropped_blocks": {"": float(s.offload_dropped)},
            "offload_sync_writes": {"": float(s.sync_writes)},
            "tier_bytes_written": {k: float(v) for k, v in s.written_bytes.items() if k in self._tier_names()},
            "bad_block_meta": {"": float(s.bad_meta)},
            "prefetch_requests": {"": float(s.prefetch_requests)},
            "prefetch_blocks_accepted": {"": float(s.prefetch_blocks_accepted)},
            "prefetch_blocks_landed": {"": float(s.prefetch_blocks_landed)},
            "prefetch_cancelled": {"": float(s.prefetch_cancelled)},
            "prefetch_transfers_dropped": {"": float(sum(link.dropped for link in self.links.values()))},
            "link_bytes": {t.name: float(link.meter.bytes) for t, link in self.links.items()},
            "link_busy_seconds": {t.name: link.meter.busy_s for t, link in self.links.items()},
        }
        if Tier.PEER in self.links:
            out["peer_errors"] = {"": float(s.peer_errors)}
            out["peer_exported_blocks"] = {"": float(s.peer_exported_blocks)}
        stores = [st for st in (self.disk, self.remote) if st is not None]
        for name in ("puts", "refused", "hits", "misses", "checksum_errors", "truncated", "io_errors", "evicted",
                     "dropped", "breaker_trips", "breaker_skips"):
            vals = {st.tier: float(getattr(st.stats, name)) for st in stores}
            if vals:
                out[f"store_{name}"] = vals
        return out

    def _tier_names(self) -> set[str]:
        return {t.name for t in self.links}

    def _changed(self) -> None:
        cb = self.on_change
        if cb is not None:
            cb()


def _parents_first(evicted: list[EvictedBlock]) -> list[EvictedBlock]:
    """The batch with every block after its parent when both are in it (eviction usually
    comes tail first, but LRU order is not a promise)."""
    by_key = {e.key: e for e in evicted}
    depth: dict[bytes, int] = {}
    for e in evicted:
        path = []
        k: bytes | None = e.key
        while k is not None and k in by_key and k not in depth:
            path.append(k)
            k = by_key[k].meta.parent
        d = depth[k] + 1 if k is not None and k in depth else 0
        for x in reversed(path):
            depth[x] = d
            d += 1
    return sorted(evicted, key=lambda e: depth[e.key])


class _Copier:
    """Copies into the device pool for one link thread: direct on a CPU device; on CUDA
    through the link's own stream (staging bytes in pinned memory), waiting first for the
    offload copies of the blocks it overwrites, synchronised before the blocks are used."""

    STAGING = 32

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        self.stream: Any = None
        self.staging: torch.Tensor | None = None
        self.used = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(pool.device)  # type: ignore[no-untyped-call]
            self.staging = torch.empty((self.STAGING, *pool.data.shape[1:]), dtype=pool.data.dtype, pin_memory=True)

    def begin(self, after: Any) -> None:
        if self.cuda and after is not None:
            self.stream.wait_event(after)

    def from_host(self, dst: int, src: torch.Tensor) -> None:
        if not self.cuda:
            self.pool.data[dst].copy_(src)
            return
        with torch.cuda.stream(self.stream):
            self.pool.data[dst].copy_(src, non_blocking=True)

    def from_bytes(self, dst: int, payload: bytes) -> None:
        if not self.cuda:
            write_block(self.pool.data[dst], payload)
            return
        assert self.staging is not None
        if self.used == self.STAGING:
            self.stream.synchronize()
            self.used = 0
        buf = self.staging[self.used]
        self.used += 1
        write_block(buf, payload)
        with torch.cuda.stream(self.stream):
            self.pool.data[dst].copy_(buf, non_blocking=True)

    def finish(self) -> None:
        if self.cuda:
            self.stream.synchronize()
            self.used = 0


class _PeerStream:
    """A blocking `POST <peer>/kv/blocks` asking for records (the PEER link's thread)."""

    def __init__(self, url: str, token: str, keys: list[bytes], timeout: float) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"bad peer URL {url!r}")
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self._conn = cls(u.hostname, u.port, timeout=timeout)
        body = json.dumps({"keys_b64": base64.b64encode(b"".join(keys)).decode()})
        self._conn.request("POST", u.path.rstrip("/") + "/kv/blocks", body=body, headers={
            "Authorization": f"Bearer {token}", "Accept": RECORDS_MEDIA_TYPE, "Content-Type": "application/json"})
        self._resp = self._conn.getresponse()
        ctype = self._resp.getheader("Content-Type", "")
        if self._resp.status != 200 or not ctype.startswith(RECORDS_MEDIA_TYPE):
            raise OSError(f"peer {url} answered {self._resp.status} ({ctype})")

    def read(self, n: int) -> bytes:
        return self._resp.read(n)

    def __enter__(self) -> _PeerStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()
