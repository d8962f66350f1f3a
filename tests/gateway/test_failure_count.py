"""Real bugs that surviving mutants led to (bench/notes/mutation.md), each now fixed and guarded
by its test."""
from __future__ import annotations

from typing import Any

import aiohttp
from fakes import FakeWorker, serve_fake
from gateway_fleet import DIGEST, MODEL, _cfg, fleet

from router.fleet.fleetconfig import WorkerConfig


async def _post(url: str, body: dict[str, Any]) -> int:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


async def test_one_refused_request_counts_one_failure() -> None:
    """The admin view's `failures` of a worker whose process is gone: one request that
    found its connection refused is one failure (router/fleet/pool_health.py report_failure counted it,
    then handed it to the health check (pool_health.Health.failed), which counted it again)."""
    async with serve_fake(FakeWorker("a", DIGEST)) as doomed:
        url_a = doomed.url
    cfg = _cfg(routing={"policy": "round_robin", "retries": 1},
               pool={"load_poll_interval_s": 5, "health_interval_s": 5, "unhealthy_after": 50})
    async with fleet([FakeWorker("b", DIGEST)], cfg) as (gw, url):
        w = gw.pool.add(WorkerConfig(id="a", url=url_a, model=MODEL))
        assert w.task is not None
        w.task.cancel()  # only the request path may find out
        gw.pool.roster.join(w)
        gw.pool.roster.set_state(w, type(w.state).HEALTHY, "")
        for _ in range(2):  # round robin: one of the two reaches a
            assert await _post(url, {"model": MODEL, "prompt": "hello", "max_tokens": 1}) == 200
        assert w.state.value == "unhealthy"
        assert w.summary()["failures"] == 1
