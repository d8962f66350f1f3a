"""Workers too busy to accept a connection are overloaded, not failed (issue #25 item 2).

Before, when every worker tried was slow to accept (the connect timeout passed), the
gateway answered 502 `worker_failed`, as if live workers had died; overload must be a
429 with Retry-After, and it must not feed the workers' circuit breakers."""
from __future__ import annotations

import json
from typing import Any

import pytest
from fakes import FakeWorker
from gateway_fleet import DIGEST, MODEL, _cfg, _raw, _shape, fleet

from router.upstream.proxy import UpstreamError


async def test_every_worker_slow_to_accept_is_a_429_not_a_502(monkeypatch: pytest.MonkeyPatch) -> None:
    fakes = [FakeWorker("a", DIGEST), FakeWorker("b", DIGEST)]
    async with fleet(fakes, _cfg(routing={"policy": "round_robin", "retries": 1})) as (gw, url):
        tried: list[str] = []

        async def slow_to_accept(a: Any, _out: Any) -> int:
            tried.append(a.worker.id)
            raise UpstreamError(f"worker {a.worker.id} did not accept the connection within 5.0 s", True,
                                phase="connect_timeout")

        monkeypatch.setattr(gw.relay, "run", slow_to_accept)
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True}).encode()
        status, answer, headers = await _raw(url, "/v1/completions", body)
        assert sorted(tried) == ["a", "b"]  # retried before answering
        assert status == 429, answer
        assert int(headers["Retry-After"]) >= 1
        err = _shape(answer)
        assert err["type"] == "rate_limit_error" and "a" not in err["message"].split()
        assert all(w.breaker.fails == 0 for w in gw.pool.workers.values())
        assert gw.metrics.shed.labels("slow_to_accept")._value.get() == 1


async def test_a_worker_failure_after_a_slow_one_is_still_a_502(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only overload is a 429: when the last worker tried failed outright, the client hears of it."""
    fakes = [FakeWorker("a", DIGEST), FakeWorker("b", DIGEST)]
    async with fleet(fakes, _cfg(routing={"policy": "round_robin", "retries": 1})) as (gw, url):
        calls: list[str] = []

        async def slow_then_reset(a: Any, _out: Any) -> int:
            calls.append(a.worker.id)
            if len(calls) == 1:
                raise UpstreamError(f"worker {a.worker.id} did not accept the connection within 5.0 s", True,
                                    phase="connect_timeout")
            raise UpstreamError(f"worker {a.worker.id} failed: connection reset", True, phase="first")

        monkeypatch.setattr(gw.relay, "run", slow_then_reset)
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
        status, answer, _ = await _raw(url, "/v1/completions", body)
        assert status == 502 and _shape(answer)["code"] == "worker_failed"
