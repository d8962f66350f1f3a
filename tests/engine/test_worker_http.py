"""The worker HTTP surface (docs/wire.md) over simulated workers started in-process on
free ports: OpenAI completions and chat (stream or not, ids or text), usage and the `kv`
extension, /v1/models (OpenAI SDK), /load, /info, /kv/prefetch (+ cancel, + peer pull in
and across processes), /kv/blocks auth, /kv/purge, /health, /metrics, OpenAI-shaped
errors, client disconnects, and a ZMQ subscriber receiving the worker's KV events (and
replaying them). The FastAPI side (/openapi.json, tokenizer, fields rule, direct lane):
tests/engine/test_worker_openapi.py."""
from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import openai
import pytest
import zmq
import zmq.asyncio
from hangs import patience

from kvindex.events import BlockStored, EventDecoder, seq_from_bytes, seq_to_bytes
from kvindex.keys import BlockHasher, Namespace, digests64
from workers.cluster import SimCluster
from workers.fleetkeys import peer_bearer
from workers.sim.profile import ComputeModel
from workers.sim.testing import make_profile

TOKEN = "peer-secret"
FAST = ComputeModel(
    prefill_tokens_per_s=200000.0,
    prefill_attn_s_per_token2=0.0,
    prefill_overhead_s=0.0005,
    decode_base_s=0.002,
    decode_per_seq_s=0.0,
    decode_per_ctx_token_s=0.0,
)


def profile(**kw: object):
    args = dict(
        block_size=4, gpu_blocks=40, cpu_blocks=200, remote_blocks=200, compute=FAST,
        cpu_Bps=1e7, remote_Bps=1e7, peer_Bps=1e7, latency_s=0.0005, max_context_tokens=512,
        max_num_batched_tokens=256, prefetch_queue=4,
    )
    args.update(kw)
    return make_profile(**args)  # type: ignore[arg-type]


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    c = SimCluster(2, profile(), remote_groups=1, peer_token=TOKEN)
    await c.start()
    try:
        yield c
    finally:
        await c.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, dict]:
    async with http.post(url, data=json.dumps(body), headers={"content-type": "application/json"}) as r:
        return r.status, await r.json()


async def wait_until(predicate: Callable[[], bool | Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll `predicate` (sync or async) until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + patience(timeout)
    while True:
        got = predicate()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        assert time.monotonic() < deadline, f"condition not met within {timeout} s"
        await asyncio.sleep(0.005)


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 17) % 30000 for i in range(n)]


def keys_of(info: dict, tokens: list[int], salt: str | None = None) -> list[bytes]:
    """Keys exactly as the router computes them from /info (docs/wire.md § Block keys)."""
    ns = Namespace(**info["namespace"])
    return BlockHasher.for_namespace(ns).keys_for(tokens, ns.scoped(cache_salt=salt or ""))


async def sse(http: aiohttp.ClientSession, url: str, body: dict) -> list[dict | str]:
    out: list[dict | str] = []
    async with http.post(url, json=body) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.strip()
            if not line:
                continue
            assert line.startswith(b"data: ")
            data = line[6:]
            out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def test_completions_ids_and_text_usage_and_cache(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    url = cluster.workers[0].url
    prompt = ids(1, 100)
    st, a = await post(http, url + "/v1/completions", {"model": "test/model", "prompt": prompt, "max_tokens": 7})
    assert st == 200, a
    assert a["object"] == "text_completion" and a["choices"][0]["finish_reason"] == "length"
    u = a["usage"]
    assert u["prompt_tokens"] == 100 and u["completion_tokens"] == 7 and u["total_tokens"] == 107
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    kv = u["kv"]
    assert set(kv["loaded_tokens"]) == {"GPU", "CPU", "DISK", "REMOTE", "PEER"}
    assert kv["recomputed_tokens"] == 100 and kv["ttft_ms"] > 0 and kv["decode_ms"] > 0
    for f in ("queue_ms", "load_ms", "prefill_ms", "prefetched_tokens"):
        assert f in kv
    st, b = await post(http, url + "/v1/completions", {"prompt": prompt, "max_tokens": 3})
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 96  # 24 of 25 blocks
    assert b["usage"]["kv"]["loaded_tokens"]["GPU"] == 96
    text = "hello there, simulated worker"
    st, c = await post(http, url + "/v1/completions", {"prompt": text, "max_tokens": 4})
    assert st == 200 and c["usage"]["prompt_tokens"] == len(cluster.tokenizer.encode(text))
    assert c["choices"][0]["text"] == cluster.tokenizer.filler(0, 4)[1]


async def test_chat_stream_and_not(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    url = cluster.workers[1].url
    filler = cluster.tokenizer.filler
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    st, r = await post(http, url + "/v1/chat/completions", {"messages": msgs, "max_completion_tokens": 5})
    assert st == 200
    assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant"
    assert r["choices"][0]["message"]["content"] == filler(0, 5)[1] and r["usage"]["completion_tokens"] == 5
    chunks = await sse(http, url + "/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1] == "[DONE]"
    body = [c for c in chunks if isinstance(c, dict)]
    assert all(c["object"] == "chat.completion.chunk" for c in body)
    assert body[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in body if c["choices"])
    assert text == filler(0, 6)[1]
    assert [c["choices"][0]["finish_reason"] for c in body if c["choices"]][-1] == "length"
    assert body[-1]["choices"] == [] and body[-1]["usage"]["completion_tokens"] == 6
    assert body[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # same template prefix as before
    # completions stream without usage
    chunks = await sse(http, url + "/v1/completions", {"prompt": ids(2, 30), "max_tokens": 4, "stream": True})
    body = [c for c in chunks if isinstance(c, dict)]
    assert "".join(c["choices"][0]["text"] for c in body) and all("usage" not in c for c in body)


async def test_openai_sdk(cluster: SimCluster) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.workers[0].url + "/v1", api_key="unused")
    try:
        models = await client.models.list()
        assert models.data[0].id == "test/model"
        assert (await client.models.retrieve("test/model")).id == "test/model"
        r = await client.completions.create(model="test/model", prompt=ids(3, 40), max_tokens=5)
        assert r.usage is not None and r.usage.completion_tokens == 5
        assert r.usage.prompt_tokens_details is None or r.usage.prompt_tokens_details.cached_tokens == 0
        stream = await client.chat.completions.create(
            model="test/model", messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
            if ch.usage:
                usage = ch.usage
        assert text == cluster.tokenizer.filler(0, 4)[1] and usage is not None and usage.completion_tokens == 4
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt=[1, 2, 3], max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="test/model", prompt=[1, 2, 3], max_tokens=10_000)
    finally:
        await client.close()


async def test_errors_are_openai_shaped(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    url = cluster.workers[0].url
    cases = [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, -2]}, 400, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2]]}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2], "n": 2}, 400, "n"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": "x"}, 400, "max_tokens"),
        ("/v1/completions", {"model": "other", "prompt": [1]}, 404, "model"),
        ("/v1/completions", {"prompt": ids(1, 400), "max_tokens": 200}, 400, "max_tokens"),  # > context 512
        ("/v1/completions", {"prompt": ids(1, 150), "max_tokens": 20}, 400, "prompt"),  # > 40 KV blocks
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages[0].content[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs"),
        ("/v1/completions", {"prompt": [1, 2], "echo": True}, 400, "echo"),
        ("/kv/prefetch", {"prefetch_id": "p", "keys_b64": "!!!"}, 400, "keys_b64"),
        ("/kv/prefetch", {"prefetch_id": "p", "keys_b64": base64.b64encode(b"x" * 31).decode()}, 400, "keys_b64"),
        ("/kv/prefetch", {"prefetch_id": "p", "keys_b64": "", "deadline_ms": -1}, 400, "deadline_ms"),
        ("/kv/purge", {}, 400, "cache_salt"),
    ]
    for path, body, status, param in cases:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with http.post(url + path, data=data, headers={"content-type": "application/json"}) as r:
            got = await r.json()
            assert r.status == status, (path, body, got)
            err = got["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], got
            if param:
                assert err["param"] == param, (path, body, got)
    too_large = {"prompt": ids(1, 150), "max_tokens": 20}
    st, got = await post(http, url + "/v1/completions", too_large)
    assert got["error"]["code"] == "context_length_exceeded" and "KV blocks" in got["error"]["message"]
    async with http.get(url + "/nope") as r:
        assert r.status == 404 and "error" in await r.json()
    async with http.get(url + "/v1/completions") as r:
        assert r.status == 405 and "error" in await r.json()
    async with http.delete(url + "/kv/prefetch/unknown") as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "invalid_request_error"


async def test_queue_full_is_429_with_retry_after(http: aiohttp.ClientSession) -> None:
    slow = ComputeModel(prefill_tokens_per_s=1e5, prefill_attn_s_per_token2=0, prefill_overhead_s=0.0,
                        decode_base_s=0.03, decode_per_seq_s=0, decode_per_ctx_token_s=0)
    c = SimCluster(1, profile(compute=slow, max_num_seqs=1, max_waiting=1))
    await c.start()
    try:
        url = c.workers[0].url + "/v1/completions"
        tasks = [asyncio.ensure_future(post(http, url, {"prompt": ids(i, 8), "max_tokens": 12})) for i in range(2)]

        async def one_runs_one_waits() -> bool:
            async with http.get(c.workers[0].url + "/load") as r:
                load = await r.json()
            return bool(load["running_requests"] == 1 and load["waiting_requests"] == 1)

        await wait_until(one_runs_one_waits)
        async with http.post(url, json={"prompt": ids(9, 8), "max_tokens": 2}) as r:
            assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert (await r.json())["error"]["type"] == "rate_limit_error"
        results = await asyncio.gather(*tasks)
        assert [s for s, _ in results] == [200, 200]
    finally:
        await c.stop()


async def test_disconnect_cancels(http: aiohttp.ClientSession) -> None:
    slow = ComputeModel(prefill_tokens_per_s=1e5, prefill_attn_s_per_token2=0, prefill_overhead_s=0.0,
                        decode_base_s=0.02, decode_per_seq_s=0, decode_per_ctx_token_s=0)
    c = SimCluster(1, profile(compute=slow, max_num_seqs=1))
    await c.start()
    try:
        url = c.workers[0].url + "/v1/completions"
        eng = c.workers[0].engine
        async with http.post(url, json={"prompt": ids(1, 8), "max_tokens": 100, "stream": True}) as r:
            assert r.status == 200
            await r.content.readline()  # first chunk arrived: decoding
        # a non-streaming request waiting behind another one, then abandoned
        blocker = asyncio.ensure_future(post(http, url, {"prompt": ids(2, 8), "max_tokens": 30}))
        waiting = asyncio.ensure_future(post(http, url, {"prompt": ids(3, 8), "max_tokens": 30}))
        await wait_until(lambda: eng.counts()["waiting"] == 1 and eng.counts()["decoding"] == 1)
        waiting.cancel()
        await wait_until(lambda: eng.stats.cancelled >= 2)
        assert eng.stats.cancelled == 2
        assert (await blocker)[0] == 200
    finally:
        await c.stop()


async def test_shutdown_ends_streams_with_an_error(http: aiohttp.ClientSession) -> None:
    slow = ComputeModel(prefill_tokens_per_s=1e5, prefill_attn_s_per_token2=0, prefill_overhead_s=0.0,
                        decode_base_s=0.02, decode_per_seq_s=0, decode_per_ctx_token_s=0)
    c = SimCluster(1, profile(compute=slow))
    await c.start()
    stopping = None
    try:
        async with http.post(c.workers[0].url + "/v1/completions",
                             json={"prompt": ids(1, 8), "max_tokens": 100, "stream": True}) as r:
            await r.content.readline()
            stopping = asyncio.ensure_future(c.stop())
            rest = [line.strip() async for line in r.content if line.strip()]
        assert rest[-1] == b"data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert "shutting down" in err["message"] and err["type"] == "server_error"
    finally:
        if stopping is not None:
            await stopping
        else:
            await c.stop()


async def test_load_info_health_metrics(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    w = cluster.workers[0]
    await post(http, w.url + "/v1/completions", {"prompt": ids(5, 50), "max_tokens": 3})
    async with http.get(w.url + "/info") as r:
        info = await r.json()
    assert info["worker_id"] == "w0" and info["kind"] == "kvroute" and info["engine"] == "sim"
    assert info["block_size"] == 4 and info["block_bytes"] == 128 and info["url"] == w.url
    assert info["events"] == {"endpoint": w.events_endpoint, "replay_endpoint": w.replay_endpoint, "topic": "kv"}
    assert info["remote_group"] == "rg0" and "prefetch" in info["capabilities"]
    assert info["namespace_digest"] == Namespace(**info["namespace"]).digest.hex()
    async with http.get(w.url + "/load") as r:
        load = await r.json()
    for f in ("worker_id", "ts", "waiting_requests", "waiting_prefill_tokens", "running_requests",
              "running_prefill_tokens", "est_queue_s", "blocks", "speeds", "tiers", "prefetch_queue", "max_waiting"):
        assert f in load, f
    assert load["blocks"]["GPU"]["used"] >= 12 and load["blocks"]["GPU"]["capacity"] == 40
    assert set(load["tiers"]) == {"CPU", "REMOTE", "PEER"}
    assert load["speeds"]["prefill_tokens_per_s"] == 200000.0
    async with http.get(w.url + "/health") as r:
        assert await r.json() == {"status": "ok"}
    async with http.get(w.url + "/metrics") as r:
        text = await r.text()
    for m in ("kvroute_worker_requests_total", "kvroute_worker_ttft_seconds_bucket", "kvroute_worker_blocks_used",
              "kvroute_worker_cached_tokens_total", "kvroute_worker_evicted_blocks_total",
              "kvroute_worker_est_queue_seconds"):
        assert m in text, m
    w.driver.draining = True
    async with http.get(w.url + "/health") as r:
        assert await r.json() == {"status": "draining"}
    st, err = await post(http, w.url + "/v1/completions", {"prompt": [1, 2, 3]})
    assert st == 503 and err["error"]["code"] == "draining"


async def test_prefetch_cancel_and_hit(http: aiohttp.ClientSession) -> None:
    # a slow CPU link so a second prefetch is still queued when we cancel it
    c = SimCluster(1, profile(cpu_Bps=5000.0), peer_token=TOKEN)
    await c.start()
    try:
        w = c.workers[0]
        async with http.get(w.url + "/info") as r:
            info = await r.json()
        a, b, d = ids(1, 100), ids(2, 100), ids(3, 100)
        for p in (a, b, d):  # 25 blocks each, GPU holds 40: a and b end up on CPU
            assert (await post(http, w.url + "/v1/completions", {"prompt": p, "max_tokens": 1}))[0] == 200
        ka, kb = keys_of(info, a), keys_of(info, b)
        qa, qb = (base64.b64encode(b"".join(k)).decode() for k in (ka, kb))
        st, r1 = await post(http, w.url + "/kv/prefetch", {"prefetch_id": "pa", "keys_b64": qa, "deadline_ms": 5000})
        assert st == 202 and r1["accepted_blocks"] > 0 and r1["queued"] is True
        st, r2 = await post(http, w.url + "/kv/prefetch", {"prefetch_id": "pb", "keys_b64": qb, "deadline_ms": 5000})
        assert st == 202 and r2["accepted_blocks"] > 0
        st, dup = await post(http, w.url + "/kv/prefetch",
                             {"prefetch_id": "pb", "keys_b64": base64.b64encode(ka[0]).decode()})
        assert st == 400
        async with http.delete(w.url + "/kv/prefetch/pb") as r:
            assert r.status == 200 and (await r.json())["cancelled"] is True
        async with http.get(w.url + "/load") as r:
            assert (await r.json())["prefetch_queue"] == 1
        await wait_until(lambda: w.engine.counts()["prefetches"] == 0)  # pa landed
        st, res = await post(http, w.url + "/v1/completions", {"prompt": a, "max_tokens": 1})
        kv = res["usage"]["kv"]
        assert r1["accepted_blocks"] == 25  # all of a's blocks were on CPU
        assert kv["prefetched_tokens"] == 24 * 4 and kv["load_ms"] == 0  # the last block is recomputed
        assert c.workers[0].engine.stats.prefetch_blocks_landed == r1["accepted_blocks"]
    finally:
        await c.stop()


async def test_peer_export_and_pull(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    w0, w1 = cluster.workers
    async with http.get(w0.url + "/info") as r:
        info = await r.json()
    p = ids(7, 60)
    await post(http, w0.url + "/v1/completions", {"prompt": p, "max_tokens": 1})
    keys = keys_of(info, p)
    q = base64.b64encode(b"".join(keys)).decode()
    async with http.get(w0.url + "/kv/blocks", params={"keys_b64": q}) as r:
        assert r.status == 401
    async with http.get(w0.url + "/kv/blocks", params={"keys_b64": q}, headers={"Authorization": "Bearer wrong"}) as r:
        assert r.status == 401
    raw_secret = {"Authorization": f"Bearer {TOKEN}"}  # the fleet secret is not the bearer: a token derived from it is
    async with http.get(w0.url + "/kv/blocks", params={"keys_b64": q}, headers=raw_secret) as r:
        assert r.status == 401
    hdr = {"Authorization": f"Bearer {peer_bearer(TOKEN)}"}
    async with http.get(w0.url + "/kv/blocks", params={"keys_b64": q}, headers=hdr) as r:
        got = await r.json()
    assert [b["key"] for b in got["blocks"]] == [k.hex() for k in keys] and got["missing"] == 0
    assert all(b["tier"] == "GPU" and b["bytes"] == 128 for b in got["blocks"])
    # w1 pulls them from w0 (same process: resolved directly), then serves p from them
    st, r = await post(http, w1.url + "/kv/prefetch", {"prefetch_id": "peer", "keys_b64": q,
                                                         "source_peer": {"url": w0.url, "worker_id": "w0"}})
    assert st == 202 and r["accepted_blocks"] == len(keys)
    await wait_until(lambda: w1.engine.counts()["prefetches"] == 0)
    st, res = await post(http, w1.url + "/v1/completions", {"prompt": p, "max_tokens": 1})
    assert res["usage"]["kv"]["loaded_tokens"]["PEER"] == (len(keys) - 1) * 4  # last block recomputed
    # a worker in another process (another cluster): the pull asks w0 over HTTP
    other = SimCluster(1, profile(), peer_token=TOKEN, id_prefix="x")
    await other.start()
    try:
        x0 = other.workers[0]
        st, r = await post(http, x0.url + "/kv/prefetch", {"prefetch_id": "far", "keys_b64": q,
                                                             "source_peer": {"url": w0.url, "worker_id": "w0"}})
        assert st == 202 and r["accepted_blocks"] == len(keys)
        await wait_until(lambda: x0.engine.counts()["prefetches"] == 0)
        st, res = await post(http, x0.url + "/v1/completions", {"prompt": p, "max_tokens": 1})
        assert res["usage"]["kv"]["loaded_tokens"]["PEER"] == (len(keys) - 1) * 4
        st, err = await post(http, x0.url + "/kv/prefetch", {"prefetch_id": "gone", "keys_b64": q,
                                                               "source_peer": {"url": "http://127.0.0.1:1"}})
        assert st == 400 and err["error"]["param"] == "source_peer"
    finally:
        await other.stop()


async def test_purge(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    url = cluster.workers[0].url
    p = ids(11, 40)
    for salt in ("t:one", "t:two"):
        await post(http, url + "/v1/completions", {"prompt": p, "max_tokens": 1, "cache_salt": salt})
    st, r = await post(http, url + "/kv/purge", {"cache_salt": "t:one"})
    assert st == 200 and r["purged_blocks"] == 10
    _, res = await post(http, url + "/v1/completions", {"prompt": p, "max_tokens": 1, "cache_salt": "t:one"})
    assert res["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, res = await post(http, url + "/v1/completions", {"prompt": p, "max_tokens": 1, "cache_salt": "t:two"})
    assert res["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
    st, r = await post(http, url + "/kv/purge", {"all": True})
    assert st == 200 and r["purged_blocks"] >= 20
    _, res = await post(http, url + "/v1/completions", {"prompt": p, "max_tokens": 1, "cache_salt": "t:two"})
    assert res["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_zmq_subscriber_gets_events_and_replay(cluster: SimCluster, http: aiohttp.ClientSession) -> None:
    w = cluster.workers[0]
    async with http.get(w.url + "/info") as r:
        info = await r.json()
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(info["events"]["endpoint"])
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(info["events"]["replay_endpoint"])
    warmups = iter(range(1000, 2000))

    async def subscribed() -> bool:
        """A PUB socket drops what it sends before the subscription reaches it: send
        one-block requests until the subscriber receives their events."""
        await post(http, w.url + "/v1/completions", {"prompt": ids(next(warmups), 8), "max_tokens": 1})
        return bool(await sub.poll(50))

    try:
        await wait_until(subscribed)
        p = ids(21, 50)
        await post(http, w.url + "/v1/completions", {"prompt": p, "max_tokens": 2, "cache_salt": "t:z"})
        keys = keys_of(info, p, "t:z")
        dec = EventDecoder()
        stored: list[BlockStored] = []
        while not stored:  # skip the warm-up batches: the batch that stores p's blocks
            topic, seq_b, payload = await asyncio.wait_for(sub.recv_multipart(), patience(5))
            assert topic == b"kv"
            batch = dec.decode(payload)
            stored = [e for e in batch.events if isinstance(e, BlockStored) and e.block_hashes[0] == digests64(keys)[0]]
        seq = seq_from_bytes(seq_b)
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored[0].medium == "GPU" and stored[0].block_size == 4
        hashes = [h for e in stored for h in e.block_hashes]
        toks = [t for e in stored for t in e.token_ids]
        assert hashes == digests64(keys) and toks == p[: len(keys) * 4]
        assert stored[0].parent_block_hash is None and stored[0].extra_keys[0] == ("t:z",)
        # replay from that sequence: the same batch again, then the end marker
        await dealer.send_multipart([b"", seq_to_bytes(seq)])
        frames = await asyncio.wait_for(dealer.recv_multipart(), patience(5))
        assert frames[0] == b"" and seq_from_bytes(frames[1]) == seq and frames[2] == payload
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), patience(5))
            if seq_from_bytes(frames[1]) == -1:
                assert frames[2] == b""
                break
    finally:
        sub.close()
        dealer.close()
        ctx.term()
