"""The real engine behind the worker HTTP app, in-process on the tiny Llama (CPU): chat and
completions, streaming with usage, `cached_tokens` on a repeated long prompt, /load's
measured speeds, /info's namespace digest equal to the gateway's for the same model
config, the /kv endpoints of stage 1, 429, client disconnects, shutdown, and the KV
events the worker publishes (fetched through its replay socket) rebuilding its GPU
block set in kvindex's PrefixIndex."""
from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import zmq
import zmq.asyncio

from kvindex.events import EventDecoder, seq_from_bytes, seq_to_bytes
from kvindex.index import PrefixIndex
from kvindex.keys import Namespace, digests64
from kvindex.tiers import Tier
from workers.engine.core import EngineConfig, EngineCore
from workers.engine.engine import TorchEngine
from workers.engine.model import LoadedModel, ModelSpec, load_model
from workers.engine.server import EngineWorker, ServeOptions

REPO = Path(__file__).resolve().parent.parent
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
    deadline = time.monotonic() + timeout
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


async def test_kv_endpoints_of_stage_one(worker: EngineWorker, http: aiohttp.ClientSession) -> None:
    url = worker.url
    keys = base64.b64encode(bytes(64)).decode()
    st, body = await post(http, url + "/kv/prefetch", {"prefetch_id": "p1", "keys_b64": keys})
    assert st == 501 and body["error"]["code"] == "not_supported"
    async with http.post(url + "/kv/blocks", json={"keys_b64": keys},
                         headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status == 501
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


async def test_published_events_rebuild_the_gpu_block_set(lm: LoadedModel, http: aiohttp.ClientSession) -> None:
    """A mixed workload on a small pool (evictions, shared prefixes, salts, a cancel, a purge),
    then every batch the worker published, replayed from its first sequence number."""
    w = await start(lm, block_size=4, num_blocks=48, max_num_batched_tokens=64)
    url = w.url + "/v1/completions"
    try:
        bases = [ids(10 + i, 60) for i in range(3)]
        rng = random.Random(0)

        async def one(i: int) -> None:
            base = bases[i % 3]
            body: dict[str, object] = {"prompt": base[: rng.randint(8, 60)] + ids(100 + i, rng.randint(0, 9)),
                                       "max_tokens": rng.randint(1, 8), "ignore_eos": True}
            if i % 4 == 3:
                body["cache_salt"] = "t:x"
            await post(http, url, body)

        for wave in range(3):
            await asyncio.gather(*(one(8 * wave + i) for i in range(8)))
            if wave == 1:
                await post(http, w.url + "/kv/purge", {"cache_salt": "t:x"})
        async with http.post(url, json={"prompt": ids(99, 30), "max_tokens": 100, "stream": True}) as r:
            await r.content.readline()  # cancelled mid-way
        await wait_until(lambda: not w.engine.core.seqs)
        assert w.engine.core.blocks.evicted > 0
        truth = w.engine.tiers_snapshot()[Tier.GPU]
        assert truth

        index = PrefixIndex(block_size=4)
        async with http.get(w.url + "/info") as r:
            info = await r.json()
        index.add_worker("w0", bytes.fromhex(info["namespace_digest"]), 4)
        for payload in await replay(info["events"]["replay_endpoint"]):
            st = index.apply("w0", EventDecoder().decode(payload))
            assert st.orphans == 0 and st.bad_events == 0 and st.unknown_removed == 0, st
        assert index.entries() == len(truth)
        for d in digests64(list(truth)):
            assert index.holders(d) == {"w0": [Tier.GPU]}
    finally:
        await w.stop()


async def replay(endpoint: str) -> list[bytes]:
    """Every batch the publisher still buffers, from sequence 0, in order."""
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    out: list[bytes] = []
    try:
        await dealer.send_multipart([b"", seq_to_bytes(0)])
        expect = 0
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
            seq = seq_from_bytes(frames[1])
            if seq == -1:
                return out
            assert seq == expect
            expect += 1
            out.append(frames[2])
    finally:
        dealer.close()
        ctx.term()
