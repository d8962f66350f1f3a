"""POST /v1/embeddings through the gateway's common path (router/api/embeddings.py): timeouts,
tenant caps, the served name, the request id, a bounded answer, only legitimate statuses
relayed."""
from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
from fakes import FakeWorker
from gateway_fleet import DIGEST, KEY, MODEL, _cfg, fleet

_LEAKS = ("fake-", "127.0.0.1", "http://", "Traceback", "Error", "aiohttp")


async def _embed(url: str, body: dict[str, Any] | None = None, key: str | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    h = {**({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s, \
            s.post(url + "/v1/embeddings", json=body or {"model": MODEL, "input": "hello"}, headers=h) as r:
        return r.status, msgspec.json.decode(await r.read()), {k.lower(): v for k, v in r.headers.items()}


def _clean_error(got: Any) -> dict[str, Any]:
    err: dict[str, Any] = got["error"]
    assert {"message", "type", "param", "code"} <= set(err) and err["message"]
    assert not any(x in err["message"] for x in _LEAKS), err
    return err


async def test_the_worker_gets_the_served_name_and_the_request_id() -> None:
    v = FakeWorker("fake-v", DIGEST)
    async with fleet([v]) as (_, url):
        st, got, hdrs = await _embed(url, {"model": "alias", "input": ["a", "b"], "encoding_format": "float"},
                                     headers={"x-request-id": "client-req-42"})
        assert st == 200 and got["data"][0]["embedding"] == [0.5, 0.25]
        assert v.embeddings[-1] == {"model": MODEL, "input": ["a", "b"], "encoding_format": "float"}
        assert v.embedding_headers[-1]["x-request-id"] == "client-req-42" == hdrs["x-request-id"]


async def test_only_statuses_an_openai_route_gives_are_relayed() -> None:
    odd = FakeWorker("fake-odd", DIGEST, embeddings_status=202, embeddings_body=b'{"prefetch_id": "p", "queued": true}')
    async with fleet([odd]) as (_, url):
        st, got, _ = await _embed(url)
        assert st == 502 and _clean_error(got)["code"] == "worker_failed"
        odd.embeddings_status, odd.embeddings_body = 401, b'{"error": {"message": "bad worker key"}}'
        st, got, _ = await _embed(url)
        assert st == 502 and "bad worker key" not in _clean_error(got)["message"]
        odd.embeddings_status, odd.embeddings_body = 400, b'{"error": {"message": "input too long at 10.0.0.9:80"}}'
        st, got, _ = await _embed(url)
        assert st == 400 and "input too long" in _clean_error(got)["message"]
        assert "10.0.0.9" not in got["error"]["message"]


async def test_a_5xx_is_retried_on_the_next_worker_and_its_message_cleaned() -> None:
    boom = b'{"error": {"message": "engine crashed on fake-a at 127.0.0.1:9: Traceback (most recent call last)"}}'
    a = FakeWorker("fake-a", DIGEST, embeddings_status=500, embeddings_body=boom)
    b = FakeWorker("fake-b", DIGEST)
    async with fleet([a, b]) as (gw, url):
        sent = 0
        while not a.embeddings and sent < 50:  # the order among idle workers is random
            st, got, _ = await _embed(url)
            sent += 1
            assert st == 200, got
        assert a.embeddings and len(b.embeddings) == sent  # a was tried, b answered every time
        await _remove(url, "fake-b")
        st, got, _ = await _embed(url)
        assert st == 502 and "engine crashed" in _clean_error(got)["message"]


async def _remove(url: str, wid: str) -> None:
    async with aiohttp.ClientSession() as s, s.delete(url + f"/admin/workers/{wid}") as r:
        assert r.status == 200


async def test_a_worker_that_never_answers_costs_the_first_byte_window() -> None:
    v = FakeWorker("fake-v", DIGEST, embeddings_delay_s=3600)
    cfg = _cfg(pool={"load_poll_interval_s": 0.05, "health_interval_s": 0.1, "probe_timeout_s": 0.5,
                     "first_byte_min_s": 0.5, "idle_timeout_s": 0.5})
    async with fleet([v], cfg) as (_, url):
        st, got, _ = await _embed(url)
        assert st == 504 and _clean_error(got)["code"] == "worker_timeout"
        assert len(v.embeddings) == 1  # no other worker to retry on


async def test_the_answer_is_bounded() -> None:
    big = b'{"object": "list", "data": [{"embedding": [' + b"0.125, " * 2000 + b'0.5]}]}'
    v = FakeWorker("fake-v", DIGEST, embeddings_body=big)
    async with fleet([v], _cfg(limits={"max_embeddings_answer_bytes": 4096})) as (gw, url):
        st, got, _ = await _embed(url)
        assert st == 502 and _clean_error(got)["code"] == "answer_too_large"
        assert gw.body_budget.used == 0


async def test_embeddings_take_the_tenants_concurrency_slot() -> None:
    v = FakeWorker("fake-v", DIGEST, embeddings_delay_s=3600)  # holds the tenant's one slot
    cfg = _cfg(tenants=[{"id": "a", "api_keys": [KEY], "max_concurrency": 1}])
    async with fleet([v], cfg) as (gw, url):
        first = asyncio.ensure_future(_embed(url, key=KEY))
        while not v.embeddings:
            await asyncio.sleep(0.01)
        st, got, hdrs = await _embed(url, key=KEY)
        assert st == 429 and got["error"]["code"] == "tenant_concurrency" and "retry-after" in hdrs
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        st, _, _ = await _embed(url)  # no key: refused like every route
        assert st == 401


async def test_embeddings_refuse_a_malformed_body() -> None:
    async with fleet([FakeWorker("fake-v", DIGEST)]) as (_, url):
        for body, param in (({"model": MODEL}, "input"), ({"model": MODEL, "input": []}, "input"),
                            ({"model": MODEL, "input": "x", "dimensions": 0}, "dimensions")):
            st, got, _ = await _embed(url, body)
            assert st == 400 and got["error"]["param"] == param, got
        st, got, _ = await _embed(url, {"model": "nope", "input": "x"})
        assert st == 404
