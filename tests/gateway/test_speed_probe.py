"""A vLLM worker registered with no `cost:` is measured at join; until then kv_cost routes
by cache affinity and load, and says so (router/fleet/speed_probe.py, planner/speedfit.py)."""
from __future__ import annotations

import aiohttp
import pytest
from fakes import FakeWorker
from gateway_fleet import ADMIN, _cfg, fleet, wait_until

from router.fleet.speed_probe import PROBE_TOKENS, probe_body, probe_lengths


def _vllm(wid: str, **kw: object) -> FakeWorker:
    return FakeWorker(wid, "", model="test-model", kind="vllm", **kw)  # type: ignore[arg-type]


async def _admin(url: str, path: str, method: str = "GET", body: object = None) -> dict:  # type: ignore[type-arg]
    async with aiohttp.ClientSession() as s, s.request(method, url + path, json=body,
                                                       headers={"authorization": f"Bearer {ADMIN}"}) as r:
        assert r.status == 200, await r.text()
        return await r.json()  # type: ignore[no-any-return]


def _speeds(workers: dict, wid: str) -> dict:  # type: ignore[type-arg]
    return next(w["speeds"] for w in workers["workers"] if w["id"] == wid)


async def test_a_vllm_worker_is_measured_when_it_joins() -> None:
    slow = _vllm("v", probe_tps=4000.0, probe_overhead_s=0.02)
    async with fleet([slow], _cfg(admin_token=ADMIN)) as (gw, url):
        w = gw.pool.workers["v"]
        await wait_until(lambda: w.view.speeds_fitted, 10.0, "speeds fitted")
        assert len(slow.probes) == len(PROBE_TOKENS)
        assert all(p["max_tokens"] == 1 and p["cache_salt"] for p in slow.probes)
        assert len({p["cache_salt"] for p in slow.probes}) == len(slow.probes)  # never a cache hit
        sp = _speeds(await _admin(url, "/admin/workers"), "v")
        assert sp["state"] == "fitted" and sp["source"] == "fitted" and sp["confidence"] > 0
        # Measured through an event loop and HTTP, which a loaded machine only slows: never
        # faster than the engine's 4,000 tokens/s (the default it replaces is 10,000).
        assert 0 < sp["in_use"]["prefill_tokens_per_s"] < 6000
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
            text = await r.text()
        assert 'kvroute_worker_speed_state{source="fitted",state="fitted",worker="v"} 1.0' in text


async def test_unmeasured_workers_are_routed_by_affinity_and_explain_says_so() -> None:
    slow = _vllm("v", probe_tps=1000.0, probe_overhead_s=30.0)  # each probe takes half a minute
    async with fleet([slow], _cfg(admin_token=ADMIN)) as (gw, url):
        w = gw.pool.workers["v"]
        await wait_until(lambda: len(slow.probes) >= 1, 10.0, "a probe")
        assert not w.view.speeds_known and not w.view.speeds_fitted
        ex = await _admin(url, "/admin/route/explain", "POST",
                          {"model": "test-model", "prompt": "hello there", "max_tokens": 4})
        assert ex["decision"]["reason"] == "speeds_unknown"
        assert "not measured yet" in ex["note"] and ex["speeds"]["v"]["source"] == "defaults"
        # the probe runs beside the monitor: health checks go on meanwhile
        assert w.state.value == "healthy" and w.probe_task is not None and not w.probe_task.done()


async def test_a_worker_that_fails_its_probes_is_priced_with_the_defaults() -> None:
    broken = _vllm("v", probe_status=500)  # answers clients, not the probe
    async with fleet([broken], _cfg(admin_token=ADMIN)) as (gw, url):
        w = gw.pool.workers["v"]
        await wait_until(lambda: w.view.speeds_known, 10.0, "probing given up")
        assert not w.view.speeds_fitted and len(broken.probes) == 1
        ex = await _admin(url, "/admin/route/explain", "POST",
                          {"model": "test-model", "prompt": "hello there", "max_tokens": 4})
        assert ex["decision"]["reason"] != "speeds_unknown" and ex["speeds"]["v"]["source"] == "defaults"


async def test_a_stated_speed_is_not_probed() -> None:
    cfg2 = _cfg(models=[{"id": "test-model", "tokenizer": "configs/assets/tiny-tokenizer", "max_context_tokens": 512,
                         "cost": {"prefill_tokens_per_s": 1234.0}}])
    fake2 = _vllm("v")
    async with fleet([fake2], cfg2) as (gw, _url):
        w = gw.pool.workers["v"]
        assert w.view.speeds_known and not fake2.probes


@pytest.mark.parametrize("ctx,expect", [(4096, [16, 64, 512, 256, 128]), (200, [16, 64, 100, 100, 100])])
def test_probe_lengths_leave_room_for_the_answer(ctx: int, expect: list[int]) -> None:
    assert probe_lengths(ctx) == expect


def test_probe_body_salts_only_vllm() -> None:
    assert b"cache_salt" in probe_body("m", [1, 2], "vllm")
    assert b"cache_salt" not in probe_body("m", [1, 2], "kvroute")
