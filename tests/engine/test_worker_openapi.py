"""The worker app as FastAPI serves it, called in-process (httpx's ASGI transport): the
/openapi.json route table and request schemas, FastAPI's own errors in OpenAI's shape,
/v1/models and vLLM's /tokenize and /detokenize (same ids as the completion routes),
the shared fields rule of kvwire.openai (400 naming the field), and the direct lane of
the generation routes answering with the same bytes as FastAPI's path."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from worker_app import AliasedDriver, assert_error, client

import workers.web.stream as stream_mod
from kvwire import LoadReport, WorkerInfo
from workers.api import GenChunk, GenRequest
from workers.app import WorkerFastAPI, build_app
from workers.errors import QueueFull
from workers.sim.driver import SimDriver
from workers.sim.engine import SimEngine
from workers.sim.testing import make_profile
from workers.tokenizer import SimTokenizer
from workers.usage import Usage

ROUTES = {
    ("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
    ("/v1/models/{model_id}", "get"), ("/tokenize", "post"), ("/detokenize", "post"), ("/load", "get"),
    ("/info", "get"), ("/health", "get"), ("/metrics", "get"), ("/kv/prefetch", "post"),
    ("/kv/prefetch/{prefetch_id}", "delete"), ("/kv/blocks", "get"), ("/kv/blocks", "post"), ("/kv/purge", "post"),
    ("/kv/republish", "post"), ("/v1/embeddings", "post"),
}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]


@pytest.fixture
async def sim() -> AsyncIterator[SimDriver]:
    d = AliasedDriver(SimEngine("w0", make_profile(gpu_blocks=256, max_context_tokens=1024)))
    await d.start()
    try:
        yield d
    finally:
        await d.close()


@pytest.fixture
async def http(sim: SimDriver) -> AsyncIterator[httpx.AsyncClient]:
    async with client(build_app(sim)) as c:
        yield c


# ------------------------------------------------------------------ /openapi.json


async def test_openapi_lists_every_route_and_the_request_schemas(http: httpx.AsyncClient) -> None:
    doc = (await http.get("/openapi.json")).json()
    assert {(p, m) for p, ops in doc["paths"].items() for m in ops} == ROUTES
    schemas = doc["components"]["schemas"]

    def body_schema(path: str) -> dict[str, Any]:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        return dict(schemas[ref.rsplit("/", 1)[1]])

    completion, chat = body_schema("/v1/completions"), body_schema("/v1/chat/completions")
    assert {"prompt", "max_tokens", "stream", "cache_salt", "kv"} <= set(completion["properties"])
    assert {"messages", "max_completion_tokens", "stream_options"} <= set(chat["properties"])
    assert {"prompt", "messages", "add_special_tokens"} <= set(body_schema("/tokenize")["properties"])
    assert "text/event-stream" in doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    params = {p["name"] for p in doc["paths"]["/kv/blocks"]["get"]["parameters"]}
    assert params == {"keys_b64", "meta"}
    refs = [v for v in _walk(doc) if isinstance(v, str) and v.startswith("#/components/schemas/")]
    assert refs and all(r.rsplit("/", 1)[1] in schemas for r in refs)
    for ui in ("/docs", "/redoc"):  # no docs UI: it would fetch its assets from a CDN
        assert_error(await http.get(ui), 404)
    assert (await http.head("/health")).status_code == 200  # answered as before, not documented


def _walk(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [x for v in node.values() for x in _walk(v)]
    if isinstance(node, list):
        return [x for v in node for x in _walk(v)]
    return [node]


async def test_fastapi_errors_are_openai_shaped(sim: SimDriver) -> None:
    app = build_app(sim)

    async def probe(n: int) -> dict[str, int]:
        return {"n": n}

    app.add_api_route("/probe", probe, methods=["GET"])  # a typed parameter: FastAPI validates it
    async with client(app) as http:
        assert assert_error(await http.get("/nope"), 404)["code"] == "unknown_url"
        assert_error(await http.post("/v1/embeddings", json={}), 400, "input")
        r = await http.get("/v1/completions")
        assert assert_error(r, 405)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
        assert_error(await http.put("/kv/purge", json={}), 405)
        assert_error(await http.get("/probe", params={"n": "x"}), 400, "n")
        assert (await http.get("/probe", params={"n": "3"})).json() == {"n": 3}


# ------------------------------------------------------------------ models, tokenizer


async def test_models(http: httpx.AsyncClient) -> None:
    r = await http.get("/v1/models")
    assert r.status_code == 200
    got = r.json()
    assert got["object"] == "list" and [m["id"] for m in got["data"]] == ["alias", "test/model"]
    for m in got["data"]:
        assert m["object"] == "model" and m["root"] == "test/model" and m["max_model_len"] == 1024
        assert isinstance(m["created"], int) and m["owned_by"]
    one = (await http.get("/v1/models/test/model")).json()  # a model id with a slash
    assert one == got["data"][1]
    assert (await http.get("/v1/models/alias")).json()["id"] == "alias"
    assert_error(await http.get("/v1/models/nope"), 404, "model")
    c = (await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})).json()
    assert c["model"] == "alias"  # the first served name is the one responses carry


async def test_tokenize_agrees_with_the_completion_routes(http: httpx.AsyncClient, sim: SimDriver) -> None:
    text = "hello there, simulated worker"
    tok = (await http.post("/tokenize", json={"model": "alias", "prompt": text})).json()
    assert tok["tokens"] == sim.tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 1024
    comp = (await http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})).json()
    assert comp["usage"]["prompt_tokens"] == tok["count"]
    back = (await http.post("/detokenize", json={"model": "alias", "tokens": tok["tokens"]})).json()
    assert back == {"prompt": text}
    again = (await http.post("/tokenize", json={"prompt": back["prompt"], "add_special_tokens": True})).json()
    assert again["tokens"] == tok["tokens"]

    msgs = (await http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": True})).json()
    chat = (await http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})).json()
    assert msgs["count"] == chat["usage"]["prompt_tokens"] == len(msgs["tokens"])
    assert msgs["tokens"] == sim.tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                                                {"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "add_special_tokens": False}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, 400, "add_generation_prompt"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs"),
        ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
        ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages[0].content[0]"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"tokens": [1, -2]}, 400, "tokens"),
        ("/detokenize", {"tokens": "x"}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
    ],
)
async def test_tokenizer_refusals(http: httpx.AsyncClient, path: str, body: dict[str, Any], status: int,
                                  param: str) -> None:
    assert_error(await http.post(path, json=body), status, param)


# ------------------------------------------------------------------ the fields rule

UNSUPPORTED = [
    ("response_format", {"type": "json_object"}), ("logit_bias", {"50256": -100}),
    ("top_k", 40), ("repetition_penalty", 1.2), ("n", 2),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
]
NEUTRAL = [("n", 1), ("logprobs", False), ("top_k", -1), ("user", "x"), ("lora", "adapter-a"), ("temperature", 0.7)]


def gen_body(path: str, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"prompt": [5, 6, 7]} if path == "/v1/completions" else {"messages": CHAT}
    return {**base, "max_tokens": 2, **extra}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("field", "value"), UNSUPPORTED)
async def test_unsupported_fields_are_refused(http: httpx.AsyncClient, path: str, field: str, value: Any) -> None:
    err = assert_error(await http.post(path, json=gen_body(path, **{field: value})), 400, field)
    assert err["message"] == f"{field} is not supported by this worker" and err["code"] == "unsupported_parameter"


@pytest.mark.parametrize(("path", "asks"), [("/v1/completions", {"logprobs": 2}),
                                           ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}),
                                           ("/v1/chat/completions", {"logprobs": True})])
async def test_the_simulated_engine_refuses_logprobs(http: httpx.AsyncClient, path: str, asks: dict[str, Any]) -> None:
    err = assert_error(await http.post(path, json=gen_body(path, **asks)), 400, "logprobs")
    assert err["code"] == "unsupported_parameter" and "simulated engine has no model" in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_the_simulated_engine_refuses_kv_transfer_params(http: httpx.AsyncClient, path: str) -> None:
    asks = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    err = assert_error(await http.post(path, json=gen_body(path, **asks)), 400, "kv_transfer_params")
    assert err["code"] == "unsupported_parameter" and "holds no KV to transfer" in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_the_simulated_engine_takes_min_tokens_and_returns_token_ids(http: httpx.AsyncClient, sim: SimDriver,
                                                                          path: str) -> None:
    chat = path != "/v1/completions"
    r = await http.post(path, json=gen_body(path, max_tokens=6, min_tokens=6, return_token_ids=True))
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] == 6 and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 6
    assert sim.tokenizer.decode(choice["token_ids"]) == (choice["message"]["content"] if chat else choice["text"])
    prompt_ids = body["prompt_token_ids"] if chat else choice["prompt_token_ids"]
    assert len(prompt_ids) == body["usage"]["prompt_tokens"]
    if not chat:
        assert prompt_ids == [5, 6, 7]
    # streamed: the prompt's ids once, each chunk's generated ids
    async with http.stream("POST", path, json=gen_body(path, max_tokens=6, min_tokens=2, return_token_ids=True,
                                                       stream=True)) as s:
        events = [json.loads(line[6:]) async for line in s.aiter_lines()
                  if line.startswith("data: {")]
    with_prompt = [e for e in events if "prompt_token_ids" in (e if chat else e["choices"][0])]
    assert len(with_prompt) == 1
    got = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    assert got == choice["token_ids"]  # filler tokens: the same for the same length
    for bad, param in (({"min_tokens": 7}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                       ({"min_tokens": "x"}, "min_tokens")):
        assert_error(await http.post(path, json=gen_body(path, max_tokens=6, **bad)), 400, param)
    # without max_tokens, this worker's default length gives way to min_tokens
    body = {k: v for k, v in gen_body(path, min_tokens=40).items() if k != "max_tokens"}
    r = await http.post(path, json=body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 40, r.text


async def test_non_text_content_is_refused(http: httpx.AsyncClient) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this"}, image]}]
    err = assert_error(await http.post("/v1/chat/completions", json={"messages": msgs}), 400, "messages[0].content[1]")
    assert err["code"] == "unsupported_parameter"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("field", "value"), NEUTRAL)
async def test_neutral_values_are_accepted(http: httpx.AsyncClient, path: str, field: str, value: Any) -> None:
    r = await http.post(path, json=gen_body(path, **{field: value}))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


async def test_sampling_fields_reach_the_engine(sim: SimDriver) -> None:
    """Fields the list calls implemented are passed on (the torch engine reads them by
    name), typed: a wrong type is a 400 naming the field."""
    engine = Scripted(sim.tokenizer)
    async with client(build_app(engine)) as http:
        body = {"prompt": [1, 2], "temperature": 0, "top_p": 0.5, "seed": 7, "stop": ["##"], "lora": "ad"}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        req = engine.last
        assert req is not None and isinstance(req, GenRequest) and req.lora == "ad"
        assert (getattr(req, "temperature", None), getattr(req, "top_p", None)) == (0.0, 0.5)
        assert (getattr(req, "seed", None), getattr(req, "stop", None)) == (7, ["##"])
        assert_error(await http.post("/v1/completions", json={"prompt": [1], "temperature": "hot"}), 400,
                     "temperature")


# ------------------------------------------------------------------ the direct lane


class _Stream:
    def __init__(self, req: GenRequest) -> None:
        self.request_id = req.request_id
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self.prompt = len(req.prompt_ids)

    async def __aiter__(self) -> AsyncIterator[GenChunk]:
        for t in ("Hello", " world"):
            yield GenChunk([7], t)
        self.usage = Usage(self.prompt, 2, recomputed_tokens=self.prompt, ttft_ms=1.5)
        self.finish_reason = "length"

    def cancel(self) -> None:
        pass


class Scripted:
    """A deterministic engine: the same request always gets the same bytes; a prompt
    starting with id 0 finds the queue full (429 + Retry-After)."""

    worker_id = "w0"
    draining = False

    def __init__(self, tokenizer: SimTokenizer) -> None:
        self.tokenizer = tokenizer
        self.last: GenRequest | None = None

    def info(self) -> WorkerInfo:
        return WorkerInfo(namespace_digest="0" * 64, block_size=16, worker_id="w0", engine="scripted",
                          model="test/model", max_context_tokens=1024)

    def load(self) -> LoadReport:
        return LoadReport(worker_id="w0")

    async def generate(self, req: GenRequest) -> _Stream:
        if req.prompt_ids[0] == 0:
            raise QueueFull("the waiting queue is full", retry_after=2.0)
        self.last = req
        return _Stream(req)

    def counters(self) -> dict[str, dict[str, float]]:
        return {}


async def test_direct_lane_answers_with_the_same_bytes(sim: SimDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_mod, "time", type("FixedTime", (), {"time": staticmethod(lambda: 1_700_000_000.0)}))
    engine = Scripted(sim.tokenizer)
    fast, slow = build_app(engine, max_body_bytes=4096), build_app(engine, max_body_bytes=4096, fast_path=False)
    assert isinstance(fast, WorkerFastAPI) and set(fast.lanes) == {"/v1/completions", "/v1/chat/completions"}
    assert not slow.lanes

    async def not_fastapi(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the direct lane went through FastAPI's stack")

    fast.middleware_stack = not_fastapi  # every case below must take the lane
    kv = {"request_id": "r1"}
    cases: list[tuple[str, bytes, int]] = [
        ("/v1/completions", msgspec.json.encode({"prompt": [1, 2, 3], "max_tokens": 2, "kv": kv}), 200),
        ("/v1/completions", msgspec.json.encode({"prompt": "hello", "kv": kv, "stream": True,
                                                 "stream_options": {"include_usage": True}}), 200),
        ("/v1/chat/completions", msgspec.json.encode({"messages": CHAT, "kv": kv}), 200),
        ("/v1/chat/completions", msgspec.json.encode({"messages": CHAT, "kv": kv, "stream": True}), 200),
        ("/v1/completions", msgspec.json.encode({"prompt": [1], "response_format": {"type": "json_object"}}), 400),
        ("/v1/completions", msgspec.json.encode({"prompt": [0, 1]}), 429),
        ("/v1/completions", msgspec.json.encode({"model": "nope", "prompt": [1]}), 404),
        ("/v1/completions", msgspec.json.encode({"prompt": [1] * 3000}), 413),
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/chat/completions", b"[1, 2]", 400),
    ]
    async with client(fast) as a, client(slow) as b:
        for path, body, status in cases:
            hdr = {"content-type": "application/json"}
            ra, rb = await a.post(path, content=body, headers=hdr), await b.post(path, content=body, headers=hdr)
            assert ra.status_code == rb.status_code == status, (path, body, ra.text)
            assert ra.content == rb.content, (path, body)
            assert ra.headers.multi_items() == rb.headers.multi_items(), (path, body)
        assert (await a.post("/v1/completions", content=cases[5][1])).headers["retry-after"] == "2"
