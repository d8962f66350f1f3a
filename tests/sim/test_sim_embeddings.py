"""/v1/embeddings on the simulated workers (workers/sim/embed.py, workers/web/embeddings.py),
alone and through the gateway with the OpenAI SDK (what `kvroute up --sim` serves)."""
from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from sim_cluster import _cfg, gateway
from worker_app import AliasedDriver, assert_error, client

from workers.app import build_app
from workers.sim.embed import DIMS
from workers.sim.engine import SimEngine
from workers.sim.testing import make_profile


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    d = AliasedDriver(SimEngine("w0", make_profile(gpu_blocks=256, max_context_tokens=64)))
    await d.start()
    try:
        async with client(build_app(d)) as c:
            yield c
    finally:
        await d.close()


async def _embed(http: httpx.AsyncClient, **body: Any) -> Any:
    r = await http.post("/v1/embeddings", json={"model": "alias", **body})
    assert r.status_code == 200, r.text
    return r.json()


async def test_vectors_are_deterministic_unit_vectors_from_the_tokens(http: httpx.AsyncClient) -> None:
    got = await _embed(http, input=["the cat sat", "the cat sat", "the cat ran", "quantum flux capacitor"])
    assert got["object"] == "list" and got["model"] == "alias"
    vs = [np.array(d["embedding"]) for d in got["data"]]
    assert [d["index"] for d in got["data"]] == [0, 1, 2, 3] and all(len(v) == DIMS for v in vs)
    assert all(abs(np.linalg.norm(v) - 1.0) < 1e-5 for v in vs)
    assert vs[0].tolist() == vs[1].tolist()
    assert vs[0] @ vs[2] > vs[0] @ vs[3]  # sharing tokens is closer
    tok = (await http.post("/tokenize", json={"model": "alias", "prompt": "the cat sat"})).json()["tokens"]
    assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] == 3 * len(tok) + len(
        (await http.post("/tokenize", json={"model": "alias", "prompt": "quantum flux capacitor"})).json()["tokens"])
    by_ids = await _embed(http, input=tok)
    assert by_ids["data"][0]["embedding"] == got["data"][0]["embedding"]


async def test_base64_and_dimensions(http: httpx.AsyncClient) -> None:
    f = (await _embed(http, input="hello", dimensions=8))["data"][0]["embedding"]
    b = (await _embed(http, input="hello", dimensions=8, encoding_format="base64"))["data"][0]["embedding"]
    assert len(f) == 8 and list(struct.unpack("<8f", base64.b64decode(b))) == pytest.approx(f)


@pytest.mark.parametrize("body,status,param", [
    ({"input": []}, 400, "input"),
    ({"input": ["a", 1]}, 400, "input"),
    ({"input": "x", "dimensions": DIMS + 1}, 400, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "x", "truncate_prompt_tokens": 3}, 400, "truncate_prompt_tokens"),
    ({"input": [[1] * 65]}, 400, "input"),
    ({"input": "x", "model": "other"}, 404, "model"),
])
async def test_embeddings_refusals(http: httpx.AsyncClient, body: dict[str, Any], status: int, param: str) -> None:
    assert_error(await http.post("/v1/embeddings", json={"model": "alias", **body}), status, param)


async def test_embeddings_through_the_gateway_with_the_sdk(cluster: list[str]) -> None:  # noqa: F811
    async with gateway(_cfg(cluster)) as (_, url):
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        try:
            # the SDK asks for base64 unless told otherwise
            r = await c.embeddings.create(model="llama-3.1-8b", input=["a long day", "a long night"])
            f = await c.embeddings.create(model="llama-3.1-8b", input="a long day", encoding_format="float")
        finally:
            await c.close()
        assert len(r.data) == 2 and len(r.data[0].embedding) == DIMS and r.usage.prompt_tokens > 0
        assert r.data[0].embedding == pytest.approx(f.data[0].embedding, abs=1e-6)
