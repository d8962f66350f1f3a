"""Late binding over HTTP (router/binding.py): the Binder on its own, then the gateway
holding requests while every fake worker reports a long queue."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from fakes import FakeWorker
from gateway_fleet import KEY, MODEL, _cfg, client, fleet, wait_until
from hangs import patience

from kvindex.keys import Namespace
from router.binding import Binder
from router.config import GatewayQueueConfig
from router.planner.gateway_queue import GatewayQueue
from router.telemetry.metrics import GatewayMetrics

DIGEST = Namespace(MODEL).digest.hex()


class Fleet:
    """Predicted queues the test sets; each bound request adds `per_request` to worker 0."""

    def __init__(self, queues: list[float], per_request: float = 0.0) -> None:
        self.queues = queues
        self.per_request = per_request

    def __call__(self, model_id: str) -> list[float]:
        return list(self.queues)

    def bind(self) -> None:
        self.queues[0] += self.per_request


def _binder(fl: Fleet, **cfg: Any) -> tuple[Binder, GatewayMetrics]:
    m = GatewayMetrics()
    return Binder(GatewayQueueConfig(**cfg), fl, m), m


async def _request(b: Binder, fl: Fleet, name: str, order: list[str], size: float = 1.0, tenant: str = "") -> float:
    held = await b.turn("m", lambda: size, tenant)
    order.append(name)
    fl.bind()  # counted on its worker before its first real await, as the gateway does
    await asyncio.sleep(0)
    return held


def _sample(m: GatewayMetrics, name: str) -> float:
    v = m.registry.get_sample_value(name, {"model": "m"})
    return v or 0.0


async def test_off_or_a_worker_under_the_target_routes_on_arrival() -> None:
    fl = Fleet([5.0, 5.0])
    off, _ = _binder(fl)
    assert not off.enabled and await off.turn("m", lambda: 1.0, "") == 0.0
    fl.queues = [5.0, 0.5]
    b, _ = _binder(fl, hold_target_s=1.0)
    assert await b.turn("m", lambda: 1.0, "") == 0.0
    fl.queues = []  # no worker at all: not held (routing answers 503 at once)
    assert await b.turn("m", lambda: 1.0, "") == 0.0
    assert b.held("m") == 0


async def test_held_while_every_worker_is_over_and_bound_in_order_as_they_drain() -> None:
    fl = Fleet([3.0, 4.0], per_request=0.6)
    b, m = _binder(fl, hold_target_s=1.0, order="spf")
    order: list[str] = []
    sizes = {"long": 9000.0, "short": 100.0, "mid": 2000.0}
    tasks = [asyncio.create_task(_request(b, fl, n, order, s)) for n, s in sizes.items()]
    await asyncio.sleep(0.05)
    assert order == [] and b.held("m") == 3
    assert _sample(m, "kvroute_gateway_held_requests") == 3
    fl.queues = [0.0, 4.0]  # worker 0 drains; each binding adds 0.6 s to it
    b.check("m")
    await asyncio.sleep(0.05)
    assert order == ["short", "mid"]  # after two, worker 0 is over the target again: the third waits
    assert b.held("m") == 1
    fl.queues[1] = 0.0
    b.check("m")
    held = await asyncio.gather(*tasks)
    assert order == ["short", "mid", "long"] and all(h > 0.0 for h in held)
    assert _sample(m, "kvroute_gateway_held_requests") == 0
    assert _sample(m, "kvroute_gateway_hold_seconds_count") == 3


async def test_the_fairness_bound_binds_a_request_held_max_hold_s() -> None:
    fl = Fleet([9.0])
    b, _ = _binder(fl, hold_target_s=1.0, max_hold_s=0.15)
    t = time.monotonic()
    held = await asyncio.wait_for(b.turn("m", lambda: 1.0, ""), patience(2.0))  # the queue never drains
    assert held >= 0.15 and time.monotonic() - t >= 0.15
    b.close()


async def test_a_client_that_leaves_while_held_is_dropped() -> None:
    fl = Fleet([9.0])
    b, m = _binder(fl, hold_target_s=1.0)
    order: list[str] = []
    gone = asyncio.create_task(_request(b, fl, "gone", order))
    stays = asyncio.create_task(_request(b, fl, "stays", order))
    await asyncio.sleep(0.02)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert b.held("m") == 1 and _sample(m, "kvroute_gateway_held_requests") == 1
    fl.queues = [0.0]
    b.check("m")
    await asyncio.wait_for(stays, patience(1.0))
    assert order == ["stays"] and b.held("m") == 0


async def test_a_full_queue_routes_on_arrival_and_counts_it() -> None:
    fl = Fleet([9.0])
    b, m = _binder(fl, hold_target_s=1.0, max_held=2)
    waiting = [asyncio.create_task(b.turn("m", lambda: 1.0, "")) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert await asyncio.wait_for(b.turn("m", lambda: 1.0, ""), patience(0.5)) == 0.0
    assert _sample(m, "kvroute_gateway_queue_full_total") == 1
    b.close()  # a stopping gateway lets what it holds go
    await asyncio.wait_for(asyncio.gather(*waiting), patience(1.0))


async def test_tenants_take_turns() -> None:
    fl = Fleet([9.0], per_request=0.0)
    b, _ = _binder(fl, hold_target_s=1.0)
    order: list[str] = []
    tasks = [asyncio.create_task(_request(b, fl, f"a{i}", order, 100.0, "a")) for i in range(3)]
    await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(_request(b, fl, "b0", order, 100.0, "b")))
    await asyncio.sleep(0.01)
    fl.queues = [0.0]
    b.check("m")
    await asyncio.gather(*tasks)
    assert order.index("b0") <= 1  # b served nothing yet: it goes before a's second


def test_dropped_requests_are_not_bound_nor_counted() -> None:
    q: GatewayQueue[str] = GatewayQueue(order="fifo")
    h = q.push("a", 1, 0.0, "t1")
    q.push("b", 1, 0.5, "t2")
    assert q.oldest_arrival() == 0.0
    q.drop(h)
    q.drop(h)
    assert len(q) == 1 and q.oldest_arrival() == 0.5
    assert q.pop(1.0) == "b" and q.pop(1.0) is None and q.oldest_arrival() is None


# --------------------------------------------------------------------------- over HTTP


async def test_gateway_holds_while_every_worker_is_busy_and_binds_when_one_drains() -> None:
    busy = {"est_queue_s": 5.0}
    fakes = [FakeWorker(f"w{i}", DIGEST, load=dict(busy)) for i in range(2)]
    cfg = _cfg(routing={"policy": "kv_cost", "gateway_queue": {"hold_target_s": 1.0, "max_hold_s": 30}})
    async with fleet(fakes, cfg) as (gw, url):
        c = client(url, KEY)

        async def ask(i: int) -> str:
            r = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                                                max_tokens=2)
            return r.choices[0].message.content or ""

        tasks = [asyncio.create_task(ask(i)) for i in range(3)]
        await wait_until(lambda: gw.binder.held(MODEL) == 3, what="three held requests")
        await asyncio.sleep(0.3)  # several load polls, every worker still over the target
        assert not any(f.completions for f in fakes) and gw.binder.held(MODEL) == 3
        ex = await gw_explain(url)
        assert ex["gateway_queue"]["held"] == 3 and ex["gateway_queue"]["hold_target_s"] == 1.0
        fakes[1].load = {}  # w1 drains: the next load report releases the held requests
        answers = await asyncio.wait_for(asyncio.gather(*tasks), patience(5.0))
        assert len(answers) == 3 and len(fakes[1].completions) == 3 and not fakes[0].completions
        body = gw.metrics.render().decode()
        assert f'kvroute_gateway_hold_seconds_count{{model="{MODEL}"}} 3.0' in body


async def test_gateway_binds_a_held_request_at_the_fairness_bound() -> None:
    fakes = [FakeWorker("w0", DIGEST, load={"est_queue_s": 5.0})]
    cfg = _cfg(routing={"policy": "kv_cost", "gateway_queue": {"hold_target_s": 1.0, "max_hold_s": 0.3}})
    async with fleet(fakes, cfg) as (_gw, url):
        t = time.monotonic()
        r = await client(url, KEY).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        assert r.choices and time.monotonic() - t >= 0.3 and len(fakes[0].completions) == 1


async def gw_explain(url: str) -> dict[str, Any]:
    import aiohttp

    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/admin/route/explain", json=body) as r:
            assert r.status == 200, await r.text()
            out: dict[str, Any] = await r.json()
            return out
