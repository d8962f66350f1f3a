"""KV-cache groups of hybrid models: each group's spec, the blocks of groups > 0, and
the engine's hybrid prefix-cache hit rule (docs/kv-groups.md).

Group 0 lives in the holder bitmaps (`kvindex.blockmap`) like every block of a
single-group worker; a worker gets a `WorkerGroups` only once its events show another
group or a group 0 that is not full attention, so single-group workers carry nothing.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import lcm
from typing import Any

from .engine_hashes import EngineHashes

# Kinds vLLM names in `kv_cache_spec_kind`, by how a prefix hit is decided.
FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
STATE_KINDS = frozenset({"mamba"})
# Groups beyond this index are not tracked (their events are counted as ignored).
MAX_GROUPS = 16
# A group > 0 holding more entries than this is emptied and counted (a publisher that
# never removes must not grow the index without bound).
MAX_GROUP_BLOCKS = 1 << 22


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group as its events describe it. `block_size` in tokens (the engine's)."""

    kind: str
    block_size: int
    window: int | None = None

    def needs(self, index_block_size: int) -> int | None:
        """Blocks the group must hold ending at a hit's end: 0 for full attention (all of
        them), `ceil((window - 1) / block_size)` for a window, 1 for a state; None when
        the rule does not cover the kind or the block size is not a multiple of the
        index's (the worker is then credited nothing)."""
        if self.block_size % index_block_size:
            return None
        if self.kind in FULL_KINDS:
            return 0
        if self.kind in WINDOW_KINDS:
            w = self.window
            if type(w) is not int or w <= 0:
                return None
            return max(1, -(-(w - 1) // self.block_size))
        if self.kind in STATE_KINDS:
            return 1
        return None

    def describe(self) -> str:
        s = f"{self.kind}/{self.block_size}"
        return s if self.window is None else f"{s}/window={self.window}"


class WorkerGroups:
    """A hybrid worker's groups: specs of all, and for each group > 0 its blocks.

    `held[g]`: digest -> tier bits (1 << tier index, REMOTE = 3) of the blocks group g
    holds; `hashes[g]`: its engine hash -> digest(s); `keys`: full keys of the digests
    some group > 0 holds and the index had no key for when they were stored, which
    later events of those groups chain from (a key group 0 held and later dropped makes
    a later child an orphan: a hit lost, never a false one).
    """

    __slots__ = ("specs", "held", "hashes", "keys", "cuts", "cut_blocks", "disagreements", "_order")

    def __init__(self) -> None:
        self.specs: dict[int, GroupSpec] = {}
        self.held: dict[int, dict[int, int]] = {}
        self.hashes: dict[int, EngineHashes] = {}
        self.keys: dict[int, bytes] = {}
        self.cuts = 0  # queries where other groups cut what group 0 alone holds
        self.cut_blocks = 0
        self.disagreements = 0  # queries where full-attention groups held different runs
        self._order: list[tuple[int, GroupSpec, int]] | None = None  # (group, spec, needs), full first

    def learn(self, g: int, spec: GroupSpec) -> bool:
        """Record group g's spec; True when it replaces a different one."""
        old = self.specs.get(g)
        if old == spec:
            return False
        self.specs[g] = spec
        self._order = None
        if g:
            self.held.setdefault(g, {})
            self.hashes.setdefault(g, EngineHashes())
        return old is not None

    def clear_blocks(self) -> None:
        """Forget every block of groups > 0 (the specs stay: they are the engine's config)."""
        for h in self.held.values():
            h.clear()
        for m in self.hashes.values():
            m.clear()
        self.keys.clear()

    def entries(self) -> int:
        return sum(map(len, self.held.values()))

    def forget_key(self, d: int) -> None:
        """Drop a digest's full key once no group > 0 holds it."""
        for h in self.held.values():
            if d in h:
                return
        self.keys.pop(d, None)

    def all_specs(self, default_block_size: int) -> dict[int, GroupSpec]:
        """Every group's spec; group 0 without one (its events named full attention
        before the worker showed other groups) is full attention."""
        specs = dict(self.specs)
        specs.setdefault(0, GroupSpec("full_attention", default_block_size))
        return specs

    def order(self, default_block_size: int, index_block_size: int) -> list[tuple[int, GroupSpec, int]] | None:
        """Groups in the order the rule asks them (full attention first); None when a
        group is not covered. Group 0 without a spec is full attention."""
        if self._order is None:
            out = []
            for g, spec in sorted(self.all_specs(default_block_size).items()):
                n = spec.needs(index_block_size)
                if n is None:
                    return None
                out.append((g, spec, n))
            out.sort(key=lambda x: x[2] != 0)  # stable: full attention first, then by group
            self._order = out
        return self._order


def spec_of(ev: Any) -> GroupSpec | None:
    """The spec an event reports, or None when it names no kind or no block size."""
    kind = ev.kv_cache_spec_kind
    bs = ev.block_size
    if type(kind) is not str or type(bs) is not int or bs <= 0:
        return None
    w = ev.kv_cache_spec_sliding_window
    return GroupSpec(kind, bs, w if type(w) is int else None)


def hybrid_blocks(
    order: Sequence[tuple[int, GroupSpec, int]],
    holds: Callable[[int, int], bool],
    n: int,
    index_block_size: int,
    leading: Callable[[int, int], int] | None = None,
    span_held: Callable[[int, int, int, int], bool] | None = None,
) -> tuple[int, list[int]]:
    """The engine's hybrid hit over `n` index blocks, in index blocks, and each
    full-attention group's leading run (index blocks, on the common boundary, capped
    at the search bound).

    `holds(g, i)`: whether group g holds the engine block whose last index block is i;
    `leading(g, limit)`, if given: how many leading index blocks (at most `limit`) a
    full-attention group g holds, a faster answer than asking `holds` block by block;
    `span_held(g, k, lo, hi)`, if given: whether group g (`k` index blocks per engine
    block) holds every engine block in `lo..hi-1`, likewise.
    Every group's block size must be a multiple of the index's. The answer is the
    largest common boundary (a multiple of every group's block size) that every group
    accepts, found as vLLM finds it: each group lowers the candidate to its own longest
    hit no longer than it, full attention first, until a round changes nothing. A
    window scans leftwards from the candidate end and, at a missing block, jumps to the
    last boundary before it, so a typical answer costs about a window's lookups.
    """
    ks = [spec.block_size // index_block_size for _, spec, _ in order]
    a = lcm(*ks)
    top = n // a * a
    runs: list[int] = []  # full-attention groups' leading runs
    for (g, _spec, c), k in zip(order, ks, strict=True):
        if c == 0:
            if leading is not None:
                r = leading(g, top) // k
            else:
                r = 0
                while r < top // k and holds(g, r * k + k - 1):
                    r += 1
            runs.append(r * k // a * a)
    x = min(runs, default=top)
    while x:
        y = x
        for (g, _spec, c), k in zip(order, ks, strict=True):
            if c:
                y = _window_hit(g, c, k, a, holds, span_held, y)
                if not y:
                    break
        if y == x:
            break
        x = y
    return x, runs


def _window_hit(
    g: int,
    c: int,
    k: int,
    a: int,
    holds: Callable[[int, int], bool],
    span_held: Callable[[int, int, int, int], bool] | None,
    x: int,
) -> int:
    """A group that needs the `c` engine blocks ending at a hit's end (all of them when
    the hit is shorter): its longest hit no longer than `x` index blocks, on a boundary."""
    step = a // k  # engine blocks per boundary step
    e = x // k  # candidate end, in engine blocks (x is on a boundary)
    while e > 0:
        j = e - 1
        stop = e - min(c, e)
        if span_held is not None and span_held(g, k, stop, e):
            return e * k
        while j >= stop and holds(g, j * k + k - 1):
            j -= 1
        if j < stop:
            return e * k
        e = j // step * step  # the last boundary at or before the missing block j
    return 0
