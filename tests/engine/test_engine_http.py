"""The real engine behind the worker HTTP app, in-process on the tiny Llama (CPU): chat and
completions, streaming with usage, `cached_tokens` on a repeated long prompt, /load's
measured speeds, /info's namespace digest equal to the gateway's for the same model
config, the /kv endpoints without and with tiers (prefetch, cancel, 429, peer export as
JSON and as records), 429, client disconnects, shutdown, and the KV events the worker
publishes (fetched through its replay socket) rebuilding its block set in every tier
(GPU alone, then GPU + CPU + DISK + REMOTE through evictions, purges and faults) in
kvindex's PrefixIndex and in a plain per-tier model."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import zmq
import zmq.asyncio
from hangs import patience

from kvindex.events import BlockRemoved, BlockStored, EventDecoder, seq_from_bytes, seq_to_bytes
from kvindex.index import PrefixIndex
from kvindex.keys import Namespace, digests64
from kvindex.tiers import Tier
from workers.api import RECORDS_MEDIA_TYPE
from workers.engine.blockio import read_records
from workers.engine.core import EngineCore
from workers.engine.engine import TorchEngine
from workers.engine.engineconfig import EngineConfig
from workers.engine.model import LoadedModel, ModelSpec, load_model
from workers.engine.sequence import SamplingParams
from workers.engine.server import EngineWorker, ServeOptions
from workers.engine.store.disk import DiskConfig
from workers.engine.testing import RedisServer, redis_binary
from workers.engine.tiers import TierConfig
from workers.fleetkeys import peer_bearer

REPO = Path(__file__).resolve().parents[2]
TOKEN = "peer-secret"


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread is faster than two fighting
    try:
        yield load_model(ModelSpec(cache_dir=Path(tmp_path_factory.getbasetemp()) / "kvroute-cache"))
    finally:
        torch.set_num_threads(threads)


async def start(lm: LoadedModel, *, calibrate: bool = False, **kw: object) -> EngineWorker:
    args: dict[str, object] = dict(num_blocks=128, max_num_batched_tokens=256, max_waiting=8)
    args.update(kw)
    engine = TorchEngine(EngineCore(lm, EngineConfig(**args)), calibrate=calibrate)  # type: ignore[arg-type]
    w = EngineWorker(engine, ServeOptions(peer_token=TOKEN))
    await w.start()
    return w


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    pytest.importorskip("redis")
    if redis_binary() is None:
        msg = "!!! REMOTE TIER TESTS SKIPPED: no redis-server on PATH; the REMOTE tier was NOT tested !!!"
        warnings.warn(msg, stacklevel=1)
        pytest.skip(msg)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
async def worker(lm: LoadedModel) -> AsyncIterator[EngineWorker]:
    w = await start(lm, calibrate=True)
    try:
        yield w
    finally:
        await w.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, dict[str, Any]]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def sse(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    async with http.post(url, json=body) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.strip()
            if line and line != b"data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + patience(timeout)
    while True:
        got = predicate()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(0.01)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


async def test_chat_completion_and_stream_with_usage(worker: EngineWorker, http: aiohttp.ClientSession) -> None:
    url = worker.url
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]
    greedy = {"max_tokens": 8, "temperature": 0}
    st, body = await post(http, url + "/v1/chat/completions", {"model": "tiny", "messages": msgs, **greedy})
    assert st == 200, body
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    text = body["choices"][0]["message"]["content"]
    assert isinstance(text, str) and body["choices"][0]["finish_reason"] in ("length", "stop")
    chunks = await sse(http, url + "/v1/chat/completions", {"messages": msgs, **greedy, "stream": True,
                                                             "stream_options": {"include_usage": True}})
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == text  # greedy: the same answer, streamed
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == body["usage"]["prompt_tokens"] and usage["completion_tokens"] >= 1
    kv = usage["kv"]
    assert set(kv["loaded_tokens"]) == {"GPU", "CPU", "DISK", "REMOTE", "PEER"}
    assert kv["ttft_ms"] > 0 and kv["prefill_ms"] > 0 and kv["queue_ms"] >= 0
    assert kv["recomputed_tokens"] + usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]


async def test_repeated_long_prompt_is_served_from_the_pool(worker: EngineWorker,
                                                            http: aiohttp.ClientSession) -> None:
    url = worker.url + "/v1/completions"
    prompt = ids(1, 200)
    st, a = await post(http, url, {"prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert st == 200 and a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    st, b = await post(http, url, {"prompt": prompt, "max_tokens": 5, "temperature": 0})
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 192  # 12 of 13 blocks: the last token is computed
    assert b["usage"]["kv"]["loaded_tokens"]["GPU"] == 192 and b["usage"]["kv"]["recomputed_tokens"] == 8
    assert b["choices"][0]["text"] == a["choices"][0]["text"]


async def test_load_speeds_and_info_digest_equal_the_gateways(worker: EngineWorker,
                                                              http: aiohttp.ClientSession) -> None:
    from router.config import build_config

    await post(http, worker.url + "/v1/completions", {"prompt": ids(2, 40), "max_tokens": 4})
    async with http.get(worker.url + "/load") as r:
        load = await r.json()
    sp = load["speeds"]
    assert sp["prefill_tokens_per_s"] > 0 and sp["decode_step_s"] > 0
    assert sp["prefill_overhead_s"] >= 0 and sp["prefill_attn_s_per_token2"] >= 0
    assert load["blocks"]["GPU"]["capacity"] == 128 and load["max_waiting"] == 8 and load["block_size"] == 16
    async with http.get(worker.url + "/info") as r:
        info = await r.json()
    assert info["engine"] == "torch" and info["capabilities"] == ["purge"] and info["events"]["replay_endpoint"]
    # the gateway configured for the bundled model through the tiny-cpu profile
    cfg = build_config({"models": [{"id": "kvroute/tiny-llama", "tokenizer": "assets/tiny-tokenizer",
                                    "profile": "tiny-cpu"}]}, REPO / "configs", environ={})
    m = cfg.models[0]
    ns = m.namespace
    gateway = Namespace(m.id, ns.revision, ns.tokenizer_revision, ns.kv_dtype, ns.parallel, ns.block_size)
    assert info["namespace_digest"] == gateway.digest.hex()
    assert info["block_bytes"] == m.cost.block_bytes


async def test_kv_endpoints_without_tiers(worker: EngineWorker, http: aiohttp.ClientSession) -> None:
    url = worker.url
    keys = base64.b64encode(bytes(64)).decode()
    st, body = await post(http, url + "/kv/prefetch", {"prefetch_id": "p1", "keys_b64": keys})
    assert st == 501 and body["error"]["code"] == "not_supported"
    async with http.post(url + "/kv/blocks", json={"keys_b64": keys},
                         headers={"Authorization": f"Bearer {peer_bearer(TOKEN)}"}) as r:
        assert r.status == 200 and (await r.json()) == {"blocks": [], "missing": 2}
    async with http.delete(url + "/kv/prefetch/p1") as r:
        assert r.status == 404
    await post(http, url + "/v1/completions", {"prompt": ids(3, 70), "max_tokens": 2, "cache_salt": "t:s"})
    await post(http, url + "/v1/completions", {"prompt": ids(4, 40), "max_tokens": 2})
    st, body = await post(http, url + "/kv/purge", {"cache_salt": "t:s"})
    assert st == 200 and body["purged_blocks"] == 4
    st, body = await post(http, url + "/kv/purge", {"all": True})
    assert body["purged_blocks"] == 2
    st, body = await post(http, url + "/v1/completions", {"prompt": ids(3, 70), "max_tokens": 2, "cache_salt": "t:s"})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_queue_full_is_429(lm: LoadedModel, http: aiohttp.ClientSession) -> None:
    w = await start(lm, max_waiting=0)
    try:
        async with http.post(w.url + "/v1/completions", json={"prompt": ids(5, 10), "max_tokens": 2}) as r:
            body = await r.json()
            assert r.status == 429 and r.headers["Retry-After"] and body["error"]["code"] == "queue_full"
    finally:
        await w.stop()


async def test_disconnect_frees_blocks(worker: EngineWorker, http: aiohttp.ClientSession) -> None:
    core = worker.engine.core
    async with http.post(worker.url + "/v1/completions",
                         json={"prompt": ids(6, 100), "max_tokens": 1000, "stream": True, "ignore_eos": True}) as r:
        assert r.status == 200
        await r.content.readline()  # decoding
        assert core.seqs
    await wait_until(lambda: not core.seqs and core.stats.cancelled == 1)
    assert all(b.ref == 0 for b in core.blocks.blocks)


async def test_shutdown_ends_streams_with_an_error(lm: LoadedModel, http: aiohttp.ClientSession) -> None:
    w = await start(lm)
    stopping = None
    try:
        async with http.post(w.url + "/v1/completions",
                             json={"prompt": ids(7, 8), "max_tokens": 1000, "stream": True, "ignore_eos": True}) as r:
            await r.content.readline()
            stopping = asyncio.ensure_future(w.stop())
            rest = [line.strip() async for line in r.content if line.strip()]
        assert rest[-1] == b"data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert "shutting down" in err["message"] and err["type"] == "server_error"
    finally:
        await (stopping if stopping is not None else w.stop())


def tier_config(tmp: Path, redis: RedisServer | None, *, block_bytes: int, cpu_blocks: int,
                disk_blocks: int, group: str = "g0") -> TierConfig:
    from workers.engine.store.remote import RedisConfig

    seg = 8 * (block_bytes + 300)  # ~8 blocks a segment: DISK evicts whole segments
    return TierConfig(cpu_bytes=cpu_blocks * block_bytes,
                      disk=DiskConfig(tmp / "disk", max(2 * seg, disk_blocks * (block_bytes + 300)),
                                      segment_bytes=seg, admit_after=1),
                      remote=RedisConfig(port=redis.port, group=group) if redis is not None else None,
                      peer_token=TOKEN)


@pytest.mark.parametrize("tiers", [False, True], ids=["gpu", "all-tiers"])
async def test_published_events_rebuild_every_tier(lm: LoadedModel, http: aiohttp.ClientSession, tiers: bool,
                                                   tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A mixed workload on small tiers (evictions cascading GPU -> CPU -> DISK, REMOTE writes,
    DISK segment evictions, shared prefixes, salts, a cancel, a purge, a corrupt DISK record
    and a REMOTE block gone behind the worker's back), then every batch the worker published,
    replayed from its first sequence number: applied to kvindex's PrefixIndex and to a
    plain per-tier set, they give exactly what each tier holds (and the stores agree)."""
    extra: dict[str, object] = {}
    redis: RedisServer | None = None
    if tiers:
        redis = request.getfixturevalue("redis")
        extra["tiers"] = tier_config(tmp_path, redis, block_bytes=4 * lm.kv.token_bytes, cpu_blocks=24,
                                     disk_blocks=20)
    w = await start(lm, block_size=4, num_blocks=48, max_num_batched_tokens=64, **extra)
    url = w.url + "/v1/completions"
    core = w.engine.core
    try:
        bases = [ids(10 + i, 60) for i in range(3)]
        rng = random.Random(0)

        async def one(i: int) -> None:
            base = bases[i % 3]
            body: dict[str, object] = {"prompt": base[: rng.randint(8, 60)] + ids(100 + i, rng.randint(0, 9)),
                                       "max_tokens": rng.randint(1, 8), "ignore_eos": True}
            if i % 4 == 3:
                body["cache_salt"] = "t:x"
            st, b = await post(http, url, body)
            assert st == 200, b

        for wave in range(4):
            await asyncio.gather(*(one(8 * wave + i) for i in range(8)))
            if wave == 1:
                await post(http, w.url + "/kv/purge", {"cache_salt": "t:x"})
            if wave == 2 and core.tiers is not None:
                await asyncio.to_thread(core.tiers.drain)
                damage(core, redis)
        async with http.post(url, json={"prompt": ids(99, 30), "max_tokens": 100, "stream": True}) as r:
            await r.content.readline()  # cancelled mid-way
        await wait_until(lambda: not core.seqs)
        if core.tiers is not None:
            await asyncio.to_thread(core.tiers.drain)
        assert core.blocks.evicted > 0
        truth = w.engine.tiers_snapshot()
        assert truth[Tier.GPU]
        if tiers:
            assert core.tiers is not None and core.tiers.disk is not None and redis is not None
            assert all(truth[t] for t in (Tier.CPU, Tier.DISK, Tier.REMOTE)), {t: len(v) for t, v in truth.items()}
            assert core.tiers.stats.evicted["CPU"] and core.tiers.disk.stats.evicted  # both cascaded further
            assert {k for k, _ in core.tiers.disk.scan()} == truth[Tier.DISK]  # the store agrees
            await asyncio.to_thread(core.tiers.reconcile_remote)  # what went behind our back (its audit)
            truth = w.engine.tiers_snapshot()
            assert redis.keys(core.tiers.remote.config.prefix.decode()) == truth[Tier.REMOTE]

        async with http.get(w.url + "/info") as r:
            info = await r.json()
        index = PrefixIndex(block_size=4)
        index.add_worker("w0", bytes.fromhex(info["namespace_digest"]), 4, remote_group=info["remote_group"])
        model: dict[str, set[int]] = {t.name: set() for t in truth}
        for payload in await replay(info["events"]["replay_endpoint"]):
            batch = EventDecoder().decode(payload)
            st = index.apply("w0", batch)
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    model[ev.medium].update(ev.block_hashes)  # type: ignore[arg-type]
                elif isinstance(ev, BlockRemoved):
                    unknown = set(ev.block_hashes) - model[ev.medium]  # type: ignore[arg-type]
                    assert not unknown, (ev.medium, unknown)  # a removal always follows its store
                    model[ev.medium].difference_update(ev.block_hashes)  # type: ignore[arg-type]
            assert st.orphans == 0 and st.bad_events == 0 and st.unknown_removed == 0, st
        for t, keys in truth.items():
            assert model[t.name] == set(digests64(list(keys))), t
        assert index.entries() == sum(len(v) for v in truth.values())
        held: dict[int, set[Tier]] = {}
        for t, keys in truth.items():
            for d in digests64(list(keys)):
                held.setdefault(d, set()).add(t)
        for d, ts in held.items():
            assert set(index.holders(d).get("w0", [])) == ts, (d, ts, index.holders(d))
        # a gateway that restarts asks for everything again: one batch rebuilds the same state
        st, body = await post(http, w.url + "/kv/republish", {})
        assert st == 200
        fresh = PrefixIndex(block_size=4)
        fresh.add_worker("w0", bytes.fromhex(info["namespace_digest"]), 4, remote_group=info["remote_group"])
        batches = await replay(info["events"]["replay_endpoint"], body["seq"])
        assert len(batches) == 1
        st = fresh.apply("w0", EventDecoder().decode(batches[0]))
        # what it cannot take: blocks still held whose parent has left every tier since (the
        # incremental index knew the parent when they were stored); every device block is there
        assert st.bad_events == 0 and fresh.entries() + st.orphans == index.entries()
        assert all(fresh.holders(d).get("w0") for d in digests64(list(truth[Tier.GPU])))
    finally:
        await w.stop()


def damage(core: EngineCore, redis: RedisServer | None) -> None:
    """A corrupt DISK record and a REMOTE block deleted behind the worker's back."""
    tiers = core.tiers
    assert tiers is not None and tiers.disk is not None and redis is not None
    for key in list(tiers.disk_keys)[:2]:
        loc = tiers.disk._index[key]
        with open(loc.seg.path, "r+b") as f:
            f.seek(loc.offset + 56 + loc.meta_len + 5)
            f.write(b"\xff\xfe")
    for key in list(tiers.remote_keys)[:2]:
        redis.client().delete(tiers.remote._name(key))


async def test_kv_endpoints_with_tiers(lm: LoadedModel, http: aiohttp.ClientSession, tmp_path: Path,
                                      redis: RedisServer) -> None:
    cfg = tier_config(tmp_path, redis, block_bytes=16 * lm.kv.token_bytes, cpu_blocks=64, disk_blocks=64,
                      group="kv-http")
    w = await start(lm, tiers=replace(cfg, prefetch_queue=1))
    url = w.url
    core = w.engine.core
    try:
        async with http.get(url + "/info") as r:
            info = await r.json()
        assert info["capabilities"] == ["prefetch", "peer_pull", "purge"] and info["remote_group"] == "kv-http"
        prompt = ids(1, 200)
        st, body = await post(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert st == 200
        keys = core.new_sequence("k", prompt, SamplingParams()).keys
        kb64 = base64.b64encode(b"".join(keys)).decode()
        auth = {"Authorization": f"Bearer {peer_bearer(TOKEN)}"}
        async with http.post(url + "/kv/blocks", json={"keys_b64": kb64, "meta": True}, headers=auth) as r:
            listing = await r.json()
        assert [b["tier"] for b in listing["blocks"]] == ["GPU"] * 12 and listing["missing"] == 0
        assert listing["blocks"][1]["meta"]["parent"] == keys[0].hex()
        async with http.post(url + "/kv/blocks", json={"keys_b64": kb64},
                             headers={**auth, "Accept": RECORDS_MEDIA_TYPE}) as r:
            assert r.status == 200 and r.headers["content-type"] == RECORDS_MEDIA_TYPE
            data = await r.read()
        mac = core.tiers.mac  # type: ignore[union-attr]
        got = list(read_records(io.BytesIO(data).read, keys, mac, core.tiers.peer_scope))  # type: ignore[union-attr]
        assert [k for k, _, _ in got] == keys and all(len(p) == core.pool.block_bytes for _, _, p in got)
        async with http.post(url + "/kv/blocks", json={"keys_b64": kb64}, headers={"Accept": RECORDS_MEDIA_TYPE}) as r:
            assert r.status == 401
        await asyncio.to_thread(_below_cpu, core)
        async with http.get(url + "/load") as r:
            load = await r.json()
        assert load["blocks"]["DISK"]["used"] == 12 and load["blocks"]["REMOTE"]["used"] == 12
        assert load["blocks"]["CPU"]["used"] == 0 and set(load["tiers"]) == {"CPU", "DISK", "REMOTE", "PEER"}
        with core.lock:  # hold the links: the first prefetch stays queued
            st, body = await post(http, url + "/kv/prefetch", {"prefetch_id": "p1", "keys_b64": kb64,
                                                               "deadline_ms": 10000})
            assert st == 202 and body == {"prefetch_id": "p1", "accepted_blocks": 12, "queued": True}
        st, body = await post(http, url + "/kv/prefetch", {"prefetch_id": "p1", "keys_b64": kb64})
        assert st in (202, 400)
        await wait_until(lambda: not core.tiers.prefetches)  # type: ignore[union-attr]
        async with http.delete(url + "/kv/prefetch/p1") as r:
            assert r.status == 404
        st, body = await post(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        kv = body["usage"]["kv"]
        assert kv["loaded_tokens"]["DISK"] == 192 and kv["prefetched_tokens"] == 192
        async with http.get(url + "/metrics") as r:
            metrics = await r.text()
        assert 'kvroute_worker_loaded_blocks_total{tier="DISK"}' in metrics
        assert 'kvroute_worker_prefetch_blocks_landed_total 12.0' in metrics
    finally:
        await w.stop()


def _below_cpu(core: EngineCore) -> None:
    assert core.tiers is not None
    with core.lock:
        core.blocks.evict_cached()
    core.tiers.drain()
    core.tiers.demote_all()


async def replay(endpoint: str, start: int = 0) -> list[bytes]:
    """Every batch the publisher still buffers, from sequence `start`, in order."""
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out: list[bytes] = []
    try:
        await dealer.send_multipart([b"", seq_to_bytes(start)])
        expect = start
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), patience(5))
            seq = seq_from_bytes(frames[1])
            if seq == -1:
                return out
            assert seq == expect
            expect += 1
            out.append(frames[2])
    finally:
        dealer.close()
        ctx.term()
