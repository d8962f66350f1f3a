"""Pages smaller than the index block, assembled into index blocks along their chain.

An engine whose cache unit (page) is smaller than the index block publishes one hash
per page, each page naming its predecessor as `parent_block_hash` (SGLang's radix cache
does so, with pages of one token by default). The index keys whole blocks of
`block_size` tokens, so a worker registered with a page size that divides the index
block size gets a `PageChain`: it remembers each page (its parent, its depth along the
chain, its tokens and the tiers it is held in) and, when the page that ends an index
block arrives, keys that block from the tokens of its pages and the full key of the
block before it.

The rule is exact and conservative: an index block is credited in a tier only while
every one of its pages is held there by the worker; a page that is removed, evicted
from this bounded memory, or cleared takes the credit of every block containing it
with it. A page whose parent is unknown (an orphan, or a child that came before its
parent) is not placed, so nothing below it is credited until the engine stores the
chain again. A block is credited when its last page is stored; a page of the block
stored in a tier later than the block's last page is credited at the next store of
that last page (the engine stores a chain parent first, so this is rare).

Some SGLang releases name a page by a hash of its own tokens only (the same tokens give
the same hash at any position) and give the first page of every radix node no parent, so
a node that continues another looks like a chain root. Such a stream cannot be placed:
keyed as roots, those pages would be credited as the start of prompts they never began.
A worker whose chain-root page carries exactly that hash (Python's hash of the tuple of
its tokens, what those releases publish) is credited nothing (`unchained_pages`).
A page stored again under another parent than the one it was placed under is ambiguous
the same way: it and the pages after it in its event are not placed (`orphans`).

Memory is bounded by `max_pages` pages per worker (about 300 bytes each). Past it a
page is forgotten, and the blocks it was part of are no longer credited: the least
recently stored page among those no remembered page names as its parent (a leaf, as the
engine's own radix cache evicts), so a prefix that later chains still hang from is kept
while any of them is.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .blockmap import BlockMap
from .keys import ROOT_KEY, BlockHasher, digest64, tokens_to_bytes

DEFAULT_MAX_PAGES = 1 << 20
Changed = Callable[[int, int], None]  # told (bit, +n) / (bit, -n) of index entry bits set / cleared


class _Page:
    """One page the worker holds (in at least one tier)."""

    __slots__ = ("parent", "depth", "tokens", "tiers", "key", "digest", "credited", "ends", "kids")

    def __init__(self, parent: Any, depth: int, tokens: bytes) -> None:
        self.parent = parent
        self.depth = depth  # pages between it and the chain root (0: the first page)
        self.tokens = tokens  # u32 little-endian
        self.tiers = 0  # the worker's bitmap bits this page is held in
        self.key: bytes | None = None  # full key of the index block this page ends
        self.digest = 0
        self.credited = 0  # bits its block is credited with in the index (last pages only)
        self.ends: list[Any] | None = None  # last pages of the credited blocks containing it
        self.kids = 0  # remembered pages that name it as their parent


class PageChain:
    """One worker's pages; see the module doc. Not thread-safe (the index is not)."""

    def __init__(
        self, page_size: int, block_size: int, hasher: BlockHasher, max_pages: int = DEFAULT_MAX_PAGES
    ) -> None:
        if page_size <= 0 or block_size % page_size:
            raise ValueError(f"page size {page_size} does not divide the block size {block_size}")
        if max_pages < 1:
            raise ValueError("max_pages must be positive")
        self.page_size = page_size
        self.per_block = block_size // page_size
        self.hasher = hasher
        self.max_pages = max_pages
        self.pages: dict[Any, _Page] = {}
        self.leaves: dict[Any, None] = {}  # pages without remembered children, least recently stored first
        self._refs: dict[tuple[int, int], int] = {}  # (digest, bit) -> last pages crediting it
        self.evicted = 0
        self.unchained = False  # its page hashes do not depend on the position: nothing placed

    def __len__(self) -> int:
        return len(self.pages)

    def clear(self) -> None:
        self.pages.clear()
        self.leaves.clear()
        self._refs.clear()

    # ------------------------------------------------------------------ stored

    def store(
        self,
        blocks: BlockMap,
        hashes: Sequence[Any],
        parent: Any,
        tokens: bytes,
        bit: int,
        extra: tuple[Any, ...] | None,
        changed: Changed,
    ) -> tuple[int, int]:
        """Pages `hashes` (each `page_size` tokens of `tokens`, u32 bytes), the first one a
        child of `parent` (None: a chain root), stored in tier `bit`.

        Returns (pages placed, orphans). `changed(bit, delta)` is told of every index
        entry bit set or cleared (evictions clear bits of any tier).
        """
        pages = self.pages
        step = self.page_size * 4
        placed = 0
        for i, h in enumerate(hashes):
            node = pages.get(h)
            if node is not None:  # stored again (another tier, or a repeat)
                if node.parent != parent:  # the same hash elsewhere in the tree: ambiguous
                    return placed, len(hashes) - i
                if h in self.leaves:
                    del self.leaves[h]
                    self.leaves[h] = None  # the most recent leaf now
            else:
                pn = None
                if parent is None:
                    depth = 0
                else:
                    pn = pages.get(parent)
                    if pn is None:
                        return placed, len(hashes) - i
                    depth = pn.depth + 1
                node = _Page(parent, depth, tokens[i * step : (i + 1) * step])
                pages[h] = node
                self.leaves[h] = None
                if pn is not None:
                    pn.kids += 1
                    if pn.kids == 1:
                        self.leaves.pop(parent, None)
                if len(pages) > self.max_pages:
                    self._evict_one(blocks, changed)
                    if h not in pages:  # it was the only leaf: the chain cannot grow past the bound
                        return placed, len(hashes) - i - 1
            node.tiers |= bit
            placed += 1
            if (node.depth + 1) % self.per_block == 0:
                self._settle(blocks, h, node, bit, extra, changed)
            parent = h
        return placed, 0

    def _block_pages(self, h: Any, node: _Page) -> list[tuple[Any, _Page]] | None:
        """The pages of the block `node` ends, first to last; None when one is unknown."""
        out = [(h, node)]
        cur = node
        for _ in range(self.per_block - 1):
            ph = cur.parent
            pn = self.pages.get(ph)
            if pn is None or pn.depth != cur.depth - 1:
                return None
            out.append((ph, pn))
            cur = pn
        out.reverse()
        return out

    def _settle(
        self, blocks: BlockMap, h: Any, node: _Page, bit: int, extra: tuple[Any, ...] | None,
        changed: Changed,
    ) -> None:
        """Key the block `node` ends (once) and credit it in `bit` if all its pages hold it."""
        members = self._block_pages(h, node)
        if members is None:
            return
        if node.key is None:
            first = members[0][1]
            if first.depth == 0:
                parent_key: bytes | None = ROOT_KEY
            else:
                prev = self.pages.get(first.parent)
                parent_key = None if prev is None else prev.key
            if parent_key is None:
                return  # the block before it is not keyed: nothing to chain from
            buf = b"".join(p.tokens for _, p in members)
            states = None if extra is None else self.hasher.states_for([extra], 1)
            node.key = self.hasher.chain(buf, 1, states, parent_key)[0]
            node.digest = digest64(node.key)
        if node.credited & bit or not all(p.tiers & bit for _, p in members):
            return
        key = (node.digest, bit)
        n = self._refs.get(key, 0)
        self._refs[key] = n + 1
        if not n:
            changed(bit, blocks.set_bits([node.digest], [node.key], bit))
        node.credited |= bit
        for _, p in members[:-1]:
            if p.ends is None:
                p.ends = [h]
            elif h not in p.ends:
                p.ends.append(h)

    # ------------------------------------------------------------------ removed

    def remove(self, blocks: BlockMap, hashes: Sequence[Any], bit: int, changed: Changed) -> tuple[int, int]:
        """Pages no longer held in tier `bit`; returns (pages known, pages unknown)."""
        known = unknown = 0
        pages = self.pages
        for h in hashes:
            try:
                node = pages.get(h)
            except TypeError:
                unknown += 1
                continue
            if node is None or not node.tiers & bit:
                unknown += 1
                continue
            known += 1
            node.tiers &= ~bit
            self._uncredit_containing(blocks, h, node, bit, changed)
            if not node.tiers:
                self._forget(h, node)
        return known, unknown

    def _forget(self, h: Any, node: _Page) -> None:
        del self.pages[h]
        self.leaves.pop(h, None)
        pn = self.pages.get(node.parent)
        if pn is not None and pn.kids > 0:
            pn.kids -= 1
            if not pn.kids:
                self.leaves[node.parent] = None

    def _uncredit_containing(self, blocks: BlockMap, h: Any, node: _Page, bits: int, changed: Changed) -> None:
        if node.credited & bits:
            self._uncredit(blocks, node, bits, changed)
        for e in node.ends or ():
            en = self.pages.get(e)
            if en is not None and en.credited & bits:
                self._uncredit(blocks, en, bits, changed)

    def _uncredit(self, blocks: BlockMap, end: _Page, bits: int, changed: Changed) -> None:
        both = end.credited & bits
        end.credited &= ~bits
        while both:
            bit = both & -both
            both ^= bit
            key = (end.digest, bit)
            n = self._refs.get(key, 0) - 1
            if n > 0:
                self._refs[key] = n
            else:
                self._refs.pop(key, None)
                changed(bit, -blocks.clear_bits([end.digest], bit))

    def _evict_one(self, blocks: BlockMap, changed: Changed) -> None:
        """Forget the least recently stored leaf (any page, should no leaf be left)."""
        h = next(iter(self.leaves)) if self.leaves else next(iter(self.pages))
        node = self.pages[h]
        self._forget(h, node)
        self.evicted += 1
        every = -1  # every tier bit
        self._uncredit_containing(blocks, h, node, every, changed)


def page_tokens(tokens: Any, n: int, page_size: int) -> bytes | None:
    """The u32 bytes of `n` pages of tokens, or None when there are not exactly that many."""
    if type(tokens) is not list or len(tokens) != n * page_size:
        return None
    try:
        return tokens_to_bytes(tokens)
    except (OverflowError, TypeError, ValueError):
        return None


def unchained_hash(h: Any, tokens: Any, pages: PageChain) -> bool:
    """The first page's hash is the hash of its tokens alone (a release whose page hashes
    do not chain: see the module doc)."""
    try:
        return type(h) is int and h == hash(tuple(tokens[: pages.page_size]))
    except TypeError:
        return False
