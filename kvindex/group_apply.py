"""Applying the events of KV-cache groups > 0 (hybrid models), and learning every
group's spec (docs/kv-groups.md).

A group > 0's blocks are keyed from their tokens with the same chained keys as group
0's, so one request's digests look up every group; they are kept per worker in its
`WorkerGroups`, never in the holder bitmaps.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .blockmap import BlockMap
from .events import BlockRemoved, BlockStored, EventDecodeError, LazyBlockStored
from .groups import FULL_KINDS, MAX_GROUP_BLOCKS, MAX_GROUPS, WorkerGroups, spec_of
from .keys import ROOT_KEY, digests64, tokens_to_bytes
from .stats import ApplyStats
from .tiers import Tier, tier_of_medium

if TYPE_CHECKING:
    from .slots import WorkerSlot


def extras_with_skipped(ev: BlockStored, n: int, k: int, skip: int) -> list[Any] | None:
    """Per-index-block extra keys for `skip` leading engine blocks the event names no
    hash for (a windowed group's null blocks) and then its `n` blocks; ValueError when
    malformed. The skipped blocks carry only the LoRA name: vLLM sends no extra keys
    for them (a request's other extra keys there would make their keys differ from the
    router's, which can only lose a hit, never claim a false one)."""
    extra = ev.extra_keys
    lora = ev.lora_name
    head: list[Any] = [(lora,) if lora else None] * (skip * k)
    if extra is None:
        if lora:
            return [(lora,)] * ((skip + n) * k)
        if ev.lora_id is not None:
            return [(("lora_id", ev.lora_id),)] * ((skip + n) * k)
        return None
    if type(extra) is not list or len(extra) != n:
        raise ValueError("extra_keys: not one entry per block")
    rest = (lora,) if lora else None
    out = head
    for e in extra:
        out.append(e)
        if k > 1:
            out.extend([rest if (rest and e and e[0] == lora) else None] * (k - 1))
    return out


class GroupApplier:
    """Applies `BlockStored` / `BlockRemoved` of groups > 0 and records group specs.

    `mark_hybrid(w)` is the slot table's: called when a worker first needs the hybrid
    rule at query time.
    """

    def __init__(self, block_size: int, blocks: BlockMap, mark_hybrid: Callable[[WorkerSlot], None]) -> None:
        self.block_size = block_size
        self._blocks = blocks
        self._mark_hybrid = mark_hybrid

    def _groups(self, w: WorkerSlot) -> WorkerGroups:
        gs = w.groups
        if gs is None:
            gs = w.groups = WorkerGroups()
        return gs

    def learn_group0(self, w: WorkerSlot, ev: BlockStored | LazyBlockStored, st: ApplyStats) -> None:
        """Group 0's spec, recorded once the worker has groups or group 0 is not full attention."""
        spec = spec_of(ev)
        if spec is None:
            return
        gs = w.groups
        if gs is None:
            if spec.kind in FULL_KINDS:
                return
            gs = self._groups(w)
        if gs.learn(0, spec):
            st.group_spec_changes += 1
        self._mark_hybrid(w)

    def stored(self, w: WorkerSlot, ev: BlockStored | LazyBlockStored, st: ApplyStats) -> int:
        g = ev.group_idx
        if type(g) is not int or g < 0:
            st.bad_events += 1
            return 0
        spec = spec_of(ev)
        if g >= MAX_GROUPS or spec is None:
            st.ignored += 1  # no kind (older publishers) or too many groups: cannot be modelled
            return 0
        gs = self._groups(w)
        if gs.learn(g, spec):
            st.group_spec_changes += 1
        self._mark_hybrid(w)
        if spec.block_size % self.block_size:
            st.ignored += 1  # not keyable at the index's block size: the worker earns nothing
            return 0
        if isinstance(ev, LazyBlockStored):
            try:
                ev = ev.materialize()
            except EventDecodeError:
                st.bad_events += 1
                return 0
        try:
            return self._key_and_hold(w, gs, g, ev, st)
        except TypeError:  # unhashable hashes, tokens of the wrong type
            st.bad_events += 1
            return 0

    def _key_and_hold(self, w: WorkerSlot, gs: WorkerGroups, g: int, ev: BlockStored, st: ApplyStats) -> int:
        hashes = ev.block_hashes
        ebs = ev.block_size
        B = self.block_size
        tokens = ev.token_ids
        if type(hashes) not in (list, tuple) or type(tokens) is not list:
            st.bad_events += 1
            return 0
        n = len(hashes)
        if not n:
            return 0
        m = len(tokens) // ebs  # engine blocks the tokens cover; the hashes name the last n
        if m < n:
            st.bad_events += 1
            return 0
        k = ebs // B
        ti = _tier_index(w, ev.medium, st)
        bit = 1 << ti
        held = gs.held[g]
        emap = gs.hashes[g]
        ds = emap.digests(list(hashes), k)
        if ds is None or not all([d in held for d in ds]):
            parent = self._parent_key(w, gs, g, ev.parent_block_hash)
            if parent is None:
                st.orphans += n
                return 0
            try:
                extras = extras_with_skipped(ev, n, k, m - n)
                buf = tokens_to_bytes(tokens if len(tokens) == m * ebs else tokens[: m * ebs])
                if len(buf) < 4 * m * ebs:
                    raise ValueError("too few tokens")
                states = None if extras is None else w.hasher.states_for(extras, m * k)
                keys = w.hasher.chain(buf, m * k, states, parent)
            except (OverflowError, ValueError):
                st.bad_events += 1
                return 0
            keys = keys[(m - n) * k :]
            ds = digests64(keys)
            emap.record(list(hashes), ds, k)
            # keys the index keeps already (group 0 holds the block) are not kept twice
            gkeys = gs.keys
            full_key = self._blocks.full_key
            for d, key in zip(ds, keys, strict=True):
                if d not in gkeys and full_key(d) is None:
                    gkeys[d] = key
        for d in ds:
            held[d] = held.get(d, 0) | bit
        if len(held) > MAX_GROUP_BLOCKS:
            held.clear()
            emap.clear()
            for d in list(gs.keys):
                gs.forget_key(d)
            st.group_overflows += 1
        st.group_stored += n
        return n * k

    def _parent_key(self, w: WorkerSlot, gs: WorkerGroups, g: int, parent: Any) -> bytes | None:
        """Full key of a group event's parent: the same tokens have the same engine hash
        in every group of one block size, so the group's own map is asked first, then
        group 0's; the key comes from the groups' keys or the index's."""
        if parent is None:
            return ROOT_KEY
        d = gs.hashes[g].get(parent)
        if d is None:
            d = w.engine_hashes.get(parent)
        if d is None:
            return None
        if type(d) is tuple:
            d = d[-1]
        key = gs.keys.get(d)
        return key if key is not None else self._blocks.full_key(d)

    def removed(self, w: WorkerSlot, ev: BlockRemoved, st: ApplyStats) -> int:
        g = ev.group_idx
        if type(g) is not int or g < 0:
            st.bad_events += 1
            return 0
        gs = w.groups
        hashes = ev.block_hashes
        if gs is None or g not in gs.held:
            st.ignored += 1  # a group the index has no spec for: nothing of it is held
            return 0
        if type(hashes) not in (list, tuple):
            st.bad_events += 1
            return 0
        bit = 1 << _tier_index(w, ev.medium, st)
        held = gs.held[g]
        emap = gs.hashes[g]
        gone = 0
        for eh in hashes:
            try:
                found = emap.get(eh)
            except TypeError:
                st.bad_events += 1
                continue
            if found is None:
                st.unknown_removed += 1
                continue
            every = found if type(found) is tuple else (found,)
            left = False
            for d in every:
                v = held.get(d, 0)
                if v & bit:
                    v ^= bit
                    gone += 1
                    if v:
                        held[d] = v
                    else:
                        del held[d]
                        gs.forget_key(d)
                left = left or d in held
            if not left:
                del emap[eh]
            st.group_removed += 1
        return gone


def _tier_index(w: WorkerSlot, medium: Any, st: ApplyStats) -> int:
    """Tier index of an event's medium (REMOTE = 3), counting an unknown one."""
    if medium is not None and not isinstance(medium, str):
        medium = "?"
    tier, known = tier_of_medium(medium)
    if not known:
        st.unknown_medium += 1
    return 3 if tier is Tier.REMOTE else int(tier)
