"""KV-cache groups of hybrid models (docs/kv-groups.md): every group's events are applied,
and a worker is credited what the engine's hybrid prefix-cache rule would serve.

Events are built as vLLM 0.32 sends them (maps with a `type`, `group_idx`,
`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`; engine hashes of its own, the
same for the same tokens in every group of one block size), encoded with our encoder
and decoded before they are applied.
"""
from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecoder, EventEncoder
from kvindex.groups import GroupSpec, hybrid_blocks
from kvindex.index import PrefixIndex
from kvindex.keys import BlockHasher, Namespace, digests64
from kvindex.tiers import Tier

BS = 16
NS = Namespace("m", block_size=BS)
HASHER = BlockHasher.for_namespace(NS)
ENC = EventEncoder()  # vLLM 0.32's form: map events in an array batch
DEC = EventDecoder()


def toks(seed: int, n_blocks: int, extra: int = 0) -> list[int]:
    return [(seed * 7_919 + i * 31) % 50_000 for i in range(n_blocks * BS + extra)]


def ehash(parent: int | None, tokens: list[int]) -> int:
    """An engine hash: seeded and chained like vLLM's, nothing like our keys."""
    h = hashlib.sha256(repr(("seed", parent, tuple(tokens))).encode()).digest()
    return int.from_bytes(h[:8], "big")


class Engine:
    """A hybrid vLLM worker's event stream for one prompt: `spec[g]` per group."""

    def __init__(self, tokens: list[int], specs: dict[int, tuple[str, int, int | None]]) -> None:
        self.tokens = tokens
        self.specs = specs
        self.hashes: dict[int, list[int]] = {}  # block size -> engine hash per block
        for _, bs, _ in specs.values():
            hs: list[int] = []
            for j in range(len(tokens) // bs):
                hs.append(ehash(hs[-1] if hs else None, tokens[j * bs : (j + 1) * bs]))
            self.hashes[bs] = hs

    def cache(self, g: int, lo: int, hi: int, null_below: int = 0) -> BlockStored:
        """Group g caches its blocks lo..hi-1 for one request step; blocks below
        `null_below` already left its window (null blocks: no hash, tokens still sent)."""
        kind, bs, window = self.specs[g]
        hs = self.hashes[bs]
        named = [hs[j] for j in range(lo, hi) if j >= null_below]
        parent = hs[lo - 1] if lo else None
        return BlockStored(named, parent, self.tokens[lo * bs : hi * bs], bs, None, "GPU", None, None, g, kind, window)

    def evict(self, g: int, *blocks: int) -> BlockRemoved:
        bs = self.specs[g][1]
        return BlockRemoved([self.hashes[bs][j] for j in blocks], "GPU", g)


def apply(idx: PrefixIndex, wid: str, events: list) -> None:
    st = idx.apply(wid, DEC.decode(ENC.encode(1.0, events)))
    assert not (st.bad_events or st.orphans or st.unknown_removed or st.ignored), st


def digests(tokens: list[int]) -> list[int]:
    return digests64(HASHER.keys(tokens[: len(tokens) // BS * BS]))


def usable(tokens: list[int]) -> int:
    """Blocks vLLM may reuse: never the last prompt token."""
    return (len(tokens) - 1) // BS


def credited(idx: PrefixIndex, wid: str, tokens: list[int]) -> int:
    m = idx.match(digests(tokens), max_blocks=usable(tokens)).get(wid)
    return 0 if m is None else m.blocks


def stats(idx: PrefixIndex, wid: str):
    return next(s for s in idx.worker_stats() if s.worker_id == wid)


FULL = ("full_attention", BS, None)


def test_worked_example_full_plus_window():
    """docs/kv-groups.md's example: W = 48 tokens (3 blocks before the end), a 161-token
    prompt, group 0 holds blocks 0-9, the window group 3-7: vLLM serves 8 blocks (128
    cached tokens), where group 0 alone would claim 10."""
    t = toks(1, 10, extra=1)
    eng = Engine(t, {0: FULL, 1: ("sliding_window", BS, 48)})
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    apply(idx, "v", [eng.cache(0, 0, 10), eng.cache(1, 0, 10)])
    assert credited(idx, "v", t) == 10
    apply(idx, "v", [eng.evict(1, 0, 1, 2)])  # left the window: the end's 3 blocks still held
    assert credited(idx, "v", t) == 10
    apply(idx, "v", [eng.evict(1, 8, 9)])
    assert credited(idx, "v", t) * BS == 128
    s = stats(idx, "v")
    assert s.kv_groups == {"0": "full_attention/16", "1": "sliding_window/16/window=48"}
    assert (s.group_cuts, s.group_cut_blocks, s.group_disagreements) == (1, 2, 0)
    assert (s.stored, s.group_stored, s.group_removed) == (10, 10, 5)
    # the same events seen as a single-group worker (what the index did before): 10
    one = PrefixIndex(BS)
    one.add_worker("v", NS.digest, BS)
    apply(one, "v", [eng.cache(0, 0, 10)])
    assert credited(one, "v", t) == 10 and one._slots.hybrid == 0


def test_window_ends_where_the_engine_may_reuse():
    """The window must end at (prompt_tokens - 1) // block_size, not at the last full block."""
    t = toks(2, 8)  # exactly 8 blocks: 7 usable
    eng = Engine(t, {0: FULL, 1: ("sliding_window", BS, 33)})  # 2 blocks before the end
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    apply(idx, "v", [eng.cache(0, 0, 8), eng.cache(1, 0, 8), eng.evict(1, 0, 1, 2, 3, 4, 5)])
    assert idx.match(digests(t))["v"].blocks == 8  # a window ending at block 8: 6 and 7 held
    assert credited(idx, "v", t) == 0  # ending at 7 needs block 5: gone, and no shorter end works


def test_window_group_event_with_null_blocks_keys_its_last_blocks():
    """A chunked prefill: the window group's second step names only the blocks still in
    its window, its tokens cover the whole step; those blocks get the router's keys."""
    t = toks(3, 10, extra=3)
    eng = Engine(t, {0: FULL, 1: ("sliding_window", BS, 40)})  # 3 blocks before the end
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    apply(idx, "v", [eng.cache(0, 0, 4), eng.cache(1, 0, 4)])
    step = eng.cache(1, 4, 10, null_below=6)
    assert len(step.block_hashes) == 4 and len(step.token_ids) == 6 * BS
    apply(idx, "v", [eng.cache(0, 4, 10), step])
    assert credited(idx, "v", t) == 10  # window 7-9 held
    ds = digests(t)
    gs = idx._slots.workers["v"].groups
    assert gs is not None and set(gs.held[1]) == {ds[i] for i in (0, 1, 2, 3, 6, 7, 8, 9)}
    short = t[: 6 * BS + 1]  # a prompt that stops inside the skipped blocks
    assert credited(idx, "v", short) == 4  # ends at 6 or 5 need 4 or 5: null; 4 needs 1-3
    apply(idx, "v", [eng.evict(1, 6, 7, 8, 9)])
    assert credited(idx, "v", t) == 4


def test_full_group_missing_a_block_shortens_the_match_and_flags_the_worker():
    t = toks(4, 9, extra=1)
    eng = Engine(t, {0: FULL, 1: ("mla_attention", BS, None)})
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    apply(idx, "v", [eng.cache(0, 0, 9), eng.cache(1, 0, 9)])
    assert credited(idx, "v", t) == 9
    assert stats(idx, "v").group_disagreements == 0
    apply(idx, "v", [eng.evict(1, 5)])
    m = idx.match(digests(t), max_blocks=usable(t))["v"]
    assert m.blocks == 5 and m.runs == ((Tier.GPU, 5),)
    s = stats(idx, "v")
    assert (s.group_disagreements, s.group_cuts, s.group_cut_blocks) == (1, 1, 4)


def test_three_groups_with_two_block_sizes_reach_the_fixed_point():
    """full (16) + window 33 tokens (2 blocks of 16) + window 64 tokens (2 blocks of 32):
    hits land on multiples of 32 tokens, and each group lowers the candidate in turn."""
    t = toks(5, 11, extra=1)  # 11 blocks of 16; 5 of 32
    eng = Engine(t, {0: FULL, 1: ("sliding_window", BS, 33), 2: ("sliding_window", 2 * BS, 64)})
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    apply(idx, "v", [eng.cache(0, 0, 11), eng.cache(1, 0, 11), eng.cache(2, 0, 5)])
    assert credited(idx, "v", t) == 10  # 11 usable blocks, on the 32-token boundary
    apply(idx, "v", [eng.evict(2, 4)])  # index blocks 8-9 of the 32-token group
    assert credited(idx, "v", t) == 8
    apply(idx, "v", [eng.evict(1, 6)])
    assert credited(idx, "v", t) == 6  # 8 needs block 6 of the 16-token window group
    apply(idx, "v", [eng.evict(2, 1)])
    assert credited(idx, "v", t) == 2  # 6 and 4 need its 32-token block 1; 2 needs only block 0
    apply(idx, "v", [eng.evict(2, 0)])
    assert credited(idx, "v", t) == 0
    apply(idx, "v", [eng.cache(2, 0, 2)])
    assert credited(idx, "v", t) == 6
    assert stats(idx, "v").kv_groups["2"] == "sliding_window/32/window=64"


def test_a_kind_the_rule_does_not_cover_earns_nothing_and_spec_changes_are_counted():
    t = toks(6, 6, extra=1)
    eng = Engine(t, {0: FULL, 1: ("chunked_local_attention", BS, None)})
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    idx.add_worker("plain", NS.digest, BS)
    apply(idx, "v", [eng.cache(0, 0, 6), eng.cache(1, 0, 6)])
    apply(idx, "plain", [eng.cache(0, 0, 6)])
    assert set(idx.match(digests(t))) == {"plain"}
    assert stats(idx, "v").kv_groups["1"] == "chunked_local_attention/16"
    again = Engine(t, {0: FULL, 1: ("sliding_window", BS, 64)})  # a restart with another config
    st = idx.apply("v", [AllBlocksCleared(), again.cache(0, 0, 6), again.cache(1, 0, 6)])
    assert st.group_spec_changes == 1
    assert credited(idx, "v", t) == 6
    odd = Engine(t, {0: FULL, 2: ("mamba", BS + 8, None)})  # a group the index cannot key
    st = idx.apply("v", [odd.cache(2, 0, 1)])
    assert st.ignored == 1 and "v" not in idx.match(digests(t))


def test_clearing_drops_every_group_but_keeps_the_specs():
    """After AllBlocksCleared the groups hold nothing: group 0's blocks alone earn nothing."""
    t = toks(7, 5, extra=1)
    eng = Engine(t, {0: FULL, 1: ("sliding_window", BS, 20)})
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    apply(idx, "v", [eng.cache(0, 0, 5), eng.cache(1, 0, 5)])
    apply(idx, "v", [AllBlocksCleared(), eng.cache(0, 0, 5)])
    assert "v" not in idx.match(digests(t), max_blocks=usable(t))
    apply(idx, "v", [eng.cache(1, 0, 5)])
    assert credited(idx, "v", t) == 5
    idx.clear_worker("v")
    assert idx._slots.workers["v"].groups.entries() == 0 and "v" not in idx.match(digests(t))


def test_a_window_only_model_in_group_0_follows_the_window_rule():
    """A single sliding-window group (group 0) drops leading blocks; the window still serves."""
    t = toks(8, 8, extra=1)
    eng = Engine(t, {0: ("sliding_window", BS, 24)})  # 2 blocks before the end
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    apply(idx, "v", [eng.cache(0, 0, 3), eng.cache(0, 3, 8, null_below=5)])
    assert credited(idx, "v", t) == 8
    assert stats(idx, "v").kv_groups == {"0": "sliding_window/16/window=24"}


def test_single_group_workers_are_unchanged():
    """vLLM 0.32's single-group events (group 0, full attention) add no group state."""
    t = toks(9, 6)
    eng = Engine(t, {0: FULL})
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    apply(idx, "v", [eng.cache(0, 0, 6), eng.evict(0, 5)])
    w = idx._slots.workers["v"]
    assert w.groups is None and idx._slots.hybrid == 0
    assert idx.match(digests(t))["v"].blocks == 5
    s = stats(idx, "v")
    assert (s.kv_groups, s.group_cuts, s.group_disagreements) == ({}, 0, 0)


def test_group_events_without_a_kind_are_ignored_as_before():
    t = toks(10, 3)
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, BS)
    ds = digests(t)
    st = idx.apply("v", [BlockStored(ds, None, t, BS, None, "GPU", None, None, 1), BlockRemoved(ds, "GPU", 1)])
    assert (st.ignored, st.group_stored) == (2, 0)
    assert idx._slots.workers["v"].groups is None


# ------------------------------------------------------------------ the rule against its definition


def accepted(order: list[tuple[int, GroupSpec, int]], held: dict[int, set[int]], L: int) -> bool:
    """Does every group serve a hit of L index blocks (block size 1 index block = 1 unit)?"""
    for g, spec, c in order:
        k = spec.block_size // BS
        if L % k:
            return False
        end = L // k
        need = range(end) if c == 0 else range(max(0, end - c), end)
        if any(j not in held[g] for j in need):
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(0, 24),
    kinds=st.lists(st.tuples(st.sampled_from([0, 1, 2, 5]), st.sampled_from([1, 2, 3])), min_size=1, max_size=4),
)
def test_the_fixed_point_is_the_longest_length_every_group_accepts(data, n, kinds):
    """vLLM's iteration (each group lowers the candidate in turn) ends at the largest common
    boundary every group accepts: checked against that definition by brute force."""
    order = []
    held: dict[int, set[int]] = {}
    for g, (c, k) in enumerate(kinds):
        kind = "full_attention" if c == 0 else "sliding_window"
        window = None if c == 0 else c * k * BS  # needs ceil((W - 1) / bs) = c blocks
        spec = GroupSpec(kind, k * BS, window)
        assert spec.needs(BS) == c
        order.append((g, spec, c))
        held[g] = set(data.draw(st.lists(st.integers(0, n // k), max_size=n + 1)))
    order.sort(key=lambda x: x[2] != 0)
    by_group = {g: (spec.block_size // BS) for g, spec, _ in order}
    def holds(g: int, i: int) -> bool:
        return (i + 1) // by_group[g] - 1 in held[g]

    def leading(g: int, limit: int) -> int:
        return next((i for i in range(limit) if not holds(g, i // by_group[g] * by_group[g] + by_group[g] - 1)), limit)

    def span_held(g: int, k: int, lo: int, hi: int) -> bool:
        return all(j in held[g] for j in range(lo, hi))

    got, _ = hybrid_blocks(order, holds, n, BS)
    want = max(L for L in range(n + 1) if accepted(order, held, L))
    assert got == want
    assert hybrid_blocks(order, holds, n, BS, leading, span_held)[0] == want  # the index's shortcuts
