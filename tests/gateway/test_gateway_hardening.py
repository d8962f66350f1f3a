"""The gateway under failure and abuse, with scriptable fake workers: health decided by
probes (not by a slow `/load` under load), the circuit breaker, first-byte and idle
timeouts, requests on a worker that dies, overload answered with 429, deep JSON, an
early 413 on a reused connection, and error texts that name no worker."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import pytest
from fakes import FakeWorker
from gateway_fleet import DIGEST, MODEL, _cfg, client, fleet, wait_until
from hangs import patience


def _pool(**over: Any) -> dict[str, Any]:
    base = {"load_poll_interval_s": 0.05, "health_interval_s": 0.1, "unhealthy_after": 2, "probe_timeout_s": 0.3}
    return {**base, **over}


async def test_a_failing_load_poll_never_marks_a_worker_dead() -> None:
    busy = FakeWorker("a", DIGEST, load={"waiting_requests": "not a number"})  # /load unreadable
    async with fleet([busy], _cfg(pool=_pool(unhealthy_min_s=0.0))) as (gw, url):
        w = gw.pool.workers["a"]
        await asyncio.sleep(1.0)  # ~20 failed polls, ~10 passed health probes
        assert w.state.value == "healthy" and "/load" in w.last_error
        r = await client(url).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert r.choices[0].text


async def test_health_probes_must_fail_long_enough() -> None:
    a = FakeWorker("a", DIGEST)
    async with fleet([a], _cfg(pool=_pool(unhealthy_min_s=1.0))) as (gw, _):
        w = gw.pool.workers["a"]
        a.health_status = 500
        t0 = time.monotonic()
        await wait_until(lambda: w.state.value == "unhealthy", 5.0, "unhealthy")
        assert time.monotonic() - t0 >= 1.0  # three failed probes within 0.3 s were not enough


async def test_the_breaker_takes_a_failing_worker_out_and_brings_it_back() -> None:
    bad, good = FakeWorker("bad", DIGEST, fail_status=500), FakeWorker("good", DIGEST)
    cfg = _cfg(pool=_pool(breaker_failures=2, breaker_open_s=0.5), routing={"policy": "round_robin", "retries": 1})
    async with fleet([bad, good], cfg) as (gw, url):
        c = client(url)
        for _ in range(6):
            assert (await c.completions.create(model=MODEL, prompt="hi", max_tokens=1)).choices[0].text
        w = gw.pool.workers["bad"]
        assert w.state.value == "healthy" and w.breaker.trips >= 1  # alive, cache kept, out of routing
        assert len(bad.completions) <= 3
        assert gw.pool.routable(MODEL) == [gw.pool.workers["good"]]
        bad.fail_status = None
        await asyncio.sleep(0.6)  # half-open: tried again
        for _ in range(6):
            await c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert w.breaker.fails == 0 and len(gw.pool.routable(MODEL)) == 2


async def test_every_worker_failing_is_a_429_not_a_5xx() -> None:
    a, b = FakeWorker("a", DIGEST, fail_status=500), FakeWorker("b", DIGEST, fail_status=502)
    cfg = _cfg(pool=_pool(breaker_failures=1, breaker_open_s=5.0))
    async with fleet([a, b], cfg) as (_, url):
        c = client(url)
        with pytest.raises(openai.InternalServerError):  # the first one relays both workers' failures
            await c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        with pytest.raises(openai.RateLimitError) as ei:
            await c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert ei.value.code == "workers_failing" and int(ei.value.response.headers["retry-after"]) >= 1


async def test_a_worker_that_never_answers_is_replaced_before_the_first_byte() -> None:
    hung, good = FakeWorker("hung", DIGEST, first_delay_s=60.0), FakeWorker("good", DIGEST)
    cfg = _cfg(pool=_pool(first_byte_min_s=0.5, first_byte_factor=1.0), routing={"policy": "round_robin",
                                                                                 "retries": 1})
    async with fleet([hung, good], cfg) as (gw, url):
        t0 = time.monotonic()
        for _ in range(2):
            r = await client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert r.choices[0].text
        assert time.monotonic() - t0 < hung.first_delay_s / 2 and len(hung.completions) == 1  # not its own 60 s
        assert gw.metrics.upstream_errors.labels("hung", "first_byte_timeout")._value.get() == 1


async def test_a_stream_that_stalls_ends_with_an_error_event() -> None:
    stall = FakeWorker("stall-worker-9", DIGEST, stall_after_chunks=1)
    async with fleet([stall], _cfg(pool=_pool(idle_timeout_s=0.5))) as (_, url):
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 5, "stream": True}) as r:
            body = (await r.read()).decode()
        assert time.monotonic() - t0 < 30.0  # the idle timeout ended it: the fake stalls for ever
        assert '"error"' in body and body.rstrip().endswith("data: [DONE]")
        assert _error_text(body) and "stall-worker-9" not in _error_text(body)


def _error_text(sse: str) -> str:
    import json

    for line in sse.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            return str(json.loads(line[6:])["error"]["message"])
    return ""


async def test_requests_on_a_worker_that_dies_are_retried() -> None:
    slow, good = FakeWorker("slow", DIGEST, first_delay_s=60.0), FakeWorker("good", DIGEST)
    cfg = _cfg(pool=_pool(unhealthy_after=1, unhealthy_min_s=0.0), routing={"policy": "round_robin", "retries": 1})
    async with fleet([slow, good], cfg) as (gw, url):
        task = asyncio.ensure_future(client(url).completions.create(model=MODEL, prompt="x", max_tokens=1))
        await wait_until(lambda: slow.completions or good.completions, 5.0, "dispatch")
        if good.completions:  # round robin picked the good one first: send another
            task2 = asyncio.ensure_future(client(url).completions.create(model=MODEL, prompt="y", max_tokens=1))
            await wait_until(lambda: slow.completions, 5.0, "dispatch to the slow one")
            await task
            task = task2
        slow.health_status = 500  # its /health fails: unhealthy, its in-flight request ends now
        r = await asyncio.wait_for(task, patience(10.0))
        assert r.choices[0].text and gw.pool.workers["slow"].state.value == "unhealthy"


async def test_deep_json_is_a_400_on_gateway_and_worker() -> None:
    deep = b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    a = FakeWorker("a", DIGEST)
    async with fleet([a]) as (_, url):
        async with aiohttp.ClientSession() as s:
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/admin/route/explain"):
                async with s.post(url + path, data=deep, headers={"content-type": "application/json"}) as r:
                    assert r.status == 400, (path, r.status, await r.text())


async def test_an_early_413_does_not_break_a_reused_connection() -> None:
    a = FakeWorker("a", DIGEST)
    cfg = _cfg(limits={"max_body_bytes": 1000})
    async with fleet([a], cfg) as (_, url):
        conn = aiohttp.TCPConnector(limit=1)  # one connection, reused
        async with aiohttp.ClientSession(connector=conn) as s:
            big = b'{"model": "x", "prompt": "' + b"a" * 200_000 + b'"}'
            async with s.post(url + "/v1/completions", data=big) as r:
                assert r.status == 413
            async with asyncio.timeout(10):
                async with s.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}) as r:
                    assert r.status == 200


async def test_error_texts_name_no_worker() -> None:
    a = FakeWorker("worker-secret-7", DIGEST, fail_status=500)
    async with fleet([a]) as (_, url):
        with pytest.raises(openai.InternalServerError) as ei:
            await client(url).completions.create(model=MODEL, prompt="hi", max_tokens=1)
        text = str(ei.value.body)
        assert "worker-secret-7" not in text and "127.0.0.1" not in text and "retry failed" not in text


# --------------------------------------------------------------------------- tenants and admission

TENANTS = [{"id": "a", "api_keys": ["sk-tenant-a-0001"]}, {"id": "b", "api_keys": ["sk-tenant-b-0002"]}]


async def test_one_tenants_text_never_hits_anothers_tokenization_cache() -> None:
    cfg = _cfg(tenants=TENANTS, admin_token="admin-token-0001")
    async with fleet([FakeWorker("w", DIGEST)], cfg) as (gw, url):
        tok = gw.models.get(MODEL).tokenizer
        secret = "the launch code is " + "seven " * 40
        await client(url, "sk-tenant-a-0001").completions.create(model=MODEL, prompt=secret, max_tokens=1)
        hits = tok.cache.stats.hit_tokens
        await client(url, "sk-tenant-b-0002").completions.create(model=MODEL, prompt=secret, max_tokens=1)
        assert tok.cache.stats.hit_tokens == hits  # tenant B gets no hit on tenant A's text
        await client(url, "sk-tenant-a-0001").completions.create(model=MODEL, prompt=secret, max_tokens=1)
        assert tok.cache.stats.hit_tokens > hits  # tenant A does


async def test_metrics_can_require_a_token() -> None:
    cfg = _cfg(observability={"metrics_token": "metrics-secret-1"})
    async with fleet([FakeWorker("w", DIGEST)], cfg) as (_, url):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/metrics") as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_metrics_token"
            async with s.get(url + "/metrics", headers={"authorization": "Bearer metrics-secret-1"}) as r:
                assert r.status == 200 and "kvroute_requests" in await r.text()


async def test_an_open_admin_api_answers_local_clients_of_a_local_gateway_only() -> None:
    import httpx

    from router.api.app import GatewayAPI

    async with fleet([FakeWorker("w", DIGEST)]) as (gw, _):
        app = GatewayAPI(gw, manage_lifespan=False)
        for client_host, status in (("127.0.0.1", 200), ("10.1.2.3", 403)):
            transport = httpx.ASGITransport(app=app, client=(client_host, 5555))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
                assert (await c.get("/admin/workers")).status_code == status
        gw.cfg.listen.host = "0.0.0.0"  # a gateway reachable from elsewhere: no open admin API at all
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5555))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            assert (await c.get("/admin/workers")).status_code == 403


@pytest.mark.parametrize("worker,status,where", [
    ({"url": "http://user:pw@127.0.0.1:9"}, 400, "credentials"),
    ({"url": "http://127.0.0.1:9/steal?x=1"}, 400, "bare origin"),
    ({"url": "file:///etc/passwd"}, 400, "http(s)"),
    ({"url": "http://169.254.169.254"}, 403, "outside the networks"),
    ({"url": "http://8.8.8.8:80"}, 403, "outside the networks"),
    ({"url": "http://127.0.0.1:9", "events": {"endpoint": "ipc:///tmp/kvroute-owned"}}, 400, "tcp://"),
    ({"url": "http://127.0.0.1:9", "events": {"endpoint": "tcp://127.0.0.1:5999", "bind": True}}, 400, "bind"),
])
async def test_the_admin_api_adds_only_safe_workers(worker: dict[str, Any], status: int, where: str) -> None:
    async with fleet([FakeWorker("w", DIGEST)]) as (gw, url):
        async with aiohttp.ClientSession() as s, s.post(url + "/admin/workers", json={"id": "x", **worker}) as r:
            err = (await r.json())["error"]
            assert r.status == status and where in err["message"], err
        assert "x" not in gw.pool.workers


async def test_a_prompt_too_long_by_its_characters_is_refused_unread() -> None:
    async with fleet([FakeWorker("w", DIGEST)]) as (gw, url):  # max_context_tokens 512
        threaded = gw.tokenization.threaded
        with pytest.raises(openai.BadRequestError) as ei:
            await client(url).completions.create(model=MODEL, prompt="word " * 300_000, max_tokens=1)
        assert ei.value.code == "context_length_exceeded" and "characters" in ei.value.message
        assert gw.tokenization.threaded == threaded  # nothing was tokenized


async def test_the_body_budget_answers_429_when_full() -> None:
    slow = FakeWorker("w", DIGEST, first_delay_s=1.0)
    cfg = _cfg(limits={"max_inflight_body_bytes": 6000, "max_body_bytes": 5000},
               models=[{"id": MODEL, "tokenizer": "configs/assets/tiny-tokenizer", "max_context_tokens": 8192}])
    async with fleet([slow], cfg) as (_, url):
        c = client(url)
        first = asyncio.ensure_future(c.completions.create(model=MODEL, prompt="a " * 2000, max_tokens=1))
        await wait_until(lambda: slow.completions, 5.0, "the first request in flight")
        with pytest.raises(openai.RateLimitError) as ei:
            await c.completions.create(model=MODEL, prompt="b " * 2000, max_tokens=1)
        assert ei.value.code == "gateway_busy"
        assert (await first).choices[0].text
        assert (await c.completions.create(model=MODEL, prompt="c " * 2000, max_tokens=1)).choices[0].text


@pytest.mark.parametrize("kind", ["kvroute", "vllm"])
async def test_a_worker_that_never_sends_its_status_line_is_replaced(kind: str) -> None:
    """It accepts the connection and says nothing: the first-byte window covers the wait
    for the status line too, so the request moves to the healthy worker in seconds
    (our relay and the pass-through to vLLM alike)."""
    hung = FakeWorker("hung", DIGEST, headers_delay_s=60.0, kind=kind)
    good = FakeWorker("good", DIGEST, kind=kind)
    cfg = _cfg(pool=_pool(first_byte_min_s=0.5, first_byte_factor=1.0), routing={"policy": "round_robin",
                                                                                 "retries": 1})
    async with fleet([hung, good], cfg) as (gw, url):
        t0 = time.monotonic()
        for _ in range(2):
            stream = await client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True)
            assert "".join([c.choices[0].text async for c in stream if c.choices])
        assert time.monotonic() - t0 < hung.headers_delay_s / 2 and len(hung.completions) == 1  # not its own 60 s
        assert gw.metrics.upstream_errors.labels("hung", "first_byte_timeout")._value.get() == 1


async def test_alone_a_silent_worker_is_an_error_not_a_hang() -> None:
    hung = FakeWorker("hung", DIGEST, headers_delay_s=60.0)
    async with fleet([hung], _cfg(pool=_pool(first_byte_min_s=0.5, first_byte_factor=1.0))) as (_, url):
        t0 = time.monotonic()
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": "hi", "max_tokens": 2}) as r:
            body = await r.json()
        assert r.status in (502, 503, 504) and body["error"]["message"]
        assert "hung" not in body["error"]["message"] and time.monotonic() - t0 < hung.headers_delay_s / 2


async def test_a_request_waiting_for_the_status_line_of_a_dying_worker_is_retried() -> None:
    """The pool declares the worker dead while the request still waits for its answer:
    that wait ends at once and the request goes to another worker."""
    slow = FakeWorker("slow", DIGEST, headers_delay_s=60.0)
    good = FakeWorker("good", DIGEST)
    cfg = _cfg(pool=_pool(unhealthy_after=1, unhealthy_min_s=0.0), routing={"policy": "round_robin", "retries": 1})
    async with fleet([slow, good], cfg) as (gw, url):
        task = asyncio.ensure_future(client(url).completions.create(model=MODEL, prompt="x", max_tokens=1))
        await wait_until(lambda: slow.completions or good.completions, 5.0, "dispatch")
        if good.completions:
            task2 = asyncio.ensure_future(client(url).completions.create(model=MODEL, prompt="y", max_tokens=1))
            await wait_until(lambda: slow.completions, 5.0, "dispatch to the slow one")
            await task
            task = task2
        slow.health_status = 500
        r = await asyncio.wait_for(task, slow.headers_delay_s / 2)  # ended by the health verdict, not its 60 s
        assert r.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_vllm_worker_answering_garbage_is_not_relayed(stream: bool) -> None:
    """Pass-through keeps vLLM's bytes, but a 200 whose body or first event is not JSON is
    a broken worker: the request is retried on another, and alone it is a 502."""
    bad, good = FakeWorker("bad", DIGEST, garbage=True, kind="vllm"), FakeWorker("good", DIGEST, kind="vllm")
    cfg = _cfg(routing={"policy": "round_robin", "retries": 1})
    req = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream}
    async with fleet([bad, good], cfg) as (_, url), aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(url + "/v1/completions", json=req) as r:
                text = await r.text()
                assert r.status == 200 and "not json" not in text and "oops" not in text, text
        assert len(bad.completions) == 1
    alone = FakeWorker("bad", DIGEST, garbage=True, kind="vllm")
    async with fleet([alone]) as (_, url), aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=req) as r:
            assert r.status == 502 and "oops" not in await r.text()


async def test_an_early_refusal_reaches_a_client_still_sending() -> None:
    """A 413 on the declared length is sent before the body is read; the rest of the body
    is drained (bounded) before the connection closes, so a client still writing reads
    the 413 instead of a connection reset."""
    a = FakeWorker("a", DIGEST)
    async with fleet([a], _cfg(limits={"max_body_bytes": 1000})) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            body = b"x" * 3_000_000
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(body))
            await asyncio.sleep(0.2)  # the refusal is on its way before the body goes out
            try:
                for i in range(0, len(body), 65536):
                    writer.write(body[i:i + 65536])
                    await writer.drain()
            except ConnectionError:
                pass  # the server stopped reading: what matters is what the client can read
            try:
                head = await asyncio.wait_for(reader.read(4096), patience(5.0))
            except ConnectionError as e:
                head = repr(e).encode()
            writer.close()
            assert head.startswith(b"HTTP/1.1 413"), head[:80]


async def test_a_whole_answer_from_a_silent_vllm_worker_is_bounded() -> None:
    """Not streamed, vLLM's status line comes only with the finished answer: the wait is
    the first-byte window plus a bound per token asked for, then another worker."""
    hung = FakeWorker("hung", DIGEST, headers_delay_s=60.0, kind="vllm")
    good = FakeWorker("good", DIGEST, kind="vllm")
    cfg = _cfg(pool=_pool(first_byte_min_s=0.5, first_byte_factor=1.0, whole_answer_token_s=0.1),
               routing={"policy": "round_robin", "retries": 1})
    async with fleet([hung, good], cfg) as (_, url):
        t0 = time.monotonic()
        for _ in range(2):
            r = await client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert r.choices[0].text
        assert time.monotonic() - t0 < hung.headers_delay_s / 2 and len(hung.completions) == 1  # not its own 60 s
