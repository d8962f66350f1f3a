"""Applying a worker's KV events to the index: stored, removed, cleared.

Two ways in (docs/prefix-index.md): verified, the default, keys each `BlockStored` from its
tokens under the worker's namespace and maps the engine's hashes to our digests;
trusted, for our own workers, applies their published digests as they are and
recomputes a sample of chain roots to catch a misconfigured worker. Both follow one
orphan rule, so they give the same answers for a well-behaved worker.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .blockmap import SHARD_MASK, BlockMap, lookup
from .events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError, LazyBlockStored
from .group_apply import GroupApplier, extras_with_skipped
from .groups import FULL_KINDS
from .keys import ROOT_KEY, digests64, tokens_to_bytes
from .page_chain import page_tokens, unchained_hash
from .slots import REMOTE, SlotTable, WorkerSlot
from .stats import ApplyStats
from .tiers import Tier, tier_of_medium

_MAX_DIGEST = (1 << 64) - 1
# A trusted worker's chain roots recomputed for verification: 1 in this many (the first always).
DEFAULT_VERIFY_EVERY = 32


class EventApplier:
    """Applies events to a `BlockMap`, counting entries in a `SlotTable`.

    `clear_worker` is the index's own (AllBlocksCleared, a digest mismatch): it
    retires the worker's slot. Events of KV-cache groups > 0 go to a `GroupApplier`.
    """

    def __init__(
        self, block_size: int, blocks: BlockMap, slots: SlotTable, clear_worker: Callable[[str], None]
    ) -> None:
        self.block_size = block_size
        self._blocks = blocks
        self._slots = slots
        self._clear_worker = clear_worker
        self._groups = GroupApplier(block_size, blocks, slots.mark_hybrid)

    def apply(self, w: WorkerSlot, events: Iterable[Any], st: ApplyStats) -> int:
        """Apply events in order, counting into `st`; returns blocks touched. Never raises."""
        work = 0
        for ev in events:
            cls = type(ev)
            try:
                if cls is LazyBlockStored or cls is BlockStored:
                    work += self._stored(w, ev, st)
                elif cls is BlockRemoved:
                    work += self._removed(w, ev, st)
                elif cls is AllBlocksCleared:
                    self._clear_worker(w.worker_id)
                    st.cleared += 1
                else:
                    st.bad_events += 1
            except (TypeError, AttributeError):  # fields of the wrong type (built in Python, not decoded)
                st.bad_events += 1
        return work

    def _tier_bit(self, w: WorkerSlot, medium: Any, st: ApplyStats) -> tuple[int, int]:
        """(bitmap bit, tier index into counts or REMOTE)."""
        if medium is not None and not isinstance(medium, str):
            medium = "?"  # not a medium at all: unknown, counted below
        tier, known = tier_of_medium(medium)
        if not known:
            st.unknown_medium += 1
        ti = REMOTE if tier is Tier.REMOTE else int(tier)
        return w.bit(ti), ti

    # ------------------------------------------------------------------ BlockStored

    def _stored(self, w: WorkerSlot, ev: BlockStored | LazyBlockStored, st: ApplyStats) -> int:
        if w.pages is not None:
            return self._stored_pages(w, ev, st)
        if ev.group_idx:
            return self._groups.stored(w, ev, st)
        kind = ev.kv_cache_spec_kind
        if kind is not None and (w.groups is not None or kind not in FULL_KINDS):
            self._groups.learn_group0(w, ev, st)
        if w.trusted:
            done = self._stored_trusted(w, ev, st)
            if done is not None:
                return done
        if isinstance(ev, LazyBlockStored):
            try:
                ev = ev.materialize()
            except EventDecodeError:
                st.bad_events += 1
                return 0
        return self._stored_verified(w, ev, st)

    def _stored_trusted(self, w: WorkerSlot, ev: BlockStored | LazyBlockStored, st: ApplyStats) -> int | None:
        """A trusted worker's event applied as it is; None: take the verified path.

        Only events at the index block size whose hashes are all 64-bit ints qualify.
        The orphan rule is the verified path's (a parent must be live unless the
        worker already holds every block), so both paths give the same answers.
        """
        hashes: list[Any] = ev.block_hashes  # our digests if all are 64-bit ints, checked below
        if ev.block_size != self.block_size or type(hashes) is not list:
            return None
        n = len(hashes)
        if not n:
            return 0
        try:
            lo = min(hashes)
            hi = max(hashes)
        except TypeError:  # ints mixed with bytes
            return None
        if type(lo) is not int or type(hi) is not int or lo < 0 or hi > _MAX_DIGEST:
            return None
        parent = ev.parent_block_hash
        if parent is None:
            if w.until_verify > 0:
                w.until_verify -= 1
            else:
                ok = self._verify_root(w, ev, st)
                if ok is None:
                    st.bad_events += 1
                    return 0
                if not ok:
                    return None  # the worker is on the verified path from now on
        bit, ti = self._tier_bit(w, ev.medium, st)
        if parent is not None and not self._parent_live(w, parent) and not self._holds_all(w, hashes):
            st.orphans += n
            return 0
        added = self._blocks.set_bits(hashes, None, bit, distinct=False)  # a publisher may repeat one
        self._slots.count_added(w, ti, added)
        st.stored += n
        return n

    def _verify_root(self, w: WorkerSlot, ev: BlockStored | LazyBlockStored, st: ApplyStats) -> bool | None:
        """Recompute a trusted worker's chain-root event from its tokens.

        True: the digests match. False: they do not; the worker's entries are dropped
        and it is switched to the verified path for good. None: the event is malformed
        (no verdict; the next chain root is checked instead).
        """
        if isinstance(ev, LazyBlockStored):
            try:
                ev = ev.materialize()
            except EventDecodeError:
                return None
        hashes = ev.block_hashes
        n = len(hashes)
        tokens = ev.token_ids
        B = self.block_size
        if type(tokens) is not list or len(tokens) < n * B:
            return None
        try:
            extras = _extras(ev, n, 1)
            buf = tokens_to_bytes(tokens[: n * B])
            states = None if extras is None else w.hasher.states_for(extras, n)
            keys = w.hasher.chain(buf, n, states, ROOT_KEY)
        except (OverflowError, TypeError, ValueError):
            return None
        w.until_verify = w.verify_every - 1
        st.digests_verified += 1
        if digests64(keys) == hashes:
            return True
        st.digest_mismatches += 1
        self._clear_worker(w.worker_id)
        w.trusted = False
        return False

    def _parent_live(self, w: WorkerSlot, parent: Any) -> bool:
        """A trusted worker's parent is indexed and held by a live holder (no key needed)."""
        d = w.engine_hashes.parent_digest(parent)
        return d is not None and bool(self._blocks.bitmap(d) & self._slots.live)

    def _holds_all(self, w: WorkerSlot, ds: list[int]) -> bool:
        """The worker holds every one of these digests already (locally or in its group)."""
        recs = lookup(self._blocks.bitmaps, ds)
        if None in recs:
            return False
        held = w.held_mask()
        return all([r & held for r in recs])

    def _stored_verified(self, w: WorkerSlot, ev: BlockStored, st: ApplyStats) -> int:
        hashes = ev.block_hashes
        n = len(hashes)
        ebs = ev.block_size
        B = self.block_size
        tokens = ev.token_ids
        if type(ebs) is not int or ebs <= 0 or ebs % B or len(tokens) < n * ebs or type(hashes) not in (list, tuple):
            st.bad_events += 1
            return 0
        if not n:
            return 0
        k = ebs // B
        bit, ti = self._tier_bit(w, ev.medium, st)
        ds = self._known(w, hashes, k)
        if ds is not None:
            # The same worker stores blocks it already holds (a copy to another tier):
            # their content was verified when first stored, no keying needed.
            added = self._blocks.set_bits(ds, None, bit, distinct=False)
            if k > 1 and ti != REMOTE:
                w.engine_hashes.hold(hashes, ds, k, bit)
        else:
            # The hashes name the last n of the blocks the tokens cover: a windowed group
            # skips the blocks that already left its window (docs/kv-groups.md).
            m = len(tokens) // ebs if type(tokens) is list else n
            try:
                extras = _extras(ev, n, k) if m == n else extras_with_skipped(ev, n, k, m - n)
            except ValueError:
                st.bad_events += 1
                return 0
            parent = self._parent_key(w, ev.parent_block_hash)
            if parent is None:
                st.orphans += n
                return 0
            hasher = w.hasher
            try:
                buf = tokens_to_bytes(tokens if len(tokens) == m * ebs else tokens[: m * ebs])
                if len(buf) < 4 * m * ebs:  # tokens given as packed bytes, too few of them
                    raise ValueError("too few tokens")
                states = None if extras is None else hasher.states_for(extras, m * k)
                keys = hasher.chain(buf, m * k, states, parent)
            except (OverflowError, TypeError, ValueError):
                st.bad_events += 1
                return 0
            if m != n:
                keys = keys[(m - n) * k :]
            ds = digests64(keys)
            added = self._blocks.set_bits(ds, keys, bit)
            try:
                w.engine_hashes.record(hashes, ds, k)
                if k > 1 and ti != REMOTE:
                    w.engine_hashes.hold(hashes, ds, k, bit)
            except TypeError:  # unhashable engine hashes
                st.bad_events += 1
        self._slots.count_added(w, ti, added)
        st.stored += n
        return n * k

    def _known(self, w: WorkerSlot, hashes: list[Any], k: int) -> list[int] | None:
        """Our digests for engine blocks this worker already holds, if it holds them all."""
        shards = self._blocks.bitmaps
        if w.engine_hashes:
            ds = w.engine_hashes.digests(hashes, k)
            if ds is None or None in lookup(shards, ds):
                return None  # e.g. only its REMOTE copy was known, and it is gone
            return ds
        h0 = hashes[0]
        if type(h0) is not int or h0 not in shards[h0 & SHARD_MASK]:
            return None
        try:
            recs = lookup(shards, hashes)
        except TypeError:  # a non-int hash among ints
            return None
        if None in recs:
            return None
        # Our own workers publish our digests: trust them only where this worker holds them.
        held = w.held_mask()
        if not all([r & held for r in recs]) or k != 1:
            return None
        return hashes

    def _parent_key(self, w: WorkerSlot, parent: Any) -> bytes | None:
        """Full key of the parent block, or None when it is unknown (an orphan)."""
        if parent is None:
            return ROOT_KEY
        d = w.engine_hashes.parent_digest(parent)
        if d is None or not self._blocks.bitmap(d) & self._slots.live:
            return None
        # None when only trusted workers stored it: they keep no full keys (docs/prefix-index.md)
        return self._blocks.full_key(d)

    # ------------------------------------------------------------------ pages

    def _changed(self, w: WorkerSlot) -> Callable[[int, int], None]:
        """Counts a page-chain worker's index entries as its page chain sets or clears bits."""

        def changed(bit: int, delta: int) -> None:
            pos = bit.bit_length() - 1
            ti = REMOTE if pos % 4 == 3 else pos - 4 * w.slot
            if delta > 0:
                self._slots.count_added(w, ti, delta)
            elif delta < 0:
                self._slots.count_removed(w, ti, -delta)

        return changed

    def _stored_pages(self, w: WorkerSlot, ev: BlockStored | LazyBlockStored, st: ApplyStats) -> int:
        """A worker whose pages are smaller than the index block (kvindex/page_chain.py)."""
        pages = w.pages
        assert pages is not None
        if isinstance(ev, LazyBlockStored):
            try:
                ev = ev.materialize()
            except EventDecodeError:
                st.bad_events += 1
                return 0
        hashes = ev.block_hashes
        if ev.group_idx or ev.extra_keys is not None or type(hashes) not in (list, tuple):
            st.bad_events += 1  # per-page extra keys or groups: not what a page-chain engine sends
            return 0
        n = len(hashes)
        if not n:
            return 0
        if ev.block_size != pages.page_size:
            st.partial_pages += n  # a page shorter than the others: it ends no index block
            return 0
        buf = page_tokens(ev.token_ids, n, pages.page_size)
        if buf is None:
            st.bad_events += 1
            return 0
        if not pages.unchained and ev.parent_block_hash is None and unchained_hash(hashes[0], ev.token_ids, pages):
            # a release whose page hashes do not depend on the position (kvindex/page_chain.py):
            # its pages cannot be placed, so nothing it stored is credited
            self._clear_worker(w.worker_id)
            pages.unchained = True
        if pages.unchained:
            st.unchained_pages += n
            return 0
        extra: tuple[Any, ...] | None = None
        if ev.lora_name:
            extra = (ev.lora_name,)
        elif ev.lora_id is not None:
            extra = (("lora_id", ev.lora_id),)
        bit, _ti = self._tier_bit(w, ev.medium, st)
        before = pages.evicted
        try:
            placed, orphans = pages.store(self._blocks, hashes, ev.parent_block_hash, buf, bit, extra, self._changed(w))
        except TypeError:  # unhashable page hashes
            st.bad_events += 1
            return 0
        st.stored += placed
        st.orphans += orphans
        st.pages_evicted += pages.evicted - before
        return placed

    def _removed_pages(self, w: WorkerSlot, ev: BlockRemoved, st: ApplyStats) -> int:
        pages = w.pages
        assert pages is not None
        if ev.group_idx:
            st.bad_events += 1
            return 0
        bit, _ti = self._tier_bit(w, ev.medium, st)
        known, unknown = pages.remove(self._blocks, ev.block_hashes, bit, self._changed(w))
        st.removed += known
        st.unknown_removed += unknown
        return known

    # ------------------------------------------------------------------ BlockRemoved

    def _removed(self, w: WorkerSlot, ev: BlockRemoved, st: ApplyStats) -> int:
        if w.pages is not None:
            return self._removed_pages(w, ev, st)
        if ev.group_idx:
            return self._groups.removed(w, ev, st)
        bit, ti = self._tier_bit(w, ev.medium, st)
        if w.engine_hashes:
            held = 0 if ti == REMOTE else w.local_bits()
            gone = w.engine_hashes.remove(ev.block_hashes, self._blocks, bit, held, st)
        else:
            gone = self._removed_digests(ev.block_hashes, bit, st)
        self._slots.count_removed(w, ti, gone)
        return gone

    def _removed_digests(self, hashes: Iterable[Any], bit: int, st: ApplyStats) -> int:
        """Removal for a worker without engine-hash map: its hashes are our digests.

        One pass that clears bits inline (as `BlockMap.clear_bits` does): this loop
        runs per removed block, and a call per block would cost more than the work.
        """
        shards = self._blocks.bitmaps
        kshards = self._blocks.full_keys
        intern = self._blocks.intern
        gone = 0
        for eh in hashes:
            if type(eh) is int:
                shard = shards[eh & SHARD_MASK]
                v = shard.get(eh)
                if v is not None and v & bit:
                    v ^= bit
                    if v:
                        shard[eh] = intern(v)
                    else:
                        del shard[eh]
                        kshards[eh & SHARD_MASK].pop(eh, None)
                    gone += 1
                    continue
            elif not _hashable(eh):
                st.bad_events += 1
                continue
            st.unknown_removed += 1
        st.removed += gone
        return gone


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _extras(ev: BlockStored, n: int, k: int) -> list[Any] | None:
    """Per-index-block extra keys for a stored event; ValueError when malformed."""
    extra = ev.extra_keys
    lora = ev.lora_name
    if extra is None:
        if lora:
            return [(lora,)] * (n * k)
        if ev.lora_id is not None:  # old releases: no name; never mix with base-model keys
            return [(("lora_id", ev.lora_id),)] * (n * k)
        return None
    if type(extra) is not list or len(extra) != n:
        raise ValueError("extra_keys: not one entry per block")
    if k == 1:
        return extra
    rest = (lora,) if lora else None
    out: list[Any] = []
    for e in extra:
        out.append(e)
        # only the LoRA name (vLLM puts it first) carries over to the sub-blocks
        out.extend([rest if (rest and e and e[0] == lora) else None] * (k - 1))
    return out
