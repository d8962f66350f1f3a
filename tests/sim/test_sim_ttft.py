"""TTFT on an idle worker follows the profile (virtual clock), per tier, hit vs miss;
a prefetch issued early enough takes the load off the critical path.

The profile is the real h200-llama3.1-8b one, with the GPU pool shrunk to exactly one
request's blocks so a second request pushes the first one's blocks down a tier.
"""
from __future__ import annotations

import dataclasses

import pytest

from kvindex.keys import BlockHasher
from kvindex.tiers import Tier
from workers.errors import RequestTooLarge
from workers.sim import RemoteStore, SimEngine, SimRequest, load_profile
from workers.sim.profile import DeviceMemory, SimProfile
from workers.sim.testing import drain

P = 8192  # prompt tokens: 512 blocks of 16; one chunk (budget 8192)
BS = 16


def profile(cpu: bool = True, disk: bool = True, remote: bool = True) -> SimProfile:
    base = load_profile("h200-llama3.1-8b")
    blocks = -(-(P + 1) // BS)  # one request's reservation
    mem = DeviceMemory(device_bytes=blocks * base.block_bytes, memory_utilization=1.0, weights_bytes=0.0)
    disk_spec = dataclasses.replace(base.disk, admit_after_uses=1) if disk else None
    return dataclasses.replace(
        base, memory=mem, cpu=base.cpu if cpu else None, disk=disk_spec, remote=base.remote if remote else None
    )


def prompt(seed: int, n: int = P) -> list[int]:
    return [(seed * 7919 + i * 31) % 100000 for i in range(n)]


class Clock:
    def __init__(self, eng: SimEngine | list[SimEngine]) -> None:
        self.engines = eng if isinstance(eng, list) else [eng]
        self.t = 0.0

    def run(self, eng: SimEngine, tokens: list[int], max_tokens: int = 1, **kw: object):
        """Submit at the current time on an idle fleet; return (ttft_s, usage)."""
        self.t = max(self.t, max(e.now for e in self.engines)) + 1.0
        out: dict[str, object] = {}
        req = SimRequest(
            f"r{self.t}", len(tokens), max_tokens, token_ids=tokens,
            on_first_token=lambda t, u: out.setdefault("ft", t),
            on_finish=lambda t, u: out.setdefault("u", u), **kw,  # type: ignore[arg-type]
        )
        start = self.t
        eng.submit(req, start)
        drain(self.engines)
        return out["ft"] - start, out["u"]  # type: ignore[operator]


def expected_prefill(comp, n: int, c: int, budget: int) -> float:
    """Chunked prefill as the profile prices it: the formula per chunk, c = context before it."""
    t = 0.0
    while n > 0:
        k = min(n, budget)
        t += comp.prefill_s(k, c)
        c += k
        n -= k
    return t


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    """Equal up to float rounding: the engine prices exactly the profile's formulas
    (measured differences are ~1e-14; a real pricing error is orders of magnitude more)."""
    return abs(a - b) <= rel * b


def load_s(prof: SimProfile, spec, blocks: int) -> float:
    return spec.latency_s + blocks * prof.block_bytes / spec.read_Bps


def test_miss_and_gpu_hit_follow_profile() -> None:
    prof = profile()
    eng = SimEngine("w0", prof)
    clk = Clock(eng)
    toks = prompt(1)
    miss, u = clk.run(eng, toks)
    assert u.recomputed_tokens == P and u.cached_tokens == 0
    assert close(miss, prof.compute.prefill_s(P, 0))
    hit, u = clk.run(eng, toks)
    cached = (P - 1) // BS * BS  # the last block is always recomputed
    assert u.loaded_tokens["GPU"] == cached and u.recomputed_tokens == P - cached
    assert close(hit, prof.compute.prefill_s(P - cached, cached))
    assert hit < miss / 20


def test_long_prompt_is_chunked() -> None:
    prof = profile()
    big = dataclasses.replace(prof, memory=dataclasses.replace(prof.memory, device_bytes=prof.memory.device_bytes * 4))
    eng = SimEngine("w0", big)
    n = 20000
    ttft, u = Clock(eng).run(eng, prompt(3, n))
    assert close(ttft, expected_prefill(big.compute, n, 0, big.scheduler.max_num_batched_tokens))


@pytest.mark.parametrize("tier", ["CPU", "DISK"])
def test_local_tier_hit_follows_profile(tier: str) -> None:
    prof = profile(cpu=tier == "CPU", disk=tier == "DISK", remote=False)
    eng = SimEngine("w0", prof)
    clk = Clock(eng)
    a, b = prompt(1), prompt(2)
    miss, _ = clk.run(eng, a)
    clk.run(eng, b)  # evicts all of a's blocks one tier down
    snap = eng.tiers_snapshot()
    assert not snap[Tier.GPU] & set(BlockHasher.for_namespace(prof.namespace()).keys_for(a, prof.namespace().scoped()))
    hit, u = clk.run(eng, a)
    blocks = (P - 1) // BS
    assert u.loaded_tokens[tier] == blocks * BS and u.loaded_tokens["GPU"] == 0
    spec = prof.cpu if tier == "CPU" else prof.disk
    expect = load_s(prof, spec, blocks) + prof.compute.prefill_s(P - blocks * BS, blocks * BS)
    assert close(hit, expect), (hit, expect)
    assert close(u.load_ms / 1000, load_s(prof, spec, blocks))
    assert hit < miss


def test_remote_hit_on_another_worker_of_the_group() -> None:
    prof = profile(cpu=False, disk=False, remote=True)
    store = RemoteStore("rg0", prof.tier_blocks(prof.remote), BS)
    w0, w1 = SimEngine("w0", prof, remote=store), SimEngine("w1", prof, remote=store)
    clk = Clock([w0, w1])
    a = prompt(1)
    clk.run(w0, a)
    clk.run(w0, prompt(2))  # a's blocks leave w0's GPU into the group's store
    hit, u = clk.run(w1, a)  # w1 never saw a
    blocks = (P - 1) // BS
    assert u.loaded_tokens["REMOTE"] == blocks * BS
    expect = load_s(prof, prof.remote, blocks) + prof.compute.prefill_s(P - blocks * BS, blocks * BS)
    assert close(hit, expect), (hit, expect)


def test_engine_recomputes_when_loading_is_slower() -> None:
    """A tier slower than recompute is not used: the engine applies the cost cut."""
    base = profile(cpu=False, disk=True, remote=False)
    slow = dataclasses.replace(base, disk=dataclasses.replace(base.disk, read_Bps=1e8))  # 100 MB/s
    eng = SimEngine("w0", slow)
    clk = Clock(eng)
    a = prompt(1)
    miss, _ = clk.run(eng, a)
    clk.run(eng, prompt(2))
    again, u = clk.run(eng, a)
    assert u.loaded_tokens["DISK"] == 0 and u.recomputed_tokens == P
    assert close(again, miss)


def test_prefetch_early_enough_hides_the_load() -> None:
    prof = profile(cpu=True, disk=False, remote=False)
    eng = SimEngine("w0", prof)
    clk = Clock(eng)
    a = prompt(1)
    clk.run(eng, a)
    clk.run(eng, prompt(2))
    ns = prof.namespace()
    keys = BlockHasher.for_namespace(ns).keys_for(a, ns.scoped())
    t = clk.t + 1.0
    assert eng.prefetch(keys, t, t + 5.0, "p1") == len(keys)
    drain(eng)  # the prefetch lands
    assert set(keys) <= eng.tiers_snapshot()[Tier.GPU]
    hit, u = clk.run(eng, a)
    blocks = (P - 1) // BS
    assert u.prefetched_tokens == blocks * BS and u.loaded_tokens["CPU"] == blocks * BS
    assert u.load_ms == 0.0
    assert close(hit, prof.compute.prefill_s(P - blocks * BS, blocks * BS))


def test_prefetch_while_queued_overlaps_the_wait() -> None:
    """The router's case: the request waits behind another one; the prefetch issued at
    dispatch runs during that wait, so TTFT = queue + prefill, no load term."""
    prof = profile(cpu=True, disk=False, remote=False)
    big = dataclasses.replace(prof, memory=dataclasses.replace(prof.memory, device_bytes=prof.memory.device_bytes * 2))
    eng = SimEngine("w0", big)
    clk = Clock(eng)
    a = prompt(1)
    clk.run(eng, a)
    clk.run(eng, prompt(2))
    clk.run(eng, prompt(3))
    clk.run(eng, prompt(6))  # a is on CPU only now
    ns = big.namespace()
    keys = BlockHasher.for_namespace(ns).keys_for(a, ns.scoped())
    assert eng.tiers_snapshot()[Tier.CPU] >= set(keys)
    t0 = clk.t + 1.0
    done: dict[str, float] = {}
    busy = SimRequest("busy", P, 1, token_ids=prompt(4), on_first_token=lambda t, u: done.setdefault("busy", t))
    eng.submit(busy, t0)
    eng.prefetch(keys, t0, t0 + 5.0, "p")
    eng.submit(SimRequest("a", P, 1, token_ids=a, on_first_token=lambda t, u: done.setdefault("a", t),
                          on_finish=lambda t, u: done.setdefault("u", u)), t0)  # type: ignore[arg-type]
    drain(eng)
    u = done["u"]
    blocks = (P - 1) // BS
    assert u.prefetched_tokens == blocks * BS and u.load_ms == 0.0  # type: ignore[attr-defined]
    # starts right after the busy request's step, with nothing left to load
    assert close(done["a"] - done["busy"], big.compute.prefill_s(P - blocks * BS, blocks * BS))
    assert load_s(big, big.cpu, blocks) < done["busy"] - t0  # the load fit inside the wait


def test_prefetch_past_its_deadline_is_dropped() -> None:
    prof = profile(cpu=True, disk=False, remote=False)
    slow = dataclasses.replace(prof, cpu=dataclasses.replace(prof.cpu, read_Bps=1e9))
    eng = SimEngine("w0", slow)
    clk = Clock(eng)
    a, b = prompt(1), prompt(2)
    clk.run(eng, a)
    clk.run(eng, b)
    clk.run(eng, prompt(5))  # a and b both on CPU
    ns = slow.namespace()
    h = BlockHasher.for_namespace(ns)
    t = clk.t + 1.0
    assert eng.prefetch(h.keys_for(b, ns.scoped()), t, t + 10.0, "first") > 0  # ~1 s on the link
    assert eng.prefetch(h.keys_for(a, ns.scoped()), t, t + 0.01, "late") > 0  # queued behind it
    drain(eng)
    assert eng.stats.prefetch_transfers_dropped == 1
    assert not set(h.keys_for(a, ns.scoped())) & eng.tiers_snapshot()[Tier.GPU]
    assert eng.cancel_prefetch("late") is False  # already over


def test_too_large_for_kv_capacity() -> None:
    prof = profile()
    eng = SimEngine("w0", prof)
    with pytest.raises(RequestTooLarge, match="KV blocks"):
        eng.submit(SimRequest("x", P, 64, token_ids=prompt(1)), 0.0)
    with pytest.raises(RequestTooLarge, match="context"):
        eng.submit(SimRequest("y", 131072, 1), 0.0)


def test_queue_estimate_prices_blocks_held_below_as_loaded() -> None:
    """A waiting request whose prefix sits in CPU will load it beside the compute: the
    queue estimate counts only its recompute as work, not the whole prompt."""
    prof = profile(cpu=True, disk=False, remote=False)
    eng = SimEngine("w0", prof)
    clk = Clock(eng)
    a = prompt(1)
    clk.run(eng, a)
    clk.run(eng, prompt(2))  # a's blocks now in CPU only
    t = clk.t + 1.0
    eng.submit(SimRequest("c", P, 1, token_ids=prompt(3)), t)  # fills the step and the pool
    eng.submit(SimRequest("a", P, 1, token_ids=a), t)  # waits, its prefix on CPU
    blocks = (P - 1) // BS
    comp = prof.compute
    expect = comp.prefill_s(P, 0) + comp.prefill_s(P - blocks * BS, blocks * BS)
    assert close(eng.estimate_queue_s(t), expect), (eng.estimate_queue_s(t), expect)
    assert eng.load_report(t).waiting_prefill_tokens == P - blocks * BS
    drain([eng])
