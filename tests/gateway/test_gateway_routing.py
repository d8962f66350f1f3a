"""Routing decisions seen from the wire, with fake workers whose index state the test sets:
prefetch of CPU/DISK blocks (keys, deadline, not for vLLM workers), prefetch cancel on
reroute, explain, queue-vs-recompute, in-flight accounting, metrics."""
from __future__ import annotations

import asyncio
import base64
import time
from array import array
from typing import Any

import aiohttp
from fakes import FakeWorker
from gateway_fleet import DIGEST, MODEL, _cfg, client, fleet, wait_until
from hangs import patience

from kvindex.events import BlockStored
from kvindex.keys import digest64
from kvindex.tiers import Tier
from router.fleet.fleetconfig import WorkerConfig

PROMPT = list(range(100, 100 + 16 * 20 + 5))  # 20 full blocks + 5 tokens


def _store(gw: Any, worker_id: str, tokens: list[int], medium: str, blocks: int) -> list[bytes]:
    """Make the index believe `worker_id` holds the first `blocks` blocks of `tokens` in `medium`."""
    rt = gw.models.get(MODEL)
    keys = rt.keys.hasher.keys(tokens)[:blocks]
    ev = BlockStored([digest64(k) for k in keys], None, tokens[: 16 * blocks], 16, medium=medium)
    st = rt.index.apply(worker_id, [ev])
    assert st.stored == blocks
    return keys


async def _explain(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url + "/admin/route/explain", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_explain_shows_the_policy_parameters_in_effect() -> None:
    """Defaults, with what `routing.params` sets over them."""
    cfg = _cfg(routing={"policy": "kv_cost", "params": {"saturation": False}})
    async with fleet([FakeWorker("a", DIGEST)], cfg) as (gw, url):
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        p = ex["policy_params"]
        assert ex["policy"] == "kv_cost" and p["saturation"] is False
        assert p == {"max_ttft_s": None, "balance_eps": 1.0, "prefetch": True, "peer_pull": True,
                     "saturation": False, "calibrate": True}


async def test_prefetch_sent_for_cpu_blocks_before_forwarding() -> None:
    # Both report half a second of queue: the prefetch deadline must cover it (plus the margin).
    a, b = (FakeWorker(n, DIGEST, load={"est_queue_s": 0.5}) for n in ("a", "b"))
    async with fleet([a, b]) as (gw, url):
        keys = _store(gw, "a", PROMPT, "CPU", 20)
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert ex["decision"]["worker_id"] == "a" and ex["decision"]["prefetch_blocks"] == 20
        ea = next(w for w in ex["workers"] if w["worker_id"] == "a")
        assert ea["matched_blocks"] == {"CPU": 20} and ea["recompute_tokens"] == 5 + 0
        assert not a.prefetches and not a.completions  # explain sends nothing
        r = await client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert r.choices[0].text
        assert len(a.prefetches) == 1 and len(a.completions) == 1 and not b.completions
        pf = a.prefetches[0]
        raw = base64.b64decode(pf["keys_b64"])
        # deadline = max(min_deadline 0.2 s, t_queue + margin 0.05 s); t_queue is the 0.5 s report
        # aged by at most one poll interval (0.05 s)
        assert raw == b"".join(keys) and 490 <= pf["deadline_ms"] <= 550, pf["deadline_ms"]
        assert pf["prefetch_id"] == "p-" + a.completions[0]["kv"]["request_id"]
        m = gw.metrics
        assert m.prefetch_sent._value.get() == 1 and m.prefetch_requested_tokens._value.get() == 320
        assert m.prefetch_wasted_tokens._value.get() == 320  # the fake reports prefetched_tokens=0


async def test_no_prefetch_for_gpu_blocks_or_vllm_workers() -> None:
    a = FakeWorker("a", DIGEST)
    v = FakeWorker("v", DIGEST)
    cfg = _cfg()
    async with fleet([a], cfg) as (gw, url):
        _store(gw, "a", PROMPT, "GPU", 20)
        await client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert not a.prefetches and len(a.completions) == 1
    from fakes import serve_fake

    async with serve_fake(v):
        cfg = _cfg()
        cfg.workers = [WorkerConfig(id="v", url=v.url, kind="vllm", model=MODEL)]
        async with fleet([], cfg) as (gw, url):
            assert gw.pool.workers["v"].view.supports_prefetch is False
            _store(gw, "v", PROMPT, "CPU", 20)
            r = await client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
            assert r.choices[0].text and not v.prefetches
            assert "kv" not in v.completions[0]  # vLLM gets no kvroute extension
            assert gw.pool.workers["v"].view.running_requests == 0  # load came from /metrics


async def test_prefetch_cancelled_when_rerouted() -> None:
    a = FakeWorker("a", DIGEST, fail_status=503)
    b = FakeWorker("b", DIGEST)
    async with fleet([a, b]) as (gw, url):
        _store(gw, "a", PROMPT, "CPU", 20)
        r = await client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert r.choices[0].text and len(b.completions) == 1 and len(a.completions) == 1
        await wait_until(lambda: a.deleted_prefetches)
        assert a.deleted_prefetches == [a.prefetches[0]["prefetch_id"]]
        assert gw.metrics.prefetch_cancelled._value.get() == 1


async def test_long_queue_loses_to_idle_worker_when_recompute_is_cheaper() -> None:
    busy = FakeWorker("a", DIGEST,
                      load={"waiting_requests": 40, "waiting_prefill_tokens": 400_000, "est_queue_s": 12.0})
    idle = FakeWorker("b", DIGEST)
    async with fleet([busy, idle]) as (gw, url):
        await wait_until(lambda: gw.pool.workers["a"].view.est_queue_s == 12.0, what="a load poll")
        _store(gw, "a", PROMPT, "GPU", 20)
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert ex["decision"]["worker_id"] == "b"
        ea = next(w for w in ex["workers"] if w["worker_id"] == "a")
        eb = next(w for w in ex["workers"] if w["worker_id"] == "b")
        assert ea["matched_blocks"] == {"GPU": 20} and ea["t_queue_s"] > 10
        assert eb["recompute_tokens"] == len(PROMPT) and eb["t_ttft_s"] < ea["t_ttft_s"]
        await client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert len(idle.completions) == 1 and not busy.completions
        # ... and with an idle queue the holder wins
        busy.load = {}
        await wait_until(lambda: gw.pool.workers["a"].view.est_queue_s == 0.0, what="a load poll")
        ex = await _explain(url, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert ex["decision"]["worker_id"] == "a"


async def test_inflight_accounting_and_metrics() -> None:
    slow = FakeWorker("a", DIGEST, first_delay_s=0.3)
    async with fleet([slow]) as (gw, url):
        w = gw.pool.workers["a"]
        c = client(url)
        t = asyncio.ensure_future(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1))
        await wait_until(lambda: slow.completions, what="the request to reach the worker")
        assert w.view.inflight_requests == 1 and w.view.inflight_prefill_tokens == len(PROMPT)
        await t
        assert w.view.inflight_requests == 0 and w.view.inflight_prefill_tokens == 0 and not w.inflight
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
        assert 'kvroute_requests_total{model="test-model",route="/v1/completions",status="200"} 1.0' in text
        for name in ("kvroute_ttft_seconds_bucket", "kvroute_decision_seconds_bucket", "kvroute_worker_healthy{",
                     "kvroute_index_blocks{", "kvroute_ttft_actual_over_predicted_bucket",
                     "kvroute_route_choices_total"):
            assert name in text, name
        ok = [ln for ln in text.splitlines() if ln.startswith("kvroute_worker_healthy{")]
        assert ok and ok[0].endswith(" 1.0")


async def test_admin_workers_drain_remove_add() -> None:
    a, b = FakeWorker("a", DIGEST), FakeWorker("b", DIGEST)
    async with fleet([a]) as (gw, url):
        from fakes import serve_fake

        async with serve_fake(b), aiohttp.ClientSession() as s:
            async with s.post(url + "/admin/workers", json={"id": "b", "url": b.url}) as r:
                assert r.status == 201
            async with s.post(url + "/admin/workers", json={"id": "b", "url": b.url}) as r:
                assert r.status == 409
            async with s.post(url + "/admin/workers", json={"id": "c", "url": "nope"}) as r:
                assert r.status == 400 and "url" in (await r.json())["error"]["message"]
            await wait_until(lambda: len(gw.pool.routable(MODEL)) == 2)
            async with s.post(url + "/admin/workers/a/drain") as r:
                assert (await r.json())["state"] == "draining"
            c = client(url)
            for _ in range(3):
                await c.completions.create(model=MODEL, prompt="hello", max_tokens=1)
            assert len(b.completions) == 3 and not a.completions
            async with s.delete(url + "/admin/workers/a") as r:
                assert r.status == 200
            async with s.delete(url + "/admin/workers/a") as r:
                assert r.status == 404
            async with s.get(url + "/admin/workers") as r:
                assert [w["id"] for w in (await r.json())["workers"]] == ["b"]
            async with s.get(url + "/admin/index") as r:
                assert MODEL in await r.json()


async def test_namespace_and_block_size_mismatch_refused() -> None:
    wrong_ns = FakeWorker("x", "ab" * 32)
    wrong_bs = FakeWorker("y", DIGEST, block_size=24)
    good = FakeWorker("g", DIGEST)
    async with fleet([good, wrong_ns, wrong_bs]) as (gw, url):
        await wait_until(lambda: gw.pool.workers["x"].state.value == "refused"
                         and gw.pool.workers["y"].state.value == "refused")
        assert "namespace digest" in gw.pool.workers["x"].reason
        assert "not a multiple" in gw.pool.workers["y"].reason
        assert gw.pool.routable(MODEL) == [gw.pool.workers["g"]]
        assert gw.metrics.worker_refused.labels("x", "namespace_mismatch")._value.get() == 1
        for _ in range(3):
            r = await client(url).completions.create(model=MODEL, prompt="hello", max_tokens=1)
            assert r.choices[0].text
        assert not wrong_ns.completions and not wrong_bs.completions


async def test_dead_worker_leaves_index_and_returns() -> None:
    a = FakeWorker("a", DIGEST)
    async with fleet([a, FakeWorker("b", DIGEST)]) as (gw, url):
        rt = gw.models.get(MODEL)
        _store(gw, "a", PROMPT, "GPU", 4)
        assert rt.index.has_worker("a")
        a.health_status = 500
        await wait_until(lambda: gw.pool.workers["a"].state.value == "unhealthy")
        assert gw.pool.workers["a"].state.value == "unhealthy" and not rt.index.has_worker("a")
        a.health_status = 200
        await wait_until(lambda: gw.pool.workers["a"].state.value == "healthy")
        assert gw.pool.workers["a"].state.value == "healthy" and rt.index.has_worker("a")
        assert not rt.index.match([digest64(k) for k in rt.keys.hasher.keys(PROMPT)[:4]])  # old entries gone


async def test_prefetch_cancelled_when_client_leaves_before_first_token() -> None:
    slow = FakeWorker("a", DIGEST, first_delay_s=1.0)
    async with fleet([slow]) as (gw, url):
        _store(gw, "a", PROMPT, "CPU", 20)
        async with aiohttp.ClientSession() as s:
            t = asyncio.ensure_future(s.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                                             "max_tokens": 2, "stream": True}))
            await wait_until(lambda: slow.completions and slow.prefetches, what="the request and its prefetch")
            t.cancel()
        await wait_until(lambda: slow.deleted_prefetches)
        assert len(slow.prefetches) == 1 and slow.deleted_prefetches == [slow.prefetches[0]["prefetch_id"]]
        assert not gw.pool.workers["a"].inflight


async def test_vllm_worker_events_in_bind_mode() -> None:
    """A vLLM worker publishing to tcp://127.0.0.1:P connects: the gateway binds, and the
    blocks it reports (its own engine hashes, block size 32) become routable matches."""
    import socket

    import zmq
    import zmq.asyncio
    from fakes import serve_fake

    from kvindex.events import EventEncoder, seq_to_bytes

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    v, other = FakeWorker("v", DIGEST), FakeWorker("o", DIGEST)
    async with serve_fake(v), serve_fake(other):
        cfg = _cfg(tenants=[{"id": "t", "api_keys": ["sk-tenant-t-0001"], "salt": "T"}])
        cfg.workers = [WorkerConfig(id="v", url=v.url, kind="vllm", model=MODEL, block_size=32,
                                    events={"endpoint": f"tcp://127.0.0.1:{port}", "bind": True}),
                       WorkerConfig(id="o", url=other.url, model=MODEL)]
        async with fleet([], cfg) as (gw, url):
            await wait_until(lambda: len(gw.pool.routable(MODEL)) == 2)
            rt = gw.models.get(MODEL)
            plan = rt.key_plan(array("I", PROMPT), gw.tenancy.tenants["t"].salt, None)
            ctx = zmq.asyncio.Context()
            pub = ctx.socket(zmq.PUB)
            pub.connect(f"tcp://127.0.0.1:{port}")
            # vLLM: its own hashes, 32-token blocks, cache_salt as the first block's extra key
            n = 10
            ev = BlockStored(list(range(7001, 7001 + n)), None, PROMPT[: 32 * n], 32, medium="GPU",
                             extra_keys=[(plan.wire_salt,)] + [None] * (n - 1))
            payload = EventEncoder().encode(time.time(), [ev])
            m: dict[str, Any] = {}
            for seq in range(500):  # a PUB drops what it sends before the subscription arrives: resend
                await pub.send_multipart([b"kv", seq_to_bytes(seq), payload])
                await asyncio.sleep(0.01)
                m = rt.index.match(plan.digests, ["v"])
                if m:
                    break
            assert m["v"].blocks == 2 * n  # each 32-token engine block = two index blocks
            c = client(url, "sk-tenant-t-0001")
            await c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
            assert len(v.completions) == 1 and not other.completions
            assert v.completions[0]["cache_salt"] == plan.wire_salt and "kv" not in v.completions[0]
            pub.close(0)
            ctx.term()


async def test_worker_that_reports_draining_leaves_and_returns() -> None:
    a, b = FakeWorker("a", DIGEST), FakeWorker("b", DIGEST)
    async with fleet([a, b]) as (gw, url):
        wa = gw.pool.workers["a"]
        a.health_state = "draining"
        await wait_until(lambda: wa.state.value == "draining")
        assert wa.state.value == "draining" and gw.pool.routable(MODEL) == [gw.pool.workers["b"]]
        for _ in range(3):
            await client(url).completions.create(model=MODEL, prompt="hello", max_tokens=1)
        assert not a.completions and len(b.completions) == 3
        a.health_state = "ok"
        await wait_until(lambda: wa.state.value == "healthy")
        assert wa.state.value == "healthy"


async def test_a_worker_cost_override_beats_its_reported_speeds() -> None:
    """An operator's `cost` block on a worker is a deliberate correction: polls never undo it."""
    from contextlib import AsyncExitStack

    from fakes import serve_fake

    from router.server import running_gateway

    a = FakeWorker("a", DIGEST)  # reports prefill 35000 tok/s, decode 6 ms, CPU 5e10 B/s
    cfg = _cfg()
    async with AsyncExitStack() as st:
        await st.enter_async_context(serve_fake(a))
        cfg.workers = [WorkerConfig(id="a", url=a.url, model=MODEL, cost={
            "prefill_tokens_per_s": 1234.0, "links": {"CPU": {"read_Bps": 1e6, "latency_s": 0.5}}})]
        gw, _ = await st.enter_async_context(running_gateway(cfg, ready_timeout=5.0))
        w = gw.pool.workers["a"]
        first = w.fleet.load_t
        assert first is not None  # registration polls once
        await wait_until(lambda: (w.fleet.load_t or 0.0) > first + 0.06, what="two more load polls")
        c = w.view.cost
        assert c.prefill_tokens_per_s == 1234.0 and c.decode_step_s == 0.006  # pinned vs reported
        cpu = c.links[Tier.CPU]
        assert (cpu.read_Bps, cpu.latency_s) == (1e6, 0.5)


async def test_an_index_holding_more_than_the_worker_can_asks_for_the_stream_tail() -> None:
    """A vLLM worker reports 2 KV blocks while the index credits it with 20 index blocks:
    removals were lost (a last frame shows no gap), so the gateway asks its replay
    socket for what followed the last sequence it applied."""
    import zmq
    import zmq.asyncio
    from fakes import serve_fake

    from kvindex.events import END_SEQ, EventEncoder, seq_from_bytes, seq_to_bytes
    from loadtest.ports import free_port

    pub_port, replay_port = free_port(), free_port()
    v = FakeWorker("v", DIGEST, gpu_blocks=2)
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    pub = ctx.socket(zmq.PUB)
    try:
        async with serve_fake(v):
            cfg = _cfg()
            cfg.workers = [WorkerConfig(id="v", url=v.url, kind="vllm", model=MODEL, block_size=32, events={
                "endpoint": f"tcp://127.0.0.1:{pub_port}", "bind": True,
                "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"})]
            async with fleet([], cfg) as (gw, _):
                await wait_until(lambda: len(gw.pool.routable(MODEL)) == 1)
                pub.connect(f"tcp://127.0.0.1:{pub_port}")
                ev = BlockStored(list(range(9001, 9011)), None, PROMPT[:320], 32, medium="GPU")
                rt = gw.models.get(MODEL)
                for seq in range(500):  # until the subscription is up
                    await pub.send_multipart([b"kv", seq_to_bytes(seq), EventEncoder().encode(time.time(), [ev])])
                    await asyncio.sleep(0.01)
                    if rt.index.local_blocks("v") == 20:
                        break
                asked: list[int] = []
                for _ in range(10):  # the join replay (from 0), then the probe
                    frames = await asyncio.wait_for(router.recv_multipart(), patience(5.0))
                    asked.append(seq_from_bytes(frames[-1]))
                    await router.send_multipart([frames[0], b"", seq_to_bytes(END_SEQ), b""])
                    if asked[-1] == seq + 1:
                        break
                assert asked[-1] == seq + 1, asked  # from the next expected sequence
    finally:
        pub.close(0)
        router.close(0)
        ctx.term()
