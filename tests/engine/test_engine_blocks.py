"""The real engine's block manager and scheduler, without a model: prefix matching by the
gateway's keys, reference counts, LRU eviction order, duplicate blocks, purge, preemption;
and the property that the KV events it publishes, applied by a subscriber (a plain set and
kvindex's PrefixIndex, through the wire codec), always rebuild exactly its block set."""
from __future__ import annotations

import random

import pytest

from kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecoder, EventEncoder, KVEvent
from kvindex.index import PrefixIndex
from kvindex.keys import BlockHasher, Namespace, digests64
from kvindex.tiers import Tier
from workers.engine.blocks import BlockManager, EvictedBlock
from workers.engine.detok import OutputText
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import KeyScope, SamplingParams, SeqStatus, Sequence
from workers.usage import Usage

BS = 4
NS = Namespace("test/model", kv_dtype="float32", block_size=BS)
HASHER = BlockHasher.for_namespace(NS)


def seq(rid: str, tokens: list[int], *, salt: str | None = None, spb: int = 0, lora: str | None = None,
        max_tokens: int = 8) -> Sequence:
    scope = KeyScope(HASHER, NS.scoped(cache_salt=salt or "", shared_prefix_blocks=spb, lora=lora))
    return Sequence(
        request_id=rid, token_ids=list(tokens), prompt_len=len(tokens), params=SamplingParams(max_tokens=max_tokens),
        scope=scope, keys=scope.prompt_keys(tokens), arrival=0.0, text=OutputText(lambda ids: "", []),
        usage=Usage(len(tokens)),
    )


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """What a step does to the bookkeeping: room for n tokens, their KV written, full blocks committed."""
    bm.grow(s, n)
    s.num_computed += n
    bm.commit(s)


def test_keys_equal_the_gateways_and_extend_over_generated_tokens() -> None:
    tokens = list(range(100, 130))
    for salt, spb, lora in ((None, 0, None), ("t:abc", 0, None), ("t:abc", 2, None), (None, 0, "ad1")):
        s = seq("a", tokens[:10], salt=salt, spb=spb, lora=lora)
        s.token_ids.extend(tokens[10:])  # generated
        want = HASHER.keys_for(tokens, NS.scoped(cache_salt=salt or "", shared_prefix_blocks=spb, lora=lora))
        assert [s.key(i) for i in range(len(tokens) // BS)] == want


def test_prefix_match_refcounts_and_lru_eviction_order() -> None:
    evicted: list[EvictedBlock] = []
    bm = BlockManager(6, BS, on_evict=evicted.extend)
    a = seq("a", list(range(13)))  # 3 full blocks + 1 token
    bm.admit(a, bm.match(a), 13)
    a.num_computed = 13
    bm.commit(a)
    assert len(bm.by_key) == 3 and bm.available() == 2
    b = seq("b", list(range(12)) + [99, 98])
    m = bm.match(b)
    assert m == a.block_table[:3]  # shared, not copied
    bm.admit(b, m, 2)
    assert all(bm.blocks[x].ref == 2 for x in m)
    bm.release(a)
    bm.release(b)
    assert bm.available() == 6 and len(bm.cached) == 3
    # the chain's tail is released first, so evicted first; the root goes last
    c = seq("c", list(range(500, 521)))
    bm.admit(c, bm.match(c), 21)
    assert [e.key for e in evicted] == [a.keys[2], a.keys[1], a.keys[0]]
    removed = [e for e in bm.take_events() if isinstance(e, BlockRemoved)]
    assert removed and removed[0].block_hashes == digests64([a.keys[2], a.keys[1], a.keys[0]])


def test_the_last_prompt_token_is_always_computed() -> None:
    bm = BlockManager(8, BS)
    a = seq("a", list(range(8)))
    bm.admit(a, [], 8)
    a.num_computed = 8
    bm.commit(a)
    assert len(bm.by_key) == 2
    b = seq("b", list(range(8)))
    assert len(bm.match(b)) == 1  # block 1 holds the last token: recomputed


def test_a_block_computed_twice_at_once_is_shared() -> None:
    bm = BlockManager(8, BS)
    a, b = seq("a", list(range(9))), seq("b", list(range(9)))
    bm.admit(a, [], 9)
    bm.admit(b, [], 9)
    for s in (a, b):  # both computed in one step, committed one after the other
        s.num_computed = 9
        bm.commit(s)
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.used() == 4  # a's 3 + b's own partial block; b's duplicates went back to the free list
    stored = [e for e in bm.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 2


def test_purge_by_salt_spares_the_shared_prefix_and_frees_in_use_blocks_later() -> None:
    bm = BlockManager(10, BS)
    s1 = seq("s1", list(range(12)), salt="t:x", spb=1)
    bm.admit(s1, [], 0)
    compute(bm, s1, 12)
    other = seq("o", list(range(40, 48)))
    bm.admit(other, [], 0)
    compute(bm, other, 8)
    bm.release(other)
    assert bm.purge("t:x", False) == 2  # blocks 1 and 2 of s1's chain; block 0 is the shared prefix
    assert bm.purge("t:nothing", False) == 0
    assert set(bm.by_key) == {s1.keys[0], *other.keys}
    assert bm.used() == 3 + 2  # s1 still holds its (now unkeyed) blocks
    s1.token_ids.extend(range(12, 16))
    compute(bm, s1, 4)  # block 3's parent was purged: not registered (it would be an orphan)
    assert s1.key(3) not in bm.by_key and not s1.registrable
    bm.release(s1)
    assert bm.used() == 1 + 2
    assert bm.purge(None, True) == 3 and not bm.by_key and bm.used() == 0
    assert isinstance(bm.take_events()[-1], AllBlocksCleared)


def test_scheduler_budget_chunks_and_preempts_the_newest() -> None:
    bm = BlockManager(6, BS)
    sch = Scheduler(bm, max_num_batched_tokens=10, max_num_seqs=8)
    a, b = seq("a", list(range(10))), seq("b", list(range(50, 56)))
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    assert [(s.request_id, n) for s, n in plan.prefills] == [("a", 10)] and not plan.decodes
    for s, n in plan.items():
        s.num_computed += n
    a.token_ids.append(1)
    plan = sch.schedule()  # a decodes (1 token), b prefills with the rest of the budget
    assert plan.decodes == [a] and [(s.request_id, n) for s, n in plan.prefills] == [("b", 6)]
    for s, n in plan.items():
        s.num_computed += n
        bm.commit(s)
    a.token_ids.extend([1, 1])
    b.token_ids.extend([2] * 9)
    for s in (a, b):
        s.num_computed = s.num_tokens - 1
    # 6 blocks: a holds 3 and needs a 4th for token 12; b holds 2 and needs 4: one must go
    plan = sch.schedule()
    assert plan.preempted == [b] and b.status is SeqStatus.WAITING and sch.waiting[0] is b
    assert b.num_computed == 0 and not b.block_table and plan.decodes == [a]


def test_full_queue_head_blocks_the_ones_behind() -> None:
    bm = BlockManager(4, BS)
    sch = Scheduler(bm, max_num_batched_tokens=100, max_num_seqs=8)
    big, small = seq("big", list(range(20))), seq("small", [1, 2])
    run = seq("run", list(range(30, 42)))
    sch.add(run)
    sch.schedule()
    sch.add(big)
    sch.add(small)
    plan = sch.schedule()
    assert not plan.admitted  # FCFS: small does not overtake big
    assert list(sch.waiting) == [big, small]


# ---------------------------------------------------------------------- events rebuild state


class Subscriber:
    """Applies the published events, through the wire codec, to a set and to a PrefixIndex."""

    def __init__(self) -> None:
        self.gpu: set[int] = set()
        self.enc, self.dec = EventEncoder(), EventDecoder()
        self.index = PrefixIndex(block_size=BS)
        self.index.add_worker("w0", NS.digest, BS)

    def apply(self, events: list[KVEvent]) -> None:
        if not events:
            return
        batch = self.dec.decode(self.enc.encode(1.0, events))
        assert not batch.errors
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                assert ev.medium == "GPU" and len(ev.token_ids) == BS * len(ev.block_hashes)
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.gpu, "orphan"
                self.gpu.update(int(h) for h in ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= self.gpu
                self.gpu.difference_update(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.gpu.clear()
        st = self.index.apply("w0", batch)
        assert st.orphans == 0 and st.bad_events == 0 and st.unknown_removed == 0, st

    def check(self, bm: BlockManager) -> None:
        truth = set(digests64(list(bm.snapshot())))
        assert self.gpu == truth
        assert self.index.entries() == len(truth)
        for d in truth:
            assert self.index.holders(d) == {"w0": [Tier.GPU]}


@pytest.mark.parametrize("seed", range(6))
def test_events_rebuild_the_block_set(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(rng.choice([12, 20]), BS)
    sch = Scheduler(bm, max_num_batched_tokens=rng.choice([6, 16]), max_num_seqs=4)
    sub = Subscriber()
    bases = [[rng.randrange(1000) for _ in range(20)] for _ in range(3)]
    n = 0
    for _ in range(150):
        k = rng.random()
        if k < 0.3 and len(sch.waiting) < 4:
            base = rng.choice(bases)
            salt = rng.choice([None, None, "t:a"])
            s = seq(f"r{n}", base[: rng.randint(1, 20)] + [rng.randrange(1000) for _ in range(rng.randint(0, 3))],
                    salt=salt, spb=rng.choice([0, 2]) if salt else 0, lora=rng.choice([None, "ad1"]),
                    max_tokens=rng.randint(1, 6))
            n += 1
            sch.add(s)
        elif k < 0.35 and sch.running:
            victim = rng.choice(sch.running)
            sch.running.remove(victim)
            bm.release(victim)
        elif k < 0.38:
            bm.purge("t:a", False)
        elif k < 0.39:
            bm.purge(None, True)
        plan = sch.schedule()
        for s, c in plan.items():
            s.num_computed += c
            bm.commit(s)
            if s.num_computed == s.num_tokens:
                s.token_ids.append(rng.randrange(1000))
                if s.num_output >= s.params.max_tokens:
                    s.status = SeqStatus.FINISHED
        for s in [s for s in sch.running if s.status is SeqStatus.FINISHED]:
            sch.running.remove(s)
            bm.release(s)
        sub.apply(bm.take_events())
        sub.check(bm)
    assert bm.stored > 0 and bm.evicted > 0
