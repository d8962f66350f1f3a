"""The CPU tier: a second block pool in host memory (pinned when the device is CUDA).

Same block layout as the device pool, preallocated once (`capacity_bytes // block_bytes`
slots; pages are touched only when written, so RSS grows with use). A slot holds one
block by key, with the metadata and salt its events and purges need. Bookkeeping only
here; the callers (the tier parts, workers/engine/tiers.py) hold the engine lock around every call, and
copy bytes in and out of `data[slot]` outside it while the slot is pinned.

A slot is *held* (findable, in the LRU), *leaving* (findable, out of the LRU: being
written to DISK before it goes) or *dropped* (not findable: purged or gone, freed when
its last pin goes). Pins are taken by whoever reads the slot's bytes outside the lock
(a load, a DISK/REMOTE write, a peer export), so a slot is never reused under a reader.
On CUDA a slot filled by an offload copy carries the CUDA event that copy recorded:
readers wait on it before touching the bytes.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from workers.blockmeta import BlockMeta

from .model import KVShape


@dataclass(slots=True, eq=False)
class Slot:
    id: int
    key: bytes
    meta: BlockMeta
    salt: str | None
    pins: int = 0
    leaving: bool = False  # goes once its writes below are done
    dropped: bool = False
    purged: bool = False  # dropped by a purge: a write that lands meanwhile is taken back
    writing_disk: bool = False
    writing_remote: bool = False
    disk_tried: bool = False  # written to DISK, or refused there (admission, budget, error)
    remote_tried: bool = False
    ready: Any = None  # torch.cuda.Event of the copy that filled it (CUDA), else None


class HostPool:
    def __init__(self, shape: KVShape, capacity_blocks: int, block_size: int, *, pinned: bool) -> None:
        if capacity_blocks < 1:
            raise ValueError("the CPU tier needs room for at least one block")
        self.capacity = capacity_blocks
        self.pinned = pinned
        self.data = torch.empty(
            (capacity_blocks, block_size, shape.layers, 2, shape.kv_heads, shape.head_dim),
            dtype=shape.dtype, pin_memory=pinned,
        )
        self.free: list[int] = list(range(capacity_blocks - 1, -1, -1))
        self.by_key: dict[bytes, Slot] = {}
        self.lru: OrderedDict[bytes, None] = OrderedDict()  # held (not leaving), oldest first
        self.leaving = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.by_key

    def __len__(self) -> int:
        return len(self.by_key)

    @property
    def used(self) -> int:
        """Slots not free (held, leaving, or dropped but still pinned)."""
        return self.capacity - len(self.free)

    def get(self, key: bytes) -> Slot | None:
        return self.by_key.get(key)

    def touch(self, keys: list[bytes]) -> None:
        """Most recently used, children first so that parents stay the most recent."""
        for k in reversed(keys):
            if k in self.lru:
                self.lru.move_to_end(k)

    def add(self, slot_id: int, key: bytes, meta: BlockMeta, salt: str | None) -> Slot:
        s = Slot(slot_id, key, meta, salt)
        self.by_key[key] = s
        self.lru[key] = None
        return s

    def take_free(self) -> int | None:
        return self.free.pop() if self.free else None

    def oldest(self) -> Slot | None:
        """The least recently used held slot that nobody reads now (pins would outlive it)."""
        for k in self.lru:
            s = self.by_key[k]
            if not s.pins:
                return s
        return None

    def start_leaving(self, s: Slot) -> None:
        """Out of the LRU, still findable, while its copy goes down."""
        del self.lru[s.key]
        s.leaving = True
        self.leaving += 1

    def remove(self, s: Slot) -> bool:
        """Not findable any more; the slot is freed now or when its last pin goes.
        False if it was removed already."""
        if s.dropped:
            return False
        s.dropped = True
        if self.by_key.get(s.key) is s:
            del self.by_key[s.key]
        self.lru.pop(s.key, None)
        if s.leaving:
            s.leaving = False
            self.leaving -= 1
        if not s.pins:
            self.free.append(s.id)
        return True

    def pin(self, s: Slot) -> None:
        s.pins += 1

    def unpin(self, s: Slot) -> None:
        s.pins -= 1
        if not s.pins and s.dropped:
            self.free.append(s.id)

    def block(self, s: Slot) -> torch.Tensor:
        return self.data[s.id]
