"""Peer export: the blocks a peer asks for (`/kv/blocks`), read from this worker's tiers.

A block is exported from its fastest local tier (GPU, CPU, DISK); REMOTE blocks are not
exported, a peer reads them itself. Sources are pinned under the lock and read outside it
(device blocks referenced, released tail first so that the LRU order of a chain is kept).
"""
from __future__ import annotations

from typing import Any

import torch

from kvindex.tiers import Tier
from workers.blockmeta import BlockMeta

from .blockio import block_bytes_of, encode_meta
from .blocks import Block
from .hostpool import Slot
from .tierstate import TierState


class Export:
    """See the module doc."""

    def __init__(self, st: TierState) -> None:
        self.st = st
        self._stream: Any = torch.cuda.Stream(st.pool.device) if st.cuda else None  # type: ignore[no-untyped-call]

    def locate(self, keys: list[bytes]) -> list[tuple[bytes, Tier, BlockMeta | None]]:
        """Which keys this worker can export, each in its fastest local tier, with metadata
        when at hand (under the lock)."""
        st = self.st
        out = []
        host = st.host
        for k in keys:
            bid = st.blocks.by_key.get(k)
            if bid is not None:
                out.append((k, Tier.GPU, st.blocks.blocks[bid].meta))
            elif host is not None and k in host.by_key:
                out.append((k, Tier.CPU, host.by_key[k].meta))
            elif k in st.disk_keys:
                out.append((k, Tier.DISK, None))
        return out

    def export(self, keys: list[bytes]) -> list[tuple[bytes, bytes, bytes]]:
        """(key, meta, payload) of the leading `keys` this worker holds. Takes the lock."""
        st = self.st
        srcs = self._pin(keys)
        out: list[tuple[bytes, bytes, bytes]] = []
        try:
            for k, src in srcs:
                rec = self._read(k, src)
                if rec is None:
                    break
                out.append(rec)
        finally:
            with st.lock:
                for _, src in reversed(srcs):
                    if isinstance(src, Slot):
                        if st.host is not None:
                            st.host.unpin(src)
                    elif src is not None:
                        st.blocks.release_block(src.id)
                st.stats.peer_exported_blocks += len(out)
        return out

    def _pin(self, keys: list[bytes]) -> list[tuple[bytes, Block | Slot | None]]:
        """The leading keys held locally, each with its source pinned (None: on DISK)."""
        st = self.st
        srcs: list[tuple[bytes, Block | Slot | None]] = []
        with st.lock:
            for k in keys:
                bid = st.blocks.by_key.get(k)
                if bid is not None:
                    st.blocks.acquire(bid)
                    srcs.append((k, st.blocks.blocks[bid]))
                elif st.host is not None and k in st.host.by_key:
                    slot = st.host.by_key[k]
                    st.host.pin(slot)
                    srcs.append((k, slot))
                elif k in st.disk_keys:
                    srcs.append((k, None))
                else:
                    break
        return srcs

    def _read(self, k: bytes, src: Block | Slot | None) -> tuple[bytes, bytes, bytes] | None:
        """One pinned source's record, outside the lock; None when DISK lost it meanwhile."""
        st = self.st
        if isinstance(src, Slot):
            if src.ready is not None:
                src.ready.synchronize()
            assert st.host is not None
            return k, encode_meta(src.meta, src.salt, st.bs), block_bytes_of(st.host.block(src))
        if src is not None:
            assert src.meta is not None
            return k, encode_meta(src.meta, src.salt, st.bs), self._device_bytes(src.id)
        assert st.disk is not None
        rec = st.disk.get(k)
        return None if rec is None else (k, rec.meta, rec.payload)

    def _device_bytes(self, bid: int) -> bytes:
        block = self.st.pool.data[bid]
        if not self.st.cuda:
            return block_bytes_of(block)
        with torch.cuda.stream(self._stream):
            host = block.to("cpu", non_blocking=False)
        return block_bytes_of(host)
