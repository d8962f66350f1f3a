"""Property: a subscriber that rebuilds cache state from the published KV events always
holds exactly the engines' real state, in every tier, under random workloads with
evictions, cascades, loads, prefetches (local and peer), cancels and purges.

Events go through the wire codec (EventEncoder -> EventDecoder) and are applied both
to a naive per-tier model and to kvindex's PrefixIndex (keys recomputed from token_ids,
REMOTE shared by the group).
"""
from __future__ import annotations

import random

import pytest

from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecoder, EventEncoder
from kvindex.index import PrefixIndex
from kvindex.keys import BlockHasher, digests64
from kvindex.tiers import Tier, tier_of_medium
from workers.errors import EngineError
from workers.sim import RemoteStore, SimEngine, SimRequest
from workers.sim.testing import drain, make_profile

BS = 4


class Rebuilt:
    """Per-worker local tiers + per-group REMOTE, from events only."""

    def __init__(self, n: int) -> None:
        self.local = [{t: set() for t in (Tier.GPU, Tier.CPU, Tier.DISK)} for _ in range(n)]
        self.remote: set[int] = set()
        self.enc = EventEncoder()
        self.dec = EventDecoder()
        self.index: PrefixIndex | None = None
        self.batches = 0

    def apply(self, i: int, events: list) -> None:
        batch = self.dec.decode(self.enc.encode(1.0, events))
        assert not batch.errors
        self.batches += 1
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                tier, known = tier_of_medium(ev.medium)
                assert known
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                tgt = self.remote if tier is Tier.REMOTE else self.local[i][tier]
                tgt.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                tier, _ = tier_of_medium(ev.medium)
                tgt = self.remote if tier is Tier.REMOTE else self.local[i][tier]
                assert set(ev.block_hashes) <= tgt, "removed a block the subscriber never saw stored"
                tgt.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                for s in self.local[i].values():
                    s.clear()
        if self.index is not None:
            st = self.index.apply(f"w{i}", batch)
            assert st.orphans == 0 and st.bad_events == 0 and st.unknown_removed == 0, st


def check(engines: list[SimEngine], sub: Rebuilt) -> None:
    remote_truth = None
    for i, e in enumerate(engines):
        snap = e.tiers_snapshot()
        for t in (Tier.GPU, Tier.CPU, Tier.DISK):
            assert set(digests64(list(snap[t]))) == sub.local[i][t], (i, t)
        remote_truth = set(digests64(list(snap[Tier.REMOTE])))
    assert remote_truth == sub.remote
    idx = sub.index
    if idx is None:
        return
    expected: dict[int, dict[str, list[Tier]]] = {}
    for i, e in enumerate(engines):
        for t, keys in e.tiers_snapshot().items():
            for d in digests64(list(keys)):
                if t is Tier.REMOTE:
                    for j in range(len(engines)):
                        expected.setdefault(d, {}).setdefault(f"w{j}", []).append(Tier.REMOTE)
                else:
                    expected.setdefault(d, {}).setdefault(f"w{i}", []).append(t)
    for d, holders in expected.items():
        got = idx.holders(d)
        want = {w: sorted(set(ts)) for w, ts in holders.items()}
        assert {w: sorted(ts) for w, ts in got.items()} == want, d
    n_entries = sum(len(e.tiers_snapshot()[t]) for e in engines for t in (Tier.GPU, Tier.CPU, Tier.DISK))
    assert idx.entries() == n_entries + len(sub.remote)


def workload(seed: int, ops: int = 160, remote_write: str = "evict") -> tuple[Rebuilt, list[SimEngine], int]:
    rng = random.Random(seed)
    prof = make_profile(
        block_size=BS,
        gpu_blocks=rng.choice([24, 40]),
        cpu_blocks=rng.choice([0, 12, 20]),
        disk_blocks=rng.choice([0, 16]),
        remote_blocks=24,
        admit_after_uses=rng.choice([1, 2]),
        max_num_batched_tokens=32,
        max_waiting=6,
        prefetch_queue=3,
        remote_write=remote_write,
    )
    store = RemoteStore("rg0", prof.tier_blocks(prof.remote), BS)
    sub = Rebuilt(2)
    idx = PrefixIndex(block_size=BS)
    ns = prof.namespace()
    for i in range(2):
        idx.add_worker(f"w{i}", ns.digest, BS, "rg0")
    sub.index = idx
    engines = [
        SimEngine(f"w{i}", prof, remote=store, on_events=(lambda ev, i=i: sub.apply(i, ev))) for i in range(2)
    ]
    hasher = BlockHasher.for_namespace(ns)
    bases = [[rng.randrange(5000) for _ in range(48)] for _ in range(4)]
    salts = [None, None, "t:a", "t:b"]
    live: list[tuple[int, str]] = []
    prefetches: list[tuple[int, str]] = []
    finished = [0]
    t = 0.0
    n = 0
    for _ in range(ops):
        t += rng.expovariate(40.0)
        for e in engines:
            e.advance(t)
        k = rng.random()
        wi = rng.randrange(2)
        e = engines[wi]
        if k < 0.55:
            base = rng.choice(bases)
            prompt = base[: rng.randint(1, len(base))] + [rng.randrange(5000) for _ in range(rng.randint(0, 6))]
            salt = rng.choice(salts)
            rid = f"r{n}"
            n += 1
            req = SimRequest(
                rid, len(prompt), rng.randint(1, 6), token_ids=prompt, cache_salt=salt,
                lora=rng.choice([None, None, None, "ad1"]),
                shared_prefix_blocks=rng.choice([0, 0, 2]) if salt else 0,
                on_finish=lambda tt, u: finished.__setitem__(0, finished[0] + 1),
            )
            try:
                e.submit(req, t)
                live.append((wi, rid))
            except EngineError:
                pass
        elif k < 0.65 and live:
            wj, rid = live.pop(rng.randrange(len(live)))
            engines[wj].cancel(rid, t)
        elif k < 0.80:
            base = rng.choice(bases)
            keys = hasher.keys_for(base[: rng.randint(4, len(base))], ns.scoped())
            pid = f"p{n}"
            n += 1
            src = engines[1 - wi] if rng.random() < 0.4 else None
            try:
                e.prefetch(keys, t, t + rng.uniform(0.0, 0.05), pid, source=src)
                prefetches.append((wi, pid))
            except EngineError:
                pass
        elif k < 0.85 and prefetches:
            wj, pid = prefetches.pop(rng.randrange(len(prefetches)))
            engines[wj].cancel_prefetch(pid)
        elif k < 0.87:
            e.purge(rng.choice(["t:a", "t:b"]))
        elif k < 0.88:
            e.purge(None, lora="ad1")
        elif k < 0.89:
            e.purge(None, everything=True)
        elif k < 0.93:  # damage stored copies of a prefix the workload keeps asking for
            tier = rng.choice([Tier.CPU, Tier.DISK, Tier.REMOTE])
            held = e.tiers_snapshot()[tier]
            chain = [x for x in hasher.keys_for(rng.choice(bases), ns.scoped()) if x in held]
            if chain:
                e.corrupt(rng.sample(chain, min(len(chain), rng.randint(1, 3))), tier)
        elif k < 0.95:
            store.set_available(not store.available)
        if rng.random() < 0.3:
            check(engines, sub)
    store.set_available(True)
    drain(engines)
    check(engines, sub)
    return sub, engines, finished[0]


@pytest.mark.parametrize("seed", range(12))
def test_events_rebuild_state(seed: int) -> None:
    sub, engines, finished = workload(seed)
    assert sub.batches > 0
    assert finished > 0
    # every accepted request ended: nothing left in flight
    for e in engines:
        c = e.counts()
        assert c["waiting"] == c["loading"] == c["prefilling"] == c["decoding"] == 0
        # all blocks released: GPU holds only cached (evictable) blocks
        assert e.kv.n_anon == 0 and e.kv.n_pinned == 0
        assert len(e.kv.lru) == len(e.kv.gpu) <= e.kv.capacity
        load = e.load_report(e.now)
        assert load.waiting_prefill_tokens == load.running_prefill_tokens == load.running_requests == 0
        assert load.est_queue_s == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_events_rebuild_state_write_through(seed: int) -> None:
    workload(100 + seed, remote_write="compute")


def test_workloads_exercise_every_tier() -> None:
    """The property above is only worth something if the workloads reach every tier."""
    seen = {t: 0 for t in Tier if t is not Tier.PEER}
    moved = {"CPU": 0, "DISK": 0, "REMOTE": 0, "PEER": 0}
    damaged = down = 0
    for seed in range(12):
        _, engines, _ = workload(seed)
        for e in engines:
            for t, v in e.kv.stored.items():
                seen[t] += v
            for t, v in e.link_stats().items():
                moved[t] += v["bytes"]
            damaged += e.kv.checksum_errors
            down += e.kv.remote_unavailable
    assert all(v > 0 for v in seen.values()), seen
    assert all(v > 0 for v in moved.values()), moved
    assert damaged > 0 and down > 0


@pytest.mark.parametrize("seed", range(6))
def test_a_republished_state_alone_rebuilds_every_routable_block(seed: int) -> None:
    """What a worker republishes for a gateway that (re)starts, applied alone in a fresh
    index: it never claims a block the worker lacks, and it holds every block the worker
    could serve as part of a prefix (its whole chain of parents held by the worker or its
    group). A block whose parent the worker no longer has anywhere cannot be keyed from
    scratch (the index's orphan rule), and no prefix can reach it either."""
    _, engines, _ = workload(seed)
    idx = PrefixIndex(block_size=BS)
    for i, e in enumerate(engines):
        idx.add_worker(f"w{i}", e.namespace.digest, BS, "rg0", trusted_digests=True)
    enc, dec = EventEncoder(), EventDecoder(lazy=True)
    for i, e in enumerate(engines):
        st = idx.apply(f"w{i}", dec.decode(enc.encode(1.0, e.state_events())))
        assert st.bad_events == 0 and st.unknown_removed == 0, st
    for i, e in enumerate(engines):
        snap = e.tiers_snapshot()
        held = set().union(*snap.values())
        meta = {**(e.remote.meta if e.remote is not None else {}), **e.kv.meta}

        def reachable(k: bytes | None, held: set[bytes] = held, meta: dict = meta) -> bool:
            while k is not None:
                if k not in held or k not in meta:
                    return False
                k = meta[k].parent
            return True

        for t, keys in snap.items():
            for k, d in zip(keys, digests64(list(keys)), strict=True):
                tiers = idx.holders(d).get(f"w{i}", [])
                if reachable(k):
                    assert t in tiers, (i, t)
        for t in (Tier.GPU, Tier.CPU, Tier.DISK):  # nothing invented
            claimed = {d for d in digests64(list(held)) if t in idx.holders(d).get(f"w{i}", [])}
            assert claimed <= set(digests64(list(snap[t]))), (i, t)
