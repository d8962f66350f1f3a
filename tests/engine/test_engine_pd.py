"""Prefill/decode disaggregation on the real engine, the tiny Llama, over HTTP, driven the way
vLLM's disaggregated-serving proxies drive it: the request with `max_tokens: 1` and
`kv_transfer_params.do_remote_decode` to a prefill-role worker, then the client's request
with the returned `kv_transfer_params` to a decode-role worker, which pulls the blocks from
the prefill worker's authenticated peer path and decodes. Greedy output equals one worker
recomputing everything; the pulled tokens are reported; the prefill worker's pinned blocks
go back to 0 when pulled, or when the bound passes if no decode worker ever pulls; forged
or stale parameters are clean 4xx/5xx errors."""
from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hangs import patience

from workers.api import RECORDS_MEDIA_TYPE
from workers.engine.model import LoadedModel, ModelSpec, load_model
from workers.fleetkeys import peer_bearer

TOKEN = "pd-fleet-secret"
BLOCK = 16
PROMPT = [(i * 37 + 11) % 8000 for i in range(70)]  # 4 full blocks a decode worker reuses, 6 tokens after
VLLM_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoadedModel]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model(ModelSpec(cache_dir=Path(tmp_path_factory.getbasetemp()) / "kvroute-cache",
                                   device="cpu", dtype="float32"))
    finally:
        torch.set_num_threads(threads)


async def start_worker(lm: LoadedModel, wid: str, role: str, *, token: str | None = TOKEN,
                       pin_s: float = 30.0) -> Any:
    from workers.engine.core import EngineCore
    from workers.engine.engine import TorchEngine
    from workers.engine.engineconfig import EngineConfig
    from workers.engine.server import EngineWorker, ServeOptions
    from workers.engine.tiers import TierConfig

    cfg = EngineConfig(worker_id=wid, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=256,
                       tiers=TierConfig(peer_token=token) if token else None, role=role, pd_pin_s=pin_s)
    w = EngineWorker(TorchEngine(EngineCore(lm, cfg), calibrate=False), ServeOptions(peer_token=token))
    await w.start()
    return w


@pytest.fixture
async def http() -> AsyncIterator[Any]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        yield s


def body(max_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}


async def post(http: Any, url: str, b: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(url + "/v1/completions", json=b) as r:
        return r.status, await r.json()


async def post_chat(http: Any, url: str, b: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(url + "/v1/chat/completions", json=b) as r:
        return r.status, await r.json()


async def metric(http: Any, url: str, name: str) -> float:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


async def wait_metric(http: Any, url: str, name: str, value: float, within_s: float) -> float:
    """The metric once it reads `value`, or as it reads when `within_s` (scaled by the
    machine's load: a deadline for an event, not a speed bound) has passed."""
    deadline = time.monotonic() + patience(within_s)
    while True:
        got = await metric(http, url, name)
        if got == value or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


async def test_prefill_then_decode_equals_one_worker(lm: LoadedModel, http: Any) -> None:
    p = await start_worker(lm, "p", "prefill")
    d = await start_worker(lm, "d", "decode")
    both = await start_worker(lm, "b", "both", token=None)
    try:
        async with http.get(p.url + "/info") as r:
            assert (await r.json())["role"] == "prefill"
        async with http.get(d.url + "/info") as r:
            assert (await r.json())["role"] == "decode"

        status, ref = await post(http, both.url, body())
        assert status == 200, ref
        want = ref["choices"][0]["token_ids"]
        assert len(want) == 8

        # request 1, as vLLM's proxy sends it: one token, not streamed, do_remote_decode
        status, first = await post(http, p.url, body(1, stream=False, kv_transfer_params=VLLM_PREFILL))
        assert status == 200, first
        assert first["choices"][0]["token_ids"] == want[:1]
        kvt = first["kv_transfer_params"]
        prompt_keys = p.engine.core.new_sequence("k", PROMPT, _greedy()).keys
        assert kvt["do_remote_prefill"] is True and kvt["do_remote_decode"] is False
        assert kvt["remote_engine_id"] == "p"
        assert kvt["remote_block_ids"] == [k.hex() for k in prompt_keys[:4]]
        assert kvt["remote_host"] == "127.0.0.1" and kvt["remote_port"] == p.port
        assert kvt["kvroute_tokens"] == 64 and kvt["kvroute_pin_s"] == 30.0
        assert await metric(http, p.url, "kvroute_worker_pd_pinned_blocks") == 4
        # pinned: not evictable while the pool is churned by other prompts
        for i in range(4):
            other = [(j * 13 + 100 * i + 5) % 8000 for j in range(300)]
            st, _ = await post(http, p.url, {"prompt": other, "max_tokens": 1})
            assert st == 200
        assert all(k in p.engine.core.blocks.by_key for k in prompt_keys[:4])

        # request 2: the client's own request with the returned fields, to the decode worker
        status, out = await post(http, d.url, body(kv_transfer_params=kvt))
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want
        kv = out["usage"]["kv"]
        assert kv["loaded_tokens"]["PEER"] == 64 and kv["recomputed_tokens"] == len(PROMPT) - 64
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 64

        assert await wait_metric(http, p.url, "kvroute_worker_pd_pinned_blocks", 0, 5.0) == 0
        assert await metric(http, p.url, "kvroute_worker_pd_pins_pulled_total") == 1
        assert await metric(http, p.url, "kvroute_worker_pd_pins_expired_total") == 0
        assert await metric(http, d.url, "kvroute_worker_pd_pinned_blocks") == 0
        assert d.engine.core.blocks.used() - len(d.engine.core.blocks.cached) == 0  # nothing held on D

        # chat, the decode streamed: the same exchange, the usage chunk reports the pull
        chat = {"messages": [{"role": "user", "content": "tell me a long story about blocks " * 4}],
                "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, ref_chat = await post_chat(http, both.url, chat)
        assert status == 200, ref_chat
        async with http.post(p.url + "/v1/chat/completions",
                             json={**chat, "max_tokens": 1, "stream": True, "kv_transfer_params": VLLM_PREFILL}) as r:
            assert r.status == 200
            events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                      if line.startswith("data: {")]
        ckvt = events[-1]["kv_transfer_params"]  # streamed: on the finish chunk
        assert ckvt["remote_engine_id"] == "p" and events[-1]["choices"][0]["finish_reason"] == "length"
        n = len(ckvt["remote_block_ids"])
        assert n >= 2 and ckvt["kvroute_tokens"] == n * BLOCK
        async with http.post(d.url + "/v1/chat/completions",
                             json={**chat, "stream": True, "stream_options": {"include_usage": True},
                                   "kv_transfer_params": ckvt}) as r:
            assert r.status == 200
            events = [json.loads(line[6:]) for line in (await r.text()).splitlines()
                      if line.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
        assert text == ref_chat["choices"][0]["message"]["content"]
        assert events[-1]["usage"]["kv"]["loaded_tokens"]["PEER"] == n * BLOCK
        assert await wait_metric(http, p.url, "kvroute_worker_pd_pinned_blocks", 0, 5.0) == 0
        assert await metric(http, p.url, "kvroute_worker_pd_pins_pulled_total") == 2
    finally:
        for w in (p, d, both):
            await w.stop()


def _greedy() -> Any:
    from workers.engine.sequence import SamplingParams

    return SamplingParams(max_tokens=1)


async def test_pins_are_released_after_the_bound_when_no_decode_pulls(lm: LoadedModel, http: Any) -> None:
    p = await start_worker(lm, "p", "both", pin_s=0.6)
    d = await start_worker(lm, "d", "decode")
    try:
        status, first = await post(http, p.url, body(1, kv_transfer_params=VLLM_PREFILL))
        assert status == 200, first
        assert await metric(http, p.url, "kvroute_worker_pd_pinned_blocks") == 4
        # a decode worker that only listed the blocks, or pulled half of them, then died
        kvt = first["kv_transfer_params"]
        keys = [bytes.fromhex(k) for k in kvt["remote_block_ids"]]
        auth = {"Authorization": f"Bearer {peer_bearer(TOKEN)}"}
        async with http.post(p.url + "/kv/blocks", json={"keys_b64": base64.b64encode(b"".join(keys)).decode()},
                             headers=auth) as r:
            assert r.status == 200 and len((await r.json())["blocks"]) == 4
        async with http.post(p.url + "/kv/blocks", json={"keys_b64": base64.b64encode(b"".join(keys[:2])).decode()},
                             headers={**auth, "Accept": RECORDS_MEDIA_TYPE}) as r:
            assert r.status == 200 and len(await r.read()) > 2 * p.engine.core.pool.block_bytes
        assert await metric(http, p.url, "kvroute_worker_pd_pinned_blocks") == 4
        # the pins go back within the bound
        assert await wait_metric(http, p.url, "kvroute_worker_pd_pinned_blocks", 0, 3.0) == 0
        assert await metric(http, p.url, "kvroute_worker_pd_pins_expired_total") == 1
        assert p.engine.core.blocks.available() == p.engine.core.blocks.num_blocks

        # the prefill worker gone: the decode side answers a clean 502, holds nothing, serves on
        await p.stop()
        status, err = await post(http, d.url, body(kv_transfer_params=kvt))
        assert status == 502, err
        assert err["error"]["code"] == "kv_transfer_failed" and "p" in err["error"]["message"]
        assert d.engine.core.blocks.used() == 0
        status, ok = await post(http, d.url, body())
        assert status == 200 and ok["usage"]["kv"]["loaded_tokens"]["PEER"] == 0
    finally:
        await p.stop()
        await d.stop()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_forged_or_misdirected_transfer_params_are_clean_errors(lm: LoadedModel, http: Any) -> None:
    p = await start_worker(lm, "p", "prefill")
    d = await start_worker(lm, "d", "decode")
    intruder = await start_worker(lm, "x", "decode", token="not-the-fleet-secret")
    try:
        status, first = await post(http, p.url, body(1, kv_transfer_params=VLLM_PREFILL))
        assert status == 200
        kvt = first["kv_transfer_params"]

        async def refused(url: str, params: dict[str, Any], want_status: int, b: dict[str, Any] | None = None) -> str:
            st, err = await post(http, url, {**(b or body()), "kv_transfer_params": params})
            assert st == want_status, (params, err)
            assert set(err["error"]) >= {"message", "type", "code"}
            return str(err["error"]["message"])

        # a worker without the fleet secret is refused by the prefill worker's peer path
        assert "401" in await refused(intruder.url, kvt, 502)
        # nobody listens there
        await refused(d.url, {**kvt, "remote_port": _closed_port()}, 502)
        # keys of another prompt (or forged ones) are not this prompt's chain
        await refused(d.url, {**kvt, "remote_block_ids": ["ab" * 32] * 4}, 400)
        await refused(d.url, kvt, 400, {**body(), "prompt": list(reversed(PROMPT))})
        await refused(d.url, kvt, 400, {**body(), "cache_salt": "tenant-b"})
        # vLLM's integer block ids, malformed fields, contradictory flags
        await refused(d.url, {**kvt, "remote_block_ids": [1, 2, 3]}, 400)
        await refused(d.url, {**kvt, "remote_host": "evil/path"}, 400)
        await refused(d.url, {**kvt, "remote_port": 0}, 400)
        await refused(d.url, {**kvt, "do_remote_decode": True}, 400)
        # a role does not do the other half
        assert "role" in await refused(d.url, VLLM_PREFILL, 400)
        assert "role" in await refused(p.url, kvt, 400)

        assert d.engine.core.blocks.used() == 0 and intruder.engine.core.blocks.used() == 0
        assert await metric(http, p.url, "kvroute_worker_pd_pinned_blocks") == 4  # nobody pulled them
        status, out = await post(http, d.url, body(kv_transfer_params=kvt))  # the right worker still can
        assert status == 200 and out["usage"]["kv"]["loaded_tokens"]["PEER"] == 64
        assert await wait_metric(http, p.url, "kvroute_worker_pd_pinned_blocks", 0, 5.0) == 0
    finally:
        for w in (p, d, intruder):
            await w.stop()


def test_role_flags(lm: LoadedModel) -> None:
    import argparse

    from workers.engine.args import add_arguments, check_arguments
    from workers.engine.server import build_engine

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    common = ["--port", "0", "--device", "cpu", "--cache-dir", str(lm.folder.parent), "--num-blocks", "8",
              "--no-calibrate"]
    assert ap.parse_args(common).role == "both"
    a = ap.parse_args([*common, "--role", "prefill", "--pd-pin-s", "5"])
    assert check_arguments(a) is None
    engine = build_engine(a)
    assert engine.info().role == "prefill" and engine.core.cfg.pd_pin_s == 5.0
    assert check_arguments(ap.parse_args([*common, "--pd-pin-s", "0"])) == "--pd-pin-s must be positive"
    with pytest.raises(SystemExit):
        ap.parse_args([*common, "--role", "decoder"])


async def test_a_pin_whose_client_left_as_it_finished_is_still_released(lm: LoadedModel) -> None:
    from workers.api import GenRequest
    from workers.engine.core import EngineCore
    from workers.engine.engine import TorchEngine
    from workers.engine.engineconfig import EngineConfig

    core = EngineCore(lm, EngineConfig(num_blocks=32, pd_pin_s=0.5))
    engine = TorchEngine(core, calibrate=False)
    await engine.start()
    try:
        stream = await engine.generate(GenRequest("r", PROMPT, 1, kv_transfer_params=VLLM_PREFILL))
        deadline = time.monotonic() + patience(30)
        while True:  # the event loop held: the engine thread finishes the prefill, nothing is dispatched yet
            with core.lock:
                if core.pins:
                    break
            assert time.monotonic() < deadline
            time.sleep(0.002)
        stream.cancel()  # the client went away between the finish and its delivery
        assert engine.pd_pinned_blocks() == 4
        await asyncio.sleep(1.0)
        assert engine.pd_pinned_blocks() == 0 and core.stats.pd_pins_expired == 1
        assert core.blocks.available() == core.blocks.num_blocks
    finally:
        await engine.close()


# --------------------------------------------------------------------------- through the gateway


def _pd_gateway_config(lm: LoadedModel, workers: list[tuple[str, str, str]]) -> Any:
    from router.config import build_config

    repo = Path(__file__).resolve().parents[2]
    return build_config({
        "models": [{"id": lm.model_id, "tokenizer": "assets/tiny-tokenizer", "profile": "tiny-cpu",
                    "namespace": {"block_size": BLOCK}}],
        "workers": [{"id": wid, "url": url, "model": lm.model_id, "kind": "kvroute", "role": role}
                    for wid, url, role in workers],
        "pool": {"load_poll_interval_s": 0.05, "health_interval_s": 0.1, "probe_timeout_s": 2.0},
        "routing": {"policy": "pd_cost", "retries": 1},
    }, repo / "configs", environ={})


async def test_a_pair_through_the_gateway_streams_what_one_worker_computes(lm: LoadedModel, http: Any) -> None:
    """The issue's end to end on our engine: a prefill-role and a decode-role worker behind the
    gateway (pd_cost), the OpenAI SDK streaming a chat answer: greedy text equal to one `both`
    worker's, the headers naming who prefilled, who decoded and how many tokens moved, and
    the prefill worker's pins back to 0 once the decode worker pulled them."""
    import openai

    from router.server import running_gateway

    p, d, ref = (await start_worker(lm, "p0", "prefill"), await start_worker(lm, "d0", "decode"),
                 await start_worker(lm, "ref", "both"))
    msgs = [{"role": "user", "content": "Tell me about caches and routers. " * 6}]
    try:
        st, want = await post_chat(http, ref.url, {"messages": msgs, "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True})
        assert st == 200
        cfg = _pd_gateway_config(lm, [("p0", p.url, "prefill"), ("d0", d.url, "decode")])
        async with running_gateway(cfg, ready_timeout=20.0) as (gw, url):
            deadline = time.monotonic() + patience(20)
            while len(gw.pool.routable(lm.model_id)) < 2:
                assert time.monotonic() < deadline, "the pair did not register"
                await asyncio.sleep(0.05)
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            try:
                raw = await c.chat.completions.with_raw_response.create(
                    model=lm.model_id, messages=msgs, max_tokens=8, temperature=0, stream=True,  # type: ignore[arg-type]
                    extra_body={"ignore_eos": True})
                text = "".join([ch.choices[0].delta.content or "" async for ch in raw.parse() if ch.choices])
            finally:
                await c.close()
        assert text == want["choices"][0]["message"]["content"]
        assert raw.headers["x-kvroute-prefill-worker"] == "p0" and raw.headers["x-kvroute-decode-worker"] == "d0"
        assert int(raw.headers["x-kvroute-kv-moved-tokens"]) >= BLOCK
        assert await wait_metric(http, p.url, "kvroute_worker_pd_pinned_blocks", 0, 5.0) == 0
        assert await metric(http, p.url, "kvroute_worker_pd_pins_pulled_total") == 1
    finally:
        for w in (p, d, ref):
            await w.stop()


async def test_a_dead_decode_worker_is_a_clear_error_and_leaks_nothing(lm: LoadedModel, http: Any) -> None:
    """The decode side gone: a request the gateway pairs before it notices gets its 502 (the
    decode side failed after the prefill, no other decode worker to retry on), one after it
    noticed a 503 (no worker can answer), never a 429 (busy); and the prefill worker's pins
    are back within their bound."""
    import openai

    from router.server import running_gateway

    p, d = await start_worker(lm, "p0", "prefill", pin_s=1.0), await start_worker(lm, "d0", "decode")
    try:
        cfg = _pd_gateway_config(lm, [("p0", p.url, "prefill"), ("d0", d.url, "decode")])
        async with running_gateway(cfg, ready_timeout=20.0) as (gw, url):
            deadline = time.monotonic() + patience(20)
            while len(gw.pool.routable(lm.model_id)) < 2:
                assert time.monotonic() < deadline, "the pair did not register"
                await asyncio.sleep(0.05)
            await d.stop()
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            try:
                for _ in range(2):  # before and after the health probes mark it down
                    with pytest.raises(openai.APIStatusError) as ei:
                        await c.completions.create(model=lm.model_id, prompt=PROMPT, max_tokens=4, temperature=0)
                    assert ei.value.status_code in (502, 503), ei.value
                    await asyncio.sleep(0.5)
            finally:
                await c.close()
        assert await wait_metric(http, p.url, "kvroute_worker_pd_pinned_blocks", 0, 5.0) == 0
    finally:
        await p.stop()
