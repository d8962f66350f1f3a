"""What a `BlockStored` event says about each block (`BlockMeta`), and how blocks stored
together become events: one per chain run, parents first.

Neutral ground for both engines (DESIGN §3: the real engine never imports the
simulator): it is the wire side of a block (docs/wire.md § KV events) and its JSON form
for peer export and import, used by the simulated cache, driver and loader and by the real
engine's tiers, writer and disk scan alike.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

from kvindex.events import AllBlocksCleared, BlockHash, BlockStored, KVEvent
from kvindex.keys import digest64, digests64
from kvindex.tiers import Tier


class BlockMeta(NamedTuple):
    """What `BlockStored` needs about a block: parent key, its tokens, extra keys, LoRA."""

    parent: bytes | None
    tokens: Sequence[int]
    offset: int
    extra: tuple[Any, ...] | None
    lora: str | None


def block_hashes(keys: Sequence[bytes]) -> list[BlockHash]:
    """The blocks' hashes as our events carry them: digest64 of each key (docs/wire.md)."""
    return cast("list[BlockHash]", digests64(keys))


def stored_events(tier: Tier, keys: list[bytes], meta: Mapping[bytes, BlockMeta], block_size: int) -> list[BlockStored]:
    """One BlockStored per chain run among `keys` (as vLLM batches them), runs ordered so
    that a subscriber always knows a block's parent when it applies the event."""
    runs = _chain_runs(keys, meta)
    if len(runs) > 1:
        runs = _parents_first(runs, meta)
    return [_stored(run, meta, block_size, tier.name) for run in runs]


def _chain_runs(keys: list[bytes], meta: Mapping[bytes, BlockMeta]) -> list[list[bytes]]:
    """`keys` cut into chain runs, each in parent-to-child order (runs may come in either direction)."""
    runs: list[list[bytes]] = []
    run: list[bytes] = []
    direction = 0  # +1 forward (child after parent), -1 backward
    last_parent: bytes | None = None
    for k in keys:
        m = meta[k]
        if run:
            if direction >= 0 and m.parent == run[-1]:
                run.append(k)
                direction = 1
                last_parent = m.parent
                continue
            if direction <= 0 and last_parent == k:
                run.append(k)
                direction = -1
                last_parent = m.parent
                continue
            if direction < 0:
                run.reverse()
            runs.append(run)
        run = [k]
        direction = 0
        last_parent = m.parent
    if run:
        if direction < 0:
            run.reverse()
        runs.append(run)
    return runs


def _stored(run: list[bytes], meta: Mapping[bytes, BlockMeta], bs: int, medium: str) -> BlockStored:
    first = meta[run[0]]
    toks: list[int] = []
    extras: list[tuple[Any, ...] | None] = []
    has_extra = False
    # consecutive blocks of one request's token list: one slice per stretch
    src: Sequence[int] | None = None
    lo = hi = 0
    for k in run:
        m = meta[k]
        if m.tokens is src and m.offset == hi:
            hi += bs
        else:
            if src is not None:
                toks.extend(src[lo:hi])
            src, lo, hi = m.tokens, m.offset, m.offset + bs
        extras.append(m.extra)
        if m.extra:
            has_extra = True
    if src is not None:
        toks.extend(src[lo:hi])
    return BlockStored(
        block_hashes=block_hashes(run),
        parent_block_hash=digest64(first.parent) if first.parent is not None else None,
        token_ids=toks,
        block_size=bs,
        medium=medium,
        lora_name=first.lora,
        extra_keys=extras if has_extra else None,
    )


def _parents_first(runs: list[list[bytes]], meta: Mapping[bytes, BlockMeta]) -> list[list[bytes]]:
    """Order chain runs so that a run whose parent block is in another run comes after it
    (a subscriber resolves each block's parent when it applies the event)."""
    where: dict[bytes, int] = {}
    for ri, run in enumerate(runs):
        for k in run:
            where[k] = ri
    seen = [False] * len(runs)
    out: list[list[bytes]] = []
    for ri in range(len(runs)):
        stack: list[int] = []
        r: int | None = ri
        while r is not None and not seen[r]:
            seen[r] = True
            stack.append(r)
            p = meta[runs[r][0]].parent
            r = where.get(p) if p is not None else None
        out.extend(runs[x] for x in reversed(stack))
    return out


def state_events(held: Mapping[Tier, set[bytes]], meta: Mapping[bytes, BlockMeta], block_size: int) -> list[KVEvent]:
    """The whole state as events: `AllBlocksCleared`, then one `BlockStored` per block and
    tier, every block after its parent whatever tier either sits in (a subscriber that
    applies them in order, alone, rebuilds exactly `held`; blocks without metadata cannot
    be described and are left out)."""
    depth: dict[bytes, int] = {}

    def depth_of(start: bytes) -> int:
        path, k = [], start
        while k not in depth:
            p = meta[k].parent
            if p is None or p not in meta:
                depth[k] = 0  # a root, or a block whose parent nothing describes
                break
            path.append(k)
            k = p
        d = depth[k]
        for c in reversed(path):
            d += 1
            depth[c] = d
        return depth[start]

    keys = {k for ks in held.values() for k in ks if k in meta}
    order = sorted(keys, key=depth_of)
    events: list[KVEvent] = [AllBlocksCleared()]
    for k in order:
        for tier in (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE):
            if k in held.get(tier, ()):
                events.append(_stored([k], meta, block_size, tier.name))
    return events


def meta_to_json(m: BlockMeta, block_size: int) -> dict[str, Any]:
    return {
        "parent": m.parent.hex() if m.parent is not None else None,
        "token_ids": list(m.tokens[m.offset : m.offset + block_size]),
        "extra_keys": list(m.extra) if m.extra else None,
        "lora_name": m.lora,
    }


def meta_from_json(d: dict[str, Any]) -> BlockMeta:
    parent = d.get("parent")
    extra = d.get("extra_keys")
    return BlockMeta(
        bytes.fromhex(parent) if parent else None,
        list(d["token_ids"]),
        0,
        tuple(extra) if extra else None,
        d.get("lora_name"),
    )
