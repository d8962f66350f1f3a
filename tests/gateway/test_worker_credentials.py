"""Per-worker credentials (router/fleet/credentials.py): a worker that wants an API key
gets it on every call the gateway makes to it, and no view of the gateway shows it."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pydantic
import pytest
from fakes import FakeWorker, serve_fake
from gateway_fleet import DIGEST, MODEL, _cfg, client

from router.fleet.credentials import AuthConfig, CredentialError, head_lines, resolve
from router.fleet.fleetconfig import WorkerConfig
from router.server import running_gateway

KEY = "sk-test-4f1d9c"
CHAT = [{"role": "user", "content": "Say something about caches."}]


def test_the_config_names_where_a_secret_lives_never_the_secret(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    monkeypatch.setenv("W_KEY", KEY)
    monkeypatch.setenv("W_ORG", "org-7")
    a = AuthConfig(api_key_env="W_KEY", headers_env={"X-Org": "W_ORG"})
    assert resolve(a) == {"Authorization": f"Bearer {KEY}", "X-Org": "org-7"}
    assert head_lines(resolve(a)) == f"Authorization: Bearer {KEY}\r\nX-Org: org-7\r\n".encode()
    assert KEY not in repr(a) and KEY not in str(a.described()) and KEY not in a.model_dump_json()
    assert a.described() == {"api_key": "env:W_KEY", "headers": {"X-Org": "env:W_ORG"}}
    f = tmp_path / "key"
    f.write_text(KEY + "\n")
    assert resolve(AuthConfig(api_key_file=str(f))) == {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("fields,says", [
    ({"api_key_env": "W_KEY", "api_key_file": "/k"}, "not both"),
    ({"api_key_env": "W_NOT_SET"}, "environment variable W_NOT_SET is missing"),
    ({"api_key_file": "/nonexistent/key"}, "file /nonexistent/key is missing"),
    ({"headers_env": {"Bad Header": "W_KEY"}}, "not a header"),
    ({"headers_env": {"Content-Length": "W_KEY"}}, "not a header"),
    ({"api_key_env": "W_KEY", "headers_env": {"authorization": "W_KEY"}}, "Authorization"),
    ({"api_key_env": "W_CRLF"}, "line break"),
])
def test_a_bad_or_missing_secret_fails_when_the_config_is_read(monkeypatch: pytest.MonkeyPatch,
                                                                fields: dict[str, Any], says: str) -> None:
    monkeypatch.setenv("W_KEY", KEY)
    monkeypatch.setenv("W_CRLF", "a\r\nX-Evil: 1")
    monkeypatch.delenv("W_NOT_SET", raising=False)
    with pytest.raises(pydantic.ValidationError) as ei:
        WorkerConfig(id="w", url="http://127.0.0.1:1", auth=fields)  # type: ignore[arg-type]
    assert says in str(ei.value) and KEY not in str(ei.value)


def test_resolve_reads_the_secret_now() -> None:
    a = AuthConfig.model_construct(api_key_env="W_LATER", api_key_file=None, headers_env={})
    with pytest.raises(CredentialError, match="W_LATER"):
        resolve(a, {})
    assert resolve(a, {"W_LATER": "k2"}) == {"Authorization": "Bearer k2"}


@asynccontextmanager
async def _keyed_fleet(fakes: list[FakeWorker], kinds: list[str], auth: dict[str, Any] | None
                       ) -> AsyncIterator[tuple[Any, str]]:
    cfg = _cfg()
    async with AsyncExitStack() as st:
        for f in fakes:
            await st.enter_async_context(serve_fake(f))
        cfg.workers = [WorkerConfig(id=f.worker_id, url=f.url, model=MODEL, kind=k, auth=auth)  # type: ignore[arg-type]
                       for f, k in zip(fakes, kinds, strict=True)]
        yield await st.enter_async_context(running_gateway(cfg, ready_timeout=5.0))


@pytest.mark.parametrize("kind", ["vllm", "kvroute"])
async def test_every_call_to_a_keyed_worker_carries_its_key(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    monkeypatch.setenv("W_KEY", KEY)
    w = FakeWorker("w", DIGEST, api_key=KEY, kind=kind)
    async with _keyed_fleet([w], [kind], {"api_key_env": "W_KEY"}) as (_, url):
        c = client(url)
        r = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert r.choices[0].message.content
        stream = await c.completions.create(model=MODEL, prompt="hello", max_tokens=2, stream=True)
        assert [ch async for ch in stream]
        async with aiohttp.ClientSession() as s, s.get(url + "/admin/workers") as resp:
            shown = await resp.text()
    assert not w.unauthorized, w.unauthorized
    seen = set(w.authorized_paths)
    assert {"/health", "/v1/chat/completions" if kind == "vllm" else "/v1/completions", "/v1/completions"} <= seen
    assert ("/metrics" if kind == "vllm" else "/load") in seen  # the load polls too
    assert KEY not in shown and "env:W_KEY" in shown


async def test_without_its_key_a_keyed_worker_never_serves() -> None:
    w = FakeWorker("w", DIGEST, api_key=KEY, kind="vllm")
    async with _keyed_fleet([w], ["vllm"], None) as (gw, url):
        with pytest.raises(openai.APIStatusError) as ei:
            await client(url).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert ei.value.status_code == 503
        assert gw.pool.workers["w"].state.value != "healthy" and "401" in gw.pool.workers["w"].last_error
    assert w.unauthorized and not w.authorized_paths
