"""The block map: each indexed block's 64-bit digest -> the bitmap of its holders.

Bitmap values are interned, so the many blocks with the same holders share one int
object and a lookup finds it in cache; a second map keeps the full key of blocks keyed
from their tokens, which verified children chain from. Both maps are sharded so that
a dict resize never stalls the event loop for long (docs/prefix-index.md).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

# Each map is split over this many dicts by the digest's low bits, so that a dict resize
# (CPython rebuilds a dict's whole table when it grows or has used up its free slots)
# stalls the event loop for ~1/256 of the index: ~10 ms at 10M blocks instead of ~2 s.
SHARD_BITS = 8
SHARD_MASK = (1 << SHARD_BITS) - 1
_INTERN_MAX = 1 << 20  # distinct bitmaps kept canonical before the table starts over

Shards = list[dict[int, Any]]


# lookup/_insert are plain comprehensions and loops on purpose: CPython 3.11+ specialises
# `shards[d & M].get(d)` and `shard[d] = v` in the interpreter, which is 2-4x faster than
# `map()` over the slot wrappers `list.__getitem__` / `dict.__setitem__`.
def lookup(shards: Shards, ds: Iterable[int]) -> list[Any]:
    """Values of many digests (None where absent)."""
    return [shards[d & SHARD_MASK].get(d) for d in ds]


def _insert(shards: Shards, ds: Iterable[int], values: Iterable[Any]) -> None:
    """Set many values (as many as digests)."""
    for d, v in zip(ds, values, strict=True):
        shards[d & SHARD_MASK][d] = v


@dataclass(slots=True)
class SweepPass:
    """An incremental erasure of retired slots' bits, shard by shard, each over a
    snapshot of its digests (digests added after a snapshot cannot carry those bits)."""

    slots: list[int]
    clear: int  # bitmap bits to erase (retired slots' nibbles)
    shard: int = 0  # next shard to snapshot
    digests: list[int] = field(default_factory=list)
    pos: int = 0


class BlockMap:
    """digest -> holders bitmap (`bitmaps`) and digest -> full key (`full_keys`), sharded."""

    __slots__ = ("bitmaps", "full_keys", "_interned")

    def __init__(self) -> None:
        self.bitmaps: list[dict[int, int]] = [{} for _ in range(SHARD_MASK + 1)]
        self.full_keys: list[dict[int, bytes]] = [{} for _ in range(SHARD_MASK + 1)]
        self._interned: dict[int, int] = {}  # one object per distinct bitmap value

    def __len__(self) -> int:
        return sum(map(len, self.bitmaps))

    def bitmap(self, d: int) -> int:
        """Holders of one digest (0: not indexed)."""
        return self.bitmaps[d & SHARD_MASK].get(d, 0)

    def full_key(self, d: int) -> bytes | None:
        return self.full_keys[d & SHARD_MASK].get(d)

    def intern(self, v: int) -> int:
        """The canonical object for a bitmap value: blocks share it, so a lookup
        finds it in cache instead of chasing one object per block."""
        interned = self._interned
        x = interned.get(v)
        if x is None:
            if len(interned) >= _INTERN_MAX:
                interned.clear()  # only an optimisation: values stay correct
            x = interned[v] = v
        return x

    def set_bits(self, ds: list[int], keys: Sequence[bytes] | None, bit: int, distinct: bool = True) -> int:
        """Set `bit` on every digest, inserting new ones; returns bits added.

        `keys`: the digests' full keys, kept for the digests that have none yet (so
        every block keyed through the verified path can parent a verified child);
        None inserts new digests without one (a trusted worker's blocks, or copies
        of blocks known to be indexed). `distinct` says the digests cannot repeat
        (a key chain), which spares a check.
        """
        shards = self.bitmaps
        vals = lookup(shards, ds)
        n = len(ds)
        if keys is not None:
            kshards = self.full_keys
            for d, key in zip(ds, keys, strict=True):
                kshards[d & SHARD_MASK].setdefault(d, key)
        if distinct or len(set(ds)) == n:
            missing = vals.count(None)
            if not missing:
                # all present: one interned object per distinct new bitmap
                had = len([v for v in vals if v & bit])
                if had < n:
                    interned = self._interned
                    if len(interned) >= _INTERN_MAX:
                        interned.clear()
                    setdefault = interned.setdefault
                    _insert(shards, ds, [setdefault(x, x) for x in [v | bit for v in vals]])
                return n - had
            if missing == n:
                # all new (a fresh chain): one shared bitmap object
                _insert(shards, ds, repeat(self.intern(bit), n))
                return n
        added = 0
        intern = self.intern
        for d in ds:
            shard = shards[d & SHARD_MASK]
            v = shard.get(d)  # not vals[i]: a digest may repeat within one call
            if v is None:
                shard[d] = intern(bit)
                added += 1
            elif not v & bit:
                shard[d] = intern(v | bit)
                added += 1
        return added

    def clear_bits(self, ds: Iterable[int], bit: int) -> int:
        """Clear `bit` on every digest (dropping blocks nobody holds); returns bits cleared."""
        shards = self.bitmaps  # the only local: one digest per call is common (engine blocks)
        gone = 0
        for d in ds:
            shard = shards[d & SHARD_MASK]
            v = shard.get(d)
            if v is not None and v & bit:
                v ^= bit
                gone += 1
                if v:
                    shard[d] = self.intern(v)
                else:
                    del shard[d]
                    self.full_keys[d & SHARD_MASK].pop(d, None)
        return gone

    def erase(self, sw: SweepPass, budget: int | None) -> bool:
        """Advance a sweep pass by at most `budget` digests (None: to the end).

        True once the pass has covered every shard.
        """
        shards = self.bitmaps
        clear = sw.clear
        keep = ~clear
        intern = self.intern
        while budget is None or budget > 0:
            if sw.pos >= len(sw.digests):
                if sw.shard > SHARD_MASK:
                    return True
                sw.digests = list(shards[sw.shard])
                sw.shard += 1
                sw.pos = 0
                continue
            end = len(sw.digests) if budget is None else min(len(sw.digests), sw.pos + budget)
            for d in sw.digests[sw.pos : end]:
                shard = shards[d & SHARD_MASK]
                v = shard.get(d)
                if v is not None and v & clear:
                    v &= keep
                    if v:
                        shard[d] = intern(v)
                    else:
                        del shard[d]
                        self.full_keys[d & SHARD_MASK].pop(d, None)
            if budget is not None:
                budget -= end - sw.pos
            sw.pos = end
        return False
