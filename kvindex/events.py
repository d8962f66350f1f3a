"""The KV-event wire codec, in vLLM's format (DESIGN.md §4.2).

A publisher sends ZMQ multipart frames `(topic, seq: 8-byte big-endian, payload)`;
the payload is msgpack of an event batch `(ts, events, data_parallel_rank)`.
Releases disagree on the encoding, so decoding accepts every combination seen:

- the batch as a positional array `[ts, events, dp_rank]` or as a map;
- each event as a tagged positional array `["BlockStored", hashes, parent, ...]`
  (older releases) or as a map with a `"type"` key (newer ones);
- trailing fields absent (older releases stop after `lora_id` or `medium`);
- block hashes as 64-bit ints or as bytes.

Decoding is msgspec's (C) on the fast path: the whole batch in one typed call.
If that fails, the batch is decoded event by event so one bad event costs only
itself; the bad ones are reported in `DecodedBatch.errors`, never raised.

`EventDecoder(lazy=True)` yields `LazyBlockStored` instead of `BlockStored`:
`token_ids` and `extra_keys` stay msgpack (`msgspec.Raw`, skipped in C, no Python
int per token) until `materialize()`. It is for workers whose block hashes are
our own digests (`PrefixIndex.add_worker(trusted_digests=True)`): the index
needs their tokens only for the events it samples for verification, and
building the token ints is most of the eager decoder's cost.

Encoding reproduces vLLM's struct layout byte for byte (field order, tags,
`omit_defaults`), so a subscriber built for vLLM reads our workers unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import msgspec

BlockHash = Union[int, bytes]

# --------------------------------------------------------------------------- #
# Decoded form (lenient: every field that some release omits has a default).   #
# --------------------------------------------------------------------------- #


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]

class EventDecodeError(ValueError):
    """The payload as a whole is not an event batch (bad msgpack or wrong shape), or a
    lazy event's deferred fields are malformed (`LazyBlockStored.materialize`)."""


_NIL = msgspec.Raw(b"\xc0")  # msgpack nil: an absent `extra_keys`
_TOKENS_DEC = msgspec.msgpack.Decoder(list[int])
_EXTRAS_DEC = msgspec.msgpack.Decoder(Union[list[Union[tuple[Any, ...], None]], None])


class LazyBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    """A `BlockStored` whose `token_ids` and `extra_keys` are still msgpack.

    What `EventDecoder(lazy=True)` yields (see the module doc). Their content is
    unchecked until `materialize()`, which validates exactly as the eager decoder does.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: msgspec.Raw = _NIL
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None

    def materialize(self) -> BlockStored:
        """The eager `BlockStored`; EventDecodeError when the deferred fields are malformed."""
        try:
            tokens = _TOKENS_DEC.decode(self.token_ids)
            extra = _EXTRAS_DEC.decode(self.extra_keys)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise EventDecodeError(f"BlockStored: {e}") from None
        return BlockStored(
            self.block_hashes,
            self.parent_block_hash,
            tokens,
            self.block_size,
            self.lora_id,
            self.medium,
            self.lora_name,
            extra,
            self.group_idx,
            self.kv_cache_spec_kind,
            self.kv_cache_spec_sliding_window,
        )


LazyKVEvent = Union[LazyBlockStored, BlockRemoved, AllBlocksCleared]


# Positional forms (vLLM's array_like encoding): the public structs' fields, in order.
class _BlockStoredPos(BlockStored, tag="BlockStored", array_like=True):
    pass


class _BlockRemovedPos(BlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class _AllBlocksClearedPos(AllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    pass


_PosEvent = Union[_BlockStoredPos, _BlockRemovedPos, _AllBlocksClearedPos]


class _LazyBlockStoredPos(LazyBlockStored, tag="BlockStored", array_like=True):
    pass


_LazyPosEvent = Union[_LazyBlockStoredPos, _BlockRemovedPos, _AllBlocksClearedPos]


def _batch(name: str, events: Any, array_like: bool) -> type[msgspec.Struct]:
    """A batch struct `(ts, events, data_parallel_rank)` whose events decode as `events`."""
    return msgspec.defstruct(
        name,
        [("ts", float), ("events", list[events]), ("data_parallel_rank", Union[int, None], None)],
        array_like=array_like,
        gc=False,
    )


# (batch is an array, events are positional) -> batch struct, eager and lazy
_BATCHES: dict[tuple[bool, bool], type[msgspec.Struct]] = {
    (arr, pos): _batch(f"_Batch{'Arr' if arr else 'Map'}{'Pos' if pos else 'Map'}", _PosEvent if pos else KVEvent, arr)
    for arr in (True, False)
    for pos in (True, False)
}
_LAZY_BATCHES: dict[tuple[bool, bool], type[msgspec.Struct]] = {
    (arr, pos): _batch(
        f"_LazyBatch{'Arr' if arr else 'Map'}{'Pos' if pos else 'Map'}", _LazyPosEvent if pos else LazyKVEvent, arr
    )
    for arr in (True, False)
    for pos in (True, False)
}


class _BatchArrRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _BatchMapRaw(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


def _to_public(ev: Any) -> KVEvent | LazyBlockStored:
    if isinstance(ev, (_LazyBlockStoredPos, _BlockStoredPos)):
        cls = LazyBlockStored if isinstance(ev, _LazyBlockStoredPos) else BlockStored
        return cls(
            ev.block_hashes,
            ev.parent_block_hash,
            ev.token_ids,
            ev.block_size,
            ev.lora_id,
            ev.medium,
            ev.lora_name,
            ev.extra_keys,
            ev.group_idx,
            ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window,
        )
    if isinstance(ev, _BlockRemovedPos):
        return BlockRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    if isinstance(ev, _AllBlocksClearedPos):
        return AllBlocksCleared()
    return ev


@dataclass(slots=True)
class DecodedBatch:
    """One payload's events, in order, plus what could not be decoded.

    `events` holds `LazyBlockStored` instead of `BlockStored` from a lazy decoder.
    """

    ts: float
    events: list[KVEvent | LazyBlockStored]
    data_parallel_rank: int | None = None
    errors: list[str] = field(default_factory=list)


def _is_array(buf: bytes | memoryview) -> bool:
    if not buf:
        return False
    b = buf[0]
    return 0x90 <= b <= 0x9F or b in (0xDC, 0xDD)


class EventDecoder:
    """Decodes payloads of any supported encoding; reusable, not thread-safe.

    `lazy=True`: `BlockStored` events come out as `LazyBlockStored` (module doc).
    """

    def __init__(self, lazy: bool = False) -> None:
        dec = msgspec.msgpack.Decoder
        self.lazy = lazy
        self._fast = {k: dec(t) for k, t in (_LAZY_BATCHES if lazy else _BATCHES).items()}
        self._raw = {True: dec(_BatchArrRaw), False: dec(_BatchMapRaw)}
        self._ev_map = dec(LazyKVEvent if lazy else KVEvent)
        self._ev_pos = dec(_LazyPosEvent if lazy else _PosEvent)
        # The encoding a publisher used last time: tried first next time.
        self._last_events_pos = False

    def decode(self, payload: bytes | memoryview) -> DecodedBatch:
        batch_arr = _is_array(payload)
        for events_pos in (self._last_events_pos, not self._last_events_pos):
            try:
                b = self._fast[(batch_arr, events_pos)].decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            self._last_events_pos = events_pos
            events = [_to_public(e) for e in b.events] if events_pos else b.events
            return DecodedBatch(b.ts, events, b.data_parallel_rank)
        return self._decode_slow(payload, batch_arr)

    def _decode_slow(self, payload: bytes | memoryview, batch_arr: bool) -> DecodedBatch:
        try:
            raw = self._raw[batch_arr].decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise EventDecodeError(f"not an event batch: {e}") from None
        out = DecodedBatch(raw.ts, [], raw.data_parallel_rank)
        for i, r in enumerate(raw.events):
            dec = self._ev_pos if _is_array(memoryview(r)) else self._ev_map
            try:
                out.events.append(_to_public(dec.decode(r)))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                out.errors.append(f"event {i}: {e}")
        return out


# --------------------------------------------------------------------------- #
# Encoded form: vLLM's exact layout.                                           #
# --------------------------------------------------------------------------- #


class _WireStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _WireRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class _WireCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class _WireStoredPos(msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _WireRemovedPos(msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None


class _WireClearedPos(msgspec.Struct, tag="AllBlocksCleared", array_like=True, omit_defaults=True, gc=False):
    pass


# The first releases with KV events (no `medium`, no data-parallel rank).
class _WireStoredV0(msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class _WireRemovedV0(msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]


class _WireBatchArr(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _WireBatchV0(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class _WireBatchMap(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class EventEncoder:
    """Encodes batches as vLLM does.

    `positional=False` (default): events as maps with a `type` tag, the batch as
    `[ts, events, dp_rank]` — what vLLM 0.32 sends. `positional=True`: the older
    releases' tagged arrays (fields up to `medium`; with `with_medium=False` up to
    `lora_id`, as the first releases with KV events). `batch_map=True` encodes the
    batch itself as a map, as vLLM's newest `EventBatch` struct does. A
    `data_parallel_rank` of None is omitted from a map batch and sent as nil in an
    array batch (msgspec's `omit_defaults` does not drop array positions), exactly
    as vLLM's structs encode it; the first releases' batch has no such field.
    """

    def __init__(self, positional: bool = False, batch_map: bool = False, with_medium: bool = True) -> None:
        self.positional = positional
        self.batch_map = batch_map
        self.with_medium = with_medium
        self._enc = msgspec.msgpack.Encoder()

    def _wire(self, ev: KVEvent) -> Any:
        if isinstance(ev, BlockStored):
            if self.positional and not self.with_medium:
                return _WireStoredV0(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id)
            if self.positional:
                return _WireStoredPos(
                    ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id, ev.medium
                )
            return _WireStored(
                ev.block_hashes,
                ev.parent_block_hash,
                ev.token_ids,
                ev.block_size,
                ev.lora_id,
                ev.medium,
                ev.lora_name,
                ev.extra_keys,
                ev.group_idx,
                ev.kv_cache_spec_kind,
                ev.kv_cache_spec_sliding_window,
            )
        if isinstance(ev, BlockRemoved):
            if self.positional and not self.with_medium:
                return _WireRemovedV0(ev.block_hashes)
            if self.positional:
                return _WireRemovedPos(ev.block_hashes, ev.medium)
            return _WireRemoved(ev.block_hashes, ev.medium, ev.group_idx)
        if isinstance(ev, AllBlocksCleared):
            return _WireClearedPos() if self.positional else _WireCleared()
        raise TypeError(f"not a KV event: {type(ev).__name__}")

    def encode(self, ts: float, events: list[KVEvent], data_parallel_rank: int | None = None) -> bytes:
        wire = [self._wire(e) for e in events]
        if self.positional and not self.with_medium:
            if data_parallel_rank is not None:
                raise ValueError("the first releases' batches carry no data_parallel_rank")
            return self._enc.encode(_WireBatchV0(ts, wire))
        cls = _WireBatchMap if self.batch_map else _WireBatchArr
        return self._enc.encode(cls(ts, wire, data_parallel_rank))


# ZMQ framing helpers (the frames around the payload).
END_SEQ = -1


def seq_to_bytes(seq: int) -> bytes:
    """A sequence frame: 8 bytes big-endian (signed, so END_SEQ is all ones)."""
    return seq.to_bytes(8, "big", signed=True)


def seq_from_bytes(b: bytes | memoryview) -> int:
    """Parse a sequence frame; ValueError unless it is exactly 8 bytes."""
    if len(b) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(b)}")
    return int.from_bytes(b, "big", signed=True)
