"""Offload: device blocks the block manager evicts, copied into the CPU tier before reuse.

`Offload.offload` is the block manager's `on_evict` (engine thread, under the engine
lock). Each evicted block is copied into a CPU slot before its pool slot is reused: on
CUDA on the offload stream (an event the next forward and every load wait for), on a CPU
device a memcpy. `BlockStored(CPU)` comes before the eviction's `BlockRemoved(GPU)`.
Making room in CPU evicts its LRU block: a clean one at once, a dirty one after its
write below, in line (writer.py). A block whose parent is held nowhere is not kept.
"""
from __future__ import annotations

from typing import Any

import torch

from kvindex.tiers import Tier
from workers.blockmeta import stored_events

from .blocks import EvictedBlock
from .hostpool import Slot
from .tierstate import TierState
from .writer import Writer


class Offload:
    """Evicted device blocks into the CPU tier (under the lock)."""

    def __init__(self, st: TierState, writer: Writer) -> None:
        self.st = st
        self.writer = writer
        self._stream: Any = torch.cuda.Stream(st.pool.device) if st.cuda else None  # type: ignore[no-untyped-call]

    def offload(self, evicted: list[EvictedBlock]) -> None:
        """Copy evicted device blocks into the CPU tier before their slots are reused,
        publish them there, queue what goes further down."""
        st = self.st
        if st.host is None:
            return
        chain = parents_first(evicted)
        # Making room writes the oldest CPU blocks below in line, maybe children of blocks of
        # this batch (a chain leaving the pool over several evictions, children first): out
        # of the pool and not yet in CPU, those parents count as held while they are on
        # their way (`Writer.commit`); a child kept so is taken back if its parent is dropped.
        st.arriving = {e.key for e in chain}
        st.arrival_kept = {}
        try:
            self._offload(chain)
        finally:
            st.arriving, st.arrival_kept = set(), {}
        self.writer.keep_clean()

    def _offload(self, chain: list[EvictedBlock]) -> None:
        st = self.st
        host = st.host
        assert host is not None
        copies: list[tuple[int, Slot]] = []
        for e in chain:
            s = host.get(e.key)
            if s is not None:  # inclusive tiers: the CPU copy is still there
                st.arriving.discard(e.key)
                self.writer.queue_remote_on_gpu_evict(s)
                continue
            if not host.free and copies:
                # making room evicts CPU blocks, maybe one added by this batch: its copy and
                # its BlockStored must come first
                self._place(copies)
                copies = []
            parent = e.meta.parent
            sid = None
            if parent is None or st.held(parent):  # else an orphan: its parent is held nowhere
                sid = self._free_slot()  # (may evict CPU blocks: the parent check comes again after)
            st.arriving.discard(e.key)
            if sid is None or (parent is not None and not st.held(parent)):
                if sid is not None:  # its parent went to make room, and was not kept below
                    host.free.append(sid)
                st.retract(st.arrival_kept.pop(e.key, []))  # its children kept below: orphans now
                st.stats.offload_dropped += 1
                continue
            copies.append((e.block_id, host.add(sid, e.key, e.meta, e.salt)))
        if copies:
            self._place(copies)

    def _place(self, copies: list[tuple[int, Slot]]) -> None:
        """Copy evicted blocks into their new CPU slots, publish them, queue REMOTE writes."""
        st = self.st
        assert st.host is not None
        self._copy_out(copies)
        new = [s.key for _, s in copies]
        st.stats.stored["CPU"] += len(new)
        st.blocks.events.extend(stored_events(Tier.CPU, new, {s.key: s.meta for _, s in copies}, st.bs))
        st.host.touch(new)
        for _, s in copies:
            self.writer.queue_remote_on_gpu_evict(s)

    def _copy_out(self, copies: list[tuple[int, Slot]]) -> None:
        st = self.st
        host = st.host
        assert host is not None
        data = st.pool.data
        if not st.cuda:
            for bid, s in copies:
                host.data[s.id].copy_(data[bid])
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(st.pool.device))
        with torch.cuda.stream(stream):
            for bid, s in copies:
                host.data[s.id].copy_(data[bid], non_blocking=True)
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(stream)
        st.offload_event = ev
        for _, s in copies:
            s.ready = ev

    def _free_slot(self) -> int | None:
        """A CPU slot for a new block: a free one, else the LRU block's (nobody reading it).
        A clean LRU block (its DISK copy written ahead by the writer) goes at once; a dirty
        one is written below first, here and now (the rare case of a burst the write-behind
        did not cover: exact LRU cascade order, at the cost of I/O under the lock)."""
        st = self.st
        host = st.host
        assert host is not None
        sid = host.take_free()
        if sid is not None:
            return sid
        s = host.oldest()
        if s is None:
            return None
        if self.writer.dirty(s):
            self.writer.write_now(s)
        if not s.dropped:
            st.remove_cpu([s])
        return host.take_free()


def parents_first(evicted: list[EvictedBlock]) -> list[EvictedBlock]:
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
