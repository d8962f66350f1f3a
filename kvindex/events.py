"""The KV-event wire codec, in vLLM's format.

vLLM releases disagree on the encoding (events as tagged arrays or as maps, the batch
as an array or a map, trailing fields absent, hashes as ints or bytes), so decoding
accepts every combination and never raises on a bad event; encoding reproduces vLLM's
layout byte for byte, so a subscriber built for vLLM reads our workers unchanged.
`BlockStored`'s fields are declared once (`_StoredFields`); every other form of it is
derived from that declaration. docs/events.md has the formats and the lazy decoder.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import msgspec
from msgspec.structs import astuple

BlockHash = int | bytes

_Tokens = TypeVar("_Tokens")
_Extras = TypeVar("_Extras")
_Ev = TypeVar("_Ev")

# --------------------------------------------------------------------------- #
# Decoded form (lenient: every field that some release omits has a default).   #
# --------------------------------------------------------------------------- #


class _StoredFields(msgspec.Struct, Generic[_Tokens, _Extras], omit_defaults=True, gc=False):
    """`BlockStored`'s fields in vLLM's order, generic over how `token_ids` and
    `extra_keys` decode: eagerly (`BlockStored`) or kept as msgpack (`LazyBlockStored`)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: _Tokens
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: _Extras | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockStored(_StoredFields[list[int], list[tuple[Any, ...] | None]], tag=True):
    """Blocks written to a tier, with their tokens (the index keys them from these)."""


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventDecodeError(ValueError):
    """The payload as a whole is not an event batch (bad msgpack or wrong shape), or a
    lazy event's deferred fields are malformed (`LazyBlockStored.materialize`)."""


_NIL = msgspec.Raw(b"\xc0")  # msgpack nil: an absent `extra_keys`
_TOKENS_DEC = msgspec.msgpack.Decoder(list[int])
_EXTRAS_DEC = msgspec.msgpack.Decoder(list[tuple[Any, ...] | None] | None)


class LazyBlockStored(_StoredFields[msgspec.Raw, msgspec.Raw], tag="BlockStored"):
    """A `BlockStored` whose `token_ids` and `extra_keys` are still msgpack.

    What `EventDecoder(lazy=True)` yields: building the token ints is most of the
    eager decoder's cost, and the index needs a trusted worker's tokens only for the
    events it samples. Their content is unchecked until `materialize()`, which
    validates exactly as the eager decoder does.
    """

    extra_keys: msgspec.Raw = _NIL  # msgspec cannot decode a Raw inside a union

    def materialize(self) -> BlockStored:
        """The eager `BlockStored`; EventDecodeError when the deferred fields are malformed."""
        try:
            tokens = _TOKENS_DEC.decode(self.token_ids)
            extra = _EXTRAS_DEC.decode(self.extra_keys)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise EventDecodeError(f"BlockStored: {e}") from None
        ev = BlockStored(*astuple(self))  # the same fields in the same order, then the two decoded
        ev.token_ids = tokens
        ev.extra_keys = extra
        return ev


LazyKVEvent = LazyBlockStored | BlockRemoved | AllBlocksCleared


# Positional forms (vLLM's array_like encoding): the public structs' fields, in order.
class _BlockStoredPos(BlockStored, tag="BlockStored", array_like=True):
    pass


class _LazyBlockStoredPos(LazyBlockStored, tag="BlockStored", array_like=True):
    pass


class _BlockRemovedPos(BlockRemoved, tag="BlockRemoved", array_like=True):
    pass


class _AllBlocksClearedPos(AllBlocksCleared, tag="AllBlocksCleared", array_like=True):
    pass


_PosEvent = _BlockStoredPos | _BlockRemovedPos | _AllBlocksClearedPos
_LazyPosEvent = _LazyBlockStoredPos | _BlockRemovedPos | _AllBlocksClearedPos
# positional form -> public struct (same fields, same order)
_PUBLIC: dict[type, type[KVEvent | LazyBlockStored]] = {
    _BlockStoredPos: BlockStored,
    _LazyBlockStoredPos: LazyBlockStored,
    _BlockRemovedPos: BlockRemoved,
    _AllBlocksClearedPos: AllBlocksCleared,
}


def _to_public(ev: KVEvent | LazyBlockStored) -> KVEvent | LazyBlockStored:
    cls = _PUBLIC.get(type(ev))
    return ev if cls is None else cls(*astuple(ev))


class _Batch(msgspec.Struct, Generic[_Ev], omit_defaults=True, gc=False):
    """vLLM's `EventBatch` as a map (its newest releases); `events` decode as `_Ev`."""

    ts: float
    events: list[_Ev]
    data_parallel_rank: int | None = None


class _BatchArr(_Batch[_Ev], array_like=True):
    """The same as an array (vLLM 0.32 and older). A None `data_parallel_rank` is sent
    as nil: `omit_defaults` does not drop array positions."""


def _batch_type(batch_arr: bool, events: Any) -> Any:
    return (_BatchArr if batch_arr else _Batch)[events]


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

    The whole batch is decoded in one typed msgspec call on the fast path; if that
    fails, event by event, so one bad event costs only itself (`DecodedBatch.errors`).
    `lazy=True`: `BlockStored` events come out as `LazyBlockStored`.
    """

    def __init__(self, lazy: bool = False) -> None:
        dec = msgspec.msgpack.Decoder
        self.lazy = lazy
        ev_map, ev_pos = (LazyKVEvent, _LazyPosEvent) if lazy else (KVEvent, _PosEvent)
        # (batch is an array, events are positional) -> decoder of the whole batch
        self._fast: dict[tuple[bool, bool], msgspec.msgpack.Decoder[_Batch[Any]]] = {
            (arr, pos): dec(_batch_type(arr, ev_pos if pos else ev_map))
            for arr in (True, False)
            for pos in (True, False)
        }
        self._raw: dict[bool, msgspec.msgpack.Decoder[_Batch[msgspec.Raw]]] = {
            arr: dec(_batch_type(arr, msgspec.Raw)) for arr in (True, False)
        }
        self._ev_map: msgspec.msgpack.Decoder[KVEvent | LazyBlockStored] = dec(ev_map)
        self._ev_pos: msgspec.msgpack.Decoder[KVEvent | LazyBlockStored] = dec(ev_pos)
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
# Encoded form: vLLM's exact layout, derived from the decoded structs' fields.  #
# --------------------------------------------------------------------------- #


# vLLM declares BlockStored's fields up to `lora_name` and BlockRemoved's up to `medium`
# without a default: they are encoded even when None.
_STORED_ALWAYS = 7
_REMOVED_ALWAYS = 2


class _WireForm(NamedTuple):
    """An event class, the struct it is encoded as, and how many of its fields that takes."""

    cls: type[KVEvent]
    wire: type[msgspec.Struct]
    n_fields: int


def _wire_struct(
    src: type[msgspec.Struct], upto: int | None = None, always: int = 0, **options: Any
) -> type[msgspec.Struct]:
    """A struct of `src`'s first `upto` fields as vLLM declares them: the first
    `always` without a default, so encoded even when None."""
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        (f.name, f.type) if i < always or f.required else (f.name, f.type, f.default)
        for i, f in enumerate(msgspec.structs.fields(src)[:upto])
    ]
    return msgspec.defstruct(f"_Wire{src.__name__}", spec, omit_defaults=True, gc=False, **options)


def _event_form(cls: type[KVEvent], upto: int | None, always: int, array_like: bool) -> _WireForm:
    wire = _wire_struct(cls, upto, always, tag=cls.__name__, array_like=array_like)
    return _WireForm(cls, wire, len(wire.__struct_fields__))


def _wire_events(upto_stored: int | None, upto_removed: int | None, array_like: bool) -> list[_WireForm]:
    """How one generation of vLLM encodes each event."""
    return [
        _event_form(BlockStored, upto_stored, _STORED_ALWAYS, array_like),
        _event_form(BlockRemoved, upto_removed, _REMOVED_ALWAYS, array_like),
        _event_form(AllBlocksCleared, None, 0, array_like),
    ]


# Current releases: map events, every field.
_WIRE_MAP = _wire_events(None, None, array_like=False)
# Older releases: tagged arrays up to `medium`.
_WIRE_POS = _wire_events(6, 2, array_like=True)
# The first releases with KV events: up to `lora_id`, removals without medium.
_WIRE_V0 = _wire_events(5, 1, array_like=True)
# Their batch: `[ts, events]`, no data-parallel rank.
_BatchV0 = _wire_struct(_Batch, 2, array_like=True)


class EventEncoder:
    """Encodes batches as vLLM does.

    `positional=False` (default): events as maps with a `type` tag, the batch as
    `[ts, events, dp_rank]` — what vLLM 0.32 sends. `positional=True`: the older
    releases' tagged arrays (fields up to `medium`; with `with_medium=False` up to
    `lora_id`, as the first releases with KV events). `batch_map=True` encodes the
    batch itself as a map, as vLLM's newest `EventBatch` struct does. A
    `data_parallel_rank` of None is omitted from a map batch and sent as nil in an
    array batch, exactly as vLLM's structs encode it; the first releases' batch has
    no such field.
    """

    def __init__(self, positional: bool = False, batch_map: bool = False, with_medium: bool = True) -> None:
        self.positional = positional
        self.batch_map = batch_map
        self.with_medium = with_medium
        self._v0 = positional and not with_medium
        forms = _WIRE_V0 if self._v0 else _WIRE_POS if positional else _WIRE_MAP
        self._forms: dict[type, _WireForm] = {f.cls: f for f in forms}
        self._enc = msgspec.msgpack.Encoder()

    def _wire(self, ev: KVEvent) -> Any:
        form = self._forms.get(type(ev))
        if form is None:  # a subclass, e.g. a positionally decoded event
            form = next((f for f in self._forms.values() if isinstance(ev, f.cls)), None)
            if form is None:
                raise TypeError(f"not a KV event: {type(ev).__name__}")
        return form.wire(*astuple(ev)[: form.n_fields])

    def encode(self, ts: float, events: list[KVEvent], data_parallel_rank: int | None = None) -> bytes:
        wire = [self._wire(e) for e in events]
        if self._v0:
            if data_parallel_rank is not None:
                raise ValueError("the first releases' batches carry no data_parallel_rank")
            return self._enc.encode(_BatchV0(ts, wire))
        cls = _Batch if self.batch_map else _BatchArr
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
