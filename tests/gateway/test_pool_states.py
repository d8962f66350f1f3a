"""The worker pool's per-worker state as the gateway keeps it: health transitions, the
circuit breaker's inputs, draining in and out of the index, caps, the in-flight
ledger's counts, context limits and what a vLLM worker's metrics turn into.

Written against mutants that survived the gateway/pool tests (bench/notes/mutation.md): each
test pins one rule whose operator could be flipped without any other test noticing.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from fakes import FakeWorker, serve_fake
from gateway_fleet import DIGEST, MODEL, _cfg, fleet, wait_until

from kvindex.events import BlockStored
from kvindex.keys import digest64
from kvwire import BlockCounts
from router.fleet.fleetconfig import EventsConfig, WorkerConfig
from router.fleet.vllm_load import VllmLoad, parse_vllm_metrics, vllm_report

B = 16


async def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


def _store(gw: Any, worker_id: str, tokens: list[int], blocks: int) -> list[int]:
    """Make the index believe `worker_id` holds the first `blocks` blocks of `tokens` on GPU."""
    rt = gw.models.get(MODEL)
    ds = [digest64(k) for k in rt.keys.hasher.keys(tokens)[:blocks]]
    assert rt.index.apply(worker_id, [BlockStored(ds, None, tokens[: B * blocks], B, medium="GPU")]).stored == blocks
    return ds


# ----------------------------------------------------------------------------- health


async def test_unhealthy_after_exactly_n_failed_probes_spanning_the_minimum_time() -> None:
    """`pool.unhealthy_after` consecutive failed `/health` probes take a worker out, as
    soon as the n-th fails (not one later), provided they span `unhealthy_min_s`; a
    success in between starts the count again."""
    cfg = _cfg(pool={"load_poll_interval_s": 5, "health_interval_s": 60, "unhealthy_after": 2,
                     "unhealthy_min_s": 0.2, "probe_timeout_s": 0.5})
    async with fleet([FakeWorker("a", DIGEST)], cfg) as (gw, _url):
        pool, w = gw.pool, gw.pool.workers["a"]
        pool.health.failed(w, "GET /health: HTTP 500")
        assert w.state.value == "healthy" and w.fails == 1
        pool.health.failed(w, "GET /health: HTTP 500")  # the 2nd, but within 0.2 s of the 1st
        assert w.state.value == "healthy"
        await asyncio.sleep(0.25)
        pool.health.failed(w, "GET /health: HTTP 500")
        assert (w.state.value, w.reason) == ("unhealthy", "GET /health: HTTP 500")
        assert pool.routable(MODEL) == []
    cfg = _cfg(pool={"load_poll_interval_s": 5, "health_interval_s": 60, "unhealthy_after": 2,
                     "unhealthy_min_s": 0.0, "probe_timeout_s": 0.5})
    async with fleet([FakeWorker("a", DIGEST)], cfg) as (gw, _url):
        pool, w = gw.pool, gw.pool.workers["a"]
        pool.health.failed(w, "x")
        assert w.state.value == "healthy"
        pool.health.failed(w, "x")
        assert w.state.value == "unhealthy"
    cfg = _cfg(pool={"load_poll_interval_s": 5, "health_interval_s": 60, "unhealthy_after": 1,
                     "unhealthy_min_s": 0.0, "probe_timeout_s": 0.5})
    async with fleet([FakeWorker("a", DIGEST)], cfg) as (gw, _url):
        w = gw.pool.workers["a"]
        gw.pool.health.failed(w, "x")  # one failure, no minimum time: out at once
        assert w.state.value == "unhealthy"


async def test_a_worker_that_stops_draining_by_itself_is_matched_again() -> None:
    """A worker reporting `draining` on /health leaves routing and index matches; when it
    reports `ok` again it is healthy and its cached blocks are matched again (a worker
    left out of the index's matches would get no cache-aware traffic ever after)."""
    a, b = FakeWorker("a", DIGEST), FakeWorker("b", DIGEST)
    async with fleet([a, b]) as (gw, _url):
        wa = gw.pool.workers["a"]
        idx = gw.models.get(MODEL).index
        ds = _store(gw, "a", list(range(200, 200 + 4 * B)), 4)
        assert idx.match(ds)["a"].blocks == 4
        a.health_state = "draining"
        await wait_until(lambda: wa.state.value == "draining", what="draining")
        assert "a" not in idx.match(ds) and "a" in idx.match(ds, include_draining=True)
        a.health_state = "ok"
        await wait_until(lambda: wa.state.value == "healthy", what="healthy again")
        assert idx.match(ds)["a"].blocks == 4


async def test_an_admin_drain_leaves_routing_and_matches_and_undrain_restores_both() -> None:
    """`drain` takes a healthy worker out of routing and out of the index's matches (its
    blocks stay, for an undrain); undraining makes it healthy, routable and matched
    again. A removed worker is unhealthy with reason `removed` to anything still holding
    it, and gone from routing and from the index."""
    a, b = FakeWorker("a", DIGEST), FakeWorker("b", DIGEST)
    async with fleet([a, b]) as (gw, _url):
        pool, idx = gw.pool, gw.models.get(MODEL).index
        ds = _store(gw, "a", list(range(300, 300 + 3 * B)), 3)
        w = pool.drain("a")
        assert (w.state.value, w.reason) == ("draining", "drained by admin")
        assert [x.id for x in pool.routable(MODEL)] == ["b"]
        assert "a" not in idx.match(ds) and idx.match(ds, include_draining=True)["a"].blocks == 3
        w = pool.drain("a", False)
        assert (w.state.value, w.reason) == ("healthy", "")
        assert sorted(x.id for x in pool.routable(MODEL)) == ["a", "b"]
        assert idx.match(ds)["a"].blocks == 3
        gone = await pool.remove("a")
        assert (gone.state.value, gone.reason) == ("unhealthy", "removed")
        assert "a" not in pool.workers and [x.id for x in pool.routable(MODEL)] == ["b"]
        assert not idx.has_worker("a") and idx.match(ds) == {}


# ----------------------------------------------------------------------------- what the proxy sees fail


@pytest.mark.parametrize(("status", "counted"), [(500, 1), (502, 1), (429, 0), (503, 0)])
async def test_only_worker_trouble_feeds_the_circuit_breaker(status: int, counted: int) -> None:
    """A 5xx from a worker counts toward its circuit breaker (every one: two failures
    count two); an overloaded (429) or draining (503) answer says nothing bad about the
    worker and must not open it."""
    bad = FakeWorker("a", DIGEST, fail_status=status)
    async with fleet([bad], _cfg(pool={"load_poll_interval_s": 0.05, "health_interval_s": 0.1,
                                       "unhealthy_after": 2, "probe_timeout_s": 0.5,
                                       "breaker_failures": 5})) as (gw, url):
        w = gw.pool.workers["a"]
        for n in (1, 2):
            code, _ = await _post(url, {"model": MODEL, "prompt": "hello", "max_tokens": 1})
            assert code >= 400
            assert (w.breaker.fails, w.failures_total) == (counted * n, counted * n)
        assert w.state.value == "healthy"  # a failed answer is not a dead worker


async def test_a_refused_connection_on_a_request_takes_the_worker_out_at_once() -> None:
    """A worker whose process is gone (the connection is refused) when a request reaches
    it is unhealthy at once, out of the index, and the request is served elsewhere; no
    health probe is needed for that (its monitor is stopped here so only the request
    path can find out)."""
    async with serve_fake(FakeWorker("a", DIGEST)) as doomed:
        url_a = doomed.url
    cfg = _cfg(routing={"policy": "round_robin", "retries": 1},
               pool={"load_poll_interval_s": 5, "health_interval_s": 5, "unhealthy_after": 50})
    async with fleet([FakeWorker("b", DIGEST)], cfg) as (gw, url):
        w = gw.pool.add(WorkerConfig(id="a", url=url_a, model=MODEL))
        assert w.task is not None
        w.task.cancel()
        gw.pool.roster.join(w)
        gw.pool.roster.set_state(w, type(w.state).HEALTHY, "")  # as if it registered, then died
        assert gw.models.get(MODEL).index.has_worker("a")
        for _ in range(2):  # round robin: one of the two goes to a first
            code, body = await _post(url, {"model": MODEL, "prompt": "hello", "max_tokens": 1})
            assert code == 200, body
        assert w.state.value == "unhealthy" and "a" in w.reason
        assert [x.id for x in gw.pool.routable(MODEL)] == ["b"]
        assert not gw.models.get(MODEL).index.has_worker("a") and not w.in_index


# ----------------------------------------------------------------------------- caps and accounting


async def test_worker_cap_defaults_to_the_gateway_wide_limit() -> None:
    """A worker without its own `max_inflight` takes `limits.worker_max_inflight`; its own
    setting wins when given. The cap sheds with a 429 `worker_caps` once reached."""
    fake = FakeWorker("a", DIGEST, first_delay_s=0.5)
    async with fleet([fake], _cfg(limits={"worker_max_inflight": 1})) as (gw, url):
        w = gw.pool.workers["a"]
        assert w.max_inflight == 1
        own = gw.pool.add(WorkerConfig(id="own", url="http://127.0.0.1:9", model=MODEL, max_inflight=5))
        assert own.max_inflight == 5
        first = asyncio.ensure_future(_post(url, {"model": MODEL, "prompt": "hello", "max_tokens": 1}))
        await wait_until(lambda: len(w.inflight) == 1, what="first request in flight")
        code, body = await _post(url, {"model": MODEL, "prompt": "hello", "max_tokens": 1})
        assert code == 429 and body["error"]["code"] == "worker_caps"
        assert (await first)[0] == 200
    async with fleet([FakeWorker("a", DIGEST)]) as (gw, url):
        assert gw.pool.workers["a"].max_inflight is None  # no limit anywhere: uncapped


async def test_in_flight_kv_tokens_are_prompt_plus_max_tokens() -> None:
    """While a request is in flight its worker's view counts the KV it may come to hold:
    prompt tokens plus max_tokens (Dynamo's decode-load term reads this); it leaves the
    count when the request ends."""
    fake = FakeWorker("a", DIGEST, first_delay_s=0.4)
    async with fleet([fake], _cfg(routing={"policy": "dynamo"})) as (gw, url):
        w = gw.pool.workers["a"]
        prompt = list(range(1000, 1000 + 40))
        req = asyncio.ensure_future(_post(url, {"model": MODEL, "prompt": prompt, "max_tokens": 7}))
        await wait_until(lambda: len(w.inflight) == 1, what="request in flight")
        assert w.view.active_kv_tokens == 40 + 7
        assert w.view.inflight_requests == 1 and w.view.inflight_prefill_tokens == 40
        assert (await req)[0] == 200
        assert w.view.active_kv_tokens == 0 and w.view.inflight_requests == 0


async def test_a_prompt_as_long_as_the_context_is_refused() -> None:
    """A prompt must leave room for one generated token: `max_context_tokens` prompt tokens
    is a 400 context_length_exceeded, one fewer is served."""
    async with fleet([FakeWorker("a", DIGEST)]) as (_gw, url):  # the model's context: 512 tokens
        for extra in ({"max_tokens": 1}, {}):  # with or without max_tokens: the prompt is at fault
            code, body = await _post(url, {"model": MODEL, "prompt": list(range(1, 513)), **extra})
            assert code == 400 and body["error"]["code"] == "context_length_exceeded"
            assert body["error"]["param"] == "prompt"
        code, _ = await _post(url, {"model": MODEL, "prompt": list(range(1, 512)), "max_tokens": 1})
        assert code == 200


# ----------------------------------------------------------------------------- capabilities


async def test_prefetch_is_planned_only_for_workers_that_advertise_it() -> None:
    """Only our workers that list `prefetch` take prefetches: one that does not, and any
    vLLM worker, is priced without prefetch overlap."""
    ours = FakeWorker("a", DIGEST)
    plain = FakeWorker("b", DIGEST, capabilities=("purge",))
    vllm = FakeWorker("c", DIGEST, kind="vllm")
    async with fleet([ours, plain, vllm]) as (gw, _url):
        ws = gw.pool.workers
        assert ws["a"].view.supports_prefetch is True
        assert ws["b"].view.supports_prefetch is False
        assert ws["c"].view.supports_prefetch is False


# ----------------------------------------------------------------------------- vLLM's metrics


def test_vllm_kv_usage_becomes_free_and_used_gpu_blocks() -> None:
    """vLLM reports KV usage as a fraction; with `cache_config_info` its block count is
    known and the report's GPU blocks are `free = round((1 - usage) * total)`, `used =
    total - free`. Without it they are on a per-10k scale."""
    text = ('vllm:num_requests_waiting{model_name="m"} 2\n'
            'vllm:num_requests_running{model_name="m"} 3\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'vllm:cache_config_info{num_gpu_blocks="1000"} 1.0\n')
    rep = vllm_report(parse_vllm_metrics(text))
    assert (rep.waiting_requests, rep.running_requests) == (2, 3)
    assert rep.blocks["GPU"] == BlockCounts(used=250, free=750, capacity=1000)
    rep = vllm_report(VllmLoad(0, 0, 0.9, None))
    assert rep.blocks["GPU"] == BlockCounts(used=9000, free=1000, capacity=10_000)
    assert vllm_report(VllmLoad(1, 1, None)).blocks == {}


async def test_a_vllm_worker_view_shows_its_free_gpu_blocks() -> None:
    """Through the pool: a vLLM worker at 50% KV usage with 800 blocks shows 400 free."""
    vllm = FakeWorker("v", DIGEST, kind="vllm", gpu_blocks=800)
    async with fleet([vllm]) as (gw, _url):
        v = gw.pool.workers["v"].view
        await wait_until(lambda: v.gpu_capacity_blocks == 800, what="a metrics poll")
        assert v.gpu_free_blocks == 400


# ----------------------------------------------------------------------------- republish on registration


@dataclass
class RepublishingWorker(FakeWorker):
    """A fake that answers `POST /kv/republish` with `republish` (status, body)."""

    republish: tuple[int, Any] = (200, {"seq": 0})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") == "http" and scope["path"] == "/kv/republish":
            while (await receive()).get("more_body"):
                pass
            status, body = self.republish
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps(body).encode()})
            return
        await super().__call__(scope, receive, send)


async def test_republish_returns_the_sequence_to_wait_for_only_when_it_is_one() -> None:
    """On registration the pool asks our worker to republish its blocks and waits (for
    /ready) until the index has seen the sequence number it answers: a non-negative int,
    0 included. Anything else (a negative or non-int seq, no seq, an error status) is
    nothing to wait for; a worker without events, or a vLLM worker, is not asked."""
    fake = RepublishingWorker("a", DIGEST)
    async with fleet([fake]) as (gw, _url):
        pool, w = gw.pool, gw.pool.workers["a"]
        assert await pool.registration.republish(w) is None  # no events configured: nothing to wait for
        w.events = EventsConfig(endpoint="tcp://127.0.0.1:5557")
        for answer, want in [((200, {"seq": 7}), 7), ((200, {"seq": 0}), 0), ((200, {"seq": -1}), None),
                             ((200, {"seq": "7"}), None), ((200, {}), None), ((500, {"seq": 7}), None)]:
            fake.republish = answer
            assert await pool.registration.republish(w) == want, answer
        w.cfg = w.cfg.model_copy(update={"kind": "vllm"})
        fake.republish = (200, {"seq": 7})
        assert await pool.registration.republish(w) is None


async def test_a_request_the_worker_has_not_answered_yet_stays_counted_after_a_poll() -> None:
    """A load report asked for while a request is on its way (dispatched, no status line
    back yet) may not know it: the pool passes the poll's send time, so the ledger keeps
    that request in its since-report counts (and prefill tokens) instead of treating the
    report as knowing everything. Catches the send time dropped."""
    slow = FakeWorker("a", DIGEST, headers_delay_s=0.6)
    cfg = _cfg(pool={"load_poll_interval_s": 30, "health_interval_s": 30, "unhealthy_after": 2,
                     "probe_timeout_s": 0.5})
    async with fleet([slow], cfg) as (gw, url):
        w = gw.pool.workers["a"]
        req = asyncio.ensure_future(_post(url, {"model": MODEL, "prompt": list(range(1, 41)), "max_tokens": 1}))
        await wait_until(lambda: len(w.inflight) == 1 and slow.completions, what="the request at the worker")
        assert await gw.pool.load.poll(w)
        assert (w.view.inflight_since_report_requests, w.view.inflight_since_report_prefill_tokens) == (1, 40)
        assert (await req)[0] == 200
