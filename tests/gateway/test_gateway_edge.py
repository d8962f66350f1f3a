"""Small edges of the gateway's OpenAI surface (issue "Harden the edge", item 11):
`/tokenize` fields, per-chunk usage, a vLLM worker's own 5xx message, duplicate
credentials."""
from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
import pytest
from fakes import FakeWorker
from gateway_fleet import DIGEST, KEY, MODEL, _cfg, fleet


async def _post(url: str, path: str, body: Any, headers: Any = None) -> tuple[int, bytes, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers) as r:
        return r.status, await r.read(), dict(r.headers)


async def test_tokenize_returns_token_strings_as_vllm_does() -> None:
    async with fleet([FakeWorker("a", DIGEST)]) as (gw, url):
        st, body, _ = await _post(url, "/tokenize", {"model": MODEL, "prompt": "Hello world",
                                                     "return_token_strs": True})
        d = msgspec.json.decode(body)
        assert st == 200 and d["count"] == len(d["tokens"]) == len(d["token_strs"]) > 0
        assert d["token_strs"] == gw.models.get(MODEL).tokenizer.hf.convert_ids_to_tokens(d["tokens"])
        assert "".join(d["token_strs"]).replace("\u0120", " ").replace("\u2581", " ").strip().endswith("world")
        st, body, _ = await _post(url, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
        assert st == 200 and msgspec.json.decode(body)["token_strs"] is None


@pytest.mark.parametrize("path,body", [
    ("/tokenize", {"model": MODEL, "prompt": "x", "chat_template": "{{ x }}", "no_such_field": 1}),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "continue_final_message": True}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2], "skip_special_tokens": False}),
])
async def test_tokenize_refuses_fields_it_does_not_implement(path: str, body: dict[str, Any]) -> None:
    async with fleet([FakeWorker("a", DIGEST)]) as (_, url):
        st, raw, _ = await _post(url, path, body)
        err = msgspec.json.decode(raw)["error"]
        unknown = [k for k in body if k not in ("model", "prompt", "messages", "tokens")]
        assert st == 400 and err["param"] == unknown[0], err
        assert all(f"`{k}`" in err["message"] for k in unknown), err


def _chunks(raw: bytes) -> list[dict[str, Any]]:
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    return [msgspec.json.decode(e) for e in events[:-1]]


@pytest.mark.parametrize("include_usage", [False, True])
async def test_continuous_usage_needs_include_usage_as_in_vllm(include_usage: bool) -> None:
    v = FakeWorker("v", DIGEST, kind="vllm")
    async with fleet([v]) as (_, url):
        opts = {"continuous_usage_stats": True, **({"include_usage": True} if include_usage else {})}
        st, raw, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                          "stream": True, "stream_options": opts})
        assert st == 200
        with_usage = [c for c in _chunks(raw) if c.get("usage")]
        if include_usage:  # every chunk, the final usage-only one too
            assert len(with_usage) == 5
        else:
            assert with_usage == []
        assert v.completions[-1]["stream_options"]["continuous_usage_stats"] is include_usage


async def test_our_workers_refuse_per_chunk_usage_rather_than_drop_it() -> None:
    async with fleet([FakeWorker("a", DIGEST)]) as (_, url):
        st, raw, _ = await _post(url, "/v1/completions", {
            "model": MODEL, "prompt": "hi", "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert st == 400 and msgspec.json.decode(raw)["error"]["param"] == "stream_options.continuous_usage_stats"


async def test_a_vllm_workers_own_5xx_message_reaches_the_client_without_internals() -> None:
    msg = ("KV cache exhausted on fake-v at 10.1.2.3:8000 (see http://10.1.2.3/x): Traceback (most recent "
           "call last):\n  File \"/opt/vllm/engine.py\", line 1\nRuntimeError: boom")
    v = FakeWorker("fake-v", DIGEST, kind="vllm", fail_status=500, fail_message=msg)
    async with fleet([v]) as (_, url):
        st, raw, _ = await _post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                               "messages": [{"role": "user", "content": "x"}]})
        err = msgspec.json.decode(raw)["error"]
        assert st == 502 and "KV cache exhausted" in err["message"], err
        for leak in ("fake-v", "10.1.2.3", "http://", "Traceback", "engine.py", "RuntimeError"):
            assert leak not in err["message"], err


@pytest.mark.parametrize("path,method", [("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
                                         ("/admin/workers", "GET")])
async def test_two_authorization_headers_are_refused(path: str, method: str) -> None:
    cfg = _cfg(tenants=[{"id": "a", "api_keys": [KEY]}], admin_token="admin-token-123456")
    async with fleet([FakeWorker("a", DIGEST)], cfg) as (_, url):
        headers = [("Authorization", "Bearer wrong-key-xxxx"), ("Authorization", f"Bearer {KEY}")]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
        async with aiohttp.ClientSession() as s, s.request(method, url + path, headers=headers,
                                                           json=body if method == "POST" else None) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "authorization" and "more than once" in err["message"]
        async with aiohttp.ClientSession() as s, s.request(method, url + path, headers=[headers[1]],
                                                           json=body if method == "POST" else None) as r:
            assert r.status != 400
