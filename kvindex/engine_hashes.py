"""One worker's engine-hash map: the engine's block hash -> our digest(s).

Engines such as vLLM name blocks by their own seeded hashes, while the index keys
blocks by our chained keys computed from the tokens. The map lets a `BlockRemoved`
and a child's `parent_block_hash`, which carry only engine hashes, find our digests.
It stays empty for workers that publish our digests (our own engines).

When an engine block spans several index blocks, two engine blocks can share their
leading index blocks (same parent, same first tokens, different later ones), so each
index block a spanning engine block holds is reference-counted per tier: removing one
engine block clears an index block only when no other engine block still holds it.
(REMOTE is a group's tier, written and removed by any member, so it is not counted
per worker: a REMOTE removal clears what it names.)
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .blockmap import SHARD_MASK, BlockMap
from .events import BlockHash
from .stats import ApplyStats


# Values are `int | tuple[int, ...]` (one digest, or several when an engine block spans
# index blocks), typed Any so that the per-block loops can test `type(v) is tuple`.
class EngineHashes(dict[BlockHash, Any]):
    """engine hash -> our digest, or digests (a tuple) when the engine block spans several.

    A dict, so that the hot paths' emptiness tests and lookups stay C calls. `tiers`
    and `refs` exist for spanning blocks only: the tier bits each engine block holds,
    and how many engine blocks hold each (digest, tier bit).
    """

    __slots__ = ("tiers", "refs")

    def __init__(self) -> None:
        super().__init__()
        self.tiers: dict[BlockHash, int] = {}
        self.refs: dict[tuple[int, int], int] = {}

    def clear(self) -> None:
        super().clear()
        self.tiers.clear()
        self.refs.clear()

    def hold(self, hashes: list[Any], ds: list[int], k: int, bit: int) -> None:
        """Spanning engine blocks `hashes` (digests `ds`, `k` each) now hold tier `bit`."""
        tiers, refs = self.tiers, self.refs
        for i, eh in enumerate(hashes):
            have = tiers.get(eh, 0)
            if have & bit:
                continue  # a repeated store of the same block in the same tier
            tiers[eh] = have | bit
            for d in ds[i * k : (i + 1) * k]:
                refs[(d, bit)] = refs.get((d, bit), 0) + 1

    def _release(self, eh: BlockHash, ds: tuple[int, ...], bit: int) -> list[int]:
        """The digests of spanning block `eh` no other engine block holds in tier `bit`."""
        have = self.tiers.get(eh, 0)
        if not have & bit:
            return []
        if have == bit:
            del self.tiers[eh]
        else:
            self.tiers[eh] = have & ~bit
        free = []
        refs = self.refs
        for d in ds:
            n = refs.get((d, bit), 0) - 1
            if n > 0:
                refs[(d, bit)] = n
            else:
                refs.pop((d, bit), None)
                free.append(d)
        return free

    def record(self, hashes: list[Any], ds: list[int], k: int) -> None:
        """Map each engine hash to its `k` digests in `ds`; TypeError if one is unhashable."""
        if k == 1:
            if hashes != ds:
                self.update(zip(hashes, ds, strict=True))
            return
        for i, eh in enumerate(hashes):
            self[eh] = tuple(ds[i * k : (i + 1) * k])

    def digests(self, hashes: list[Any], k: int) -> list[int] | None:
        """Our digests for these engine blocks, if every one of them is mapped."""
        try:
            if hashes[0] not in self:  # the common fresh chain: one lookup, not n
                return None
            vals: list[Any] = list(map(self.get, hashes))
        except TypeError:
            return None
        if None in vals:
            return None
        return vals if k == 1 else [d for t in vals for d in t]

    def parent_digest(self, parent: Any) -> int | None:
        """Our digest of a parent block: mapped, or the hash itself when it is an int
        the map does not know (an engine that publishes our digests); None otherwise."""
        try:
            m = self.get(parent)
        except TypeError:  # unhashable: a malformed event
            return None
        if m is not None:
            d: int = m[-1] if type(m) is tuple else m
            return d
        return parent if type(parent) is int else None

    def remove(self, hashes: Iterable[Any], blocks: BlockMap, bit: int, held: int, st: ApplyStats) -> int:
        """Clear `bit` on the blocks these engine hashes name; returns bits cleared.

        An int hash the map does not know is taken as our digest when that block has
        `bit`. A mapping is forgotten once the worker holds none of its blocks in any
        local tier (`held`: its local bits; 0 keeps every mapping, for REMOTE).
        """
        shards = blocks.bitmaps
        get = self.get
        clear_bits = blocks.clear_bits
        gone = 0
        for eh in hashes:
            try:
                found = get(eh)
            except TypeError:
                st.bad_events += 1
                continue
            if found is None:
                if type(eh) is int and shards[eh & SHARD_MASK].get(eh, 0) & bit:
                    found = eh
                else:
                    st.unknown_removed += 1
                    continue
            every = found if type(found) is tuple else (found,)
            # spanning blocks in a local tier: clear only what no other engine block holds
            ds = self._release(eh, found, bit) if held and type(found) is tuple else every
            gone += clear_bits(ds, bit)
            if held and found is not eh and not any(shards[d & SHARD_MASK].get(d, 0) & held for d in every):
                del self[eh]
            st.removed += 1
        return gone
