"""SGLang's KV-event structs, restated from its source for tests (SGLang is not installed here).

SGLang (`python/sglang/srt/disaggregation/kv_events.py`) declares its events as msgspec
structs with `array_like=True, omit_defaults=True, tag=True`: tagged arrays. Two
generations were read there:

- first releases: the batch `[ts, events]`; `BlockStored(block_hashes,
  parent_block_hash, token_ids, block_size, lora_id)`, `BlockRemoved(block_hashes)`,
  `AllBlocksCleared()`;
- later releases: the batch gains `attn_dp_rank` (each attention-DP rank's publisher
  fills in its rank), the events are unchanged.

Its radix cache publishes one `BlockStored` per page, each page's parent the page before
it (the chain root's parent None), with SGLang's own signed 64-bit hashes; the newest
recorder coalesces consecutive pages of one chain into one event (several hashes, their
tokens concatenated, `block_size` still the page size) and adds `medium` ("GPU", or
"CPU" for its host cache) after `lora_id`.
"""
from __future__ import annotations

import hashlib
import struct
import time
from typing import Any

import msgspec


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class SgBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class SgBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]


class SgAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class SgBlockStoredMedium(_Event, tag="BlockStored"):
    """A release whose events carry `medium` after `lora_id` (host-cache tiers)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class SgBlockRemovedMedium(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class SgBatchV1(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class SgBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


_ENC = msgspec.msgpack.Encoder()


def page_hash(parent: int | None, tokens: list[int]) -> int:
    """A signed 64-bit page hash chained on its parent, as SGLang's are (its own function)."""
    h = hashlib.sha256(struct.pack("<q", parent or 0) + struct.pack(f"<{len(tokens)}I", *tokens)).digest()
    return struct.unpack("<q", h[:8])[0]


def page_hashes(tokens: list[int], page: int, parent: int | None = None) -> list[int]:
    """Hashes of the full pages of `tokens`, the first a child of `parent`."""
    out = []
    for i in range(0, len(tokens) - len(tokens) % page, page):
        parent = page_hash(parent, tokens[i : i + page])
        out.append(parent)
    return out


def stored_pages(tokens: list[int], page: int, parent: int | None = None, *, coalesce: bool = False,
                 medium: str | None = None) -> list[Any]:
    """The `BlockStored` events SGLang's radix cache sends for a new node of `tokens`
    (full pages only): one per page, or one for all of them (`coalesce`); with `medium`,
    the struct that carries it."""
    hs = page_hashes(tokens, page, parent)
    n = len(hs)

    def ev(h: list[int], par: int | None, t: list[int]) -> Any:
        if medium is None:
            return SgBlockStored(h, par, t, page, None)
        return SgBlockStoredMedium(h, par, t, page, None, medium)

    if coalesce:
        return [ev(hs, parent, tokens[: n * page])] if n else []
    out = []
    for i, h in enumerate(hs):
        out.append(ev([h], parent if i == 0 else hs[i - 1], tokens[i * page : (i + 1) * page]))
    return out


def removed_pages(hashes: list[int], medium: str | None = None) -> Any:
    return SgBlockRemoved(hashes) if medium is None else SgBlockRemovedMedium(hashes, medium)


def encode_batch(events: list[Any], dp_rank: int | None = 0, *, first_release: bool = False,
                 ts: float | None = None) -> bytes:
    """A payload as SGLang's publisher encodes it (msgpack of the array-like batch)."""
    t = time.time() if ts is None else ts
    if first_release:
        return _ENC.encode(SgBatchV1(t, events))
    return _ENC.encode(SgBatch(t, events, dp_rank))
