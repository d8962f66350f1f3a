"""What the tiers below the device pool hold, and what the engine has published about them.

`TierState` is the one bookkeeping object the tier parts share (offload.py, writer.py,
loads.py, linkruns.py, export.py; tiers.py puts them together): the CPU pool, the DISK
and REMOTE stores, the mirrors of what was published as held in DISK and REMOTE, the
blocks moving up, the write queue, and the counters. Every structure is guarded by the
engine lock (`lock`), the same the engine thread holds for `schedule`/`commit`; store and
network calls are never made with it held. The few operations every part needs (is a
parent held, drop CPU blocks, queue a write or a discard, a store lost keys) live here so
that each is written once.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from kvindex.events import BlockRemoved
from kvindex.keys import Namespace
from kvindex.tiers import Tier
from workers.blockmeta import block_hashes

from .blocks import BlockManager
from .hostpool import HostPool, Slot
from .kvpool import KVPool
from .links import Link
from .store.base import BlockStore
from .store.disk import DiskConfig, DiskStore
from .store.mac import BlockMac

if TYPE_CHECKING:
    from .loads import Prefetch

RemoteWrite = Literal["gpu-evict", "cpu-evict"]


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
    # The fleet secret: bearer token of peer pulls and exports, and (through a KDF) the key
    # of the MAC every REMOTE value and PEER record carries (store/mac.py). REMOTE needs it.
    peer_token: str | None = None
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
        if self.remote is not None and not self.peer_token:
            raise ValueError("the REMOTE tier needs the fleet secret (--peer-token or $KVROUTE_PEER_TOKEN): its "
                             "blocks carry a MAC keyed with it, so that no one without it can plant KV there")

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0 or self.peer_token is not None


def remote_namespace(ns: Namespace) -> str:
    """REMOTE key prefix of a model namespace (model, revision, dtype, parallelism, block size)."""
    return "kvroute-" + ns.digest.hex()[:24]


def _per_tier(*names: str) -> Any:
    return field(default_factory=lambda: dict.fromkeys(names, 0))


@dataclass(slots=True)
class TierStats:
    loaded_blocks: dict[str, int] = _per_tier("CPU", "DISK", "REMOTE", "PEER")
    load_fallback_blocks: dict[str, int] = _per_tier("CPU", "DISK", "REMOTE", "PEER")
    stored: dict[str, int] = _per_tier("CPU", "DISK", "REMOTE")
    evicted: dict[str, int] = _per_tier("CPU", "DISK", "REMOTE")
    offload_dropped: int = 0  # evicted GPU blocks not kept: no CPU slot free of readers/writers
    sync_writes: int = 0  # CPU evictions that had to write below first, in line (a burst)
    written_bytes: dict[str, int] = _per_tier("DISK", "REMOTE")
    bad_meta: int = 0
    peer_errors: int = 0
    peer_mac_failures: int = 0  # peer records whose MAC did not verify (never landed)
    peer_exported_blocks: int = 0
    prefetch_requests: int = 0
    prefetch_blocks_accepted: int = 0
    prefetch_blocks_landed: int = 0
    prefetch_cancelled: int = 0


@dataclass(slots=True, eq=False)
class Write:
    """A write of a CPU slot into DISK or REMOTE, or (slot None) a discard of `keys` there."""

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


class TierState:
    """See the module doc. Built once by `KVTiers`; the parts keep a reference to it."""

    def __init__(self, cfg: TierConfig, *, pool: KVPool, blocks: BlockManager, namespace: Namespace,
                 lock: threading.RLock, wake: threading.Condition) -> None:
        self.cfg = cfg
        self.pool = pool
        self.blocks = blocks
        self.bs = pool.block_size
        self.block_bytes = pool.block_bytes
        self.lock = lock
        self.wake = wake
        self.on_change: Callable[[], None] | None = None  # set by the engine: events to publish
        self.cuda = pool.device.type == "cuda"
        self.stats = TierStats()
        self.host = (HostPool(pool.shape, cfg.cpu_bytes // self.block_bytes, self.bs, pinned=self.cuda)
                     if cfg.cpu_bytes else None)
        self.disk_keys: dict[bytes, Held] = {}  # what we published as held on DISK
        self.remote_keys: dict[bytes, Held] = {}  # what we put into REMOTE (and published)
        self.inflight: dict[bytes, Prefetch] = {}  # blocks a prefetch is moving up
        self.prefetches: dict[str, Prefetch] = {}
        self.prefetched: dict[bytes, Tier] = {}  # landed by a prefetch, not used yet -> source tier
        self.links: dict[Tier, Link] = {}  # one per source tier, filled by `KVTiers`
        self.offload_event: Any = None  # CUDA: the last offload copy (writers of pool blocks wait for it)
        self.writes: deque[Write] = deque()
        self.write_cond = threading.Condition(lock)
        self.arriving: set[bytes] = set()  # evicted blocks the offload has not placed in CPU yet
        self.arrival_kept: dict[bytes, list[tuple[Tier, bytes]]] = {}  # their children written below meanwhile
        self.disk = (DiskStore(cfg.disk, on_drop=lambda keys: self.store_dropped(Tier.DISK, keys))
                     if cfg.disk is not None else None)
        # Blocks leaving the worker are tagged with the fleet secret; PEER tags are bound to
        # the model namespace (REMOTE's also to the group: RedisStore.scope).
        self.mac = BlockMac(cfg.peer_token) if cfg.peer_token else None
        self.peer_scope = b"PEER\0" + remote_namespace(namespace).encode()
        self.remote: Any = None
        self.remote_group: str | None = None
        if cfg.remote is not None:
            from .store.remote import RedisStore

            rcfg = replace(cfg.remote, namespace=remote_namespace(namespace))
            self.remote = RedisStore(rcfg, on_drop=lambda keys: self.store_dropped(Tier.REMOTE, keys), mac=self.mac)
            self.remote_group = rcfg.group

    def mirror(self, tier: Tier) -> dict[bytes, Held]:
        """What we published as held in DISK or REMOTE."""
        return self.disk_keys if tier is Tier.DISK else self.remote_keys

    def store(self, tier: Tier) -> BlockStore | None:
        """The store of DISK or REMOTE."""
        return self.disk if tier is Tier.DISK else self.remote

    def below_tier(self, key: bytes) -> Tier | None:
        """CPU or DISK, the faster first, when this worker holds the block there (under the lock)."""
        if self.host is not None and key in self.host.by_key:
            return Tier.CPU
        return Tier.DISK if key in self.disk_keys else None

    def local(self, key: bytes) -> bool:
        """On this worker's GPU, CPU or DISK (under the lock)."""
        return key in self.blocks.by_key or self.below_tier(key) is not None

    def held(self, key: bytes) -> bool:
        """In some tier of this worker (under the lock): a block's parent must be, for its
        BlockStored to name a parent the subscriber knows."""
        return self.local(key) or key in self.remote_keys

    def remove_cpu(self, slots: list[Slot]) -> None:
        """Drop CPU blocks and publish their removal (under the lock)."""
        host = self.host
        assert host is not None
        gone = [s.key for s in slots if host.remove(s)]
        if gone:
            self.stats.evicted["CPU"] += len(gone)
            self.blocks.events.append(BlockRemoved(block_hashes(gone), "CPU"))

    def push_write(self, w: Write) -> None:
        """Queue a write (its slot pinned until it is done) or a discard for the writer thread."""
        if w.slot is not None:
            assert self.host is not None
            self.host.pin(w.slot)
        self.writes.append(w)
        self.write_cond.notify()

    def retract(self, kept: list[tuple[Tier, bytes]]) -> None:
        """Take back blocks written below and published (under the lock): forget them,
        publish their removal, queue their discard."""
        for tier in (Tier.DISK, Tier.REMOTE):
            mirror = self.mirror(tier)
            keys = [k for t, k in kept if t is tier and mirror.pop(k, None) is not None]
            if keys:
                self.stats.evicted[tier.name] += len(keys)
                self.blocks.events.append(BlockRemoved(block_hashes(keys), tier.name))
                self.push_write(Write(None, tier, keys))

    def store_dropped(self, tier: Tier, keys: list[bytes]) -> None:
        """A store lost keys on its own (evicted segment, bad record, expired): publish it.
        Called by the stores from inside their calls, never with the lock held."""
        with self.lock:
            mirror = self.mirror(tier)
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
        self.changed()

    def changed(self) -> None:
        """Tell the engine there are events to publish."""
        cb = self.on_change
        if cb is not None:
            cb()
