"""kvindex.ingest against a real ZMQ publisher that speaks vLLM's protocol
(`VllmStylePublisher`, tests/support/kv_publisher.py)."""
from __future__ import annotations

import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_publisher import BS, NS, Chain, VllmStylePublisher, matched, start, wait_until

from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, EventEncoder
from kvindex.index import PrefixIndex
from kvindex.ingest import IngestManager
from kvindex.keys import BlockHasher, Namespace, digests64
from kvindex.subscriber import WorkerSubscriber


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.term()


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex(BS, max_workers=16)


async def test_gap_is_replayed_then_restart_resyncs(ctx, index):
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub)
    try:
        a, b = Chain(1, 12), Chain(2, 4)
        await pub.publish([a.stored(0, 4)])  # seq 0
        await pub.publish([a.stored(4, 6)])  # seq 1
        await wait_until(lambda: matched(index, a) == 6)
        # seq 2, 3 are lost on the way; seq 4 reveals the gap
        await pub.publish([a.stored(6, 8)], deliver=False)
        await pub.publish([a.removed(5, 6), a.stored(8, 10, "CPU")], deliver=False)
        await pub.publish([b.stored(0, 4, "DISK")])
        await wait_until(lambda: sub.health.batches == 5)
        h = mgr.health()["w"]
        assert (h["gaps"], h["replays"], h["resyncs"], h["replay_failures"]) == (1, 1, 0, 0)
        assert h["duplicates"] == 1  # seq 4 came live and in the replay
        assert pub.replay_requests == [2]
        assert matched(index, a) == 5  # block 5 was removed by a replayed batch
        assert index.match(b.ds)["w"].runs[0][0].name == "DISK"
        assert h["last_seq"] == 4 and h["state"] == "live"

        # The engine restarts: sequence back to 0, its cache empty.
        pub.restart()
        c = Chain(3, 3)
        await pub.publish([c.stored(0, 3)])
        await wait_until(lambda: matched(index, c) == 3)
        h = mgr.health()["w"]
        assert (h["restarts"], h["resyncs"]) == (1, 1)
        assert h["last_resync_reason"] == "publisher restarted"
        assert matched(index, a) == 0 and matched(index, b) == 0  # the old picture is gone
    finally:
        await mgr.close()
        await pub.close()


async def test_live_batches_wait_for_a_slow_replay_in_order(ctx, index):
    pub = VllmStylePublisher(ctx, replay_delay_s=0.3)
    mgr, sub = await start(ctx, index, pub)
    try:
        a = Chain(10, 8)
        await pub.publish([a.stored(0, 2)])
        await wait_until(lambda: sub.health.batches == 1)
        await pub.publish([a.stored(2, 4)], deliver=False)  # lost
        await pub.publish([a.stored(4, 6)])  # gap -> slow replay starts
        await wait_until(lambda: sub.health.state == "replaying")
        # Published during the replay: order matters (store then remove then store).
        await pub.publish([a.removed(0, 1)])
        await pub.publish([a.stored(0, 1, "CPU"), a.stored(6, 8)])
        await wait_until(lambda: sub.health.last_seq == 4)
        assert sub.health.batches == 5  # every batch applied exactly once
        assert sub.health.duplicates >= 1
        assert index.match(a.ds)["w"].runs == ((index_tier("CPU"), 1), (index_tier("GPU"), 7))
        await pub.publish([a.removed(7, 8)])  # live again after the replay
        await wait_until(lambda: sub.health.last_seq == 5)
        assert index.match(a.ds)["w"].blocks == 7 and sub.health.gaps == 1
    finally:
        await mgr.close()
        await pub.close()


def index_tier(name: str):
    from kvindex.tiers import Tier

    return Tier[name]


async def test_replay_window_passed_drops_and_rebuilds(ctx, index):
    pub = VllmStylePublisher(ctx, buffer_steps=2)
    mgr, sub = await start(ctx, index, pub)
    try:
        a, b = Chain(20, 4), Chain(21, 4)
        await pub.publish([a.stored(0, 4)])
        await wait_until(lambda: matched(index, a) == 4)
        for i in range(4):  # lost, and more than the publisher keeps
            await pub.publish([b.stored(0, i + 1) if i == 0 else b.stored(i, i + 1)], deliver=False)
        c = Chain(22, 2)
        await pub.publish([c.stored(0, 2)])
        await wait_until(lambda: sub.health.last_seq == 5)
        h = mgr.health()["w"]
        assert h["resyncs"] == 1 and h["last_resync_reason"] == "replay cannot cover the gap"
        assert matched(index, a) == 0  # dropped: we could not know what happened to it
        assert matched(index, c) == 2
        # The replay gave seq 4, 5 only: b's block 3 has an unknown parent (orphan).
        assert h["orphans"] >= 1
    finally:
        await mgr.close()
        await pub.close()


@pytest.mark.parametrize(
    ("omitted", "reason"),
    [({2, 3}, "gap not covered by the replay"), ({2}, "hole in the replay")],
    ids=["replay-stops-short", "hole-in-replay"],
)
async def test_gap_the_replay_cannot_fill_resyncs(ctx, index, omitted, reason):
    """The replay answers but lacks some of the missing batches: what they did is unknown,
    so the worker's entries are dropped instead of trusting a stale picture."""
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub)
    try:
        a, b, c = Chain(120, 4), Chain(121, 2), Chain(122, 2)
        await pub.publish([a.stored(0, 4)])  # seq 0
        await wait_until(lambda: matched(index, a) == 4)
        await pub.publish([b.stored(0, 2)], deliver=False)  # seq 1: lost, replayed
        await pub.publish([a.removed(0, 4)], deliver=False)  # seq 2: lost, and not in the replay
        pub.replay_omits |= omitted
        await pub.publish([c.stored(0, 2)])  # seq 3 reveals the gap
        await wait_until(lambda: sub.health.last_seq == 3)
        h = mgr.health()["w"]
        assert pub.replay_requests == [1]
        assert (h["gaps"], h["replays"], h["replay_failures"]) == (1, 1, 0)
        assert (h["resyncs"], h["last_resync_reason"]) == (1, reason)
        assert matched(index, a) == 0  # removed by the batch never seen: must not be claimed
        assert matched(index, b) == 0  # dropped with the rest
        assert matched(index, c) == 2  # rebuilt from what followed
        assert h["state"] == "live" and h["internal_errors"] == 0
    finally:
        await mgr.close()
        await pub.close()


async def test_gap_without_replay_endpoint_drops(ctx, index):
    pub = VllmStylePublisher(ctx, replay=False)
    mgr, sub = await start(ctx, index, pub)
    try:
        a, b = Chain(30, 3), Chain(31, 3)
        await pub.publish([a.stored(0, 3)])
        await wait_until(lambda: matched(index, a) == 3)
        await pub.publish([b.stored(0, 1)], deliver=False)
        await pub.publish([b.stored(1, 3)])  # its parent was lost: an orphan
        await wait_until(lambda: sub.health.last_seq == 2)
        h = mgr.health()["w"]
        assert (h["gaps"], h["replays"], h["resyncs"]) == (1, 0, 1)
        assert h["last_resync_reason"] == "gap and no replay endpoint"
        assert matched(index, a) == 0 and matched(index, b) == 0 and h["orphans"] == 2
    finally:
        await mgr.close()
        await pub.close()


async def test_replay_timeout_drops(ctx, index):
    pub = VllmStylePublisher(ctx, replay=False)
    silent = ctx.socket(zmq.ROUTER)  # accepts the request, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    mgr, sub = await start(ctx, index, pub, replay_endpoint=f"tcp://127.0.0.1:{port}", replay_timeout_s=0.2)
    try:
        a = Chain(40, 2)
        await pub.publish([a.stored(0, 1)])
        await wait_until(lambda: sub.health.batches == 1)
        await pub.publish([a.stored(1, 2)], deliver=False)
        await pub.publish([AllBlocksCleared()])
        await wait_until(lambda: sub.health.last_seq == 2)
        h = mgr.health()["w"]
        assert (h["replay_failures"], h["resyncs"], h["last_resync_reason"]) == (1, 1, "replay failed")
        assert h["cleared"] == 1
    finally:
        await mgr.close()
        await pub.close()
        silent.close(linger=0)


async def test_late_join_replays_history_and_bind_mode(ctx, index):
    # vLLM publishing to tcp://127.0.0.1:P connects: we bind (port chosen by the OS).
    mgr = IngestManager(index, ctx=ctx)
    sub = mgr.add_worker("w", "tcp://127.0.0.1:*", bind=True, ns_digest=NS.digest, block_size=BS)
    assert sub.endpoint.startswith("tcp://127.0.0.1:") and not sub.endpoint.endswith("*")
    pub = VllmStylePublisher(ctx, connect_to=sub.endpoint)
    try:
        await pub.wait_subscribed()
        a = Chain(50, 6)
        await pub.publish([a.stored(0, 3)])
        await wait_until(lambda: matched(index, a) == 3)
        assert sub.health.replays == 0
    finally:
        await mgr.close()
        await pub.close()

    # A second router replica joins a publisher that is already at seq 3.
    index2 = PrefixIndex(BS, max_workers=4)
    pub = VllmStylePublisher(ctx)
    try:
        a = Chain(51, 8)
        for lo in range(0, 6, 2):
            await pub.publish([a.stored(lo, lo + 2)])  # nobody listens yet
        mgr, sub = await start(ctx, index2, pub)
        await pub.publish([a.stored(6, 8)])
        await wait_until(lambda: matched(index2, a) == 8)
        assert pub.replay_requests == [0] and sub.health.resyncs == 0
    finally:
        await mgr.close()
        await pub.close()


async def test_bad_messages_are_counted_and_skipped(ctx, index):
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub)
    try:
        a = Chain(60, 4)
        await pub.publish([a.stored(0, 2)])
        await wait_until(lambda: sub.health.batches == 1)
        await pub.send_raw([b"kv", b"\x00" * 8])  # two frames
        await pub.send_raw([b"kv", b"\x00" * 4, b"x"])  # short sequence frame
        await pub.send_raw([b"kv", (1).to_bytes(8, "big"), b"\xc1\xff garbage"])  # bad msgpack, seq 1
        bad_event = msgspec.msgpack.encode([time.time(), [["NoSuchEvent", 1], {"type": "BlockStored"}], None])
        await pub.send_raw([b"kv", (2).to_bytes(8, "big"), bad_event])
        pub.seq = 3
        await pub.publish([Chain(61, 1).removed(0, 1), a.stored(2, 4)])  # removal of a block never stored
        await wait_until(lambda: sub.health.last_seq == 3)
        h = mgr.health()["w"]
        assert h["bad_frames"] == 2 and h["decode_errors"] == 1
        assert h["bad_events"] == 2 and h["unknown_removed"] == 1
        assert h["gaps"] == 0 and h["resyncs"] == 0
        assert matched(index, a) == 4
        assert h["internal_errors"] == 0
    finally:
        await mgr.close()
        await pub.close()


async def test_manager_lifecycle_and_requested_resync(ctx, index):
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub)
    try:
        with pytest.raises(ValueError):
            mgr.add_worker("w", pub.endpoint)
        with pytest.raises(ValueError):
            mgr.add_worker("other", pub.endpoint)  # not in the index and no ns_digest
        a = Chain(70, 4)
        await pub.publish([a.stored(0, 4)])
        await wait_until(lambda: matched(index, a) == 4)
        mgr.resync("w")  # e.g. the gateway saw the worker restart
        assert matched(index, a) == 0
        await pub.publish([a.stored(0, 1, "CPU")])  # next batch: history replayed from 0
        await wait_until(lambda: sub.health.last_seq == 1)
        assert pub.replay_requests == [0]
        assert index.match(a.ds)["w"].runs == ((index_tier("GPU"), 4),)
        await mgr.remove_worker("w")
        assert not index.has_worker("w") and "w" not in mgr.health()
    finally:
        await mgr.close()
        await pub.close()


async def test_vllm_worker_with_engine_hashes_and_bigger_blocks(ctx):
    """A vLLM worker: its own (seeded) hashes, block size 2x the index's, positional events."""
    index = PrefixIndex(BS, max_workers=4)
    pub = VllmStylePublisher(ctx, encoder=EventEncoder(positional=True))
    mgr = IngestManager(index, ctx=ctx)
    mgr.add_worker("w", pub.endpoint, replay_endpoint=pub.replay_endpoint, ns_digest=NS.digest, block_size=2 * BS)
    try:
        await pub.wait_subscribed()
        a = Chain(80, 6)
        await pub.publish([BlockStored([9001, 9002], None, a.tokens[: 4 * BS], 2 * BS, None, "GPU", None)])
        await pub.publish([BlockStored([9003], 9002, a.tokens[4 * BS : 6 * BS], 2 * BS, None, "CPU", None)])
        await pub.publish([BlockRemoved([9002], "GPU")])
        await wait_until(lambda: mgr.health()["w"]["last_seq"] == 2)
        assert index.match(a.ds)["w"].runs == ((index_tier("GPU"), 2),)
        assert mgr.health()["w"]["blocks_stored"] == 3
    finally:
        await mgr.close()
        await pub.close()


# ---------------------------------------------------------------------------- fuzz

_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
_event_like = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Nope"])},
        optional={
            "block_hashes": st.lists(st.integers(0, 2**64 - 1) | st.binary(max_size=4), max_size=3),
            "parent_block_hash": st.none() | st.integers(0, 2**64 - 1),
            "token_ids": st.lists(st.integers(-5, 2**33), max_size=12),
            "block_size": st.integers(-4, 16),
            "medium": st.none() | st.sampled_from(["GPU", "CPU", "tape"]) | st.integers(0, 9),
            "extra_keys": st.none() | st.lists(st.none() | st.lists(_msgpack_values, max_size=2), max_size=3),
            "group_idx": st.none() | st.integers(0, 2),
        },
    ),
    st.lists(_msgpack_values, max_size=6).map(lambda xs: ["BlockStored", *xs]),
    _msgpack_values,
)
_payloads = st.one_of(
    st.binary(max_size=64),
    st.tuples(st.floats(allow_nan=False) | st.text(max_size=3), st.lists(_event_like, max_size=4), _msgpack_values).map(
        msgspec.msgpack.encode
    ),
)
_frames = st.one_of(
    st.lists(st.binary(max_size=12), max_size=5),
    st.tuples(
        st.sampled_from([b"kv", b"kv2", b""]), st.integers(0, 6).map(lambda s: s.to_bytes(8, "big")), _payloads
    ).map(list),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(_frames, max_size=8))
async def test_fuzzed_messages_never_break_ingestion(ctx, messages):
    index = PrefixIndex(BS, max_workers=8)
    index.add_worker("w", NS.digest, BS)
    sub = WorkerSubscriber("w", index, ctx, "tcp://127.0.0.1:1", replay_endpoint=None)  # nothing listens there
    try:
        for frames in messages:
            await sub.on_frames(frames)
        a = Chain(90, 2)
        seq = (sub.health.last_seq or 0) + 1
        ok = EventEncoder().encode(1.0, [a.stored(0, 2)])
        await sub.on_frames([b"kv", seq.to_bytes(8, "big"), ok])
        assert matched(index, a) == 2  # still ingesting correctly afterwards
        h = sub.snapshot()
        assert h["internal_errors"] == 0
    finally:
        await sub.close()


async def test_health_exports_every_index_counter(ctx, index):
    index.add_worker("w", NS.digest, BS)
    sub = WorkerSubscriber("w", index, ctx, "tcp://127.0.0.1:1", replay_endpoint=None)
    try:
        a = Chain(130, 2)
        batch = EventEncoder().encode(1.0, [a.stored(0, 2), a.removed(0, 1)])
        await sub.on_frames([b"kv", (0).to_bytes(8, "big"), batch])
        h = sub.snapshot()
        assert (h["blocks_stored"], h["blocks_removed"]) == (2, 1)
        exported_as = {"stored": "blocks_stored", "removed": "blocks_removed"}
        for name, value in index.worker_stats()[0].counters().items():
            assert h[exported_as.get(name, name)] == value, name
    finally:
        await sub.close()


async def test_manager_owns_its_context_by_default(index):
    mgr = IngestManager(index)
    sub = mgr.add_worker("w", "tcp://127.0.0.1:*", bind=True, ns_digest=NS.digest, block_size=BS)
    assert index.has_worker("w") and mgr.health()["w"]["state"] == "waiting"
    assert mgr.health()["w"]["last_event_age_s"] is None and sub.endpoint != "tcp://127.0.0.1:*"
    with pytest.raises(zmq.ZMQError):
        mgr.add_worker("x", "not-an-endpoint", ns_digest=NS.digest)
    assert not index.has_worker("x")  # a refused subscription leaves no registration behind
    await mgr.close()
    assert index.has_worker("w")  # closing stops ingestion; the index keeps what it knows


# ---------------------------------------------------------------------------- trusted digests


async def test_trusted_worker_is_decoded_lazily_and_verified_by_sampling(ctx, index):
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub, trusted_digests=True, verify_every=2)
    try:
        assert index.trusts_digests("w")
        a = Chain(100, 6)
        await pub.publish([a.stored(0, 3)])  # a chain root: verified
        # a child whose token ids are not even ints: never decoded, never verified
        child = {"type": "BlockStored", "block_hashes": a.ds[3:6], "parent_block_hash": a.ds[2],
                 "token_ids": "opaque", "block_size": BS, "medium": "CPU"}  # fmt: skip
        await pub.send_raw([b"kv", (1).to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [child], None])])
        pub.seq = 2
        await wait_until(lambda: sub.health.last_seq == 1)
        h = mgr.health()["w"]
        assert (h["trusted_digests"], h["digests_verified"], h["digest_mismatches"]) == (True, 1, 0)
        assert (h["bad_events"], h["decode_errors"], h["blocks_stored"]) == (0, 0, 6)
        assert index.match(a.ds)["w"].runs == ((index_tier("GPU"), 3), (index_tier("CPU"), 3))
        assert next(s for s in index.worker_stats() if s.worker_id == "w").engine_map == 0
    finally:
        await mgr.close()
        await pub.close()


async def test_drifted_trusted_worker_is_reported_and_switched(ctx, index, caplog):
    index.add_worker("w", NS.digest, BS, trusted_digests=True, verify_every=1)
    sub = WorkerSubscriber("w", index, ctx, "tcp://127.0.0.1:1", replay_endpoint=None)
    drifted_ns = Namespace("test-model", revision="other", block_size=BS)
    drifted = BlockHasher.for_namespace(drifted_ns)
    try:
        a, b = Chain(110, 4), Chain(111, 2)
        enc = EventEncoder()
        await sub.on_frames([b"kv", (0).to_bytes(8, "big"), enc.encode(1.0, [a.stored(0, 4)])])
        assert matched(index, a) == 4
        bad = digests64(drifted.keys(b.tokens))
        ev = BlockStored(bad, None, b.tokens, BS, None, "GPU", None)
        with caplog.at_level("WARNING", logger="kvindex.ingest"):
            await sub.on_frames([b"kv", (1).to_bytes(8, "big"), enc.encode(2.0, [ev])])
        assert "namespace drift" in caplog.text
        h = sub.snapshot()
        assert (h["digest_mismatches"], h["trusted_digests"], h["digests_verified"]) == (1, False, 2)
        assert matched(index, a) == 0  # dropped
        assert matched(index, b) == 2  # keyed from its tokens under the registered namespace
        # decoded eagerly again: a malformed token list is now a bad event
        junk = {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": None,
                "token_ids": "opaque", "block_size": BS}  # fmt: skip
        await sub.on_frames([b"kv", (2).to_bytes(8, "big"), msgspec.msgpack.encode([3.0, [junk], None])])
        assert sub.snapshot()["bad_events"] == 1
    finally:
        await sub.close()


async def test_manager_passes_trusted_only_when_it_registers(ctx, index):
    mgr = IngestManager(index, ctx=ctx)
    try:
        mgr.add_worker("t", "tcp://127.0.0.1:*", bind=True, ns_digest=NS.digest, block_size=BS, trusted_digests=True)
        index.add_worker("u", NS.digest, BS)  # registered by its owner: that registration applies
        mgr.add_worker("u", "tcp://127.0.0.1:*", bind=True, trusted_digests=True)
        assert index.trusts_digests("t") and not index.trusts_digests("u")
        assert mgr.health()["t"]["trusted_digests"] and not mgr.health()["u"]["trusted_digests"]
    finally:
        await mgr.close()


async def test_a_lost_last_frame_is_found_by_the_idle_probe(ctx, index):
    """Nothing follows the lost frame, so no gap ever shows: the idle stream asks the
    replay socket for what came after its last sequence and applies it."""
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub, tail_probe_s=0.3)
    try:
        a = Chain(140, 4)
        await pub.publish([a.stored(0, 4)])  # seq 0
        await wait_until(lambda: matched(index, a) == 4)
        await pub.publish([a.removed(2, 4)], deliver=False)  # seq 1, the last one: lost live
        await wait_until(lambda: matched(index, a) == 2, timeout=5.0)  # the worker evicted them
        h = mgr.health()["w"]
        assert h["tail_recovered"] == 1 and h["tail_probes"] >= 1 and h["resyncs"] == 0
        assert pub.replay_requests[-1] == 1  # from the next expected sequence
        await pub.publish([a.stored(2, 3)])  # seq 2: live goes on from there
        await wait_until(lambda: matched(index, a) == 3)
        assert mgr.health()["w"]["gaps"] == 0
    finally:
        await mgr.close()
        await pub.close()


async def test_the_owner_can_ask_for_a_probe(ctx, index):
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub, tail_probe_s=None)  # no idle probes
    try:
        a = Chain(150, 3)
        await pub.publish([a.stored(0, 3)])
        await wait_until(lambda: matched(index, a) == 3)
        await pub.publish([a.removed(0, 3)], deliver=False)
        mgr.probe("w")  # e.g. the worker's reported cache disagrees with the index
        await wait_until(lambda: matched(index, a) == 0, timeout=5.0)
        assert mgr.health()["w"]["tail_recovered"] == 1
    finally:
        await mgr.close()
        await pub.close()


async def test_a_probe_finds_frames_sent_before_the_subscription_took(ctx, index):
    """A republish answered before the SUB socket finished connecting: nothing arrives
    live, so there is no sequence to continue from; the probe replays from the start."""
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub, tail_probe_s=None)
    try:
        a = Chain(160, 3)
        await pub.publish([a.stored(0, 3)], deliver=False)  # seq 0, lost live
        assert matched(index, a) == 0
        mgr.probe("w")
        await wait_until(lambda: matched(index, a) == 3, timeout=5.0)
        h = mgr.health()["w"]
        assert h["tail_recovered"] == 1 and h["resyncs"] == 0
        assert pub.replay_requests[-1] == 0
        await pub.publish([a.removed(2, 3)])  # seq 1: live goes on without a gap
        await wait_until(lambda: matched(index, a) == 2)
        assert mgr.health()["w"]["gaps"] == 0
    finally:
        await mgr.close()
        await pub.close()


async def test_idle_tail_probes_back_off_while_they_find_nothing() -> None:
    """An idle stream is probed after `tail_probe_s`, then at doubling gaps (not every
    `tail_probe_s` forever); a live frame brings the first gap back."""
    from kvindex.subscriber import IDLE_PROBE_MAX_S, WorkerSubscriber

    now = [0.0]
    sub = WorkerSubscriber.__new__(WorkerSubscriber)
    sub._clock = lambda: now[0]  # type: ignore[method-assign]
    sub._tail_probe_s = 5.0
    sub._probe_requested = False
    sub._last_frame_at = 0.0
    sub._next_idle_probe_s = sub._idle_probe_every_s = 5.0
    probes: list[float] = []

    async def probe_tail() -> int:
        probes.append(now[0])
        return 0

    sub.probe_tail = probe_tail  # type: ignore[method-assign]
    for t in range(0, 400):
        now[0] = float(t)
        await sub._maybe_probe()
    assert probes[:4] == [5.0, 15.0, 35.0, 75.0]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert max(gaps) == IDLE_PROBE_MAX_S and len(probes) < 10
