"""Per-tenant rate of large bodies (router/intake/bodyrate.py): a tenant over it gets 429 with
Retry-After before its body is read; other tenants and small bodies are not touched."""
from __future__ import annotations

import json
from typing import Any

import aiohttp
from fakes import FakeWorker
from gateway_fleet import DIGEST, MODEL, _cfg, fleet

from router.intake.bodyrate import BodyRate
from router.intake.screen import SCREEN_BYTES


def test_bucket_admits_its_burst_then_its_rate() -> None:
    now = [0.0]
    r = BodyRate(1000.0, 3000, clock=lambda: now[0])
    assert r.take("a", 2000) == 0.0 and r.take("a", 1000) == 0.0
    assert r.take("a", 500) == 0.5  # empty: 500 bytes at 1000 B/s
    assert r.take("b", 3000) == 0.0  # another tenant has its own bucket
    now[0] = 0.5
    assert r.take("a", 500) == 0.0
    now[0] = 100.0
    assert r.take("a", 3000) == 0.0 and r.take("a", 1) > 0  # refilled to the burst, no further
    assert BodyRate(None, 10).take("a", 10**9) == 0.0


def _body(pad: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1, "user": "x" * pad}).encode()


async def _post(s: aiohttp.ClientSession, url: str, key: str, body: bytes) -> tuple[int, dict[str, Any], Any]:
    hdr = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with s.post(url + "/v1/completions", data=body, headers=hdr) as r:
        return r.status, await r.json(), r.headers


async def test_a_tenant_over_its_large_body_rate_is_refused_with_retry_after() -> None:
    ka, kb = "sk-tenant-a-123456", "sk-tenant-b-123456"
    cfg = _cfg(tenants=[{"id": "a", "api_keys": [ka]}, {"id": "b", "api_keys": [kb]}],
               limits={"max_body_bytes": 5 * SCREEN_BYTES, "tenant_large_body_bytes_per_s": 1000.0})
    big = _body(SCREEN_BYTES)  # the burst is one maximal body: four of these
    async with fleet([FakeWorker("w", DIGEST)], cfg) as (_, url):
        async with aiohttp.ClientSession() as s:
            got = [await _post(s, url, ka, big) for _ in range(5)]
            assert [g[0] for g in got] == [200] * 4 + [429]
            status, err, headers = got[-1]
            assert err["error"]["code"] == "body_rate_exceeded" and int(headers["Retry-After"]) >= 1
            assert (await _post(s, url, ka, _body(100)))[0] == 200  # small bodies are not charged
            assert (await _post(s, url, kb, big))[0] == 200  # nor is another tenant
