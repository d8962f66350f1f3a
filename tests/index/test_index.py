"""PrefixIndex: lifecycle, tiers, remote groups, and a brute-force reference model."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.errors import (
    BadBlockSize,
    BadNamespace,
    BadVerifyEvery,
    IndexFull,
    UnknownWorker,
    WorkerAlreadyRegistered,
)
from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, DecodedBatch, EventDecoder, EventEncoder
from kvindex.index import IndexError_, PrefixIndex, PrefixMatch
from kvindex.keys import BlockHasher, Namespace, digests64
from kvindex.stats import COUNTERS, ApplyStats
from kvindex.tiers import Tier

BS = 4
NS = Namespace("m", block_size=BS)
HASHER = BlockHasher.for_namespace(NS)
M64 = (1 << 64) - 1


def toks(seed: int, n_blocks: int) -> list[int]:
    return [(seed * 1_000 + i) % 60_000 for i in range(n_blocks * BS)]


def ours(tokens: list[int], lo: int, hi: int, medium: str | None = "GPU", parent_ok: bool = True) -> BlockStored:
    """What our workers publish: digests as hashes, our digest as parent."""
    ds = digests64(HASHER.keys(tokens[: hi * BS]))
    parent = ds[lo - 1] if lo and parent_ok else (None if not lo else 12345)
    return BlockStored(ds[lo:hi], parent, tokens[lo * BS : hi * BS], BS, None, medium, None)


def test_registration_rules():
    idx = PrefixIndex(16, max_workers=2)
    with pytest.raises(IndexError_, match="multiple of 16"):
        idx.add_worker("a", NS.digest, block_size=24)
    idx.add_worker("a", NS.digest, block_size=32)
    with pytest.raises(IndexError_, match="already registered"):
        idx.add_worker("a", NS.digest)
    idx.add_worker("b", NS.digest)
    with pytest.raises(IndexError_, match="full"):
        idx.add_worker("c", NS.digest)
    with pytest.raises(IndexError_, match="unknown worker"):
        idx.apply("zz", [])
    with pytest.raises(IndexError_, match="32 bytes"):
        PrefixIndex(16).add_worker("x", b"short")
    idx.remove_worker("b")
    idx.add_worker("c", NS.digest)  # the slot came back
    assert sorted(idx.workers()) == ["a", "c"]


def test_each_refusal_has_its_type_and_fields():
    """A caller tells the reasons apart by type and reads the fields, not the message."""
    idx = PrefixIndex(16, max_workers=1)
    with pytest.raises(BadBlockSize) as bs:
        idx.add_worker("a", NS.digest, block_size=24)
    assert (bs.value.worker_id, bs.value.block_size, bs.value.index_block_size) == ("a", 24, 16)
    with pytest.raises(BadNamespace) as ns:
        idx.add_worker("a", b"short")
    assert (ns.value.worker_id, ns.value.digest_bytes, ns.value.expected_bytes) == ("a", 5, 32)
    with pytest.raises(BadVerifyEvery) as ve:
        idx.add_worker("a", NS.digest, verify_every=True)
    assert (ve.value.worker_id, ve.value.verify_every) == ("a", True)
    idx.add_worker("a", NS.digest)
    with pytest.raises(WorkerAlreadyRegistered) as dup:
        idx.add_worker("a", NS.digest)
    assert dup.value.worker_id == "a"
    with pytest.raises(IndexFull) as full:
        idx.add_worker("b", NS.digest)
    assert (full.value.worker_id, full.value.max_workers, full.value.groups) == ("b", 1, False)
    for call in (idx.remove_worker, idx.clear_worker, idx.set_draining, idx.local_blocks):
        with pytest.raises(UnknownWorker) as unknown:
            call("zz")
        assert unknown.value.worker_id == "zz"
    with pytest.raises(UnknownWorker):
        idx.store_keys("zz", [])
    with pytest.raises(UnknownWorker):
        idx.remove_digests("zz", [])
    for e in (bs, ns, ve, dup, full, unknown):
        assert isinstance(e.value, IndexError_) and isinstance(e.value, ValueError)
    assert "index is full: 1 workers" in str(full.value)


def test_a_remote_group_keeps_its_slot_while_it_holds_blocks():
    """A removed worker's group stays while it holds REMOTE entries: with every group slot
    so taken, a worker that would need a new group is refused (and its slot given back)."""
    idx = PrefixIndex(BS, max_workers=1)
    idx.add_worker("a", NS.digest)
    idx.store_keys("a", HASHER.keys(toks(1, 2)), Tier.REMOTE)
    idx.remove_worker("a")
    with pytest.raises(IndexFull) as full:
        idx.add_worker("b", NS.digest)
    assert (full.value.worker_id, full.value.max_workers, full.value.groups) == ("b", 1, True)
    assert str(full.value) == "no free remote-group slots (1); raise max_workers"
    assert not idx.has_worker("b")
    idx.add_worker("b", NS.digest, remote_group="worker:a")  # the group that holds the slot
    assert idx.workers() == ["b"]


def test_tiers_groups_draining_and_filters():
    t = toks(1, 8)
    ds = digests64(HASHER.keys(t))
    idx = PrefixIndex(BS, max_workers=8)
    for w, g in (("a", None), ("b", "rg"), ("c", "rg")):
        idx.add_worker(w, NS.digest, BS, g)
    idx.apply("a", [ours(t, 0, 3, "GPU"), ours(t, 3, 5, "CPU"), ours(t, 5, 8, "DISK")])
    idx.apply("a", [ours(t, 1, 2, "CPU")])  # also in CPU: GPU stays its fastest tier
    idx.apply("b", [ours(t, 0, 6, "REMOTE"), ours(t, 0, 2, "GPU")])
    m = idx.match(ds)
    assert m["a"] == PrefixMatch("a", 8, ((Tier.GPU, 3), (Tier.CPU, 2), (Tier.DISK, 3)))
    assert m["b"].runs == ((Tier.GPU, 2), (Tier.REMOTE, 4))
    assert m["c"].runs == ((Tier.REMOTE, 6),)  # stored by b, reachable by every member
    assert m["a"].per_tier() == {Tier.GPU: 3, Tier.CPU: 2, Tier.DISK: 3}
    assert idx.holders(ds[0]) == {"a": [Tier.GPU], "b": [Tier.GPU, Tier.REMOTE], "c": [Tier.REMOTE]}
    assert set(idx.match(ds, workers=["c", "nobody"])) == {"c"}
    idx.set_draining("a")
    assert "a" not in idx.match(ds) and "a" in idx.match(ds, include_draining=True)
    idx.set_draining("a", False)
    # c removes the group's remote copy of block 2: every member loses it
    idx.apply("c", [BlockRemoved([ds[2]], "REMOTE")])
    m = idx.match(ds)
    assert m["b"].blocks == 2 and m["c"].blocks == 2 and m["a"].blocks == 8
    # removing b keeps the group's remote blocks for c
    idx.remove_worker("b")
    assert idx.match(ds)["c"].blocks == 2
    stats = {s.worker_id: s for s in idx.worker_stats()}
    assert stats["a"].blocks == {"GPU": 3, "CPU": 3, "DISK": 3, "REMOTE": 0}
    assert stats["c"].blocks["REMOTE"] == 5
    assert idx.entries() == 9 + 5
    assert idx.match([]) == {}
    assert idx.match([ds[5]]) == {
        "a": PrefixMatch("a", 1, ((Tier.DISK, 1),)),
        "c": PrefixMatch("c", 1, ((Tier.REMOTE, 1),)),
    }


def test_events_edge_cases_are_counted_never_raised():
    t = toks(2, 4)
    ds = digests64(HASHER.keys(t))
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("a", NS.digest, BS)
    st = idx.apply(
        "a",
        DecodedBatch(
            0.0,
            [
                ours(t, 0, 2, "tape"),  # unknown medium: counted, stored as DISK (never as GPU)
                ours(t, 2, 4, parent_ok=False),  # parent unknown: orphans
                BlockRemoved([ds[3], 777], "GPU"),  # never stored here
                BlockStored([1], None, [1, 2], BS, None, "GPU", None),  # too few tokens
                BlockStored([1], None, [-1, 2, 3, 4], BS, None, "GPU", None),  # not a u32 token
                BlockStored([1], None, t[:BS], 6, None, "GPU", None),  # block size not a multiple
                BlockStored([1], None, t[:BS], BS, None, "GPU", None, [("x",), ("y",)]),  # extra_keys length
                BlockStored([1], None, t[:BS], BS, None, "GPU", None, group_idx=1),  # another KV group
                "not an event",  # type: ignore[list-item]
                BlockStored([1], None, None, BS, None, "GPU", None),  # type: ignore[arg-type]
                BlockRemoved(None, "GPU"),  # type: ignore[arg-type]
            ],
            errors=["event 11: bad"],
        ),
    )
    assert (st.stored, st.orphans, st.unknown_removed, st.unknown_medium) == (2, 2, 2, 1)
    assert (st.bad_events, st.ignored) == (8, 1)
    assert idx.match(ds)["a"].runs == ((Tier.DISK, 2),)


def test_worker_stats_sum_every_counter_of_every_batch(monkeypatch):
    """`ApplyStats`'s fields drive the per-worker totals: no counter is left out of the sum."""
    monkeypatch.setattr("kvindex.group_apply.MAX_GROUP_BLOCKS", 2)  # a group > 0 outgrowing its bound
    t = toks(4, 4)
    ds = digests64(HASHER.keys(t))
    drifted = digests64(BlockHasher.for_namespace(Namespace("m", revision="other", block_size=BS)).keys(t))
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("a", NS.digest, BS)
    idx.add_worker("b", NS.digest, BS, trusted_digests=True)
    idx.add_worker("c", NS.digest, BS)
    idx.add_worker("d", NS.digest, BS // 2, max_pages=2)  # pages of half a block (kvindex/page_chain.py)
    batches = {
        "a": [
            [ours(t, 0, 2, "tape"), ours(t, 2, 4, parent_ok=False), BlockRemoved([ds[0], 777], "DISK")],
            [BlockStored([1], None, t[:BS], BS, None, "GPU", None, group_idx=1), "junk", AllBlocksCleared()],
        ],
        "b": [[BlockStored(drifted, None, t, BS, None, "GPU", None)]],  # its digests differ from ours
        "c": [  # a hybrid worker: group 1 stores, removes, changes its window, outgrows its bound
            [BlockStored([5, 6], None, t[: 2 * BS], BS, None, "GPU", None, None, 1, "sliding_window", 8)],
            [BlockRemoved([5], "GPU", 1), BlockStored([7], 6, t[2 * BS : 3 * BS], BS, None, "GPU", None,
                                                      None, 1, "sliding_window", 12)],
            [BlockStored([8, 9], None, t[: 4 * BS], BS, None, "GPU", None, None, 1, "sliding_window", 12)],
        ],
        "d": [  # pages outgrowing its bound, and a page shorter than the others
            [BlockStored([11, 12, 13], None, t[: 3 * BS // 2], BS // 2, None, "GPU", None),
             BlockStored([14], 13, t[3 * BS // 2 : 3 * BS // 2 + 1], 1, None, "GPU", None)],
            # a release whose page hashes are its tokens' hash alone: nothing of it is credited
            [BlockStored([hash(tuple(t[: BS // 2]))], None, t[: BS // 2], BS // 2, None, "GPU", None)],
        ],
    }
    seen = ApplyStats()
    for wid, wbatches in batches.items():
        total = ApplyStats()
        for b in wbatches:
            total.add(idx.apply(wid, b))
        assert next(s for s in idx.worker_stats() if s.worker_id == wid).counters() == total.counters()
        seen.add(total)
    assert set(COUNTERS) == set(seen.counters()) and all(seen.counters().values())  # every counter exercised


def test_clears_retire_slots_and_sweeps_reclaim_them():
    idx = PrefixIndex(BS, max_workers=3)
    idx.add_worker("a", NS.digest, BS)
    idx.add_worker("b", NS.digest, BS)
    shared = toks(3, 6)
    ds = digests64(HASHER.keys(shared))
    for round_ in range(20):  # far more clears than slots: sweeps must hand slots back
        idx.apply("a", [ours(shared, 0, 6)])
        idx.apply("b", [ours(shared, 0, 3)])
        assert idx.match(ds)["a"].blocks == 6 and idx.match(ds)["b"].blocks == 3
        idx.apply("a", [AllBlocksCleared()])
        assert "a" not in idx.match(ds)
        if round_ % 3 == 0:
            idx.clear_worker("b")
    assert idx.sweeps > 0
    assert idx.sweep() and idx.sweep(10)
    assert len(idx) == (3 if idx.match(ds).get("b") else 0)


def test_parents_must_be_held_by_a_live_holder():
    """A cleared or removed worker's blocks cannot parent new chains, swept or not."""
    t = toks(8, 4)
    idx = PrefixIndex(BS, max_workers=8)
    for w in ("a", "b", "c"):
        idx.add_worker(w, NS.digest, BS)
    idx.apply("a", [ours(t, 0, 2)])
    idx.clear_worker("a")  # retired bits may linger until a sweep
    assert idx.apply("b", [ours(t, 2, 3)]).orphans == 1
    idx.apply("c", [ours(t, 0, 2, "CPU")])
    assert idx.apply("b", [ours(t, 2, 3)]).stored == 1  # live again through c
    idx.remove_worker("c")
    assert idx.apply("a", [ours(t, 3, 4)]).stored == 1  # b still holds block 2
    assert idx.sweep()
    assert idx.match(digests64(HASHER.keys(t))) == {}  # block 0 is held by nobody now


def test_direct_store_and_remove():
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("a", NS.digest, BS, "g")
    keys = HASHER.keys(toks(4, 5))
    ds = digests64(keys)
    assert idx.store_keys("a", keys, Tier.CPU) == 5
    assert idx.store_keys("a", keys[:2], Tier.CPU) == 0
    assert idx.store_keys("a", keys[:2], Tier.REMOTE) == 2
    assert idx.remove_digests("a", ds[1:3], Tier.CPU) == 2
    assert idx.match(ds)["a"].runs == ((Tier.CPU, 1), (Tier.REMOTE, 1))
    with pytest.raises(ValueError):
        idx.store_keys("a", [b"x"], Tier.GPU)
    with pytest.raises(ValueError):
        idx.store_keys("a", keys, Tier.PEER)
    # a child stored by an engine event chains off the directly stored parent
    t = toks(4, 6)
    ev = BlockStored([ds[4] ^ 1], ds[4], t[5 * BS : 6 * BS], BS, None, "GPU", None)
    assert idx.apply("a", [ev]).stored == 1
    assert idx.match(digests64(HASHER.keys(t)))["a"].blocks == 2  # blocks 0 (CPU), 1 (REMOTE) then gap


def test_vllm_extra_keys_and_lora_match_router_keys():
    """Keys from vLLM's per-block extra_keys (block size 2x ours) equal the router's."""
    t = toks(5, 8)
    scoped = NS.scoped(lora="adapter-a", tenant_salt="tenant-1", cache_salt="req")
    router_ds = digests64(HASHER.keys_for(t, scoped))
    salt = scoped.wire_salt
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("v", NS.digest, 2 * BS)
    extra = [("adapter-a", salt), ("adapter-a",), ("adapter-a",), ("adapter-a",)]
    ev = BlockStored([11, 12, 13, 14], None, t, 2 * BS, None, "GPU", "adapter-a", extra)
    assert idx.apply("v", [ev]).stored == 4
    assert idx.match(router_ds)["v"].blocks == 8
    assert idx.match(digests64(HASHER.keys(t))) == {}  # never mixed with base-model keys
    # an old release: lora_id only, no extra keys; must not land on base-model keys either
    idx.add_worker("old", NS.digest, BS)
    idx.apply("old", [BlockStored([1, 2], None, t[: 2 * BS], BS, 7, "GPU", None)])
    assert "old" not in idx.match(digests64(HASHER.keys(t)))


def test_engine_map_follows_local_copies():
    """vLLM workers: the engine-hash map lives exactly as long as a local copy does."""
    t = toks(6, 4)
    ds = digests64(HASHER.keys(t))
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("v", NS.digest, BS, "g")
    stats = lambda: next(s for s in idx.worker_stats() if s.worker_id == "v")  # noqa: E731
    idx.apply("v", [BlockStored([1, 2], None, t[: 2 * BS], BS, None, "GPU", None)])
    idx.apply("v", [BlockStored([1, 2], None, t[: 2 * BS], BS, None, "CPU", None)])  # a copy: no keying
    assert stats().engine_map == 2 and stats().blocks["CPU"] == 2
    idx.apply("v", [BlockRemoved([1, 2], "GPU")])
    assert stats().engine_map == 2  # still in CPU
    idx.apply("v", [BlockRemoved([1, 2], "CPU")])
    assert stats().engine_map == 0 and len(idx) == 0
    assert idx.apply("v", [BlockRemoved([1], "CPU")]).unknown_removed == 1
    # REMOTE-only: the map entry outlives the remote copy; a later store must still key it
    idx.apply("v", [BlockStored([1, 2], None, t[: 2 * BS], BS, None, "REMOTE", None)])
    idx.apply("v", [BlockRemoved([1, 2], "REMOTE")])
    assert len(idx) == 0
    idx.apply("v", [BlockStored([1, 2], None, t[: 2 * BS], BS, None, "GPU", None)])
    assert idx.match(ds)["v"].runs == ((Tier.GPU, 2),)


# ----------------------------------------------------------------------------- reference model

PROMPTS = {
    # 0 and 1 share their first 3 blocks; 2 carries a LoRA and a salt
    0: (toks(10, 8), None),
    1: (toks(10, 3) + toks(11, 5), None),
    2: (toks(12, 8), NS.scoped(lora="L", cache_salt="s")),
}
ROUTER_DS = {p: digests64(HASHER.keys_for(t, sc or NS)) for p, (t, sc) in PROMPTS.items()}
# worker id -> (kind, engine block size in index blocks, remote group)
WORKERS = {"v0": ("vllm", 1, "g0"), "v1": ("vllm", 2, "g0"), "o0": ("ours", 1, None), "o1": ("ours", 1, "g1")}
MEDIUMS = ["GPU", "CPU", "DISK", "REMOTE", "tape"]
TIER_OF = {"GPU": 0, "CPU": 1, "DISK": 2, "REMOTE": 3, "tape": 2}


def engine_hash(p: int, j: int, k: int) -> int:
    """A vLLM-like engine hash: content-defined (shared prefixes share it), not our digest."""
    return (ROUTER_DS[p][(j + 1) * k - 1] ^ (0x9E3779B97F4A7C15 * k)) & M64


def engine_extras(p: int, lo: int, hi: int, k: int) -> tuple[list | None, str | None]:
    sc = PROMPTS[p][1]
    if sc is None:
        return None, None
    per_block = sc.extra_keys(len(ROUTER_DS[p]))
    assert per_block is not None
    return [per_block[j * k] for j in range(lo, hi)], sc.lora


@dataclass
class NaiveWorker:
    kind: str
    k: int
    group: str
    local: dict[int, set[int]] = field(default_factory=lambda: {0: set(), 1: set(), 2: set()})
    emap: dict[int, tuple[int, ...]] = field(default_factory=dict)
    held: dict[int, set[int]] = field(default_factory=lambda: {0: set(), 1: set(), 2: set()})  # engine blocks
    draining: bool = False


class Naive:
    def __init__(self) -> None:
        self.workers: dict[str, NaiveWorker] = {}
        self.remote: dict[str, set[int]] = {}

    def live(self, d: int) -> bool:
        return any(d in s for w in self.workers.values() for s in w.local.values()) or any(
            d in r for r in self.remote.values()
        )

    def store(self, wid: str, p: int, lo: int, hi: int, medium: str) -> None:
        w = self.workers[wid]
        k, t = w.k, TIER_OF[medium]
        ds = ROUTER_DS[p]
        blocks = [tuple(ds[j * k : (j + 1) * k]) for j in range(lo, hi)]
        target = self.remote.setdefault(w.group, set()) if t == 3 else w.local[t]
        flat = [d for b in blocks for d in b]
        if w.kind == "vllm":
            hs = [engine_hash(p, j, k) for j in range(lo, hi)]
            known = all(h in w.emap for h in hs) and all(self.live(d) for d in flat)
        else:
            known = all(
                any(d in s for s in w.local.values()) or d in self.remote.get(w.group, set()) for d in flat
            )
        if not known:
            if lo:
                if w.kind == "vllm":
                    ph = engine_hash(p, lo - 1, k)
                    pd = w.emap[ph][-1] if ph in w.emap else None
                else:
                    pd = ds[lo * k - 1]
                if pd is None or not self.live(pd):
                    return  # orphans
            if w.kind == "vllm":
                for j, b in zip(range(lo, hi), blocks, strict=True):
                    w.emap[engine_hash(p, j, k)] = b
        target.update(flat)
        if w.kind == "vllm" and t != 3:
            w.held[t].update(engine_hash(p, j, k) for j in range(lo, hi))

    def remove(self, wid: str, p: int, lo: int, hi: int, medium: str) -> None:
        w = self.workers[wid]
        k, t = w.k, TIER_OF[medium]
        target = self.remote.setdefault(w.group, set()) if t == 3 else w.local[t]
        for j in range(lo, hi):
            if w.kind == "vllm":
                eh = engine_hash(p, j, k)
                if eh not in w.emap:
                    continue
                ds = w.emap[eh]
            else:
                eh = ROUTER_DS[p][j]
                if eh not in target:
                    continue
                ds = (eh,)
            if t != 3 and w.kind == "vllm":
                # an index block another engine block still holds in this tier stays
                w.held[t].discard(eh)
                still = {d for e in w.held[t] for d in w.emap[e]}
                target.difference_update(set(ds) - still)
            else:
                target.difference_update(ds)
            if t != 3 and w.kind == "vllm" and not any(d in s for d in ds for s in w.local.values()):
                del w.emap[eh]

    def match(self, digests: list[int], include_draining: bool) -> dict[str, PrefixMatch]:
        out = {}
        for wid, w in self.workers.items():
            if w.draining and not include_draining:
                continue
            runs: list[tuple[Tier, int]] = []
            for d in digests:
                tiers = [t for t in (0, 1, 2) if d in w.local[t]]
                if d in self.remote.get(w.group, set()):
                    tiers.append(3)
                if not tiers:
                    break
                t = Tier(min(tiers))
                if runs and runs[-1][0] is t:
                    runs[-1] = (t, runs[-1][1] + 1)
                else:
                    runs.append((t, 1))
            if runs:
                out[wid] = PrefixMatch(wid, sum(n for _, n in runs), tuple(runs))
        return out


def event_for(wid: str, op: str, p: int, lo: int, hi: int, medium: str):
    kind, k, _ = WORKERS[wid]
    tokens = PROMPTS[p][0]
    ds = ROUTER_DS[p]
    if kind == "vllm":
        hashes = [engine_hash(p, j, k) for j in range(lo, hi)]
        parent = engine_hash(p, lo - 1, k) if lo else None
    else:
        hashes = ds[lo:hi]
        parent = ds[lo - 1] if lo else None
    if op == "remove":
        return BlockRemoved(hashes, medium)
    extra, lora = engine_extras(p, lo, hi, k)
    return BlockStored(hashes, parent, tokens[lo * k * BS : hi * k * BS], k * BS, None, medium, lora, extra)


@pytest.mark.parametrize("trusted", [False, True], ids=["verified", "trusted"])
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_match_equals_brute_force_reference(trusted, data):
    """With `trusted`, our workers' digests are applied as published (through the wire
    and the lazy decoder); the answers must not change."""
    idx = PrefixIndex(BS, max_workers=6)  # few slots: clears and removals force sweeps
    ref = Naive()
    enc, lazy = EventEncoder(), EventDecoder(lazy=True)

    def add(wid: str) -> None:
        kind, k, group = WORKERS[wid]
        idx.add_worker(wid, NS.digest, k * BS, group, trusted_digests=trusted and kind == "ours", verify_every=3)
        ref.workers[wid] = NaiveWorker(kind, k, group or f"worker:{wid}")

    def apply(wid: str, ev) -> None:
        if idx.trusts_digests(wid):
            batch = lazy.decode(enc.encode(0.0, [ev]))
            assert not batch.errors
            idx.apply(wid, batch)
        else:
            idx.apply(wid, [ev])

    for wid in WORKERS:
        add(wid)
    reach: dict[tuple[str, int], int] = {}  # (worker, prompt) -> engine blocks stored so far
    for _ in range(data.draw(st.integers(5, 50), label="steps")):
        name = data.draw(
            st.sampled_from(["store"] * 8 + ["remove"] * 3 + ["add", "remove_worker", "clear", "drain", "sweep"])
        )
        if name == "sweep":
            idx.sweep(data.draw(st.integers(1, 5)))
            continue
        wid = data.draw(st.sampled_from(list(WORKERS)))
        kind, k, group = WORKERS[wid]
        if name == "add":
            if wid not in ref.workers:
                add(wid)
            continue
        if wid not in ref.workers:
            continue
        if name == "remove_worker":
            idx.remove_worker(wid)
            del ref.workers[wid]
            reach = {key: v for key, v in reach.items() if key[0] != wid}
        elif name == "clear":
            apply(wid, AllBlocksCleared())
            ref.workers[wid].local = {0: set(), 1: set(), 2: set()}
            ref.workers[wid].emap = {}
            ref.workers[wid].held = {0: set(), 1: set(), 2: set()}
        elif name == "drain":
            flag = data.draw(st.booleans())
            idx.set_draining(wid, flag)
            ref.workers[wid].draining = flag
        else:
            p = data.draw(st.sampled_from(list(PROMPTS)))
            n_engine = len(ROUTER_DS[p]) // k
            done = reach.get((wid, p), 0)
            anywhere = data.draw(st.integers(0, n_engine - 1))
            lo = data.draw(st.sampled_from(sorted({0, min(done, n_engine - 1), anywhere})))
            hi = min(lo + data.draw(st.integers(1, 4)), n_engine)
            medium = data.draw(st.sampled_from(MEDIUMS))
            apply(wid, event_for(wid, name, p, lo, hi, medium))
            if name == "store":
                ref.store(wid, p, lo, hi, medium)
                reach[(wid, p)] = max(done, hi)
            else:
                ref.remove(wid, p, lo, hi, medium)
        for p, ds in ROUTER_DS.items():
            assert idx.match(ds) == ref.match(ds, False), (name, wid, p)
    for ds in ROUTER_DS.values():
        assert idx.match(ds, include_draining=True) == ref.match(ds, True)
        for lo in (1, 3):
            assert idx.match(ds[lo:]) == ref.match(ds[lo:], False)
    for s in idx.worker_stats():
        w = ref.workers[s.worker_id]
        assert s.digest_mismatches == 0 and s.trusted_digests == (trusted and w.kind == "ours")
        assert [s.blocks[t] for t in ("GPU", "CPU", "DISK")] == [len(w.local[t]) for t in (0, 1, 2)]
        assert s.blocks["REMOTE"] == len(ref.remote.get(w.group, set()))


def test_engine_blocks_sharing_leading_index_blocks_are_counted() -> None:
    """A vLLM worker keys 2-index-block engine blocks. Two engine blocks with the same
    parent and the same first half share their first index block: removing one must
    not clear what the other still holds (recorded-style events, vLLM's own hashes)."""
    idx = PrefixIndex(BS)
    idx.add_worker("v", NS.digest, 2 * BS)
    head, shared, tail_a, tail_b = toks(1, 2), toks(2, 1), toks(3, 1), toks(4, 1)
    prompt_a, prompt_b = head + shared + tail_a, head + shared + tail_b
    ds_a, ds_b = digests64(HASHER.keys(prompt_a)), digests64(HASHER.keys(prompt_b))
    assert ds_a[2] == ds_b[2] and ds_a[3] != ds_b[3]  # the shared index block
    idx.apply("v", [BlockStored([101, 102], None, prompt_a, 2 * BS, medium="GPU"),
                    BlockStored([103], 101, shared + tail_b, 2 * BS, medium="GPU")])
    assert idx.match(ds_a)["v"].blocks == 4 and idx.match(ds_b)["v"].blocks == 4
    idx.apply("v", [BlockRemoved([102], "GPU")])
    assert idx.match(ds_a)["v"].blocks == 3  # its own second half is gone ...
    assert idx.match(ds_b)["v"].blocks == 4  # ... the block the other engine block shares is not
    idx.apply("v", [BlockRemoved([102], "GPU"), BlockRemoved([103], "GPU")])  # a repeat changes nothing more
    assert idx.match(ds_b)["v"].blocks == 2 and idx.match(ds_a)["v"].blocks == 2
    idx.apply("v", [BlockStored([103], 101, shared + tail_b, 2 * BS, medium="CPU")])  # a copy in another tier
    idx.apply("v", [BlockRemoved([103], "CPU")])
    assert idx.match(ds_b)["v"].blocks == 2


def test_a_recorded_vllm_event_sequence_applies_cleanly() -> None:
    """vLLM 0.32.0's own frames (tests/data/vllm: 32-token engine blocks, a 17-block pool,
    evictions, a salted chain, a chat, a cache reset) over a 16-token index: every event
    applies, nothing is an orphan or an unknown removal, the worker never holds more
    than its pool, and after the reset exactly the last request's blocks remain."""
    from pathlib import Path

    import msgspec

    rec = msgspec.msgpack.decode((Path(__file__).parents[1] / "data/vllm/events-0.32.0.msgpack").read_bytes())
    ns = Namespace("tiny", block_size=16)
    idx = PrefixIndex(16)
    idx.add_worker("v", ns.digest, 32)
    dec = EventDecoder()
    total = ApplyStats()
    for step in rec["steps"]:
        for _topic, _seq, payload in step["frames"]:
            batch = dec.decode(payload)
            assert not batch.errors
            total.add(idx.apply("v", batch))
        assert idx.local_blocks("v") <= 2 * 16, step["step"]  # 16 usable engine blocks, 2 index blocks each
    assert (total.bad_events, total.orphans, total.unknown_removed) == (0, 0, 0)
    assert total.cleared == 1 and total.removed == 5 + 6 + 6 + 3 + 1
    assert idx.local_blocks("v") == 2 * 6  # "A after the reset": 6 engine blocks
