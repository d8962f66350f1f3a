"""The gateway's HTTP surface on FastAPI and the transparent pass-through to vLLM workers.

Fake workers (tests/support/fakes.py) answer as vLLM does; the official `openai`
SDK and raw HTTP check that what a vLLM worker receives is the client's body plus
only what routing adds, that what the client receives is what the worker sent, and
that the gateway's own surface (OpenAPI, models, tokenize, errors) is complete.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import msgspec
import openai
import pytest
from fakes import FakeWorker, serve_fake
from gateway_fleet import DIGEST, MODEL, _cfg, client, fleet, wait_until

from router.config import Config
from router.fleet.fleetconfig import WorkerConfig
from router.server import running_gateway

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something about caches."}]
ROUTES = {
    ("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("get", "/v1/models"),
    ("get", "/v1/models/{model_id}"), ("post", "/tokenize"), ("post", "/detokenize"), ("post", "/v1/embeddings"),
    ("get", "/health"), ("get", "/ready"), ("get", "/metrics"), ("get", "/admin/workers"), ("post", "/admin/workers"),
    ("delete", "/admin/workers/{worker_id}"), ("post", "/admin/workers/{worker_id}/drain"),
    ("post", "/admin/workers/{worker_id}/undrain"), ("get", "/admin/index"), ("get", "/admin/calibration"),
    ("post", "/admin/route/explain"), ("post", "/admin/tenants/{tenant_id}/purge"),
}


@asynccontextmanager
async def vllm_fleet(fakes: list[FakeWorker], kinds: list[str] | None = None,
                     cfg: Config | None = None) -> AsyncIterator[tuple[Any, str]]:
    """A gateway in front of fakes registered as vLLM workers (or the given kinds)."""
    cfg = cfg or _cfg()
    kinds = kinds or ["vllm"] * len(fakes)
    async with AsyncExitStack() as st:
        for f in fakes:
            await st.enter_async_context(serve_fake(f))
        cfg.workers = [WorkerConfig(id=f.worker_id, url=f.url, model=MODEL, kind=k)  # type: ignore[arg-type]
                       for f, k in zip(fakes, kinds, strict=True)]
        gw, url = await st.enter_async_context(running_gateway(cfg, ready_timeout=5.0))
        yield gw, url


async def _post(url: str, path: str, body: dict[str, Any], **kw: Any) -> tuple[int, bytes, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, **kw) as r:
        return r.status, await r.read(), dict(r.headers)


# --------------------------------------------------------------------------- the surface


async def test_openapi_documents_every_route() -> None:
    async with fleet([FakeWorker("a", DIGEST)]) as (_, url):
        async with aiohttp.ClientSession() as s, s.get(url + "/openapi.json") as r:
            assert r.status == 200
            doc = await r.json()
    got = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert ROUTES <= got, sorted(ROUTES - got)
    schemas = doc["components"]["schemas"]
    assert "messages" in schemas["ChatRequest"]["properties"] and "prompt" in schemas["CompletionRequest"]["properties"]
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("/ChatRequest")


async def test_unknown_routes_methods_and_bad_bodies_are_openai_errors() -> None:
    async with fleet([FakeWorker("a", DIGEST)]) as (_, url):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/v2/nothing") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_url"
            async with s.get(url + "/v1/completions") as r:
                assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
            async with s.post(url + "/tokenize", json={"model": MODEL, "tokens": "x"}) as r:
                err = (await r.json())["error"]
                assert r.status == 400 and err["type"] == "invalid_request_error"
            async with s.post(url + "/detokenize", json={"model": MODEL, "tokens": ["x"]}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "tokens.0"
            async with s.get(url + "/v1/models/nope") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"


async def test_models_tokenize_detokenize() -> None:
    a = FakeWorker("a", DIGEST)
    async with fleet([a]) as (_, url):
        c = client(url)
        assert {m.id for m in (await c.models.list()).data} == {MODEL, "alias"}
        assert (await c.models.retrieve("alias")).model_extra["root"] == MODEL  # type: ignore[index]
        st, body, _ = await _post(url, "/tokenize", {"model": MODEL, "messages": CHAT})
        tok = msgspec.json.decode(body)
        assert st == 200 and tok["count"] == len(tok["tokens"]) > 5 and tok["max_model_len"] == 512
        r = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
        assert r.usage is not None and r.usage.prompt_tokens == tok["count"]  # the ids the gateway keys with
        st, body, _ = await _post(url, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
        assert st == 200 and "Say something about caches." in msgspec.json.decode(body)["prompt"]
        st, body, _ = await _post(url, "/tokenize", {"model": MODEL, "prompt": "hello world"})
        assert st == 200 and msgspec.json.decode(body)["count"] >= 2


async def test_fast_path_and_framework_path_answer_the_same() -> None:
    """The completion routes answer identically through the fast path and through FastAPI."""
    from router.api.app import GatewayAPI

    a = FakeWorker("a", DIGEST)
    async with fleet([a]) as (gw, url):
        fast = GatewayAPI(gw, manage_lifespan=False, fast_path=True)
        slow = GatewayAPI(gw, manage_lifespan=False, fast_path=False)
        for body in ({"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 3},
                     {"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": True,
                      "stream_options": {"include_usage": True}},
                     {"model": MODEL, "prompt": "x", "top_k": 40}):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            answers = [await _asgi(app, path, msgspec.json.encode(body)) for app in (fast, slow)]
            assert _masked(answers[0]) == _masked(answers[1])


async def _asgi(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []
    msgs = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if msgs:
            return msgs.pop()
        await wait_until(lambda: False, 60)  # never: the client stays
        return {}

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "scheme": "http", "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2),
             "http_version": "1.1", "asgi": {"version": "3.0"},
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def _masked(answer: tuple[int, bytes]) -> tuple[int, bytes]:
    import re

    status, body = answer
    return status, re.sub(rb'"(id|created|request_id)":\s*"?[A-Za-z0-9_-]+"?', b"", body)


# --------------------------------------------------------------------------- pass-through


async def test_a_vllm_worker_receives_the_clients_body_plus_only_routing_additions() -> None:
    v = FakeWorker("v", DIGEST)
    async with vllm_fleet([v]) as (_, url):
        body = {"model": "alias", "messages": CHAT, "max_tokens": 3, "response_format": {"type": "json_object"},
                "logit_bias": {"11": 5}, "min_tokens": 1, "top_k": 40, "repetition_penalty": 1.1, "n": 2,
                "logprobs": True, "top_logprobs": 2, "tools": [{"type": "function", "function": {"name": "f"}}],
                "guided_json": {"type": "object"}, "priority": 3, "lora": "l", "seed": 7, "custom_x": [1, {"y": 2}]}
        st, _, headers = await _post(url, "/v1/chat/completions", body)
        assert st == 200 and headers["x-kvroute-worker"] == "v"
        got = v.completions[-1]
        assert got.pop("model") == MODEL  # the name the worker serves, from its /v1/models
        assert got == {k: val for k, val in body.items() if k != "model"}  # nothing else added or dropped


async def test_pass_through_streams_and_bodies_come_back_as_sent() -> None:
    v = FakeWorker("v", DIGEST)
    async with vllm_fleet([v]) as (_, url):
        # whole body: byte for byte what the worker sent
        st, got, _ = await _post(url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 3})
        from fakes import _whole

        usage = v._usage(v.completions[-1], True, 3)
        assert st == 200 and got == msgspec.json.encode(_whole(True, 3, usage))
        # a stream without usage asked: the gateway asked for it upstream and drops that event
        st, got, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                           "stream": True})
        assert v.completions[-1]["stream_options"] == {"include_usage": True}
        events = got.split(b"\n\n")
        assert st == 200 and events[-2:] == [b"data: [DONE]", b""] and b'"usage"' not in got and len(events) == 5
        # with usage asked: the usage event is relayed as the worker sent it
        st, got, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                           "stream": True, "stream_options": {"include_usage": True}})
        assert b'"choices":[],"usage":{"prompt_tokens"' in got and got.endswith(b"data: [DONE]\n\n")


async def test_a_workers_own_4xx_comes_back_as_sent() -> None:
    v = FakeWorker("v", DIGEST, fail_status=400)
    async with vllm_fleet([v]) as (_, url):
        st, got, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert st == 400 and msgspec.json.decode(got)["error"]["message"] == "injected 400"
        assert len(v.completions) == 1  # a client error is not retried elsewhere


async def test_a_stream_answered_otherwise_comes_back_as_the_worker_sent_it() -> None:
    """Streams to a vLLM worker are relayed from the connection's callbacks (exchange.py):
    a 4xx to a stream request comes back with its status and body, not retried; a 5xx is
    retried on the other worker; the client's request id reaches the worker; and a 200
    that is not an event stream comes back whole."""
    bad, good = FakeWorker("bad", DIGEST, fail_status=422), FakeWorker("good", DIGEST)
    async with vllm_fleet([bad], cfg=_cfg(routing={"policy": "round_robin"})) as (_, url):
        st, got, _ = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                           "stream": True}, headers={"x-request-id": "req-42"})
        assert st == 422 and msgspec.json.decode(got)["error"]["message"] == "injected 422"
        assert len(bad.completions) == 1 and bad.completion_headers[-1]["x-request-id"] == "req-42"
    broken = FakeWorker("broken", DIGEST, fail_status=500)
    async with vllm_fleet([broken, good], cfg=_cfg(routing={"policy": "round_robin"})) as (_, url):
        for _ in range(2):
            st, got, hdrs = await _post(url, "/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                                                                       "max_tokens": 2, "stream": True})
            assert st == 200 and hdrs["x-kvroute-worker"] == "good" and got.endswith(b"data: [DONE]\n\n")
        assert broken.completions and len(good.completions) == 2
    whole = FakeWorker("whole", DIGEST, stream_as_json=True)
    async with vllm_fleet([whole]) as (_, url):
        st, got, hdrs = await _post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                              "stream": True})
        assert st == 200 and hdrs.get("Content-Type", "").startswith("application/json")
        assert msgspec.json.decode(got)["choices"][0]["finish_reason"] == "length"


async def test_fields_our_workers_lack_go_to_vllm_or_are_named() -> None:
    ours, v = FakeWorker("ours", DIGEST), FakeWorker("v", DIGEST)
    async with vllm_fleet([ours, v], ["kvroute", "vllm"]) as (_, url):
        c = client(url)
        for _ in range(4):
            await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,  # type: ignore[arg-type]
                                            response_format={"type": "json_object"})
        assert len(v.completions) == 4 and not ours.completions
    async with fleet([FakeWorker("a", DIGEST)]) as (_, url):
        with pytest.raises(openai.BadRequestError) as ei:
            await client(url).chat.completions.create(model=MODEL, messages=CHAT,  # type: ignore[arg-type]
                                                      response_format={"type": "json_object"})
        assert ei.value.code == "unsupported_parameter" and "response_format" in ei.value.message


async def test_min_tokens_reaches_our_workers_and_is_checked() -> None:
    """`min_tokens` (benchmark clients send it for fixed output lengths) is one our engines
    implement: it goes to our workers as asked, and a minimum above the maximum, or below
    0, is the client's 400 before any worker sees it."""
    a = FakeWorker("a", DIGEST)
    async with fleet([a]) as (_, url):
        c = client(url)
        await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,  # type: ignore[arg-type]
                                        extra_body={"min_tokens": 3})
        assert a.completions[-1]["min_tokens"] == 3 and a.completions[-1]["max_tokens"] == 4
        for extra, kw in (({"min_tokens": 5}, {"max_tokens": 4}), ({"min_tokens": -1}, {}),
                          ({"min_tokens": 5000}, {})):
            with pytest.raises(openai.BadRequestError) as ei:
                await c.chat.completions.create(model=MODEL, messages=CHAT, extra_body=extra,  # type: ignore[arg-type]
                                                **kw)
            assert ei.value.param == "min_tokens", ei.value.message
        assert len(a.completions) == 1


async def test_a_worker_serving_another_model_is_refused() -> None:
    wrong, good = FakeWorker("wrong", DIGEST, model="someone-else"), FakeWorker("good", DIGEST)
    async with vllm_fleet([wrong, good]) as (gw, url):
        w = gw.pool.workers["wrong"]
        await wait_until(lambda: w.state.value == "refused", what="the wrong model refused")
        assert "someone-else" in w.reason and gw.metrics.worker_refused.labels("wrong", "model_mismatch")._value.get()
        for _ in range(3):
            await client(url).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert not wrong.completions and len(good.completions) == 3


async def test_a_mis_keyed_worker_is_flagged() -> None:
    skewed, good = FakeWorker("skewed", DIGEST, prompt_skew=7), FakeWorker("good", DIGEST)
    async with vllm_fleet([skewed, good], cfg=_cfg(routing={"policy": "round_robin"})) as (gw, url):
        c = client(url)
        for i in range(30):
            await c.completions.create(model=MODEL, prompt=f"prompt {i} " * 3, max_tokens=1)
        assert len(skewed.completions) >= 5 and len(good.completions) >= 5
        async with aiohttp.ClientSession() as s, s.get(url + "/admin/workers") as r:
            ws = {w["id"]: w for w in (await r.json())["workers"]}
        assert ws["skewed"]["key_fidelity"]["mis_keyed"] is True
        assert ws["good"]["key_fidelity"]["mis_keyed"] is False and ws["good"]["key_fidelity"]["prompt_mismatches"] == 0
        assert gw.metrics.key_prompt_mismatch.labels("skewed")._value.get() == len(skewed.completions)


async def test_embeddings_are_forwarded() -> None:
    v = FakeWorker("v", DIGEST)
    async with vllm_fleet([v]) as (_, url):
        r = await client(url).embeddings.create(model=MODEL, input="hello")
        assert r.data[0].embedding == [0.5, 0.25] and v.embeddings[0]["input"] == "hello"


# Values for the fields the gateway itself reads (typed); every other field gets a value
# of its own that only a transparent proxy delivers unchanged.
_TYPED = {"model": MODEL, "messages": CHAT, "prompt": "Tell me about caches.", "max_tokens": 3,
          "max_completion_tokens": 3, "stream": True, "stream_options": {"include_usage": True}, "n": 2,
          "stop": ["\n\n"], "temperature": 0.5, "top_p": 0.9, "seed": 11, "user": "u-1", "presence_penalty": 0.1,
          "frequency_penalty": 0.2, "logprobs": True, "top_logprobs": 2, "cache_salt": "client-salt",
          "ignore_eos": True, "min_tokens": 2, "echo": True, "suffix": "s",
          "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}


@pytest.mark.parametrize("request_class", ["ChatCompletionRequest", "CompletionRequest"])
async def test_no_field_of_vllms_request_is_dropped(request_class: str) -> None:
    """Every field of vLLM's own request models (tests/data/vllm, from vLLM 0.32.0) reaches
    the vLLM worker unchanged, all of them in one request."""
    from pathlib import Path

    spec = msgspec.json.decode((Path(__file__).parents[1] / "data/vllm/request-fields-0.32.0.json").read_bytes())
    names = [f["name"] for f in spec[request_class]["fields"]]
    assert len(names) > 50
    chat = request_class == "ChatCompletionRequest"
    if not chat:
        names.remove("max_completion_tokens") if "max_completion_tokens" in names else None
    body = {n: _TYPED.get(n, {"probe": n, "list": [n, 1, 2.5, None, True]}) for n in names}
    if not chat:
        body["n"] = 1  # a stream of n completions interleaves; one is enough to relay here
    v = FakeWorker("v", DIGEST)
    async with vllm_fleet([v]) as (_, url):
        st, got, _ = await _post(url, "/v1/chat/completions" if chat else "/v1/completions", body)
        assert st == 200, got
    received = v.completions[-1]
    assert received == body  # model: the worker serves MODEL; cache_salt: no tenant salt to fold in
