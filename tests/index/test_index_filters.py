"""The prefix index's masks: which workers a query may name, and which of a block's
holder bits count as "this worker's" for workers in slots other than 0; a remote group
outliving its members; the ingest loop leaving its replay state when a replay ends, its
health counters (exported per worker as Prometheus counters) and the replay reply shapes
it accepts; a namespace's default scope.

Most index tests register one or two workers, so everything sits in slots 0 and 1
and an unfiltered query; these pin the rules where a wrong shift or mask would only
show for other slots, filtered queries or a second resync (bench/notes/mutation.md).
"""
from __future__ import annotations

import pytest
import zmq.asyncio
from kv_publisher import Chain, VllmStylePublisher, matched, start, wait_until

from kvindex.events import BlockRemoved, BlockStored
from kvindex.index import PrefixIndex, PrefixMatch
from kvindex.keys import BlockHasher, Namespace, digests64
from kvindex.tiers import Tier

BS = 4
NS = Namespace("m", block_size=BS)
HASHER = BlockHasher.for_namespace(NS)


def toks(seed: int, n_blocks: int) -> list[int]:
    return [(seed * 7_919 + i * 31) % 60_000 for i in range(n_blocks * BS)]


def stored(t: list[int], lo: int, hi: int, medium: str = "GPU") -> BlockStored:
    """The BlockStored one of our workers publishes for blocks [lo, hi) of `t` (digests as hashes)."""
    ds = digests64(HASHER.keys(t[: hi * BS]))
    return BlockStored(ds[lo:hi], ds[lo - 1] if lo else None, t[lo * BS : hi * BS], BS, None, medium, None)


def fleet(n: int, **kw: object) -> tuple[PrefixIndex, list[int]]:
    """n workers w0..w{n-1} (slots 0..n-1), all holding the same 6-block chain on GPU."""
    idx = PrefixIndex(BS, max_workers=8)
    t = toks(1, 6)
    for i in range(n):
        idx.add_worker(f"w{i}", NS.digest, BS, **kw)  # type: ignore[arg-type]
        st = idx.apply(f"w{i}", [stored(t, 0, 6)])
        assert st.stored == 6
    return idx, digests64(HASHER.keys(t))


# ----------------------------------------------------------------------------- match(workers=...)


def test_a_worker_filter_narrows_and_never_widens_the_candidates():
    """`workers=` narrows the routable set; it must not bring back a draining worker the
    unfiltered query leaves out (the gateway passes its vLLM workers' ids this way)."""
    idx, ds = fleet(3)
    idx.set_draining("w1")
    assert sorted(idx.match(ds)) == ["w0", "w2"]
    assert sorted(idx.match(ds, workers=["w0", "w1", "w2"])) == ["w0", "w2"]
    assert sorted(idx.match(ds, workers=["w1"])) == []
    assert sorted(idx.match(ds, workers=["w1"], include_draining=True)) == ["w1"]
    idx.set_draining("w1", False)
    assert sorted(idx.match(ds, workers=["w1"])) == ["w1"]


@pytest.mark.parametrize("pick", [["w2"], ["w3"], ["w1", "w3"], ["nobody", "w2"], []])
def test_a_worker_filter_selects_exactly_the_named_workers_in_any_slot(pick):
    """Each named worker's own slot bit is selected (slots 1..3 here), unknown ids are
    ignored, and an empty list selects nobody."""
    idx, ds = fleet(4)
    want = sorted(w for w in pick if w.startswith("w"))
    got = idx.match(ds, workers=pick)
    assert sorted(got) == want
    for w in want:
        assert got[w] == PrefixMatch(w, 6, ((Tier.GPU, 6),))


# ----------------------------------------------------------------------------- a worker's own bits


@pytest.mark.parametrize("others", [1, 2])
def test_a_worker_in_a_later_slot_may_copy_blocks_whose_parent_is_gone(others):
    """The orphan rule lets a worker store blocks without a live parent when it already
    holds every one of them (a copy to another tier, e.g. GPU -> CPU offload after the
    chain root was evicted). "Holds" must mean this worker's own bits, wherever its slot
    is: a worker in slot 1 or 2 gets the same answer as one in slot 0."""
    idx = PrefixIndex(BS, max_workers=8)
    for i in range(others):
        idx.add_worker(f"x{i}", NS.digest, BS)
    idx.add_worker("o", NS.digest, BS, trusted_digests=True)
    t = toks(2, 4)
    ds = digests64(HASHER.keys(t))
    assert idx.apply("o", [stored(t, 0, 4)]).stored == 4
    idx.apply("o", [BlockRemoved(ds[:1], "GPU")])  # the root is evicted
    st = idx.apply("o", [stored(t, 1, 4, "CPU")])  # offload of blocks it still holds on GPU
    assert (st.stored, st.orphans) == (3, 0)
    assert idx.local_blocks("o", Tier.CPU) == 3
    assert idx.match(ds[1:])["o"] == PrefixMatch("o", 3, ((Tier.GPU, 3),))
    # a worker that does not hold them gets no such pass: its blocks are orphans
    st = idx.apply("x0", [stored(t, 1, 4, "CPU")])
    assert (st.stored, st.orphans) == (0, 3)


def test_blocks_held_through_the_remote_group_count_as_held():
    """A worker holds what its remote group holds (REMOTE is shared storage): it may
    load such blocks to GPU after the chain root is gone, in any slot."""
    idx = PrefixIndex(BS, max_workers=8)
    idx.add_worker("x", NS.digest, BS)
    idx.add_worker("o", NS.digest, BS, remote_group="g", trusted_digests=True)
    t = toks(3, 4)
    ds = digests64(HASHER.keys(t))
    assert idx.apply("o", [stored(t, 0, 4, "REMOTE")]).stored == 4
    idx.apply("o", [BlockRemoved(ds[:1], "REMOTE")])
    st = idx.apply("o", [stored(t, 1, 4, "GPU")])
    assert (st.stored, st.orphans) == (3, 0)
    assert idx.match(ds[1:])["o"] == PrefixMatch("o", 3, ((Tier.GPU, 3),))


# ----------------------------------------------------------------------------- ingest: replay state ends


@pytest.fixture
async def ctx():
    c = zmq.asyncio.Context()
    yield c
    c.term()


async def test_after_a_replay_the_subscriber_is_live_again(ctx):
    """Once a gap's replay is applied, the subscriber leaves its replaying state: an
    owner's resync request is carried out at once (not parked until a replay that never
    comes), and tail probes run again."""
    index = PrefixIndex(BS, max_workers=16)
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub, tail_probe_s=None)
    try:
        a = Chain(170, 6)
        await pub.publish([a.stored(0, 2)])  # seq 0
        await pub.publish([a.stored(2, 4)], deliver=False)  # seq 1, lost
        await pub.publish([a.stored(4, 6)])  # seq 2 reveals the gap: replay 1..2
        await wait_until(lambda: matched(index, a) == 6)
        h = mgr.health()["w"]
        assert (h["replays"], h["resyncs"], h["state"]) == (1, 0, "live")
        sub.request_resync()
        h = mgr.health()["w"]
        assert (h["resyncs"], h["last_resync_reason"]) == (1, "requested")
        assert matched(index, a) == 0
        assert await sub.probe_tail() >= 1  # rebuilt from the replay buffer
        assert await sub.probe_tail() == 0  # and later probes run too, finding nothing new
        assert await sub.probe_tail() == 0
        assert mgr.health()["w"]["tail_probes"] == 3
        assert matched(index, a) == 6
    finally:
        await mgr.close()
        await pub.close()


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


# ----------------------------------------------------------------------------- health counters


async def test_each_late_duplicate_foreign_topic_and_unregistered_batch_counts_once(ctx):
    """A live frame the replay already applied counts one duplicate each time it comes
    (the index is not touched); a frame on another topic counts one `foreign_topic`; a
    batch for a worker the owner already took out of the index counts one
    `unregistered`. Catches a counter stuck at 1, stepping by 2 or going down."""
    index = PrefixIndex(BS, max_workers=16)
    pub = VllmStylePublisher(ctx)
    mgr, sub = await start(ctx, index, pub, tail_probe_s=None)
    try:
        a = Chain(210, 6)
        await pub.publish([a.stored(0, 2)])  # seq 0
        lost = await pub.publish([a.stored(2, 4)], deliver=False)  # seq 1, lost on the way
        await pub.publish([a.stored(4, 6)])  # seq 2: the gap is replayed
        await wait_until(lambda: matched(index, a) == 6)
        payload = pub.buffer[lost][1]
        d0 = sub.health.duplicates  # the frame that revealed the gap came after its replay
        for n in (1, 2):  # the lost frame turns up late, twice
            await sub.on_frames([b"kv", _seq(lost), payload])
            assert sub.health.duplicates == d0 + n
        assert matched(index, a) == 6
        for n in (1, 2):
            await sub.on_frames([b"other-topic", _seq(3), payload])
            assert sub.health.foreign_topic == n
        assert sub.health.last_seq == 2
        index.remove_worker("w")
        b = Chain(211, 2)
        for n, seq in ((1, 3), (2, 4)):
            await sub.on_frames([b"kv", _seq(seq), pub.enc.encode(0.0, [b.stored(0, 2)])])
            assert sub.health.unregistered == n
    finally:
        await mgr.close()
        await pub.close()


# ----------------------------------------------------------------------------- replay reply shapes


class TopicReplayPublisher(VllmStylePublisher):
    """Replies to replay requests as TensorRT-LLM does, `[b"", topic, seq, payload]`, and
    can put `garbage` replies (malformed frame lists) before the good ones."""

    garbage: list[list[bytes]] = []

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_frame = frames
            start_seq = int.from_bytes(start_frame, "big")
            self.replay_requests.append(start_seq)
            for bad in self.garbage:
                await self.router.send_multipart([client, b"", *bad])
            for seq, buf in list(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart([client, b"", self.topic, _seq(seq), buf])
            await self.router.send_multipart([client, b"", self.topic, (-1).to_bytes(8, "big", signed=True), b""])


@pytest.mark.parametrize("garbage", [[], [[b"a", b"b", b"c", b"d"]], [[b"x"], [b"kv", b"short", b"p"]]])
async def test_a_replay_with_a_topic_frame_fills_the_gap_past_malformed_replies(ctx, garbage):
    """A replay answered with a topic frame before each sequence number (TensorRT-LLM's
    shape) fills a gap like vLLM's; malformed replies before the good ones are counted
    as bad frames and skipped, never taken for the end of the replay. Catches the
    topic-frame shape not recognised, or a bad reply ending the replay early (which
    leaves the gap uncovered and forces a resync)."""
    index = PrefixIndex(BS, max_workers=16)
    pub = TopicReplayPublisher(ctx)
    pub.garbage = garbage
    mgr, sub = await start(ctx, index, pub, tail_probe_s=None)
    try:
        a = Chain(220, 6)
        await pub.publish([a.stored(0, 2)])
        await pub.publish([a.stored(2, 4)], deliver=False)
        await pub.publish([a.stored(4, 6)])
        await wait_until(lambda: sub.health.replays == 1 and sub.health.last_seq == 2)
        assert matched(index, a) == 6
        h = mgr.health()["w"]
        assert (h["resyncs"], h["bad_frames"], h["replay_failures"]) == (0, len(garbage), 0)
    finally:
        await mgr.close()
        await pub.close()


# ----------------------------------------------------------------------------- remote groups


def test_a_remote_group_keeps_its_blocks_after_its_last_member_leaves():
    """REMOTE is storage shared by a group: when its only member leaves, the group (and
    the REMOTE blocks it holds) stays while it has REMOTE entries, so a new member of
    the group sees them and a new group does not. Catches the group freed (its slot,
    with its blocks, handed to the next new group) while it still holds blocks."""
    hasher = BlockHasher.for_namespace(NS)
    idx = PrefixIndex(BS, max_workers=8)
    idx.add_worker("x", NS.digest, BS)  # a bystander in another group
    idx.add_worker("o", NS.digest, BS, remote_group="g", trusted_digests=True)
    t = [(5 * i + 3) % 50_000 for i in range(4 * BS)]
    ds = digests64(hasher.keys(t))
    assert idx.apply("o", [BlockStored(ds, None, t, BS, None, "REMOTE", None)]).stored == 4
    idx.remove_worker("o")
    assert idx.match(ds) == {}
    idx.add_worker("p", NS.digest, BS, remote_group="h")  # a new group must not inherit g's storage
    assert idx.match(ds) == {}
    idx.add_worker("n", NS.digest, BS, remote_group="g", trusted_digests=True)
    assert idx.match(ds) == {"n": PrefixMatch("n", 4, ((Tier.REMOTE, 4),))}


# ----------------------------------------------------------------------------- namespaces


def test_a_scope_without_a_cache_salt_is_the_empty_salt():
    """`Namespace.scoped(tenant_salt=...)` with no cache salt scopes exactly as an empty
    cache salt does (the gateway passes "" and a worker may omit it: both must key the
    same blocks). Catches a non-empty default."""
    a = NS.scoped(tenant_salt="t1")
    b = NS.scoped(tenant_salt="t1", cache_salt="")
    hasher = BlockHasher.for_namespace(NS)
    ids = list(range(3 * BS))
    assert hasher.keys(ids, a.extra_keys(3)) == hasher.keys(ids, b.extra_keys(3))
    assert a.wire_salt == b.wire_salt



# ----------------------------------------------------------------------------- engine hashes


def test_a_removal_of_a_hash_nobody_stored_is_counted_unknown_and_changes_nothing():
    """A vLLM worker's removal naming an engine hash the index never mapped (stored before
    the subscription, or already gone) is counted as `unknown_removed`, not as a
    removal, and leaves the worker's blocks alone. Catches an unknown hash taken for a
    digest the worker holds."""
    idx = PrefixIndex(BS, max_workers=8)
    idx.add_worker("v", NS.digest, BS)  # slot 0, untrusted: engine hashes are mapped
    t = toks(4, 3)
    ds = digests64(HASHER.keys(t))
    assert idx.apply("v", [BlockStored([9001, 9002, 9003], None, t, BS, None, "GPU", None)]).stored == 3
    st = idx.apply("v", [BlockRemoved([424242, 5], "GPU")])
    assert (st.unknown_removed, st.removed) == (2, 0)
    assert idx.match(ds)["v"] == PrefixMatch("v", 3, ((Tier.GPU, 3),))
    st = idx.apply("v", [BlockRemoved([9003], "GPU")])  # a known one is removed
    assert (st.unknown_removed, st.removed) == (0, 1)
    assert idx.match(ds)["v"].blocks == 2
