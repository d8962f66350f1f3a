"""PrefixIndex with trusted digests (our workers): same answers as the verified path,
drift caught by sampled verification, fallbacks, and bad input never raising."""
from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    EventDecoder,
    EventEncoder,
    LazyBlockStored,
)
from kvindex.index import IndexError_, PrefixIndex, PrefixMatch
from kvindex.keys import BlockHasher, Namespace, digests64
from kvindex.tiers import Tier
from workers.errors import EngineError
from workers.sim import RemoteStore, SimEngine, SimRequest
from workers.sim.testing import drain, make_profile

BS = 4
NS = Namespace("m", block_size=BS)
HASHER = BlockHasher.for_namespace(NS)
ENC = EventEncoder()


def toks(seed: int, n_blocks: int) -> list[int]:
    return [(seed * 7_919 + i * 31) % 60_000 for i in range(n_blocks * BS)]


def published(
    tokens: list[int], lo: int, hi: int, ns: Namespace = NS, medium: str = "GPU", strip_extra: bool = False, **kw
) -> BlockStored:
    """What one of our workers keyed under `ns` publishes for blocks [lo, hi) (docs/wire.md)."""
    ds = digests64(BlockHasher(ns.digest, BS).keys_for(tokens[: hi * BS], ns))
    extra = None if strip_extra else ns.extra_keys(hi)
    return BlockStored(
        ds[lo:hi],
        ds[lo - 1] if lo else None,
        tokens[lo * BS : hi * BS],
        BS,
        None,
        medium,
        ns.lora,
        extra[lo:hi] if extra is not None else None,
        **kw,
    )


def wire(events: list, lazy: bool = True):
    return EventDecoder(lazy=lazy).decode(ENC.encode(1.0, events))


def stats(idx: PrefixIndex, wid: str):
    return next(s for s in idx.worker_stats() if s.worker_id == wid)


def full_keys(idx: PrefixIndex) -> int:
    return sum(map(len, idx._blocks.full_keys))


# ----------------------------------------------------------------------------- basics


def test_trusted_blocks_apply_without_keys_or_engine_map():
    t = toks(1, 6)
    ds = digests64(HASHER.keys(t))
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("o", NS.digest, BS, trusted_digests=True)
    batch = wire([published(t, 0, 3), published(t, 3, 6, medium="CPU")])
    assert [type(e) for e in batch.events] == [LazyBlockStored, LazyBlockStored]
    st_ = idx.apply("o", batch)
    assert (st_.stored, st_.digests_verified, st_.digest_mismatches, st_.bad_events) == (6, 1, 0, 0)
    assert idx.match(ds)["o"] == PrefixMatch("o", 6, ((Tier.GPU, 3), (Tier.CPU, 3)))
    assert full_keys(idx) == 0 and stats(idx, "o").engine_map == 0
    assert idx.trusts_digests("o") and not idx.trusts_digests("nobody")
    # removal by digest, copies to another tier
    idx.apply("o", wire([published(t, 0, 2, medium="DISK"), BlockRemoved(ds[:3], "GPU")]))
    assert idx.match(ds)["o"].runs == ((Tier.DISK, 2),)
    assert stats(idx, "o").blocks == {"GPU": 0, "CPU": 3, "DISK": 2, "REMOTE": 0}


def test_salted_and_lora_chains_verify_against_router_keys():
    """The sampled check recomputes with the event's extra keys, as the router scopes them."""
    t = toks(2, 6)
    scoped = NS.scoped(lora="ad", tenant_salt="tenant", cache_salt="c", shared_prefix_blocks=2)
    router = digests64(HASHER.keys_for(t, scoped))
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("o", NS.digest, BS, trusted_digests=True, verify_every=1)
    st_ = idx.apply("o", wire([published(t, 0, 4, scoped), published(t, 4, 6, scoped)]))
    assert (st_.digests_verified, st_.digest_mismatches) == (1, 0)
    assert idx.match(router)["o"].blocks == 6
    assert idx.match(digests64(HASHER.keys(t))) == {}


def test_sampling_is_one_root_in_n_starting_with_the_first():
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("o", NS.digest, BS, trusted_digests=True, verify_every=4)
    verified = []
    for i in range(10):
        t = toks(100 + i, 3)
        st_ = idx.apply("o", [published(t, 0, 2), published(t, 2, 3)])  # a root and a child
        verified.append(st_.digests_verified)
    assert verified == [1, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    assert stats(idx, "o").digests_verified == 3
    # a malformed sampled root gives no verdict: the next root is checked instead
    t = toks(200, 2)
    bad = published(t, 0, 2)
    short = BlockStored(bad.block_hashes, None, bad.token_ids[:-1], BS, None, "GPU", None)
    idx.apply("o", [published(toks(201, 1), 0, 1)] * 2)  # roots 10, 11 pass
    st_ = idx.apply("o", [short, published(t, 0, 2)])  # root 12 due: malformed, then 13 checked
    assert (st_.bad_events, st_.digests_verified, st_.stored) == (1, 1, 2)
    # after a clear (restart, resync) the next root is checked again
    idx.apply("o", [published(toks(202, 1), 0, 1), AllBlocksCleared(), published(toks(203, 1), 0, 1)])
    assert stats(idx, "o").digests_verified == 5
    with pytest.raises(IndexError_, match="verify_every"):
        idx.add_worker("x", NS.digest, BS, trusted_digests=True, verify_every=0)


# ----------------------------------------------------------------------------- drift


DRIFTS = {
    "revision": Namespace("m", revision="r2", block_size=BS),
    "kv_dtype": Namespace("m", kv_dtype="fp8", block_size=BS),
    "parallel": Namespace("m", parallel="tp2", block_size=BS),
    "block_size_field": Namespace("m", block_size=2 * BS),  # keyed at 4 but says 8 in its namespace
    # a publisher bug rather than a drift: keys salted, the salt left out of extra_keys
    "unpublished_salt": NS.scoped(cache_salt="s"),
}


@pytest.mark.parametrize("drift", list(DRIFTS))
def test_drifted_namespace_is_caught_dropped_and_switched_to_verified(drift):
    wrong = DRIFTS[drift]
    good, bad = toks(3, 4), toks(4, 4)
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("o", NS.digest, BS, trusted_digests=True, verify_every=3)
    idx.add_worker("other", NS.digest, BS, trusted_digests=True)
    idx.apply("other", [published(good, 0, 4)])
    # a healthy start (root 0 verified), then the worker comes back misconfigured
    assert idx.apply("o", wire([published(good, 0, 4)])).digests_verified == 1
    strip = drift == "unpublished_salt"
    drifted = [published(toks(10 + i, 2), 0, 2, wrong, strip_extra=strip) for i in range(3)]
    st1 = idx.apply("o", wire(drifted[:2]))  # roots 1, 2: not sampled, applied as published
    assert (st1.stored, st1.digest_mismatches) == (4, 0)
    later = [published(bad, 0, 2, wrong, strip_extra=strip), published(bad, 2, 4, wrong, strip_extra=strip)]
    st2 = idx.apply("o", wire([drifted[2], *later]))  # root 3: sampled, mismatch; then keyed
    assert st2.digest_mismatches == 1 and st2.digests_verified == 1
    s = stats(idx, "o")
    assert s.digest_mismatches == 1 and not s.trusted_digests and not idx.trusts_digests("o")
    # every entry of the worker was dropped, good ones included; other workers untouched
    assert "o" not in idx.match(digests64(HASHER.keys(good)))
    assert idx.match(digests64(HASHER.keys(good)))["other"].blocks == 4
    # from now on its events are keyed from their tokens under the registered namespace
    assert idx.match(digests64(HASHER.keys(bad)))["o"].blocks == 4
    assert stats(idx, "o").engine_map == 6 and st2.stored == 6  # the mismatching event too
    more = toks(5, 3)
    st3 = idx.apply("o", wire([published(more, 0, 3, wrong, strip_extra=strip)], lazy=False))
    assert st3.digests_verified == 0 and st3.digest_mismatches == 0 and st3.stored == 3
    assert idx.match(digests64(HASHER.keys(more)))["o"].blocks == 3


def test_non_root_events_are_not_verified_but_applied():
    t = toks(6, 6)
    ds = digests64(HASHER.keys(t))
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("o", NS.digest, BS, trusted_digests=True, verify_every=1)
    assert idx.apply("o", [published(t, 0, 2)]).digests_verified == 1
    # a child whose digests do not match its tokens, and whose tokens are not even ints:
    # the lazy decoder never looks at them, and a non-root event is never recomputed
    fake = [d ^ 0xABCDEF for d in ds[2:4]]
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": fake, "parent_block_hash": ds[1],
                "token_ids": ["not", "tokens"], "block_size": BS, "medium": "GPU"}], None]
    )  # fmt: skip
    batch = EventDecoder(lazy=True).decode(payload)
    assert not batch.errors and type(batch.events[0]) is LazyBlockStored
    with pytest.raises(EventDecodeError):
        batch.events[0].materialize()
    st_ = idx.apply("o", batch)
    assert (st_.stored, st_.digests_verified, st_.digest_mismatches, st_.bad_events) == (2, 0, 0, 0)
    assert idx.match(ds[:2] + fake)["o"].blocks == 4
    assert idx.trusts_digests("o")
    # the eager decoder refuses that event outright
    assert EventDecoder().decode(payload).errors


# ----------------------------------------------------------------------------- fallbacks


def test_unexpected_events_of_a_trusted_worker_take_the_verified_path():
    t = toks(7, 8)
    ds = digests64(HASHER.keys(t))
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("o", NS.digest, 2 * BS, trusted_digests=True)
    # engine block size 2x the index's: split and keyed, the engine hash mapped
    big = BlockStored([111, 222], None, t[: 4 * BS], 2 * BS, None, "GPU", None)
    assert idx.apply("o", wire([big])).stored == 2
    assert stats(idx, "o").engine_map == 2 and idx.match(ds)["o"].blocks == 4
    # bytes hashes, negative ints, a mix: keyed from tokens
    for i, hashes in enumerate(([b"\x01" * 32], [-5], [ds[4], b"x"])):
        lo = 4 + i
        ev = BlockStored(hashes, 222 if i == 0 else None, t[lo * BS : (lo + len(hashes)) * BS], BS, None, "CPU", None)
        st_ = idx.apply("o", wire([ev]))
        assert st_.bad_events == 0, hashes
    assert idx.match(ds)["o"].blocks == 5  # block 4 chained from the mapped engine block 222
    assert full_keys(idx) >= 5 and idx.trusts_digests("o")
    # a lazy event whose deferred fields are garbage, on the verified path: a bad event
    lazy = LazyBlockStored([1], None, msgspec.Raw(b"\xc1"), 2 * BS)
    assert idx.apply("o", [lazy]).bad_events == 1


def test_mixed_fleet_parents_are_per_publisher():
    """A vLLM worker chains from the blocks it keyed itself even where a trusted worker
    indexed them first (no full key there); a non-trusted worker of ours cannot chain
    from a parent that only trusted workers stored."""
    t = toks(8, 4)
    ds = digests64(HASHER.keys(t))
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("o", NS.digest, BS, trusted_digests=True)
    idx.add_worker("v", NS.digest, BS)
    idx.add_worker("x", NS.digest, BS)  # ours, not trusted
    idx.apply("o", [published(t, 0, 2)])
    assert full_keys(idx) == 0
    assert idx.apply("x", [published(t, 2, 3)]).orphans == 1
    assert idx.apply("v", [BlockStored([71, 72], None, t[: 2 * BS], BS, None, "GPU", None)]).stored == 2
    assert full_keys(idx) == 2  # the vLLM worker's keying stored the full keys
    assert idx.apply("v", [BlockStored([73, 74], 72, t[2 * BS :], BS, None, "GPU", None)]).stored == 2
    assert idx.match(ds)["v"].blocks == 4
    assert idx.apply("x", [published(t, 2, 3)]).stored == 1  # now a keyed live parent exists
    # removing the vLLM copies forgets their keys only when nobody holds the digest
    idx.apply("v", [BlockRemoved([71, 72, 73, 74], "GPU")])
    assert idx.match(ds)["o"].blocks == 2 and "x" not in idx.match(ds)
    assert full_keys(idx) == 3  # blocks 0, 1 (held by o) and 2 (x) keep theirs; 3 is gone
    idx.apply("o", [BlockRemoved(ds[:2], "GPU")])
    idx.apply("x", [BlockRemoved(ds[2:3], "GPU")])
    assert len(idx) == 0 and full_keys(idx) == 0


# ----------------------------------------------------------------------------- simulated engines


def _workload(seed: int, ops: int = 120):
    """Two simulated engines (our real publisher: keys from kvindex.keys) feeding a
    verified index and a trusted one through the wire codec; yields after every batch."""
    rng = random.Random(seed)
    prof = make_profile(
        block_size=BS,
        gpu_blocks=rng.choice([24, 40]),
        cpu_blocks=rng.choice([0, 12]),
        disk_blocks=rng.choice([0, 16]),
        remote_blocks=24,
        max_num_batched_tokens=32,
        max_waiting=6,
        prefetch_queue=3,
    )
    ns = prof.namespace()
    hasher = BlockHasher.for_namespace(ns)
    store = RemoteStore("rg0", prof.tier_blocks(prof.remote), BS)
    verified, trusted = PrefixIndex(BS, max_workers=4), PrefixIndex(BS, max_workers=4)
    for i in range(2):
        verified.add_worker(f"w{i}", ns.digest, BS, "rg0")
        trusted.add_worker(f"w{i}", ns.digest, BS, "rg0", trusted_digests=True, verify_every=2)
    eager, lazy = EventDecoder(), EventDecoder(lazy=True)
    probes: list[list[int]] = []
    seen: set[int] = set()
    batches = [0]

    def on_events(i: int, events: list) -> None:
        payload = ENC.encode(1.0, events)
        a, b = eager.decode(payload), lazy.decode(payload)
        assert not a.errors and not b.errors
        sa, sb = verified.apply(f"w{i}", a), trusted.apply(f"w{i}", b)
        assert sb.digest_mismatches == 0 and sb.bad_events == 0
        assert (sa.stored, sa.removed, sa.orphans, sa.unknown_removed) == (
            sb.stored, sb.removed, sb.orphans, sb.unknown_removed,
        )  # fmt: skip
        for ev in a.events:
            if isinstance(ev, (BlockStored, BlockRemoved)):
                seen.update(ev.block_hashes)
        batches[0] += 1
        for ds in probes[-12:]:
            assert trusted.match(ds) == verified.match(ds)

    engines = [SimEngine(f"w{i}", prof, remote=store, on_events=(lambda ev, i=i: on_events(i, ev))) for i in range(2)]
    bases = [[rng.randrange(5000) for _ in range(40)] for _ in range(4)]
    t = 0.0
    for n in range(ops):
        t += rng.expovariate(40.0)
        for e in engines:
            e.advance(t)
        k = rng.random()
        e = engines[rng.randrange(2)]
        if k < 0.6:
            base = rng.choice(bases)
            prompt = base[: rng.randint(1, len(base))] + [rng.randrange(5000) for _ in range(rng.randint(0, 6))]
            salt = rng.choice([None, None, "t:a"])
            lora = rng.choice([None, None, "ad1"])
            spb = rng.choice([0, 2]) if salt else 0
            probes.append(digests64(hasher.keys_for(prompt, ns.scoped(lora=lora, cache_salt=salt or "",
                                                                       shared_prefix_blocks=spb))))  # fmt: skip
            req = SimRequest(f"r{n}", len(prompt), rng.randint(1, 4), token_ids=prompt, cache_salt=salt,
                             lora=lora, shared_prefix_blocks=spb)  # fmt: skip
            try:
                e.submit(req, t)
            except EngineError:
                pass
        elif k < 0.8:
            keys = hasher.keys_for(rng.choice(bases)[: rng.randint(4, 40)], ns.scoped())
            try:
                e.prefetch(keys, t, t + rng.uniform(0.0, 0.05), f"p{n}", source=rng.choice([None, engines[0]]))
            except EngineError:
                pass
        elif k < 0.83:
            e.purge("t:a")
        elif k < 0.85:
            e.purge(None, everything=True)
    drain(engines)
    return verified, trusted, probes, seen, batches[0]


@pytest.mark.parametrize("seed", range(6))
def test_trusted_equals_verified_on_simulated_engine_streams(seed):
    verified, trusted, probes, seen, batches = _workload(seed)
    assert batches > 20 and len(seen) > 20
    for ds in probes:
        assert trusted.match(ds) == verified.match(ds)
        for lo in (1, 2):
            assert trusted.match(ds[lo:]) == verified.match(ds[lo:])
    for d in seen:
        assert trusted.holders(d) == verified.holders(d)
    assert trusted.entries() == verified.entries() and len(trusted) == len(verified)
    for a, b in zip(verified.worker_stats(), trusted.worker_stats(), strict=True):
        assert a.blocks == b.blocks and (a.stored, a.removed, a.orphans) == (b.stored, b.removed, b.orphans)
        assert b.trusted_digests and b.digests_verified > 0 and b.digest_mismatches == 0
        assert a.engine_map == b.engine_map == 0
    assert full_keys(trusted) == 0 < full_keys(verified)


# ----------------------------------------------------------------------------- fuzz

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=4)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)
_hashes = st.lists(st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=4), max_size=4)
_stored = st.fixed_dictionaries(
    {"type": st.just("BlockStored")},
    optional={
        "block_hashes": _hashes | _values,
        "parent_block_hash": st.none() | st.integers(0, 2**64 - 1) | st.binary(max_size=4),
        "token_ids": st.lists(st.integers(-5, 2**33), max_size=12) | _values,
        "block_size": st.sampled_from([BS, 2 * BS, 3, 0, -BS]) | _values,
        "medium": st.none() | st.sampled_from(["GPU", "CPU", "REMOTE", "tape"]) | _values,
        "lora_name": st.none() | st.text(max_size=3),
        "lora_id": st.none() | st.integers(0, 3),
        "extra_keys": st.none() | st.lists(st.none() | st.lists(_values, max_size=2), max_size=3) | _values,
        "group_idx": st.none() | st.integers(0, 1),
    },
)
_event = st.one_of(
    _stored,
    st.fixed_dictionaries({"type": st.just("BlockRemoved"), "block_hashes": _hashes | _values}),
    st.just({"type": "AllBlocksCleared"}),
    st.lists(_values, max_size=6).map(lambda xs: ["BlockStored", *xs]),
    _values,
)


@settings(max_examples=200, deadline=None)
@given(batches=st.lists(st.lists(_event, max_size=5), max_size=5), verify_every=st.integers(1, 3))
def test_fuzzed_batches_never_break_a_trusted_worker(batches, verify_every):
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("o", NS.digest, BS, "g", trusted_digests=True, verify_every=verify_every)
    dec = EventDecoder(lazy=True)
    for events in batches:
        try:
            batch = dec.decode(msgspec.msgpack.encode([1.0, events, None]))
        except EventDecodeError:
            continue
        idx.apply("o", batch)  # never raises
        assert idx.entries() >= 0
    # still indexing correctly afterwards (trusted or, after a mismatch, verified)
    idx.apply("o", [AllBlocksCleared()])
    t = toks(9, 3)
    assert idx.apply("o", wire([published(t, 0, 3)])).stored == 3
    assert idx.match(digests64(HASHER.keys(t)))["o"].blocks == 3


@settings(max_examples=150, deadline=None)
@given(
    hashes=_hashes | _values,
    parent=_values,
    tokens=_values | st.lists(st.integers(0, 99), min_size=BS, max_size=3 * BS),
    block_size=_values | st.just(BS),
    medium=_values,
    extra=_values,
)
def test_python_built_events_with_any_field_types_never_raise(hashes, parent, tokens, block_size, medium, extra):
    idx = PrefixIndex(BS, max_workers=4)
    idx.add_worker("o", NS.digest, BS, trusted_digests=True, verify_every=1)
    evs = [
        BlockStored(hashes, parent, tokens, block_size, None, medium, None, extra),
        BlockStored(hashes, None, tokens, BS, None, "GPU", None),
        BlockRemoved(hashes, medium),
    ]
    raw = msgspec.Raw(msgspec.msgpack.encode(tokens))
    evs.append(LazyBlockStored(hashes, parent, raw, block_size, None, medium))  # type: ignore[arg-type]
    idx.apply("o", evs)  # never raises
    idx.apply("o", [BlockRemoved(hashes, "GPU")])
