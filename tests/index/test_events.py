"""The KV-event codec against vLLM's own struct layouts, byte for byte.

The structs below restate vllm/distributed/kv_events.py (field names, order and
struct options) for three generations of the format:
- V0: the first releases with KV events: every struct `array_like=True`,
  `BlockStored` up to `lora_id`, `BlockRemoved` with hashes only, no DP rank;
- V1: still `array_like=True`, `medium` added to both events, `data_parallel_rank`
  added to the batch;
- V2: events as maps tagged with `type` (no `array_like`), `lora_name`,
  `extra_keys`, `group_idx`, `kv_cache_spec_*`; in current main the batch is a map
  too, while the 0.32 release observed in our vLLM tests sends the batch as an array.
"""
from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
    EventEncoder,
    LazyBlockStored,
    seq_from_bytes,
    seq_to_bytes,
)
from kvindex.tiers import Tier, medium_of_tier, tier_of_medium

# ---------------------------------------------------------------- vLLM V0 (array_like, no medium)


class V0EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class V0KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V0BlockStored(V0KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class V0BlockRemoved(V0KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]


class V0AllBlocksCleared(V0KVCacheEvent, tag="AllBlocksCleared"):
    pass


# ---------------------------------------------------------------- vLLM V1 (array_like + medium)


class V1EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V1KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class V1BlockStored(V1KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class V1BlockRemoved(V1KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class V1AllBlocksCleared(V1KVCacheEvent, tag="AllBlocksCleared"):
    pass


# ---------------------------------------------------------------- vLLM V2 (map events)


class V2EventBatch(msgspec.Struct, omit_defaults=True, gc=False):  # current main: a map
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V2ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # 0.32: an array
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class V2KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class V2BlockStored(V2KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class V2BlockRemoved(V2KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class V2AllBlocksCleared(V2KVCacheEvent, tag="AllBlocksCleared"):
    pass


TS = 1764400000.25
TOKENS = list(range(100, 132))


def full_stored(**kw: Any) -> BlockStored:
    fields: dict[str, Any] = dict(
        block_hashes=[2**64 - 1, 7],
        parent_block_hash=2**63 + 5,
        token_ids=TOKENS,
        block_size=16,
        lora_id=3,
        medium="CPU",
        lora_name="adapter",
        extra_keys=[("adapter", "salt"), ("adapter",)],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
    )
    fields.update(kw)
    return BlockStored(**fields)


def test_v0_layout_byte_for_byte():
    theirs = V0EventBatch(
        TS, [V0BlockStored([1, 2], None, TOKENS, 16, None), V0BlockRemoved([2]), V0AllBlocksCleared()]
    )
    ours = [BlockStored([1, 2], None, TOKENS, 16, None, None, None), BlockRemoved([2], None), AllBlocksCleared()]
    wire = msgspec.msgpack.encode(theirs)
    assert EventEncoder(positional=True, with_medium=False).encode(TS, ours) == wire
    got = EventDecoder().decode(wire)
    assert got.ts == TS and got.data_parallel_rank is None and not got.errors
    assert got.events == ours
    assert msgspec.msgpack.decode(wire)[1][1] == ["BlockRemoved", [2]]  # positional, tagged


def test_v1_layout_byte_for_byte():
    theirs = V1EventBatch(
        TS,
        [
            V1BlockStored([b"\x01" * 32, 9], b"\x02" * 32, TOKENS, 16, 4, "GPU"),
            V1BlockRemoved([9], "CPU"),
            V1AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    ours = [
        BlockStored([b"\x01" * 32, 9], b"\x02" * 32, TOKENS, 16, 4, "GPU", None),
        BlockRemoved([9], "CPU"),
        AllBlocksCleared(),
    ]
    wire = msgspec.msgpack.encode(theirs)
    assert EventEncoder(positional=True).encode(TS, ours, data_parallel_rank=1) == wire
    got = EventDecoder().decode(wire)
    assert (got.ts, got.data_parallel_rank, got.events) == (TS, 1, ours)


@pytest.mark.parametrize("batch_cls, batch_map", [(V2EventBatch, True), (V2ArrayEventBatch, False)])
def test_v2_layout_byte_for_byte(batch_cls, batch_map):
    ev = full_stored()
    theirs = batch_cls(
        TS,
        [
            V2BlockStored(
                ev.block_hashes,
                ev.parent_block_hash,
                TOKENS,
                16,
                3,
                "CPU",
                "adapter",
                [("adapter", "salt"), ("adapter",)],
                0,
                "full_attention",
                None,
            ),
            V2BlockStored([5], None, TOKENS[:16], 16, None, None, None),  # defaults omitted
            V2BlockRemoved([b"\xff" * 32], "GPU", group_idx=1),
            V2AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    ours = [
        ev,
        BlockStored([5], None, TOKENS[:16], 16, None, None, None),
        BlockRemoved([b"\xff" * 32], "GPU", 1),
        AllBlocksCleared(),
    ]
    wire = msgspec.msgpack.encode(theirs)
    assert EventEncoder(batch_map=batch_map).encode(TS, ours, data_parallel_rank=0) == wire
    got = EventDecoder().decode(wire)
    assert got.events == ours and got.data_parallel_rank == 0 and not got.errors
    assert got.events[0].extra_keys == [("adapter", "salt"), ("adapter",)]
    decoded = msgspec.msgpack.decode(wire)
    first = (decoded["events"] if batch_map else decoded[1])[0]
    assert first["type"] == "BlockStored" and "kv_cache_spec_sliding_window" not in first
    assert first["lora_id"] == 3 and "lora_name" in first


def test_our_events_decode_with_vllms_own_structs():
    """A subscriber built for vLLM reads what our workers publish."""
    ours = [full_stored(parent_block_hash=None), BlockRemoved([7], "GPU"), AllBlocksCleared()]
    batch = msgspec.msgpack.Decoder(V2ArrayEventBatch).decode(EventEncoder().encode(TS, ours))
    v2 = msgspec.msgpack.Decoder(list[V2BlockStored | V2BlockRemoved | V2AllBlocksCleared])
    events = v2.decode(msgspec.msgpack.encode(batch.events))
    assert [type(e).__name__ for e in events] == ["V2BlockStored", "V2BlockRemoved", "V2AllBlocksCleared"]
    assert events[0].extra_keys == [("adapter", "salt"), ("adapter",)] and events[1].medium == "GPU"
    legacy = msgspec.msgpack.Decoder(V1EventBatch).decode(EventEncoder(positional=True).encode(TS, ours))
    old = msgspec.msgpack.Decoder(list[V1BlockStored | V1BlockRemoved | V1AllBlocksCleared])
    assert old.decode(msgspec.msgpack.encode(legacy.events))[0].medium == "CPU"


def test_decoder_is_lenient_where_releases_differ():
    dec = EventDecoder()
    # unknown map fields (newer releases, other engines) are ignored
    m = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "locality": "local"}
    assert dec.decode(msgspec.msgpack.encode([TS, [m]])).events == [BlockRemoved([1], "GPU")]
    # positional events with fields up to lora_name, and an int timestamp
    p = ["BlockStored", [1], None, [1, 2], 2, None, "DISK", "lora-x"]
    assert dec.decode(msgspec.msgpack.encode([1, [p], 3])).events == [
        BlockStored([1], None, [1, 2], 2, None, "DISK", "lora-x")
    ]
    # a map batch with positional events
    got = dec.decode(msgspec.msgpack.encode({"ts": TS, "events": [["AllBlocksCleared"]]}))
    assert got.events == [AllBlocksCleared()]


def test_one_bad_event_costs_only_itself():
    good = {"type": "BlockRemoved", "block_hashes": [1], "medium": None}
    payload = msgspec.msgpack.encode(
        [TS, [good, ["Mystery", 1], {"type": "BlockStored", "block_hashes": "x"}, ["BlockRemoved", [2]], 5], None]
    )
    got = EventDecoder().decode(payload)
    assert got.events == [BlockRemoved([1], None), BlockRemoved([2], None)]
    assert len(got.errors) == 3 and got.errors[0].startswith("event 1")


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\x01", msgspec.msgpack.encode({"x": 1}), b"\x92\xa1x\x90"])
def test_not_a_batch_raises_decode_error(payload):
    with pytest.raises(EventDecodeError):
        EventDecoder().decode(payload)


hashes = st.lists(st.integers(0, 2**64 - 1) | st.binary(min_size=1, max_size=32), max_size=4)
stored = st.builds(
    BlockStored,
    hashes,
    st.none() | st.integers(0, 2**64 - 1) | st.binary(min_size=32, max_size=32),
    st.lists(st.integers(0, 2**32 - 1), max_size=40),
    st.integers(1, 64),
    st.none() | st.integers(0, 100),
    st.none() | st.sampled_from(["GPU", "CPU", "DISK", "REMOTE"]),
    st.none() | st.text(max_size=6),
    st.none() | st.lists(st.none() | st.tuples(st.text(max_size=4)), max_size=3),
    st.none() | st.integers(0, 3),
    st.none() | st.sampled_from(["full_attention", "sliding_window"]),
    st.none() | st.integers(1, 4096),
)
removed = st.builds(BlockRemoved, hashes, st.none() | st.sampled_from(["GPU", "CPU"]), st.none() | st.integers(0, 3))
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=5)


@settings(max_examples=80, deadline=None)
@given(evs=events, dp=st.none() | st.integers(0, 7), batch_map=st.booleans())
def test_round_trip_map_encoding(evs, dp, batch_map):
    got = EventDecoder().decode(EventEncoder(batch_map=batch_map).encode(TS, evs, dp))
    assert got.events == evs and got.data_parallel_rank == dp and not got.errors


@settings(max_examples=80, deadline=None)
@given(evs=events)
def test_round_trip_positional_keeps_the_fields_it_has(evs):
    got = EventDecoder().decode(EventEncoder(positional=True).encode(TS, evs))
    for a, b in zip(got.events, evs, strict=True):
        if isinstance(b, BlockStored):
            assert (a.block_hashes, a.parent_block_hash, a.token_ids, a.block_size, a.lora_id, a.medium) == (
                b.block_hashes,
                b.parent_block_hash,
                b.token_ids,
                b.block_size,
                b.lora_id,
                b.medium,
            )
        elif isinstance(b, BlockRemoved):
            assert (a.block_hashes, a.medium) == (b.block_hashes, b.medium)
        else:
            assert a == b


def materialized(events: list) -> list:
    return [e.materialize() if isinstance(e, LazyBlockStored) else e for e in events]


@settings(max_examples=80, deadline=None)
@given(
    evs=events,
    dp=st.none() | st.integers(0, 7),
    enc=st.sampled_from(
        [EventEncoder(), EventEncoder(batch_map=True), EventEncoder(positional=True),
         EventEncoder(positional=True, batch_map=True), EventEncoder(positional=True, with_medium=False)]
    ),
)  # fmt: skip
def test_lazy_decoding_materializes_to_the_eager_result(evs, dp, enc):
    """Every encoding: the lazy decoder defers BlockStored's tokens and extra keys, and
    `materialize()` gives exactly what the eager decoder gives."""
    payload = enc.encode(TS, evs, None if enc.positional and not enc.with_medium else dp)
    eager, lazy = EventDecoder().decode(payload), EventDecoder(lazy=True).decode(payload)
    assert not lazy.errors and (lazy.ts, lazy.data_parallel_rank) == (eager.ts, eager.data_parallel_rank)
    assert [type(e) for e in lazy.events] == [
        LazyBlockStored if isinstance(e, BlockStored) else type(e) for e in eager.events
    ]
    assert materialized(lazy.events) == eager.events


def test_lazy_decoder_defers_validation_to_materialize():
    bad_tokens = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, "x"],
                  "block_size": 2}  # fmt: skip
    bad_extra = dict(bad_tokens, token_ids=[1, 2], extra_keys="not a list")
    broken = {"type": "BlockStored", "block_hashes": "x"}  # wrong eagerly and lazily
    payload = msgspec.msgpack.encode([TS, [bad_tokens, bad_extra, broken, ["BlockRemoved", [2]]], None])
    assert len(EventDecoder().decode(payload).errors) == 3
    got = EventDecoder(lazy=True).decode(payload)
    assert len(got.errors) == 1 and got.errors[0].startswith("event 2")
    assert [type(e).__name__ for e in got.events] == ["LazyBlockStored", "LazyBlockStored", "BlockRemoved"]
    for ev in got.events[:2]:
        with pytest.raises(EventDecodeError):
            ev.materialize()


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=80), lazy=st.booleans())
def test_random_bytes_never_escape_as_other_errors(payload, lazy):
    try:
        batch = EventDecoder(lazy=lazy).decode(payload)
    except EventDecodeError:
        return
    for ev in batch.events:
        if isinstance(ev, LazyBlockStored):
            try:
                ev.materialize()
            except EventDecodeError:
                pass


def test_sequence_frames():
    assert seq_to_bytes(5) == (5).to_bytes(8, "big")  # what vLLM sends
    assert seq_from_bytes(seq_to_bytes(2**40)) == 2**40
    assert seq_to_bytes(END_SEQ) == b"\xff" * 8 and seq_from_bytes(b"\xff" * 8) == END_SEQ
    with pytest.raises(ValueError):
        seq_from_bytes(b"\x00" * 7)


def test_mediums_map_to_tiers():
    assert tier_of_medium(None) == (Tier.GPU, True)  # vLLM's default is the device
    assert tier_of_medium("gpu") == (Tier.GPU, True)
    assert tier_of_medium("CPU_PINNED") == (Tier.CPU, True)
    assert tier_of_medium("ssd") == (Tier.DISK, True)
    assert tier_of_medium("redis") == (Tier.REMOTE, True)
    assert tier_of_medium("tape") == (Tier.DISK, False)  # unknown: never trusted as GPU
    assert [medium_of_tier(t) for t in (Tier.GPU, Tier.CPU, Tier.DISK, Tier.REMOTE)] == [
        "GPU",
        "CPU",
        "DISK",
        "REMOTE",
    ]
    with pytest.raises(ValueError):
        medium_of_tier(Tier.PEER)
