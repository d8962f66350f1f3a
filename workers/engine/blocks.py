"""The block manager: which pool block holds what, who uses it, and what may be evicted.

Bookkeeping only (no tensors), as nano-vllm splits it. A block is either free (no key,
nobody uses it), in use (reference count > 0, keyed once full and committed) or cached
(keyed, unused, in an LRU). Prefix caching is by our chained block keys, the gateway's
(kvindex.keys), so a key names a block's content and everything before it: a request
takes the leading blocks of its prompt whose keys are registered, and computes the rest.

Only full blocks are keyed, and a full block is never written again, so blocks are shared
without copy-on-write. When two requests compute the same block at once, the second one
switches to the registered copy and frees its own (the content is the same function of
the same tokens). A block is registered only if its parent is, so every `BlockStored`
names a parent the subscriber holds.

Eviction takes the least recently released cached block; a request releases its blocks
tail first, so a chain's children go before their parents. `on_evict` sees each evicted
block (key, metadata, pool block id) before its slot is reused: the hook for stage 2's
offload to CPU/DISK/REMOTE, which must copy the block's tensors before it returns.
Every change is recorded as a KV event (`events`), published by the engine.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvindex.events import AllBlocksCleared, BlockRemoved, KVEvent
from kvindex.tiers import Tier
from workers.blockmeta import BlockMeta, block_hashes, stored_events

from .sequence import Sequence as Seq


@dataclass(slots=True, eq=False)
class Block:
    id: int
    ref: int = 0
    key: bytes | None = None
    meta: BlockMeta | None = None
    salt: str | None = None


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """A cached block about to be reused: its data is still in pool block `block_id`."""

    key: bytes
    meta: BlockMeta
    block_id: int
    salt: str | None = None


EvictHook = Callable[[list[EvictedBlock]], None]


class BlockManager:
    """See the module doc."""

    def __init__(self, num_blocks: int, block_size: int, *, on_evict: EvictHook | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # least recently released first
        self.by_key: dict[bytes, int] = {}
        self.by_salt: dict[str, set[int]] = {}
        self.on_evict = on_evict
        self.events: list[KVEvent] = []
        self.stored = 0
        self.evicted = 0
        # Every layer of the model attends within this many tokens (None: some layer sees all):
        # a prefix hit then needs only the blocks its next token attends to (`match`).
        self.window: int | None = None

    # ------------------------------------------------------------------ queries

    def available(self) -> int:
        """Blocks an allocation can get now (free + evictable)."""
        return len(self.free) + len(self.cached)

    def used(self) -> int:
        """Blocks holding data (in use or cached)."""
        return self.num_blocks - len(self.free)

    def match(self, seq: Seq) -> list[int]:
        """Pool blocks of the sequence's leading cached blocks (never its last token).

        With a window (every layer windowed), vLLM's rule for a sliding-window group: a
        prefix of L blocks is a hit when the `ceil((window - 1) / block_size)` blocks
        ending at L are registered, whatever is held before them; those earlier blocks
        come back as -1 (holes that `admit` leaves trimmed)."""
        out: list[int] = []
        cap = seq.cacheable_blocks
        for i in range(cap):
            bid = self.by_key.get(seq.key(i))
            if bid is None:
                break
            out.append(bid)
        if self.window is None or len(out) == cap:
            return out
        need = max(1, -(-(self.window - 1) // self.block_size))
        best, run = len(out), 0
        for i in range(len(out), cap):
            run = run + 1 if seq.key(i) in self.by_key else 0
            if run >= need:
                best = i + 1
        if best == len(out):
            return out
        return [-1] * (best - need) + [self.by_key[seq.key(i)] for i in range(best - need, best)]

    def gpu_prefix(self, keys: Sequence[bytes], limit: int) -> int:
        """How many of the leading `keys` (at most `limit`) are registered."""
        n = 0
        while n < limit and keys[n] in self.by_key:
            n += 1
        return n

    def blocks_for(self, seq: Seq, n: int) -> int:
        """New blocks the sequence needs to compute `n` more tokens."""
        return max(0, -(-(seq.num_computed + n) // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Seq, n: int) -> bool:
        return self.blocks_for(seq, n) <= self.available()

    def can_admit(self, seq: Seq, matched: list[int], n: int) -> bool:
        """Room for a waiting sequence taking `matched` blocks and computing `n` tokens after them."""
        new = -(-(len(matched) * self.block_size + n) // self.block_size) - len(matched)
        revived = sum(1 for b in matched if b >= 0 and self.blocks[b].ref == 0)
        return new + revived <= self.available()

    def snapshot(self) -> set[bytes]:
        """Keys of every registered block (what the published events describe)."""
        return set(self.by_key)

    # ------------------------------------------------------------------ sequences

    def admit(self, seq: Seq, matched: list[int], n: int) -> None:
        """Give a waiting sequence its cached prefix blocks and room for `n` more tokens."""
        holes = 0
        for bid in matched:
            if bid < 0:  # a window hit's leading blocks: nothing attends to them (`match`)
                holes += 1
            else:
                self._acquire(bid)
        seq.block_table = list(matched)
        seq.num_computed = len(matched) * self.block_size
        seq.num_registered = len(matched)
        seq.num_trimmed = holes
        seq.registrable = True
        self.grow(seq, n)

    def grow(self, seq: Seq, n: int) -> None:
        """Room for `n` more tokens (the caller checked `can_grow`)."""
        need = self.blocks_for(seq, n)
        if need:
            seq.block_table.extend(self._allocate(need))

    def release(self, seq: Seq) -> None:
        """A sequence stops (finished, cancelled, preempted): drop its references, tail first."""
        for bid in reversed(seq.block_table):
            if bid >= 0:  # -1: trimmed (out of the window), released already
                self._release_one(bid)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0
        seq.num_trimmed = 0

    def trim(self, seq: Seq, window: int) -> None:
        """A model whose every layer attends within `window` tokens: drop the sequence's
        references to its leading registered blocks that no later token attends to (the
        next one, at `num_computed`, sees positions from `num_computed - window + 1`).
        They stay cached under their keys, so evictable (and offloaded) like any cached
        block, and reusable by a prefix hit until then; their table entries become -1.
        The last registered block is kept: registering the next one checks its key."""
        bs = self.block_size
        dead = min(max(0, seq.num_computed - window + 1) // bs, seq.num_registered - 1)
        table = seq.block_table
        while seq.num_trimmed < dead:
            i = seq.num_trimmed
            bid = table[i]
            table[i] = -1
            self._release_one(bid)
            seq.num_trimmed += 1

    def commit(self, seq: Seq) -> None:
        """Register the sequence's blocks that became full (their KV is in the pool now)."""
        full = seq.num_computed // self.block_size
        new: list[bytes] = []
        metas: dict[bytes, BlockMeta] = {}
        while seq.registrable and seq.num_registered < full:
            i = seq.num_registered
            if i and self.blocks[seq.block_table[i - 1]].key != seq.key(i - 1):
                seq.registrable = False  # its parent was purged: children would be orphans
                break
            key = seq.key(i)
            bid = seq.block_table[i]
            owner = self.by_key.get(key)
            if owner is None:
                meta = seq.block_meta(i)
                self._register(bid, key, meta, seq.scope.salt_of(i))
                new.append(key)
                metas[key] = meta
            elif owner != bid:  # computed twice at once: share the registered copy
                self._acquire(owner)
                seq.block_table[i] = owner
                self._release_one(bid)
            seq.num_registered += 1
        if new:
            self.stored += len(new)
            self.events.extend(stored_events(Tier.GPU, new, metas, self.block_size))

    # ------------------------------------------------------------------ purge / events

    def purge(self, salt: str | None, everything: bool) -> int:
        """Unregister the blocks of chains salted with `salt` (or all): cached ones are freed at
        once, those in use when their last user releases them. Returns how many."""
        return len(self.purge_keys(salt, everything))

    def purge_keys(self, salt: str | None, everything: bool) -> list[bytes]:
        """`purge`, returning the keys dropped."""
        if everything:
            victims = [b.id for b in self.blocks if b.key is not None]
        else:
            victims = sorted(self.by_salt.get(salt, ())) if salt else []
        if not victims:
            return []
        keys = [self._unregister(bid) for bid in victims]
        for bid in victims:
            if self.blocks[bid].ref == 0:
                del self.cached[bid]
                self.free.append(bid)
        self.events.append(AllBlocksCleared() if everything else BlockRemoved(block_hashes(keys), "GPU"))
        return keys

    # ------------------------------------------------------------------ blocks outside sequences

    def take(self, n: int) -> list[int]:
        """`n` unkeyed blocks held by the caller (a prefetch landing blocks): free ones first,
        then evicted ones. The caller checked `available()`."""
        return self._allocate(n) if n > 0 else []

    def acquire(self, bid: int) -> None:
        """One more reference to a block (a request joining a prefetch, a peer export)."""
        self._acquire(bid)

    def release_block(self, bid: int) -> None:
        """Drop one reference; at zero a keyed block is cached (most recent), an unkeyed one freed."""
        self._release_one(bid)

    def adopt(self, items: list[tuple[int, bytes, BlockMeta, str | None]]) -> list[bool]:
        """Register blocks the caller holds and filled (loaded from a lower tier or a peer), in
        chain order: (block, key, metadata, salt). A block is registered only if its key is
        not and its parent is (or it is a root). One BlockStored per chain run."""
        out: list[bool] = []
        new: list[bytes] = []
        metas: dict[bytes, BlockMeta] = {}
        for bid, key, meta, salt in items:
            b = self.blocks[bid]
            ok = (b.key is None and key not in self.by_key
                  and (meta.parent is None or meta.parent in self.by_key))
            if ok:
                self._register(bid, key, meta, salt)
                new.append(key)
                metas[key] = meta
            out.append(ok)
        if new:
            self.stored += len(new)
            self.events.extend(stored_events(Tier.GPU, new, metas, self.block_size))
        return out

    def evict_cached(self, n: int | None = None) -> int:
        """Evict the `n` (default: all) least recently used cached blocks down the tiers now
        (`on_evict` sees them); returns how many. Benchmarks and tests use it."""
        n = len(self.cached) if n is None else min(n, len(self.cached))
        if n <= 0:
            return 0
        saved, self.free = self.free, deque()
        try:
            got = self._allocate(n)
        finally:
            self.free = saved
        for bid in got:
            self.blocks[bid].ref = 0
            self.free.append(bid)
        return n

    def take_events(self) -> list[KVEvent]:
        ev = self.events
        self.events = []
        return ev

    # ------------------------------------------------------------------ internals

    def _acquire(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref == 0:
            del self.cached[bid]
        b.ref += 1

    def _release_one(self, bid: int) -> None:
        b = self.blocks[bid]
        b.ref -= 1
        if b.ref == 0:
            if b.key is not None:
                self.cached[bid] = None
            else:
                self.free.append(bid)

    def _allocate(self, n: int) -> list[int]:
        """`n` blocks for one sequence: free ones first, then the least recently used cached ones."""
        out: list[int] = []
        evicted: list[EvictedBlock] = []
        while len(out) < n:
            if self.free:
                bid = self.free.popleft()
            else:
                bid, _ = self.cached.popitem(last=False)
                b = self.blocks[bid]
                assert b.key is not None and b.meta is not None
                evicted.append(EvictedBlock(b.key, b.meta, bid, b.salt))
                self._unregister(bid)
            self.blocks[bid].ref = 1
            out.append(bid)
        if evicted:
            self.evicted += len(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted)
            self.events.append(BlockRemoved(block_hashes([e.key for e in evicted]), "GPU"))
        return out

    def _register(self, bid: int, key: bytes, meta: BlockMeta, salt: str | None) -> None:
        b = self.blocks[bid]
        b.key, b.meta, b.salt = key, meta, salt
        self.by_key[key] = bid
        if salt:
            self.by_salt.setdefault(salt, set()).add(bid)

    def _unregister(self, bid: int) -> bytes:
        b = self.blocks[bid]
        key = b.key
        assert key is not None
        del self.by_key[key]
        if b.salt:
            members = self.by_salt[b.salt]
            members.discard(bid)
            if not members:
                del self.by_salt[b.salt]
        b.key = b.meta = b.salt = None
        return key
