"""The KV tiers below the device pool: CPU DRAM, DISK and REMOTE, and the peers' memory.

`KVTiers` is what the engine sees of them: it puts together the shared bookkeeping
(tierstate.py: the CPU pool, the stores, what was published as held) and the parts that
change it, each in its own module, and gives the engine one object to call. Design and
numbers: docs/engine.md § Tiers. The parts:

- **Offload** (offload.py): evicted device blocks copied into CPU before reuse.
- **Writer** (writer.py): DISK write-behind and REMOTE puts on one thread; the REMOTE audit.
- **Loads and prefetch** (loads.py): a request's blocks raised at admission, and ahead of
  it on /kv/prefetch, over one link thread per source tier (links.py, linkruns.py).
- **Peer export** (export.py), the DISK scan at start (diskscan.py); purge and the reports
  are here.
- **Failure is a miss**: a block that does not arrive intact cuts the load there; the
  stores drop what they find bad (`on_drop`) and the removal is published; every case is
  counted (`counters`).

Locking: every bookkeeping structure is guarded by the engine lock (`lock`), the same the
engine thread holds for `schedule`/`commit`. Store and network calls are never made with
it held (the stores call `on_drop` from inside `get`/`put`, which takes it). Methods say
whether they expect the lock held ("under the lock") or take it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from kvindex.events import AllBlocksCleared, BlockRemoved
from kvindex.keys import Namespace
from kvindex.tiers import Tier
from kvwire import BlockCounts, TierLink
from workers.blockmeta import BlockMeta, block_hashes

from .blockio import BadMeta, decode_meta
from .blocks import BlockManager, EvictedBlock
from .diskscan import publish_disk_scan
from .export import Export
from .kvpool import KVPool
from .linkruns import LinkRuns
from .links import Link, LinkMeter
from .loads import Load, Loads
from .offload import Offload
from .sequence import Sequence
from .store.record import HEADER_SIZE
from .tierstate import TierConfig, TierState, Write
from .writer import Writer

__all__ = ["KVTiers", "TierConfig"]

# Until a link has moved anything, /load reports these (a 2-core CPU host's orders
# of magnitude; replaced by the link's own measurements after its first transfer).
PRIORS: dict[Tier, tuple[float, float]] = {
    Tier.CPU: (5.0e9, 1.0e-4),
    Tier.DISK: (1.0e9, 1.0e-3),
    Tier.REMOTE: (5.0e8, 1.0e-3),
    Tier.PEER: (5.0e8, 2.0e-3),
}


class KVTiers(TierState):
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
    ) -> None:
        super().__init__(cfg, pool=pool, blocks=blocks, namespace=namespace, lock=lock, wake=wake)
        self.writer = Writer(self)
        self.offloader = Offload(self, self.writer)
        self.loads = Loads(self, on_loaded=on_loaded, prefill_cost=prefill_cost, prefill_samples=prefill_samples)
        self.exporter = Export(self)
        for tier, run in LinkRuns(self).runs().items():
            bw, lat = PRIORS[tier]
            self.links[tier] = Link(tier, lock, LinkMeter(bw, lat), run, self.loads.transfer_done)
        self.writer.start()
        if self.disk is not None:
            publish_disk_scan(self)

    # ------------------------------------------------------------------ lifecycle

    def close(self, timeout: float = 10.0) -> None:
        """Finish the writes queued (so a restart finds them), stop the threads, close the stores.
        Takes the lock. Idempotent."""
        if self.writer.stopping:
            return
        self.drain(timeout)
        with self.lock:
            self.writer.stop()
            for link in self.links.values():
                link.stop()
        self.writer.join(timeout)
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
                if self.writer.dirty(s):
                    host.start_leaving(s)
                    self.writer.queue_writes(s)
                elif not s.pins:
                    self.remove_cpu([s])
        self.drain(timeout)

    def idle(self) -> bool:
        """Nothing queued or moving (under the lock)."""
        return (not self.writes and not self.writer.writing and not self.prefetches
                and all(link.idle() for link in self.links.values()))

    def before_compute(self) -> None:
        """CUDA: the next forward waits for the offload copies of the blocks it may overwrite."""
        ev = self.offload_event
        if ev is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(ev)

    # ------------------------------------------------------------------ the parts, as the engine calls them

    def offload(self, evicted: list[EvictedBlock]) -> None:
        """`BlockManager.on_evict` (under the lock): offload.py."""
        self.offloader.offload(evicted)

    def plan(self, seq: Sequence, gpu_blocks: int) -> Load | None:
        return self.loads.plan(seq, gpu_blocks)

    def abandon(self, load: Load) -> None:
        self.loads.abandon(load)

    def load_blocks(self, load: Load) -> int:
        return len(load.sources)

    def start(self, load: Load) -> None:
        self.loads.start(load)

    def cancel(self, seq: Sequence) -> None:
        self.loads.cancel(seq)

    def credit_gpu_hits(self, keys: list[bytes]) -> dict[Tier, int]:
        return self.loads.credit_gpu_hits(keys)

    def prefetch(self, pid: str, keys: list[bytes], deadline_s: float, *, remote_present: set[bytes] | None = None,
                 peer_url: str | None = None, peer_held: set[bytes] | None = None) -> int:
        return self.loads.prefetch(pid, keys, deadline_s, remote_present=remote_present, peer_url=peer_url,
                                   peer_held=peer_held)

    def cancel_prefetch(self, pid: str) -> bool:
        return self.loads.cancel_prefetch(pid)

    def reconcile_remote(self) -> int:
        return self.writer.reconcile_remote()

    def locate(self, keys: list[bytes]) -> list[tuple[bytes, Tier, BlockMeta | None]]:
        return self.exporter.locate(keys)

    def export(self, keys: list[bytes]) -> list[tuple[bytes, bytes, bytes, bytes]]:
        """(key, meta, payload, MAC) of the leading `keys` held here, for a peer (off the loop:
        reading and tagging cost a block's bytes each)."""
        mac = self.mac
        if mac is None:  # no fleet secret: /kv/blocks is refused before it gets here
            raise RuntimeError("peer export without a fleet secret")
        return [(k, m, p, mac.tag(self.peer_scope, k, m, p)) for k, m, p in self.exporter.export(keys)]

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
        for tier in (Tier.DISK, Tier.REMOTE):
            mirror = self.mirror(tier)
            keys = [k for k, v in mirror.items() if everything or (salt and v.salt == salt)]
            for k in keys:
                del mirror[k]
            removed[tier.name] = keys
            if keys:
                self.push_write(Write(None, tier, keys))
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
        # blocks refused for a MAC that did not verify (forged, or another fleet's): never served
        macs = {"PEER": float(s.peer_mac_failures)} if Tier.PEER in self.links else {}
        if self.remote is not None:
            macs["REMOTE"] = float(self.remote.stats.mac_failures)
        if macs:
            out["block_mac_failures"] = macs
        stores = [st for st in (self.disk, self.remote) if st is not None]
        for name in ("puts", "refused", "hits", "misses", "checksum_errors", "truncated", "io_errors", "evicted",
                     "dropped", "breaker_trips", "breaker_skips"):
            vals = {st.tier: float(getattr(st.stats, name)) for st in stores}
            if vals:
                out[f"store_{name}"] = vals
        return out

    def _tier_names(self) -> set[str]:
        return {t.name for t in self.links}
