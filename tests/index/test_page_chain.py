"""Pages smaller than the index block (SGLang's), assembled into index blocks
(kvindex/page_chain.py), fed with events built to SGLang's own structs
(tests/support/sglang_fixtures.py) and decoded by our codec."""
from __future__ import annotations

import random

import pytest
from sglang_fixtures import (
    SgAllBlocksCleared,
    SgBlockStored,
    encode_batch,
    page_hashes,
    removed_pages,
    stored_pages,
)

from kvindex.errors import BadBlockSize
from kvindex.events import BlockRemoved, BlockStored, EventDecoder
from kvindex.index import PrefixIndex
from kvindex.keys import BlockHasher, Namespace, digests64
from kvindex.tiers import Tier

NS = Namespace("m", block_size=16)
DEC = EventDecoder()


def _digests(tokens: list[int], block: int) -> list[int]:
    return digests64(BlockHasher(NS.digest, block).keys(tokens))


def _index(block: int = 16, page: int = 1, **kw: int) -> PrefixIndex:
    idx = PrefixIndex(block)
    idx.add_worker("sg", NS.digest, block_size=page, **kw)
    return idx


def _feed(idx: PrefixIndex, events: list, **kw: object) -> None:
    batch = DEC.decode(encode_batch(events, **kw))  # type: ignore[arg-type]
    assert not batch.errors
    idx.apply("sg", batch)


def _held(idx: PrefixIndex, tokens: list[int], block: int = 16) -> int:
    m = idx.match(_digests(tokens, block))
    return m["sg"].blocks if "sg" in m else 0


def _toks(n: int, seed: int = 0) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1, 50_000) for _ in range(n)]


@pytest.mark.parametrize("page,block", [(1, 16), (1, 32), (8, 16), (8, 32), (16, 32)])
def test_pages_assemble_into_whole_index_blocks(page: int, block: int) -> None:
    idx = _index(block, page)
    tokens = _toks(5 * block + 3)  # five whole blocks and a partial one
    usable = len(tokens) - len(tokens) % page
    _feed(idx, stored_pages(tokens[:usable], page))
    assert _held(idx, tokens, block) == 5
    # the keys are ours, from the tokens: another prompt sharing 2 blocks matches 2
    other = tokens[: 2 * block] + _toks(3 * block, seed=9)
    assert _held(idx, other, block) == 2
    assert idx.local_blocks("sg") == 5


@pytest.mark.parametrize("coalesce", [False, True])
def test_a_chain_across_several_events_and_batches(coalesce: bool) -> None:
    """A node's pages come in one event (coalesced) or one per page; later nodes chain
    on the last page of the earlier ones, in later batches, mid-block."""
    idx = _index(16, 1)
    tokens = _toks(64)
    first = tokens[:21]  # ends 5 pages into block 1
    _feed(idx, stored_pages(first, 1, coalesce=coalesce))
    assert _held(idx, tokens) == 1
    parent = page_hashes(first, 1)[-1]
    _feed(idx, stored_pages(tokens[21:50], 1, parent, coalesce=coalesce))
    assert _held(idx, tokens) == 3
    parent = page_hashes(tokens[:50], 1)[-1]
    _feed(idx, stored_pages(tokens[50:], 1, parent, coalesce=coalesce), dp_rank=None)
    assert _held(idx, tokens) == 4


def test_a_fork_in_the_middle_of_a_block() -> None:
    """Two requests share 20 tokens: the second's block 1 is keyed from the shared pages."""
    idx = _index(16, 1)
    a = _toks(48, seed=1)
    b = a[:20] + _toks(28, seed=2)
    _feed(idx, stored_pages(a, 1))
    parent = page_hashes(a[:20], 1)[-1]
    _feed(idx, stored_pages(b[20:], 1, parent))
    assert _held(idx, a) == 3 and _held(idx, b) == 3


def test_orphans_and_out_of_order_pages_are_never_credited() -> None:
    idx = _index(16, 8)
    tokens = _toks(32)
    evs = stored_pages(tokens, 8)
    _feed(idx, [evs[1], evs[3]])  # children before their parents
    assert _held(idx, tokens) == 0
    st = idx.worker_stats()[0]
    assert st.orphans == 2 and st.stored == 0
    _feed(idx, [evs[0], evs[2]])  # the parents alone: block 0 lacks its second page
    assert _held(idx, tokens) == 0
    _feed(idx, evs)  # the whole chain again, in order (duplicates of the pages above)
    assert _held(idx, tokens) == 2
    _feed(idx, evs)  # and again: nothing changes, nothing double-counted
    assert _held(idx, tokens) == 2 and idx.local_blocks("sg") == 2


def test_a_removed_page_drops_every_block_containing_it() -> None:
    idx = _index(16, 1)
    a = _toks(48, seed=3)
    b = a[:20] + _toks(28, seed=4)
    _feed(idx, stored_pages(a, 1))
    _feed(idx, stored_pages(b[20:], 1, page_hashes(a[:20], 1)[-1]))
    ha = page_hashes(a, 1)
    _feed(idx, [removed_pages([ha[40]])])  # a's block 2 (pages 32..47)
    assert _held(idx, a) == 2 and _held(idx, b) == 3
    _feed(idx, [removed_pages([ha[18]])])  # shared by a's and b's block 1
    assert _held(idx, a) == 1 and _held(idx, b) == 1
    assert idx.local_blocks("sg") == 2  # block 0, and b's block 2 (its pages held; not matched: its prefix is not)
    _feed(idx, [removed_pages([ha[0]])])
    assert _held(idx, a) == 0 and _held(idx, b) == 0
    # the engine stores the pages again: credited again
    _feed(idx, stored_pages(a, 1))
    assert _held(idx, a) == 3


def test_tiers_are_credited_per_medium() -> None:
    """A block is in a tier only while all its pages are (SGLang's host cache sends CPU)."""
    idx = _index(16, 8)
    tokens = _toks(32)
    _feed(idx, stored_pages(tokens, 8, medium="GPU"))
    _feed(idx, stored_pages(tokens, 8, medium="CPU"))
    hs = page_hashes(tokens, 8)
    _feed(idx, [removed_pages(hs[2:], medium="GPU")])  # block 1 leaves the GPU, stays on the host
    m = idx.match(_digests(tokens, 16))["sg"]
    assert m.blocks == 2 and m.per_tier() == {Tier.GPU: 1, Tier.CPU: 1}
    _feed(idx, [removed_pages(hs[3:], medium="CPU")])
    assert idx.match(_digests(tokens, 16))["sg"].per_tier() == {Tier.GPU: 1}


def test_cleared_and_lost_sync_forget_the_pages() -> None:
    idx = _index(16, 1)
    tokens = _toks(40)
    _feed(idx, stored_pages(tokens, 1))
    _feed(idx, [SgAllBlocksCleared()])
    assert _held(idx, tokens) == 0
    # a page of the old chain cannot parent anything now
    _feed(idx, stored_pages(_toks(16, 5), 1, page_hashes(tokens, 1)[-1]))
    assert idx.local_blocks("sg") == 0
    _feed(idx, stored_pages(tokens, 1))
    assert _held(idx, tokens) == 2
    idx.clear_worker("sg")
    assert _held(idx, tokens) == 0 and not idx._slots.workers["sg"].pages


def test_memory_is_bounded_and_eviction_only_drops_credit() -> None:
    idx = _index(16, 1, max_pages=40)
    a, b = _toks(32, seed=6), _toks(32, seed=7)
    _feed(idx, stored_pages(a, 1))
    assert _held(idx, a) == 2
    _feed(idx, stored_pages(b, 1))  # 64 pages > 40: a's first 24 are forgotten
    w = idx._slots.workers["sg"]
    assert len(w.pages) == 40
    assert _held(idx, a) == 0 and _held(idx, b) == 2
    assert idx.worker_stats()[0].pages_evicted == 24
    assert idx.local_blocks("sg") == 2


def test_the_bound_forgets_leaves_first_and_keeps_a_shared_prefix() -> None:
    """As the engine's radix cache evicts: a prefix later chains hang from is kept."""
    idx = _index(16, 1, max_pages=40)
    root = _toks(16, seed=8)
    a, b = root + _toks(16, seed=9), root + _toks(16, seed=10)
    _feed(idx, stored_pages(a, 1))
    _feed(idx, stored_pages(b[16:], 1, page_hashes(root, 1)[-1]))  # 48 pages: 8 of a's tail go
    assert _held(idx, b) == 2 and _held(idx, a) == 1
    assert idx.worker_stats()[0].pages_evicted == 8
    # one chain longer than the bound: its tail is not placed, its head stays
    idx2 = _index(16, 1, max_pages=40)
    long = _toks(64, seed=11)
    _feed(idx2, stored_pages(long, 1, coalesce=True))
    assert _held(idx2, long) == 2 and len(idx2._slots.workers["sg"].pages) == 40


def test_a_release_whose_page_hashes_do_not_chain_is_never_credited() -> None:
    """Some SGLang releases hash a page's tokens alone and give every radix node's first page
    no parent: a node continuing another would be keyed as the start of a prompt."""
    idx = _index(16, 1)
    good = _toks(32, seed=12)
    _feed(idx, stored_pages(good, 1))
    assert _held(idx, good) == 2
    a = _toks(48, seed=13)
    node1 = [SgBlockStored([hash((t,))], None if i == 0 else hash((a[i - 1],)), [t], 1, None)
             for i, t in enumerate(a[:16])]
    node2 = [SgBlockStored([hash((t,))], None if i == 0 else hash((a[16 + i - 1],)), [t], 1, None)
             for i, t in enumerate(a[16:])]  # its first page says "no parent"
    _feed(idx, node1 + node2)
    assert _held(idx, good) == 0 and _held(idx, a) == 0 and _held(idx, a[16:]) == 0
    assert idx.local_blocks("sg") == 0 and idx.worker_stats()[0].unchained_pages == 48
    _feed(idx, stored_pages(good, 1))  # and nothing from it later either
    assert _held(idx, good) == 0


def test_a_page_hash_seen_under_another_parent_is_not_placed() -> None:
    idx = _index(16, 1)
    a = _toks(32, seed=14)
    evs = stored_pages(a, 1)
    _feed(idx, evs[:16])
    assert _held(idx, a) == 1
    # page 5's hash again, now claiming page 9 as its parent, with two more pages after it
    clash = SgBlockStored([evs[5].block_hashes[0], 111, 222], evs[9].block_hashes[0], a[5:8], 1, None)
    _feed(idx, [clash])
    pages = idx._slots.workers["sg"].pages
    assert pages is not None and idx.worker_stats()[0].orphans == 3 and 111 not in pages.pages
    assert pages.pages[evs[5].block_hashes[0]].parent == evs[4].block_hashes[0]  # left as it was
    _feed(idx, evs[16:])
    assert _held(idx, a) == 2


def test_partial_and_malformed_pages() -> None:
    idx = _index(16, 8)
    tokens = _toks(20)
    hs = page_hashes(tokens, 8)
    # a last page of 4 tokens (block_size 4): it ends no index block
    idx.apply("sg", [BlockStored([hs[0]], None, tokens[:8], 8, None),
                     BlockStored([123], hs[0], tokens[16:20], 4, None),
                     BlockStored([hs[1]], hs[0], tokens[8:15], 8, None)])  # 7 tokens for a page of 8
    st = idx.worker_stats()[0]
    assert st.partial_pages == 1 and st.bad_events == 1 and st.stored == 1
    idx.apply("sg", [BlockRemoved([999])])
    assert idx.worker_stats()[0].unknown_removed == 1


def test_registration_rules_for_pages() -> None:
    idx = PrefixIndex(16)
    with pytest.raises(BadBlockSize):
        idx.add_worker("a", NS.digest, block_size=12)  # divides nothing
    idx.add_worker("b", NS.digest, block_size=1, trusted_digests=True)
    assert not idx.trusts_digests("b")  # page hashes are never our digests
    idx.add_worker("c", NS.digest, block_size=32)
    assert idx._slots.workers["c"].pages is None  # multiples keep the split path


def test_sglang_payloads_decode() -> None:
    """Every SGLang generation's payload decodes to our events."""
    tokens = _toks(16)
    evs = stored_pages(tokens, 8) + [removed_pages(page_hashes(tokens, 8)[1:]), SgAllBlocksCleared()]
    for kw in ({"first_release": True}, {"dp_rank": 3}, {"dp_rank": None}):
        b = DEC.decode(encode_batch(evs, **kw))  # type: ignore[arg-type]
        assert not b.errors
        names = [type(e).__name__ for e in b.events]
        assert names == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
        assert b.events[1].parent_block_hash == b.events[0].block_hashes[0]  # type: ignore[union-attr]
        assert b.events[0].token_ids == tokens[:8] and b.events[0].block_size == 8  # type: ignore[union-attr]
        assert b.data_parallel_rank == kw.get("dp_rank")
    med = stored_pages(tokens, 1, coalesce=True, medium="CPU") + [removed_pages([1, 2], medium="CPU")]
    b = DEC.decode(encode_batch(med, dp_rank=1))
    assert not b.errors and b.data_parallel_rank == 1
    s = b.events[0]
    assert isinstance(s, BlockStored) and s.medium == "CPU" and len(s.block_hashes) == 16 and s.block_size == 1
    assert isinstance(b.events[1], BlockRemoved) and b.events[1].medium == "CPU"
    lazy = EventDecoder(lazy=True).decode(encode_batch(stored_pages(tokens, 8)))
    assert lazy.events[0].materialize().token_ids == tokens[:8]  # type: ignore[union-attr]
