"""The real engine's tiers below the pool, on the tiny Llama: a prompt whose prefix comes
from GPU, CPU, DISK or REMOTE gives the greedy tokens and last logits of a full recompute
(on CUDA too when there is one); every fault (corrupt, truncated, missing block, a segment
whose data vanished, a full disk, Redis down, slow, or serving garbage) gives the same
correct answer by recomputing, is counted, and the bad block's removal is published; a
worker restarted over its DISK directory publishes and serves what it finds; prefetch
(queue bound, cancel, deadline, a request joining a prefetch instead of loading twice).

Needs redis-server on PATH for the REMOTE cases (skipped loudly otherwise)."""
from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_rig import BLOCK, TOKEN, _redis, below_cpu, make_core, prompt, to_cpu
from hangs import HANG_S

from kvindex.events import BlockRemoved, BlockStored, KVEvent
from kvindex.keys import digest64
from kvindex.tiers import Tier
from workers.engine.core import EngineCore
from workers.engine.engineconfig import EngineConfig
from workers.engine.model import LoadedModel, ModelSpec, load_model
from workers.engine.sequence import SamplingParams, Sequence
from workers.engine.testing import RedisServer
from workers.engine.tiers import TierConfig
from workers.errors import BadRequest, PrefetchQueueFull

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module", params=DEVICES)
def lm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is faster than two fighting
    try:
        yield load_model(ModelSpec(cache_dir=Path(tmp_path_factory.getbasetemp()) / "kvroute-cache",
                                   device=request.param, dtype="float32"))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    yield from _redis(tmp_path_factory.mktemp("redis"))


@pytest.fixture
def cores() -> Iterator[list[EngineCore]]:
    made: list[EngineCore] = []
    yield made
    for c in made:
        c.close()


def reference(lm: LoadedModel, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the prompt's last logits from plain forwards (no reuse across requests)."""
    dev = lm.device
    with torch.inference_mode():
        out = lm.model(torch.tensor([ids], device=dev), use_cache=True)
        first = out.logits[0, -1].float().cpu().clone()
        toks: list[int] = []
        for _ in range(n):
            toks.append(int(out.logits[0, -1].argmax()))
            out = lm.model(torch.tensor([[toks[-1]]], device=dev), cache=out.cache, use_cache=True)
    return toks, first


def serve(core: EngineCore, rid: str, ids: list[int], params: SamplingParams = GREEDY,
          ) -> tuple[list[int], torch.Tensor, Sequence]:
    """Run one request to the end: its tokens, the logits its first token came from, the sequence."""
    seq = core.new_sequence(rid, ids, params)
    with core.lock:
        core.add(seq)
    got: torch.Tensor | None = None
    toks: list[int] = []
    deadline = time.monotonic() + 60
    while rid in core.seqs:
        assert time.monotonic() < deadline, "request did not finish"
        with core.wake:
            plan = core.schedule()
            while plan.empty and core.scheduler.loading:
                core.wake.wait(0.05)
                plan = core.schedule()
        if plan.empty:
            continue
        res = core.execute(plan)
        if got is None and seq in res.logits:
            got = res.logits[seq].float().cpu().clone()
        with core.lock:
            toks += [t for u in core.commit(plan, res) if u.seq is seq for t in u.token_ids]
    assert got is not None
    return toks, got, seq


def events(core: EngineCore) -> list[KVEvent]:
    with core.lock:
        return core.take_events()


def removed(evs: list[KVEvent], medium: str) -> set[int]:
    return {h for e in evs if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes}  # type: ignore[misc]


def stored(evs: list[KVEvent], medium: str) -> set[int]:
    return {h for e in evs if isinstance(e, BlockStored) and e.medium == medium for h in e.block_hashes}  # type: ignore[misc]


def counter(core: EngineCore, name: str, tier: str = "") -> float:
    assert core.tiers is not None
    return core.tiers.counters().get(name, {}).get(tier, 0.0)


BASE = prompt(1, 520)
IDS = BASE[:496] + prompt(2, 37)  # 31 blocks of BASE's prefix, then 37 new tokens


def warm(core: EngineCore) -> list[bytes]:
    """Compute BASE once (its blocks registered on GPU); the 31 keys a request for IDS reuses."""
    serve(core, "warm", BASE)
    return core.new_sequence("k", IDS, GREEDY).keys[:31]


def check_exact(lm: LoadedModel, toks: list[int], logits: torch.Tensor, ids: list[int] = IDS) -> None:
    ref_toks, ref_logits = reference(lm, ids, GREEDY.max_tokens)
    assert toks == ref_toks
    tol = 1e-4 if lm.device.type == "cpu" else 1e-3
    assert torch.allclose(logits, ref_logits, atol=tol), (logits - ref_logits).abs().max()


# ---------------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("tier", ["GPU", "CPU", "DISK", "REMOTE"])
def test_prefix_from_each_tier_equals_full_recompute(lm: LoadedModel, tier: str, tmp_path: Path,
                                                     request: pytest.FixtureRequest,
                                                     cores: list[EngineCore]) -> None:
    redis = request.getfixturevalue("redis") if tier == "REMOTE" else None
    core = make_core(lm, tmp_path, disk=tier == "DISK", redis=redis)
    cores.append(core)
    warm(core)
    if tier == "CPU":
        to_cpu(core)
    elif tier in ("DISK", "REMOTE"):
        below_cpu(core)
    assert core.tiers is not None
    snap = core.tiers.snapshot()
    assert tier == "GPU" or not core.blocks.by_key
    if tier in ("DISK", "REMOTE"):
        assert not snap[Tier.CPU] and len(snap[Tier[tier]]) == 32
    toks, logits, seq = serve(core, "b", IDS)
    u = seq.usage
    assert u.loaded_tokens[tier] == 496 and u.recomputed_tokens == 37 and u.cached_tokens == 496
    assert (u.load_ms > 0) == (tier != "GPU")
    check_exact(lm, toks, logits)
    if tier != "GPU":
        assert counter(core, "loaded_blocks", tier) == 31


def test_offload_events_and_cascade_order(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> None:
    """GPU eviction: BlockStored(CPU) before BlockRemoved(GPU); CPU eviction writes DISK first
    (BlockStored(DISK)) and then drops the CPU copy; children go before their parents."""
    core = make_core(lm, tmp_path, disk=True, cpu_blocks=40)
    cores.append(core)
    keys = warm(core)
    events(core)
    to_cpu(core)
    evs = events(core)
    kinds = [(type(e).__name__, getattr(e, "medium", None)) for e in evs]
    assert kinds.index(("BlockStored", "CPU")) < kinds.index(("BlockRemoved", "GPU"))
    assert stored(evs, "CPU") == removed(evs, "GPU")
    serve(core, "other", prompt(5, 400))  # 25 blocks more: the CPU tier (40) overflows
    to_cpu(core)
    evs = events(core)
    gone_cpu = removed(evs, "CPU")
    assert gone_cpu and gone_cpu <= stored(evs, "DISK") | {digest64(k) for k in core.tiers.disk_keys}  # type: ignore[union-attr]
    assert digest64(keys[0]) not in gone_cpu  # the chain's root is the most recent: it stays


def test_chain_leaving_the_pool_in_two_evictions_through_a_full_cpu_tier_keeps_every_block(
        lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> None:
    """BASE's 32 blocks leave the device pool children first, in two evictions (the last 10,
    then the other 22) through a CPU tier of 12 blocks: making room for the second batch
    writes the first batch down to DISK, the boundary block (a child of a block of the
    batch still being offloaded) included. No block may be lost there: the whole chain
    stays below the pool, the events say so, and a request reuses all 31 shared blocks."""
    core = make_core(lm, tmp_path, disk=True, cpu_blocks=12)
    cores.append(core)
    keys = warm(core)
    chain = core.new_sequence("k", BASE, GREEDY).keys[:32]
    assert core.tiers is not None
    with core.lock:
        assert core.blocks.evict_cached(10) == 10  # the tail: blocks 22..31
    assert core.tiers.drain()
    to_cpu(core)  # blocks 0..21, parents first, evicting 22..31 from CPU to DISK
    evs = events(core)
    snap = core.tiers.snapshot()
    below = snap[Tier.CPU] | snap[Tier.DISK]
    assert [i for i, k in enumerate(chain) if k not in below] == []
    assert not removed(evs, "DISK") and stored(evs, "DISK") == {digest64(k) for k in snap[Tier.DISK]}
    assert core.tiers.stats.offload_dropped == 0
    toks, logits, seq = serve(core, "b", IDS)
    assert seq.usage.cached_tokens == 496 and seq.usage.recomputed_tokens == 37
    assert seq.usage.loaded_tokens["CPU"] + seq.usage.loaded_tokens["DISK"] == 496
    check_exact(lm, toks, logits)
    assert keys == chain[:31]


# ---------------------------------------------------------------------------------- faults


def disk_loc(core: EngineCore, key: bytes) -> Any:
    assert core.tiers is not None and core.tiers.disk is not None
    return core.tiers.disk._index[key]


def on_disk_only(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> tuple[EngineCore, list[bytes]]:
    core = make_core(lm, tmp_path, disk=True)
    cores.append(core)
    keys = warm(core)
    below_cpu(core)
    events(core)
    return core, keys


def served_from_disk_before(core: EngineCore, lm: LoadedModel, n_blocks: int) -> Sequence:
    toks, logits, seq = serve(core, "b", IDS)
    check_exact(lm, toks, logits)
    assert seq.usage.loaded_tokens["DISK"] == n_blocks * BLOCK
    assert seq.usage.recomputed_tokens == len(IDS) - n_blocks * BLOCK
    return seq


def test_corrupt_disk_block_is_a_miss(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> None:
    core, keys = on_disk_only(lm, tmp_path, cores)
    loc = disk_loc(core, keys[10])
    with open(loc.seg.path, "r+b") as f:  # one bit of the payload flipped (bit rot)
        pos = loc.offset + 56 + loc.meta_len + 1000
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))
    served_from_disk_before(core, lm, 10)
    assert counter(core, "store_checksum_errors", "DISK") == 1
    assert removed(events(core), "DISK") == {digest64(keys[10])}
    assert counter(core, "load_fallback_blocks", "DISK") == 21


def test_truncated_disk_segment_is_a_miss(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> None:
    core, keys = on_disk_only(lm, tmp_path, cores)
    last = max(range(31), key=lambda i: disk_loc(core, keys[i]).offset)  # the record written last
    loc = disk_loc(core, keys[last])
    os.truncate(loc.seg.path, loc.offset + 100)  # the index (metadata) survives, the data does not
    served_from_disk_before(core, lm, last)
    assert counter(core, "store_truncated", "DISK") == 1
    assert removed(events(core), "DISK") == {digest64(keys[last])}


def test_vanished_segment_is_a_miss(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> None:
    core, keys = on_disk_only(lm, tmp_path, cores)
    os.unlink(disk_loc(core, keys[0]).seg.path)  # everything was in one segment
    served_from_disk_before(core, lm, 0)
    assert counter(core, "store_io_errors", "DISK") == 1
    assert {digest64(k) for k in keys} <= removed(events(core), "DISK")
    assert core.tiers is not None and not core.tiers.disk_keys


def test_full_disk_is_a_miss(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.engine.store import disk as disk_mod

    def enospc(*a: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    core = make_core(lm, tmp_path, disk=True)
    cores.append(core)
    warm(core)
    monkeypatch.setattr(disk_mod.os, "pwritev", enospc)
    below_cpu(core)
    evs = events(core)
    assert not stored(evs, "DISK") and removed(evs, "CPU")  # nothing reached DISK; CPU still made room
    assert counter(core, "store_io_errors", "DISK") >= 1
    monkeypatch.undo()
    served_from_disk_before(core, lm, 0)


def test_restart_over_the_same_disk_directory(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> None:
    first = make_core(lm, tmp_path, disk=True)
    keys = warm(first)
    below_cpu(first)
    first.close()
    core = make_core(lm, tmp_path, disk=True)
    cores.append(core)
    evs = events(core)
    assert stored(evs, "DISK") == {digest64(k) for k in first.tiers.disk_keys}  # type: ignore[union-attr]
    assert {digest64(k) for k in keys} <= stored(evs, "DISK")
    served_from_disk_before(core, lm, 31)


def on_remote_only(lm: LoadedModel, tmp_path: Path, redis: RedisServer,
                   cores: list[EngineCore]) -> tuple[EngineCore, list[bytes]]:
    core = make_core(lm, tmp_path, redis=redis)
    cores.append(core)
    keys = warm(core)
    below_cpu(core)
    events(core)
    return core, keys


def remote_name(core: EngineCore, key: bytes) -> bytes:
    assert core.tiers is not None
    return core.tiers.remote._name(key)  # type: ignore[no-any-return]


def served_from_remote_before(core: EngineCore, lm: LoadedModel, n_blocks: int) -> Sequence:
    toks, logits, seq = serve(core, "b", IDS)
    check_exact(lm, toks, logits)
    assert seq.usage.loaded_tokens["REMOTE"] == n_blocks * BLOCK
    assert seq.usage.recomputed_tokens == len(IDS) - n_blocks * BLOCK
    return seq


def test_corrupt_remote_value_is_a_miss(lm: LoadedModel, tmp_path: Path, redis: RedisServer,
                                        cores: list[EngineCore]) -> None:
    core, keys = on_remote_only(lm, tmp_path, redis, cores)
    raw = redis.client()
    name = remote_name(core, keys[7])
    value = bytearray(raw.get(name))
    value[-5 - 32] ^= 0xFF  # in the payload, before the 32-byte MAC: bit rot the crc catches
    raw.set(name, bytes(value))
    served_from_remote_before(core, lm, 7)
    assert counter(core, "store_checksum_errors", "REMOTE") == 1
    assert digest64(keys[7]) in removed(events(core), "REMOTE")
    assert not raw.exists(name)


def test_missing_remote_block_is_a_miss(lm: LoadedModel, tmp_path: Path, redis: RedisServer,
                                        cores: list[EngineCore]) -> None:
    core, keys = on_remote_only(lm, tmp_path, redis, cores)
    redis.client().delete(remote_name(core, keys[20]))  # expired / evicted by the server
    served_from_remote_before(core, lm, 20)
    assert digest64(keys[20]) in removed(events(core), "REMOTE")


@pytest.mark.parametrize("fault", ["slow", "down"])
def test_remote_down_or_slow_is_a_miss(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore], fault: str) -> None:
    gen = _redis(tmp_path / "own")
    server = next(gen)
    try:
        core, keys = on_remote_only(lm, tmp_path, server, cores)
        if fault == "slow":
            server.pause()  # accepts, never answers: every call times out (0.2 s)
        else:
            server.stop()  # connection refused
        t0 = time.monotonic()
        served_from_remote_before(core, lm, 0)
        assert time.monotonic() - t0 < HANG_S  # a miss: the paused server would never answer
        assert counter(core, "store_io_errors", "REMOTE") >= 1
        for i in range(3):  # consecutive failures open the breaker: then REMOTE is not even tried
            toks, logits, seq = serve(core, f"n{i}", prompt(40 + i, 200))
            check_exact(lm, toks, logits, prompt(40 + i, 200))
        assert counter(core, "store_breaker_trips", "REMOTE") >= 1
        assert core.tiers is not None and core.tiers.remote.breaker.is_open
    finally:
        server.resume() if fault == "slow" else None
        gen.close()


# ---------------------------------------------------------------------------------- prefetch


def test_load_report_counts_blocks_held_below_as_loaded_not_computed(lm: LoadedModel, tmp_path: Path,
                                                                    cores: list[EngineCore]) -> None:
    """/load's `waiting_prefill_tokens` and the queue estimate leave out a waiting request's
    leading blocks held in a lower tier at its arrival: they are loaded beside the compute
    (docs/wire.md; the simulated worker counts them the same way)."""
    core = make_core(lm, tmp_path)
    cores.append(core)
    warm(core)
    to_cpu(core)
    seq = core.new_sequence("w", IDS, GREEDY)
    with core.lock:
        core.add(seq)
        rep = core.load_report()
    assert rep.waiting_prefill_tokens == len(IDS) - 31 * BLOCK


def test_prefetch_then_request_counts_prefetched_tokens(lm: LoadedModel, tmp_path: Path,
                                                        cores: list[EngineCore]) -> None:
    core, keys = on_disk_only(lm, tmp_path, cores)
    assert core.tiers is not None
    with core.lock:
        assert core.tiers.prefetch("p1", keys, 5.0) == 31
        with pytest.raises(BadRequest):
            core.tiers.prefetch("p1", keys, 5.0)
    assert core.tiers.drain()
    assert not core.tiers.prefetches and counter(core, "prefetch_blocks_landed") == 31
    assert {digest64(k) for k in keys} <= stored(events(core), "GPU")
    hits = core.tiers.disk.stats.hits  # type: ignore[union-attr]
    toks, logits, seq = serve(core, "b", IDS)
    check_exact(lm, toks, logits)
    u = seq.usage
    assert u.loaded_tokens["DISK"] == 496 and u.prefetched_tokens == 496 and u.loaded_tokens["GPU"] == 0
    assert core.tiers.disk.stats.hits == hits  # type: ignore[union-attr]  # nothing read twice
    with core.lock:
        assert core.tiers.prefetch("p2", keys, 5.0) == 0  # all on GPU already


def test_request_joins_a_prefetch_in_flight(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> None:
    core, keys = on_disk_only(lm, tmp_path, cores)
    assert core.tiers is not None
    link = core.tiers.links[Tier.DISK]
    hits = core.tiers.disk.stats.hits  # type: ignore[union-attr]
    with core.lock:  # the prefetch is queued (the link is held up by the lock) when the request arrives
        assert core.tiers.prefetch("p", keys, 30.0) == 31
        assert link.queued() == 1
    toks, logits, seq = serve(core, "b", IDS)
    check_exact(lm, toks, logits)
    assert seq.usage.loaded_tokens["DISK"] == 496 and seq.usage.prefetched_tokens == 496
    assert core.tiers.disk.stats.hits - hits == 31  # type: ignore[union-attr]  # one read per block


def test_a_request_waiting_for_room_starts_when_a_prefetch_lands(lm: LoadedModel, tmp_path: Path,
                                                                 cores: list[EngineCore],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's order on a worker with a small pool: a prefetch takes 31 of its 40
    blocks, then the request arrives and cannot be admitted until they land (joining the
    prefetch it would need them twice). The engine thread sleeps meanwhile; the landing
    must wake it, or the request waits for the next arrival, however long that is."""
    import threading

    from workers.engine.loop import EngineThread

    core = make_core(lm, tmp_path, disk=True, num_blocks=40)
    cores.append(core)
    keys = warm(core)
    below_cpu(core)
    tiers = core.tiers
    assert tiers is not None and tiers.disk is not None
    get = tiers.disk.get

    def slow_get(key: bytes) -> Any:  # the engine thread has gone to sleep before the blocks land
        time.sleep(0.01)
        return get(key)

    monkeypatch.setattr(tiers.disk, "get", slow_get)
    done = threading.Event()
    thread = EngineThread(core, lambda ups: [done.set() for u in ups if u.finished])
    thread.start()
    try:
        with core.lock:
            assert tiers.prefetch("p", keys, 30.0) == 31
        seq = core.new_sequence("b", IDS, GREEDY)
        thread.submit(seq)
        assert done.wait(20), f"request not started: {seq.status}, prefetches in flight {len(tiers.prefetches)}"
    finally:
        thread.stop()
    assert seq.usage.prefetched_tokens == 496 and seq.usage.loaded_tokens["DISK"] == 496


def test_prefetch_queue_bound_cancel_and_deadline(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> None:
    core = make_core(lm, tmp_path, disk=True, prefetch_queue=1)
    cores.append(core)
    keys = warm(core)
    below_cpu(core)
    tiers = core.tiers
    assert tiers is not None
    with core.lock:  # nothing moves while we hold the lock
        assert tiers.prefetch("a", keys[:10], 30.0) == 10
        with pytest.raises(PrefetchQueueFull) as e:
            tiers.prefetch("b", keys[10:], 30.0)
        assert e.value.status == 429
        assert tiers.cancel_prefetch("a") and not tiers.cancel_prefetch("a") and not tiers.cancel_prefetch("zz")
    assert tiers.drain()
    assert counter(core, "prefetch_blocks_landed") == 0 and not core.blocks.by_key
    with core.lock:  # its turn comes after its deadline
        assert tiers.prefetch("c", keys, 0.001) == 31
        time.sleep(0.01)
    assert tiers.drain()
    assert counter(core, "prefetch_transfers_dropped") == 1 and counter(core, "prefetch_blocks_landed") == 0
    assert core.blocks.available() == core.blocks.num_blocks  # every block it held came back


# ---------------------------------------------------------------------------------- peers


async def peer_worker(lm: LoadedModel) -> Any:
    """Worker A: serves HTTP, exports its blocks to holders of the peer token."""
    from workers.engine.engine import TorchEngine
    from workers.engine.server import EngineWorker, ServeOptions

    core = EngineCore(lm, EngineConfig(num_blocks=96, max_num_batched_tokens=512,
                                       tiers=TierConfig(peer_token=TOKEN)))
    w = EngineWorker(TorchEngine(core, calibrate=False), ServeOptions(peer_token=TOKEN))
    await w.start()
    return w


async def test_prefix_pulled_from_a_peer_equals_full_recompute(lm: LoadedModel, tmp_path: Path,
                                                               cores: list[EngineCore]) -> None:
    import asyncio

    import aiohttp

    from workers.api import PeerRef, PrefetchSpec
    from workers.engine.engine import TorchEngine

    a = await peer_worker(lm)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(a.url + "/v1/completions", json={"prompt": BASE, "max_tokens": 1}) as r:
                assert r.status == 200
        core = make_core(lm, tmp_path, peer_token=TOKEN)
        cores.append(core)
        b = TorchEngine(core, calibrate=False)  # not started: this test steps its core itself
        keys = core.new_sequence("k", IDS, GREEDY).keys[:31]
        bad = TorchEngine(make_core(lm, tmp_path / "x", peer_token="wrong"), calibrate=False)
        with pytest.raises(BadRequest):  # a peer refusing our token is a 400 naming source_peer
            await bad.prefetch(PrefetchSpec("p0", keys, 5.0, PeerRef(a.url)))
        await bad.close()
        res = await b.prefetch(PrefetchSpec("p1", keys, 5.0, PeerRef(a.url, "w0")))
        assert res.accepted_blocks == 31 and res.queued
        assert await asyncio.to_thread(core.tiers.drain)  # type: ignore[union-attr]
        assert counter(core, "prefetch_blocks_landed") == 31 and counter(core, "peer_errors") == 0
        assert {digest64(k) for k in keys} <= stored(events(core), "GPU")
        toks, logits, seq = await asyncio.to_thread(serve, core, "b", IDS)
        check_exact(lm, toks, logits)
        u = seq.usage
        assert u.loaded_tokens["PEER"] == 496 and u.prefetched_tokens == 496 and u.recomputed_tokens == 37
        assert a.engine.core.tiers.stats.peer_exported_blocks == 31
        assert core.load_report().tiers["PEER"].read_Bps > 0
        await b.close()
    finally:
        await a.stop()


async def test_a_corrupt_peer_stream_is_a_miss(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    import aiohttp

    from workers.api import PeerRef, PrefetchSpec
    from workers.engine.engine import TorchEngine

    a = await peer_worker(lm)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(a.url + "/v1/completions", json={"prompt": BASE, "max_tokens": 1}) as r:
                assert r.status == 200
        from workers.engine import engine as engine_mod

        real = engine_mod.record_of

        def damaged(k: bytes, m: bytes, p: bytes) -> bytes:  # bit rot on the wire, in block 20
            rec = real(k, m, p)
            return rec[:-1] + bytes([rec[-1] ^ 1]) if k == bad_key else rec

        monkeypatch.setattr(engine_mod, "record_of", damaged)
        core = make_core(lm, tmp_path, peer_token=TOKEN)
        cores.append(core)
        keys = core.new_sequence("k", IDS, GREEDY).keys[:31]
        bad_key = keys[20]
        b = TorchEngine(core, calibrate=False)
        assert (await b.prefetch(PrefetchSpec("p", keys, 5.0, PeerRef(a.url)))).accepted_blocks == 31
        assert await asyncio.to_thread(core.tiers.drain)  # type: ignore[union-attr]
        assert counter(core, "peer_errors") == 1 and counter(core, "prefetch_blocks_landed") == 20
        toks, logits, seq = await asyncio.to_thread(serve, core, "b", IDS)
        check_exact(lm, toks, logits)
        assert seq.usage.loaded_tokens["PEER"] == 320 and seq.usage.recomputed_tokens == len(IDS) - 320
        await b.close()
    finally:
        await a.stop()


# ---------------------------------------------------------------------------------- command line


def test_tier_flags(tmp_path: Path) -> None:
    from workers.cli import _parser
    from workers.engine.args import check_arguments
    from workers.engine.server import tier_config

    def parse(*flags: str) -> Any:
        return _parser().parse_args(["engine", "--port", "0", *flags])

    assert tier_config(parse()) is None  # stage 1's engine: GPU only
    a = parse("--disk-dir", str(tmp_path / "d"), "--remote-url", "redis://:pw@10.0.0.5:6380/2", "--remote-group", "rg1",
              "--disk-admit-after", "1", "--prefetch-queue", "4", "--peer-token", "t", "--remote-write", "cpu-evict")
    assert check_arguments(a) is None
    cfg = tier_config(a)
    assert cfg is not None and cfg.cpu_bytes == 1 << 30  # a CPU tier by default when DISK or REMOTE is asked for
    assert cfg.disk is not None and cfg.disk.path == tmp_path / "d" and cfg.disk.admit_after == 1
    r = cfg.remote
    assert (r.host, r.port, r.db, r.password, r.group) == ("10.0.0.5", 6380, 2, "pw", "rg1")
    assert cfg.prefetch_queue == 4 and cfg.peer_token == "t" and cfg.remote_write == "cpu-evict"
    assert check_arguments(parse("--cpu-bytes", "0", "--disk-dir", "x")) is not None
    assert check_arguments(parse("--remote-url", "http://x")) is not None
    only_peer = tier_config(parse("--peer-token", "t"))
    assert only_peer is not None and only_peer.cpu_bytes == 0 and only_peer.enabled


async def test_prefetch_from_remote_through_the_engine(lm: LoadedModel, tmp_path: Path, redis: RedisServer,
                                                      cores: list[EngineCore]) -> None:
    """The engine asks the REMOTE server which blocks it holds (its own writes included) and
    raises them; the request then counts them as REMOTE and prefetched."""
    import asyncio

    from workers.api import PrefetchSpec
    from workers.engine.engine import TorchEngine

    core, keys = on_remote_only(lm, tmp_path, redis, cores)
    eng = TorchEngine(core, calibrate=False)
    res = await eng.prefetch(PrefetchSpec("r1", keys, 5.0))
    assert res.accepted_blocks == 31
    assert await asyncio.to_thread(core.tiers.drain)  # type: ignore[union-attr]
    toks, logits, seq = await asyncio.to_thread(serve, core, "b", IDS)
    check_exact(lm, toks, logits)
    assert seq.usage.loaded_tokens["REMOTE"] == 496 and seq.usage.prefetched_tokens == 496


# ---------------------------------------------------------------------------------- forged shared KV


def _forged_kv(core: EngineCore, seed: int) -> bytes:
    """Well-formed wrong KV: a block's size and dtype, finite values a model could produce."""
    g = torch.Generator().manual_seed(seed)
    block = torch.randn(core.pool.data.shape[1:], generator=g, dtype=core.pool.data.dtype)
    return block.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_forged_remote_block_is_a_miss(lm: LoadedModel, tmp_path: Path, redis: RedisServer,
                                       cores: list[EngineCore]) -> None:
    """Someone who can write to the shared Redis but has no fleet secret replaces block 7 by a
    valid record (layout, key, meta, both crcs) of wrong KV: it is not served, it is counted
    and deleted, and the output is a full recompute's from there."""
    from workers.engine.store.mac import MAC_SIZE, BlockMac
    from workers.engine.store.record import decode, encode

    core, keys = on_remote_only(lm, tmp_path, redis, cores)
    raw = redis.client()
    name = remote_name(core, keys[7])
    real = decode(raw.get(name)[:-MAC_SIZE], keys[7])
    wrong = _forged_kv(core, 7)
    assert core.tiers is not None
    scope = core.tiers.remote.scope
    tag = BlockMac("a guessed secret").tag(scope, keys[7], real.meta, wrong)
    raw.set(name, encode(keys[7], real.meta, wrong) + tag)
    served_from_remote_before(core, lm, 7)
    assert counter(core, "block_mac_failures", "REMOTE") == 1
    assert counter(core, "store_checksum_errors", "REMOTE") == 0  # the crcs were valid: only the MAC caught it
    assert digest64(keys[7]) in removed(events(core), "REMOTE")
    assert not raw.exists(name)


async def _forging_peer(records: dict[bytes, bytes]) -> tuple[Any, str]:
    """An HTTP peer that lists `records`' keys on /kv/blocks and streams their records."""
    import base64

    from aiohttp import web

    from workers.api import RECORDS_MEDIA_TYPE

    async def blocks(request: web.Request) -> web.Response:
        raw = base64.b64decode((await request.json())["keys_b64"])
        keys = [raw[i : i + 32] for i in range(0, len(raw), 32)]
        held = []
        for k in keys:
            if k not in records:
                break
            held.append(k)
        if request.headers.get("Accept", "").startswith(RECORDS_MEDIA_TYPE):
            return web.Response(body=b"".join(records[k] for k in held), content_type=RECORDS_MEDIA_TYPE)
        return web.json_response({"blocks": [{"key": k.hex(), "tier": "GPU", "bytes": 0} for k in held]})

    app = web.Application()
    app.router.add_post("/kv/blocks", blocks)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_forged_peer_block_is_a_miss(lm: LoadedModel, tmp_path: Path, cores: list[EngineCore]) -> None:
    """A peer answers /kv/blocks with the real records of blocks 0-19 (tagged by a worker of
    the fleet) and from block 20 on well-formed records of wrong KV tagged without the fleet
    secret: the first 20 land, the forged one is counted and never lands, and the output is
    a full recompute's from there."""
    import asyncio

    from workers.api import PeerRef, PrefetchSpec
    from workers.engine.engine import TorchEngine
    from workers.engine.store.mac import BlockMac
    from workers.engine.store.record import encode

    src = make_core(lm, tmp_path / "src", peer_token=TOKEN)  # a fleet member: the genuine records
    cores.append(src)
    keys = warm(src)
    assert src.tiers is not None
    genuine = await asyncio.to_thread(src.tiers.export, keys)
    assert len(genuine) == 31
    forger = BlockMac("not the fleet secret")
    records = {}
    for j, (k, m, p, tag) in enumerate(genuine):
        if j >= 20:
            p = _forged_kv(src, j)
            tag = forger.tag(src.tiers.peer_scope, k, m, p)
        records[k] = encode(k, m, p) + tag
    runner, url = await _forging_peer(records)
    try:
        core = make_core(lm, tmp_path, peer_token=TOKEN)
        cores.append(core)
        b = TorchEngine(core, calibrate=False)  # not started: this test steps its core itself
        assert (await b.prefetch(PrefetchSpec("p", keys, 5.0, PeerRef(url)))).accepted_blocks == 31
        assert await asyncio.to_thread(core.tiers.drain)  # type: ignore[union-attr]
        assert counter(core, "block_mac_failures", "PEER") == 1 and counter(core, "prefetch_blocks_landed") == 20
        toks, logits, seq = await asyncio.to_thread(serve, core, "b", IDS)
        check_exact(lm, toks, logits)
        assert seq.usage.loaded_tokens["PEER"] == 320 and seq.usage.recomputed_tokens == len(IDS) - 320
        await b.close()
    finally:
        await runner.cleanup()


def test_remote_needs_the_fleet_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a fleet secret REMOTE is refused in code, and the worker's flags turn it off
    (with a warning) rather than share unauthenticated KV."""
    from workers.cli import _parser
    from workers.engine.server import tier_config
    from workers.engine.store.remote import RedisConfig

    with pytest.raises(ValueError, match="fleet secret"):
        TierConfig(cpu_bytes=1 << 20, remote=RedisConfig())
    a = _parser().parse_args(["engine", "--port", "0", "--remote-url", "redis://127.0.0.1:6379"])
    monkeypatch.delenv("KVROUTE_PEER_TOKEN", raising=False)
    cfg = tier_config(a)
    assert cfg is not None and cfg.remote is None and cfg.cpu_bytes == 1 << 30
