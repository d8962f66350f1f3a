"""The REMOTE tier: one store shared by the engines of a group (an in-process object).

Every engine of the group writes blocks into it and reads from it over its own REMOTE
link (its NIC); capacity is the group's, evicted LRU. The store keeps each block's
metadata (parent, token ids, extra keys) so a reader can publish `BlockStored` for a
block another engine computed. Who publishes: the engine whose call changed the store
(a write publishes `BlockStored(REMOTE)` for the new blocks and `BlockRemoved(REMOTE)`
for what it pushed out), so a subscriber that merges the group's streams sees the store.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any


class RemoteStore:
    """LRU block store of one remote group; keys are full 32-byte block keys."""

    __slots__ = (
        "name", "capacity_blocks", "block_size", "blocks", "meta", "bytes_written", "blocks_written",
        "available", "corrupt",
    )

    def __init__(self, name: str, capacity_blocks: int, block_size: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("remote store capacity must be positive")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.meta: dict[bytes, Any] = {}
        self.bytes_written = 0
        self.blocks_written = 0
        # A store that is down (set_available(False)) holds its data but answers nothing:
        # lookups miss (the engines recompute), writes are skipped.
        self.available = True
        self.corrupt: set[bytes] = set()  # damaged copies (injected), dropped when read

    def set_available(self, available: bool) -> None:
        """Take the backend down or bring it back (transfers already moving complete)."""
        self.available = available

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def put(
        self, keys: list[bytes], metas: dict[bytes, Any] | None, block_bytes: int
    ) -> tuple[list[bytes], list[bytes]]:
        """Store blocks (touching those already present); returns (new keys, evicted keys)."""
        blocks = self.blocks
        new = [k for k in keys if k not in blocks]
        for k in keys:
            if k in blocks:
                blocks.move_to_end(k)
        blocks.update(dict.fromkeys(new))
        if metas is not None:
            meta = self.meta
            for k in new:
                m = metas.get(k)
                if m is not None:
                    meta[k] = m
        self.blocks_written += len(new)
        self.bytes_written += len(new) * block_bytes
        evicted: list[bytes] = []
        over = len(blocks) - self.capacity_blocks
        if over > 0:
            pop = blocks.popitem
            meta = self.meta
            for _ in range(over):
                k, _ = pop(last=False)
                meta.pop(k, None)
                evicted.append(k)
            if self.corrupt:
                self.corrupt.difference_update(evicted)
        return new, evicted

    def touch(self, keys: list[bytes]) -> None:
        """Mark blocks recently used (children first, so parents stay the most recent)."""
        blocks = self.blocks
        for k in reversed(keys):
            if k in blocks:
                blocks.move_to_end(k)

    def remove(self, keys: list[bytes]) -> list[bytes]:
        blocks = self.blocks
        meta = self.meta
        gone = [k for k in keys if k in blocks]
        for k in gone:
            del blocks[k]
            meta.pop(k, None)
        if self.corrupt:
            self.corrupt.difference_update(gone)
        return gone
