"""Every error class of the gateway, through the official `openai` SDK (and raw HTTP where the
SDK cannot produce the fault), against scriptable fake workers: 400/401/404/413/429/500/503,
retry before the first byte, a clean error after it, client disconnects."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import openai
import pytest
from hangs import patience
from test_gateway_fakes import FakeWorker, serve_fake

from kvindex.keys import Namespace
from router.config import Config, build_config
from router.fleet.fleetconfig import WorkerConfig
from router.server import running_gateway

MODEL = "test-model"
DIGEST = Namespace(MODEL).digest.hex()
KEY = "sk-tenant-a-123456"
ADMIN = "admin-token-123456"


def _cfg(**over: Any) -> Config:
    data: dict[str, Any] = {
        "models": [{"id": MODEL, "served_names": ["alias"], "tokenizer": "configs/assets/tiny-tokenizer",
                    "max_context_tokens": 512}],
        "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.1, "unhealthy_after": 2, "probe_timeout_s": 0.5},
        "routing": {"policy": "kv_cost", "retries": 1},
    }
    for k, v in over.items():
        data[k] = v
    return build_config(data, environ={})


@asynccontextmanager
async def fleet(
    fakes: list[FakeWorker], cfg: Config | None = None, ready: bool = True
) -> AsyncIterator[tuple[Any, str]]:
    cfg = cfg or _cfg()
    async with AsyncExitStack() as st:
        for f in fakes:
            await st.enter_async_context(serve_fake(f))
        cfg.workers = cfg.workers + [WorkerConfig(id=f.worker_id, url=f.url, model=MODEL, kind=f.kind,
                                                  role=f.role)
                                     for f in fakes]
        gw, url = await st.enter_async_context(running_gateway(cfg, ready_timeout=5.0 if ready else None))
        try:
            yield gw, url
        finally:
            for c in _CLIENTS.pop(url, []):
                await c.close()


async def wait_until(cond: Any, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll `cond()` until it holds; fail the test with `what` when `timeout` passes."""
    deadline = asyncio.get_running_loop().time() + patience(timeout)
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


_CLIENTS: dict[str, list[openai.AsyncOpenAI]] = {}  # closed by `fleet` before its loop ends


def client(url: str, key: str = "none") -> openai.AsyncOpenAI:
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=10)
    _CLIENTS.setdefault(url, []).append(c)
    return c


async def _raw(
    url: str, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, data=body, headers={"content-type": "application/json", **(headers or {})}) as r:
            return r.status, await r.json(content_type=None), dict(r.headers)


def _shape(body: dict[str, Any]) -> dict[str, Any]:
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


async def test_bad_requests_are_400_in_openai_shape() -> None:
    async with fleet([FakeWorker("a", DIGEST)]) as (gw, url):
        st, body, _ = await _raw(url, "/v1/chat/completions", b"{not json")
        assert st == 400 and _shape(body)["code"] == "invalid_json"
        st, body, _ = await _raw(url, "/v1/chat/completions", b'{"model": "test-model", "messages": "hi"}')
        assert st == 400 and _shape(body)["param"] == "messages"
        st, body, _ = await _raw(url, "/v1/completions", b'{"model": "test-model", "prompt": [1, 99999999]}')
        assert st == 400 and _shape(body)["param"] == "prompt"
        st, body, _ = await _raw(url, "/v1/chat/completions", b"[]")
        assert st == 400
        c = client(url)
        with pytest.raises(openai.BadRequestError) as ei:
            await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
        assert ei.value.body["param"] == "n"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=7)
        with pytest.raises(openai.BadRequestError) as ei:  # too long for the 512-token context
            await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 800}])
        assert ei.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as ei:  # prompt fits, prompt + max_tokens does not
            await c.completions.create(model=MODEL, prompt=[5] * 300, max_tokens=300)
        assert ei.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
        with pytest.raises(openai.BadRequestError):
            await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0)
        assert not gw.pool.workers["a"].served  # nothing reached a worker


async def test_unknown_model_404_and_alias_and_models_list() -> None:
    async with fleet([FakeWorker("a", DIGEST)]) as (gw, url):
        c = client(url)
        with pytest.raises(openai.NotFoundError) as ei:
            await c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert ei.value.code == "model_not_found"
        r = await c.chat.completions.create(model="alias", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert r.model == "alias" and r.choices[0].message.content
        names = {m.id async for m in c.models.list()}
        assert names == {MODEL, "alias"}
        assert gw.metrics.requests.labels("/v1/chat/completions", "404", "-")._value.get() == 1  # counted once


async def test_auth_401_and_admin_token() -> None:
    cfg = _cfg(tenants=[{"id": "a", "api_keys": [KEY], "salt": "s-a"}], admin_token=ADMIN)
    async with fleet([FakeWorker("a", DIGEST)], cfg) as (gw, url):
        with pytest.raises(openai.AuthenticationError):
            await client(url, "sk-wrong-key-0000").chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}]
            )
        st, body, _ = await _raw(url, "/v1/chat/completions", b"{}")
        assert st == 401 and _shape(body)["type"] == "authentication_error"
        r = await client(url, KEY).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1
        )
        assert r.choices[0].message.content
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/admin/workers") as r1:
                assert r1.status == 401
            async with s.get(url + "/admin/workers", headers={"authorization": f"Bearer {KEY}"}) as r2:
                assert r2.status == 401  # a client key is not the admin token
            async with s.get(url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN}"}) as r3:
                assert r3.status == 200 and (await r3.json())["workers"][0]["state"] == "healthy"


async def test_body_too_large_413() -> None:
    cfg = _cfg(limits={"max_body_bytes": 1000})
    async with fleet([FakeWorker("a", DIGEST)], cfg) as (gw, url):
        st, body, _ = await _raw(url, "/v1/completions", b'{"model": "test-model", "prompt": "' + b"x" * 2000 + b'"}')
        assert st == 413 and _shape(body)["code"] == "request_too_large"


async def test_shed_429_with_retry_after() -> None:
    cfg = _cfg(routing={"policy": "kv_cost", "max_ttft_s": 1e-6})  # no worker can meet this SLO
    async with fleet([FakeWorker("a", DIGEST)], cfg) as (gw, url):
        with pytest.raises(openai.RateLimitError) as ei:
            await client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert int(ei.value.response.headers["retry-after"]) >= 1
        assert not gw.pool.workers["a"].served


async def test_tenant_concurrency_429() -> None:
    cfg = _cfg(tenants=[{"id": "a", "api_keys": [KEY], "max_concurrency": 1}])
    slow = FakeWorker("a", DIGEST, first_delay_s=0.5)
    async with fleet([slow], cfg) as (gw, url):
        c = client(url, KEY)
        first = asyncio.ensure_future(c.completions.create(model=MODEL, prompt="hello", max_tokens=1))
        await wait_until(lambda: slow.completions, what="the first request to reach the worker")
        with pytest.raises(openai.RateLimitError) as ei:
            await c.completions.create(model=MODEL, prompt="hello", max_tokens=1)
        assert ei.value.code == "tenant_concurrency" and ei.value.response.headers.get("retry-after")
        assert (await first).choices[0].text


async def test_no_healthy_worker_503() -> None:
    cfg = _cfg()
    cfg.workers = [WorkerConfig(id="dead", url="http://127.0.0.1:9", model=MODEL)]
    async with fleet([], cfg, ready=False) as (gw, url):
        with pytest.raises(openai.InternalServerError) as ei:
            await client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert ei.value.status_code == 503 and ei.value.code == "no_healthy_worker"
        async with aiohttp.ClientSession() as s, s.get(url + "/ready") as r:
            assert r.status == 503


async def test_unexpected_exception_is_openai_500(monkeypatch: pytest.MonkeyPatch) -> None:
    async with fleet([FakeWorker("a", DIGEST)]) as (gw, url):
        def boom(*a: Any, **k: Any) -> Any:
            raise RuntimeError("bug")

        monkeypatch.setattr(gw, "decide", boom)
        with pytest.raises(openai.InternalServerError) as ei:
            await client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert ei.value.status_code == 500 and "request id" in ei.value.message
        assert ei.value.body["request_id"].startswith("req-")  # type: ignore[index]


async def test_retry_on_next_best_before_first_byte() -> None:
    bad = FakeWorker("a", DIGEST, fail_status=500)
    good = FakeWorker("b", DIGEST)
    async with fleet([bad, good], _cfg(routing={"policy": "round_robin", "retries": 1})) as (gw, url):
        c = client(url)
        for _ in range(4):
            r = await c.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert r.choices[0].text == "t0 t1 "
        assert len(bad.completions) >= 1 and len(good.completions) == 4
        assert gw.metrics.retries.labels("before_first_byte")._value.get() >= 1


async def test_worker_429_is_relayed_when_no_other_worker() -> None:
    full = FakeWorker("a", DIGEST, fail_status=429)
    async with fleet([full]) as (gw, url):
        with pytest.raises(openai.RateLimitError) as ei:
            await client(url).completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert ei.value.response.headers.get("retry-after")


async def test_refused_worker_leaves_routing_at_once() -> None:
    async with serve_fake(FakeWorker("a", DIGEST)) as doomed:
        url_a = doomed.url
    good = FakeWorker("b", DIGEST)
    cfg = _cfg(routing={"policy": "round_robin", "retries": 1},
               pool={"load_poll_interval_s": 5, "health_interval_s": 5, "unhealthy_after": 50})
    async with fleet([good], cfg) as (gw, url):
        w = gw.pool.add(WorkerConfig(id="a", url=url_a, model=MODEL))
        w.state = type(w.state).HEALTHY  # pretend it registered before dying
        gw.pool.roster.rebuild(MODEL)
        c = client(url)
        for _ in range(3):
            r = await c.completions.create(model=MODEL, prompt="hello", max_tokens=1)
            assert r.choices[0].text
        assert w.state.value == "unhealthy" and gw.pool.routable(MODEL) == [gw.pool.workers["b"]]


async def test_failure_after_first_byte_is_an_explicit_error() -> None:
    dying = FakeWorker("a", DIGEST, die_after_chunks=2)
    async with fleet([dying]) as (gw, url):
        c = client(url)
        got: list[str] = []
        with pytest.raises(openai.APIError) as ei:
            stream = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6, stream=True
            )
            async for ch in stream:
                if ch.choices and ch.choices[0].delta.content:
                    got.append(ch.choices[0].delta.content)
        assert got == ["t0 ", "t1 "] and "worker" in str(ei.value.message)
        with pytest.raises(openai.APIStatusError) as e2:  # non-streaming: nothing sent yet → a 502
            await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=6)
        assert e2.value.status_code == 502


async def test_client_disconnect_cancels_upstream() -> None:
    slow = FakeWorker("a", DIGEST, token_delay_s=0.05)
    async with fleet([slow]) as (gw, url):
        async with aiohttp.ClientSession() as s:
            async with s.post(
                url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 200, "stream": True}
            ) as r:
                assert r.status == 200
                await r.content.readline()
        await wait_until(lambda: slow.cancelled and not gw.pool.workers["a"].inflight, what="the upstream cancel")
        assert slow.cancelled == 1
        assert not gw.pool.workers["a"].inflight and gw.pool.workers["a"].view.inflight_requests == 0

