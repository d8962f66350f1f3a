"""The admin API against the browser on the operator's machine (router/api/admin_policy.py):
with no admin token (the newcomer's default) a web page must not be able to add, drain
or remove a worker (a `text/plain` POST needs no CORS preflight), nor read `/admin/*`
through DNS rebinding (its own host name in `Host`), nor add a worker on the LAN."""
from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from fakes import FakeWorker
from gateway_fleet import ADMIN, DIGEST, _cfg, fleet

EVIL = "http://evil.example"


async def _send(url: str, method: str, path: str, *, data: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
    # skip_auto_headers: only what the test names is sent (as a browser's fetch would)
    async with aiohttp.ClientSession(skip_auto_headers=("Content-Type",)) as s, \
            s.request(method, url + path, data=data, headers=headers or {}) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize("method,path,data,headers", [
    ("POST", "/admin/workers/w/drain", b"", {"Origin": EVIL}),
    ("POST", "/admin/workers/w/drain", b"x", {"Content-Type": "text/plain"}),
    ("POST", "/admin/workers/w/drain", b"", {"Content-Type": "application/x-www-form-urlencoded"}),
    ("DELETE", "/admin/workers/w", None, {"Origin": "null"}),
    ("POST", "/admin/workers", b'{"id": "evil", "url": "http://127.0.0.1:9"}', {"Content-Type": "text/plain"}),
    ("POST", "/admin/workers", b'{"id": "evil", "url": "http://127.0.0.1:9"}',
     {"Content-Type": "application/json", "Origin": EVIL}),
])
async def test_a_cross_site_request_changes_nothing(method: str, path: str, data: bytes | None,
                                                   headers: dict[str, str]) -> None:
    async with fleet([FakeWorker("w", DIGEST)]) as (gw, url):
        status, body = await _send(url, method, path, data=data, headers=headers)
        assert status in (403, 415) and body["error"]["message"], (status, body)
        assert set(gw.pool.workers) == {"w"} and gw.pool.workers["w"].summary()["state"] == "healthy"


async def test_dns_rebinding_cannot_read_the_open_admin_api() -> None:
    async with fleet([FakeWorker("w", DIGEST)]) as (_, url):
        port = url.rsplit(":", 1)[1]
        status, body = await _send(url, "GET", "/admin/workers", headers={"Host": f"evil.example:{port}"})
        assert status == 403 and "workers" not in body, body
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            assert (await _send(url, "GET", "/admin/workers", headers={"Host": host}))[0] == 200


async def test_same_origin_and_json_are_served() -> None:
    async with fleet([FakeWorker("w", DIGEST)]) as (gw, url):
        status, _ = await _send(url, "POST", "/admin/workers/w/drain", headers={"Origin": url})
        assert status == 200 and (gw.pool.workers["w"].state.value == "draining")
        status, _ = await _send(url, "POST", "/admin/workers/w/undrain",
                                headers={"Content-Type": "application/json; charset=utf-8"}, data=b"{}")
        assert status == 200 and not (gw.pool.workers["w"].state.value == "draining")


async def test_without_a_token_workers_are_added_on_loopback_only() -> None:
    lan = b'{"id": "lan", "url": "http://192.168.1.20:8000"}'
    json_ct = {"Content-Type": "application/json"}
    async with fleet([FakeWorker("w", DIGEST)]) as (gw, url):
        status, body = await _send(url, "POST", "/admin/workers", data=lan, headers=json_ct)
        assert status == 403 and "lan" not in gw.pool.workers, body
    async with fleet([FakeWorker("w", DIGEST)], _cfg(admin_token=ADMIN)) as (gw, url):
        auth = {**json_ct, "Authorization": f"Bearer {ADMIN}"}
        status, body = await _send(url, "POST", "/admin/workers", data=lan, headers=auth)
        assert status == 201 and "lan" in gw.pool.workers, body  # the operator's token: the LAN is allowed
        # a token does not make a foreign page's request acceptable
        status, _ = await _send(url, "POST", "/admin/workers/w/drain", headers={**auth, "Origin": EVIL})
        assert status == 403 and not (gw.pool.workers["w"].state.value == "draining")
