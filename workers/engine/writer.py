"""Writing CPU blocks below: DISK write-behind and REMOTE puts, on one writer thread.

A CPU block is *dirty* while it still has to be written to DISK (when there is a DISK
tier) or to REMOTE (when REMOTE is written as blocks leave CPU) before its CPU copy may
go. Writes run in batches on the writer thread, outside the engine lock, overlapped with
compute; a batch is committed under the lock: what was stored is published (an orphan, or
a block purged meanwhile, is taken back and discarded), and slots waiting to leave go.
Write-behind keeps the oldest quarter of a nearly full CPU tier clean, so that making room
rarely writes in line (`write_now`, counted as `sync_writes`). Every `remote_audit_s` the
thread asks the REMOTE server which published blocks it still holds.
"""
from __future__ import annotations

import logging
import threading
import time

from kvindex.tiers import Tier
from workers.blockmeta import BlockMeta, stored_events

from .blockio import block_bytes_of, encode_meta
from .hostpool import Slot
from .tierstate import Held, TierState, Write

log = logging.getLogger(__name__)

WRITE_BATCH = 64


class Writer:
    """The writer thread and the write policy over a `TierState`."""

    def __init__(self, st: TierState) -> None:
        self.st = st
        self.writing = False  # a batch is out of the queue and not committed yet
        self.stopping = False
        self.clean_target = max(1, int(st.host.capacity * st.cfg.clean_fraction)) if st.host is not None else 0
        self._thread = threading.Thread(target=self._loop, name="kv-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end once the queue is empty (under the lock)."""
        self.stopping = True
        self.st.write_cond.notify_all()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    # ------------------------------------------------------------------ policy (under the lock)

    def _wants(self, s: Slot, tier: Tier) -> bool:
        """Must the block still be written to `tier` (DISK; REMOTE when it is written as
        blocks leave CPU) before its CPU copy goes?"""
        st = self.st
        if tier is Tier.DISK:
            return st.disk is not None and s.key not in st.disk_keys and not s.disk_tried
        return (st.remote is not None and st.cfg.remote_write == "cpu-evict"
                and s.key not in st.remote_keys and not s.remote_tried)

    def dirty(self, s: Slot) -> bool:
        """Must the block be written below before its CPU copy goes?"""
        return self._wants(s, Tier.DISK) or self._wants(s, Tier.REMOTE)

    def _needed(self, s: Slot, *, queued_too: bool) -> list[Write]:
        """The writes a dirty slot still needs (`queued_too`: even those queued already), marked as under way."""
        jobs = []
        if self._wants(s, Tier.DISK) and (queued_too or not s.writing_disk):
            s.writing_disk = True
            jobs.append(Write(s, Tier.DISK))
        if self._wants(s, Tier.REMOTE) and (queued_too or not s.writing_remote):
            s.writing_remote = True
            jobs.append(Write(s, Tier.REMOTE))
        return jobs

    def queue_writes(self, s: Slot) -> None:
        """Queue the writes a dirty slot still needs (each pins it)."""
        for w in self._needed(s, queued_too=False):
            self.st.push_write(w)

    def write_now(self, s: Slot) -> None:
        """The writes a dirty slot needs, synchronously (under the lock: the stores' `on_drop`
        re-enters it, which the engine's RLock allows)."""
        st = self.st
        jobs = self._needed(s, queued_too=True)
        assert st.host is not None
        for w in jobs:
            st.host.pin(s)
            self.write(w)
        st.stats.sync_writes += len(jobs)
        self.commit(jobs)

    def queue_remote_on_gpu_evict(self, s: Slot) -> None:
        st = self.st
        if (st.remote is not None and st.cfg.remote_write == "gpu-evict" and s.key not in st.remote_keys
                and not s.writing_remote and not s.dropped):
            s.writing_remote = True
            st.push_write(Write(s, Tier.REMOTE))

    def keep_clean(self) -> None:
        """Write-behind: once the CPU tier is nearly full, keep its oldest blocks (a quarter
        of it) written below ahead of need, so that making room never waits for the disk."""
        st = self.st
        host = st.host
        if host is None or (st.disk is None and st.cfg.remote_write != "cpu-evict"):
            return
        if len(host.free) >= self.clean_target:
            return  # room enough: nothing leaves CPU soon, nothing is written ahead
        n = queued = 0
        for k in host.lru:
            if n >= self.clean_target or queued >= 2 * WRITE_BATCH:
                break
            n += 1
            s = host.by_key[k]
            if self.dirty(s) and not s.writing_disk and not s.writing_remote:
                self.queue_writes(s)
                queued += 1

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        st = self.st
        cond = st.write_cond
        audit = st.cfg.remote_audit_s if st.remote is not None else None
        next_audit = time.monotonic() + audit if audit else None
        while True:
            with cond:
                while not st.writes:
                    if self.stopping:
                        return
                    if next_audit is not None and time.monotonic() >= next_audit:
                        break
                    cond.wait(None if next_audit is None else max(0.0, next_audit - time.monotonic()))
                batch = [st.writes.popleft() for _ in range(min(WRITE_BATCH, len(st.writes)))]
                self.writing = bool(batch)
            if not batch:
                assert audit is not None
                next_audit = time.monotonic() + audit
                try:
                    self.reconcile_remote()
                except Exception:
                    log.exception("REMOTE audit failed")
                continue
            self._run(batch)

    def _run(self, batch: list[Write]) -> None:
        try:
            for w in batch:
                self.write(w)
        except Exception:
            log.exception("KV writer failed on a batch")
        with self.st.write_cond:
            try:
                self.commit(batch)
            except Exception:
                log.exception("KV writer could not commit a batch")
            finally:
                self.writing = False
        self.st.changed()

    def reconcile_remote(self) -> int:
        """Ask the REMOTE server which of the blocks we published it still holds (the group's
        TTLs, its own evictions and deletes happen behind our back) and publish the removal of
        the others. No verdict while the server is unavailable. Takes the lock; returns how
        many were gone."""
        st = self.st
        remote = st.remote
        if remote is None:
            return 0
        with st.lock:
            keys = list(st.remote_keys)
        gone: list[bytes] = []
        stats = remote.stats
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            failures = stats.io_errors + stats.breaker_skips
            present = remote.contains(batch)
            if stats.io_errors + stats.breaker_skips != failures:
                return 0
            gone += [k for k, f in zip(batch, present, strict=True) if not f]
        st.store_dropped(Tier.REMOTE, gone)
        return len(gone)

    def write(self, w: Write) -> None:
        """One write or discard, outside the lock."""
        st = self.st
        store = st.store(w.tier)
        if w.slot is None:  # a purge's discard
            if store is not None:
                store.discard(w.keys)
            return
        s = w.slot
        if s.ready is not None:
            s.ready.synchronize()
        assert st.host is not None and store is not None
        payload = block_bytes_of(st.host.block(s))
        w.meta = encode_meta(s.meta, s.salt, st.bs)
        w.ok = store.put(s.key, w.meta, payload)

    def commit(self, batch: list[Write]) -> None:
        """Commit a batch (under the lock): publish what was stored, let leaving slots go."""
        st = self.st
        stored: dict[Tier, list[bytes]] = {Tier.DISK: [], Tier.REMOTE: []}
        metas: dict[bytes, BlockMeta] = {}
        undo: dict[Tier, list[bytes]] = {Tier.DISK: [], Tier.REMOTE: []}
        leaving: list[Slot] = []
        for w in batch:
            s = w.slot
            if s is None or st.host is None:
                continue
            self._settle(w, s, stored[w.tier], undo[w.tier], metas)
            st.host.unpin(s)
            if s.leaving and not s.writing_disk and not s.writing_remote:
                leaving.append(s)
        for tier, keys in stored.items():
            if keys:
                st.stats.stored[tier.name] += len(keys)
                st.blocks.events.extend(stored_events(tier, keys, metas, st.bs))
        if leaving:
            st.remove_cpu(leaving)
        for tier, keys in undo.items():
            if keys:
                st.push_write(Write(None, tier, keys))

    def _settle(self, w: Write, s: Slot, stored: list[bytes], undo: list[bytes], metas: dict[bytes, BlockMeta]) -> None:
        """One write's outcome: marked tried, and when it succeeded, kept (to be published) or
        taken back — purged meanwhile, or an orphan (its parent held nowhere, not stored in
        this batch, not on its way into CPU)."""
        st = self.st
        if w.tier is Tier.DISK:
            s.writing_disk = False
            s.disk_tried = True
        else:
            s.writing_remote = False
            s.remote_tried = True
        if not w.ok:
            return
        st.stats.written_bytes[w.tier.name] += st.block_bytes
        parent = s.meta.parent
        mirror = st.mirror(w.tier)
        if s.purged or (parent is not None and not st.held(parent) and parent not in stored
                        and parent not in st.arriving):
            undo.append(s.key)
        elif s.key not in mirror:
            mirror[s.key] = Held(s.salt, w.meta)
            stored.append(s.key)
            metas[s.key] = s.meta
            if parent is not None and parent in st.arriving:
                st.arrival_kept.setdefault(parent, []).append((w.tier, s.key))
