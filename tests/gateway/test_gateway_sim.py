"""The gateway against simulated H200 workers (`python -m workers.cli sim-cluster`, a subprocess),
through the official `openai` SDK: chat and completions, stream and not, usage; same-prefix
conversations land on the worker holding them (KV events → index); tenants isolated; tenant
purge; prefetch of blocks the worker offloaded to CPU; trace recording."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from array import array
from pathlib import Path

import aiohttp
import openai
import pytest
import yaml
from sim_cluster import (
    KEY_A,
    KEY_B,
    MODEL,
    PROFILE,
    ROOT,
    _cfg,
    _wait,
    _words,
    gateway,
    start_cluster,
    stop_cluster,
)

from kvindex.tiers import Tier
from router.server import running_gateway


async def test_openai_sdk_chat_and_completions(cluster: list[str]) -> None:
    async with (
        gateway(_cfg(cluster)) as (gw, url),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c,
    ):
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _words(1, 100)}]
        r = await c.chat.completions.create(
            model="llama-3.1-8b", messages=msgs, max_tokens=7, temperature=0.0, user="u1"
        )
        assert r.object == "chat.completion" and r.model == "llama-3.1-8b"
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
        assert r.usage.prompt_tokens > 100 and r.usage.prompt_tokens_details.cached_tokens == 0
        # streaming, usage requested: the last chunk carries it
        s = await c.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=5, stream=True,
                                            stream_options={"include_usage": True})
        chunks = [ch async for ch in s]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # same prompt, the cache held it
        assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
        # streaming without include_usage: no usage reaches the client
        s = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, stream=True)
        chunks = [ch async for ch in s]
        assert all(ch.usage is None for ch in chunks) and chunks[-1].choices[0].finish_reason == "length"
        # completions, text and token ids, stream and not, with stop
        r2 = await c.completions.create(model=MODEL, prompt=_words(2, 50), max_tokens=4, stop=["\n\n"])
        assert r2.object == "text_completion" and r2.usage.completion_tokens <= 4
        s2 = await c.completions.create(model=MODEL, prompt=list(range(1000, 1300)), max_tokens=4, stream=True,
                                        stream_options={"include_usage": True})
        cs = [ch async for ch in s2]
        assert cs[-1].usage.prompt_tokens == 300 and "".join(ch.choices[0].text for ch in cs if ch.choices)


async def test_same_prefix_conversation_stays_on_its_worker(cluster: list[str]) -> None:
    async with (
        gateway(_cfg(cluster)) as (gw, url),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c,
    ):
        history = [{"role": "system", "content": _words(10, 400)}]
        chosen: set[str] = set()
        cached: list[int] = []
        for turn in range(4):
            history.append({"role": "user", "content": _words(100 + turn, 40)})
            before = {w.id: w.served for w in gw.pool.workers.values()}
            r = await c.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
            after = {w.id: w.served for w in gw.pool.workers.values()}
            chosen |= {w for w in after if after[w] != before[w]}
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            history.append({"role": "assistant", "content": r.choices[0].message.content})
            rt = gw.models.get(MODEL)
            ids = rt.tokenizer.encode_text(rt.tokenizer.render_chat(history, add_generation_prompt=False), False)
            digests = rt.key_plan(ids[: len(ids) - len(ids) % 16], "", None).digests
            await _wait(lambda d=digests, rt=rt: any(m.blocks >= len(d) - 3 for m in rt.index.match(d).values()))
        assert len(chosen) == 1, chosen  # every turn on the worker holding the conversation
        assert cached[0] == 0 and all(x > 400 for x in cached[1:]), cached
        # explain shows why: the holder has the prefix on GPU, the others nothing
        history.append({"role": "user", "content": "one more"})
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/admin/route/explain", json={"model": MODEL, "messages": history}) as resp:
                ex = await resp.json()
        holder = next(iter(chosen))
        assert ex["decision"]["worker_id"] == holder and ex["decision"]["reason"]
        rows = {w["worker_id"]: w for w in ex["workers"]}
        assert rows[holder]["matched_blocks"].get("GPU", 0) > 25
        others = [r for wid, r in rows.items() if wid != holder]
        # the others could only pull it from the holder over the network (PEER), which costs time
        assert all(set(r["matched_blocks"]) <= {"PEER"} for r in others)
        assert rows[holder]["t_ttft_s"] < min(r["t_ttft_s"] for r in others)
        assert all(r["peer_source"] in (holder, None) for r in others)


async def test_tenants_isolated_and_purge(cluster: list[str]) -> None:
    cfg = _cfg(cluster, tenants=[{"id": "a", "api_keys": [KEY_A]}, {"id": "b", "api_keys": [KEY_B]}],
               admin_token="adm-secret-1")
    prompt = _words(7, 300)
    async with gateway(cfg) as (gw, url):
        ca = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0)
        cb = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_B, max_retries=0)
        async with ca, cb:
            await ca.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            r = await ca.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert r.usage.prompt_tokens_details.cached_tokens > 200  # tenant a hits its own cache
            r = await cb.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert r.usage.prompt_tokens_details.cached_tokens == 0  # ... tenant b never does
            await ca.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "conv-9"})
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/admin/tenants/a/purge") as resp:
                    assert resp.status == 401
                async with s.post(url + "/admin/tenants/a/purge", headers={"x-admin-token": "adm-secret-1"}) as resp:
                    body = await resp.json()
            assert body["wire_salts"] == 2  # tenant-only + the one request cache_salt seen
            full_blocks = r.usage.prompt_tokens // 16
            assert sum(w["purged_blocks"] for w in body["workers"].values()) >= full_blocks
            r = await ca.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
            assert r.usage.prompt_tokens_details.cached_tokens == 0  # purged everywhere


async def test_trace_recording(cluster: list[str], tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    cfg = _cfg(cluster, observability={"trace": {"enabled": True, "path": str(path), "salt": "rec"}})
    async with gateway(cfg) as (gw, url), openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
        p = _words(3, 700)
        for _ in range(2):
            await c.completions.create(model=MODEL, prompt=p, max_tokens=3)
        await c.completions.create(model=MODEL, prompt=p + " and more words here", max_tokens=2)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 3 and [x["output_length"] for x in lines] == [3, 3, 2]
    assert lines[0]["hash_ids"] == lines[1]["hash_ids"] and lines[2]["hash_ids"][:1] == lines[0]["hash_ids"][:1]
    assert lines[0]["timestamp"] <= lines[1]["timestamp"] <= lines[2]["timestamp"]
    assert "alpha" not in path.read_text()


def _small_gpu_profile(tmp: Path) -> Path:
    """The 8B H200 profile with room for ~95 GPU blocks, so a second prompt pushes the first to CPU."""
    d = yaml.safe_load((ROOT / "configs/profiles" / f"{PROFILE}.yaml").read_text())
    d["memory"] = {"device_bytes": 1.0e9, "memory_utilization": 1.0, "weights_bytes": 0.8e9, "reserved_bytes": 0.0}
    p = tmp / "small-gpu.yaml"
    p.write_text(yaml.safe_dump(d))
    return p


async def test_prefetch_sent_when_blocks_sit_on_cpu(tmp_path: Path) -> None:
    prof = _small_gpu_profile(tmp_path)
    proc, urls = start_cluster(2, str(prof))
    try:
        cfg = _cfg(urls, models=[{"id": MODEL, "tokenizer": "configs/assets/tiny-tokenizer", "profile": str(prof)}])
        async with gateway(cfg) as (gw, url), openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            rt = gw.models.get(MODEL)
            first = list(range(2000, 2000 + 16 * 60 + 3))
            await c.completions.create(model=MODEL, prompt=first, max_tokens=1)
            holder = next(w for w in gw.pool.workers.values() if w.served)
            digests = rt.key_plan(array("I", first), "", None).digests
            assert await _wait(lambda: rt.index.match(digests).get(holder.id) is not None)
            # push `first` out of the holder's GPU: other prompts routed to it directly
            async with aiohttp.ClientSession() as s:
                for k in range(3):
                    other = list(range(10000 + k * 5000, 10000 + k * 5000 + 16 * 60))
                    async with s.post(
                        holder.url + "/v1/completions", json={"model": MODEL, "prompt": other, "max_tokens": 1}
                    ) as r:
                        assert r.status == 200, await r.text()
            assert await _wait(lambda: dict(rt.index.match(digests)[holder.id].runs).get(Tier.CPU, 0) > 0)
            await _wait(lambda: holder.view.running_requests == 0 and holder.view.waiting_requests == 0)
            sent = gw.metrics.prefetch_sent._value.get()
            used = gw.metrics.prefetch_used_tokens._value.get()
            raw = await c.completions.with_raw_response.create(model=MODEL, prompt=first, max_tokens=1)
            r = raw.parse()
            assert gw.metrics.prefetch_sent._value.get() == sent + 1
            kv = (r.usage.model_extra or {})["kv"]
            assert r.usage.prompt_tokens_details.cached_tokens > 16 * 50
            # what the worker reported using is what the gateway counts as used
            assert gw.metrics.prefetch_used_tokens._value.get() - used == kv["prefetched_tokens"]
            if raw.headers["x-kvroute-worker"] == holder.id:
                # served from the offloaded copy: loaded from CPU, or raised to GPU by the prefetch first
                assert kv["loaded_tokens"]["CPU"] + kv["prefetched_tokens"] > 0, kv
            else:  # the planner preferred an idle peer pulling the blocks from the holder
                assert kv["loaded_tokens"]["PEER"] + kv["prefetched_tokens"] > 0, kv
    finally:
        stop_cluster(proc)


def test_kvroute_cli_help_and_exec_wiring() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0 and "serve" in r.stdout and "up" in r.stdout
    r = subprocess.run([sys.executable, "-m", "kvroute.cli", "sim-cluster", "--workers", "0", "--profile", PROFILE,
                        "--base-port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ})
    assert r.returncode == 2 and "--workers" in r.stderr  # sim-cluster's own validation answered
    r = subprocess.run([sys.executable, "-m", "kvroute.cli", "serve", "--config", "/nonexistent.yaml"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "config error" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvroute.cli", "up", "--help"],
                       cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "--sim" in r.stdout and "--engine-arg" in r.stdout  # real workers, --sim one flag away
    for fleet in ([], ["--sim"]):  # `up`'s own validation answered, before any worker was started
        r = subprocess.run([sys.executable, "-m", "kvroute.cli", "up", *fleet, "--workers", "0", "--port", "9"],
                           cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2 and "--workers must be at least 1" in r.stderr and "starting" not in r.stderr


async def test_error_classes_against_sim_workers(cluster: list[str]) -> None:
    """Every client-visible error class, with the simulated fleet behind the gateway."""
    cfg = _cfg(cluster, tenants=[{"id": "a", "api_keys": [KEY_A]}])
    cfg.models[0].max_context_tokens = 2048
    async with gateway(cfg) as (gw, url):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY_A, max_retries=0) as c:
            async with aiohttp.ClientSession() as s:
                async with s.post(
                    url + "/v1/completions", data=b"{oops", headers={"authorization": f"Bearer {KEY_A}"}
                ) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
            with pytest.raises(openai.BadRequestError):  # a field of the wrong type
                await c.completions.create(model=MODEL, prompt="x", max_tokens="many")  # type: ignore[arg-type]
            with pytest.raises(openai.BadRequestError) as ei:  # too long for the context
                await c.completions.create(model=MODEL, prompt=list(range(3000)), max_tokens=1)
            assert ei.value.code == "context_length_exceeded"
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(model="gpt-7", messages=[{"role": "user", "content": "x"}])
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-nobody-000", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    slo = _cfg(cluster, routing={"policy": "kv_cost", "max_ttft_s": 1e-5})
    async with (
        gateway(slo) as (gw, url),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c,
    ):
        with pytest.raises(openai.RateLimitError) as e429:
            await c.completions.create(model=MODEL, prompt=_words(5, 500), max_tokens=1)
        assert float(e429.value.response.headers["retry-after"]) >= 1
    dead = _cfg(["http://127.0.0.1:9"])
    async with (
        running_gateway(dead) as (gw, url),
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c,
    ):
        with pytest.raises(openai.InternalServerError) as e503:
            await c.completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert e503.value.status_code == 503


async def test_a_restarted_gateway_knows_the_fleets_cache_before_it_is_ready(cluster: list[str]) -> None:
    """Our workers republish their blocks when a gateway registers them: a gateway started
    next to a warm fleet routes by cache from its first request, and says ready only then."""
    prompt = list(range(1000, 1000 + 16 * 40))
    async with gateway(_cfg(cluster)) as (gw, url):
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
            holder = r.headers["x-kvroute-worker"]
    async with running_gateway(_cfg(cluster), ready_timeout=None) as (gw2, url2):
        rt = gw2.models.get(MODEL)
        digests = rt.key_plan(array("I", prompt), "", None).digests
        async with aiohttp.ClientSession() as s:
            assert await _wait(lambda: gw2.ready()[0], 15.0)
            m = rt.index.match(digests).get(holder)  # known without any new request
            assert m is not None and m.blocks == 40, gw2.ready()
            async with s.get(url2 + "/ready") as r:
                assert r.status == 200 and (await r.json())["indexing_workers"] == []
            async with s.post(url2 + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                               "max_tokens": 1}) as r:
                assert r.headers["x-kvroute-worker"] == holder
                usage = (await r.json())["usage"]
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 16 * 39
