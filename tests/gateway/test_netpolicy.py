"""One network policy for every address the gateway connects to (router/fleet/netpolicy.py):
worker URLs and KV-event endpoints, admin-added, configured or advertised in `/info`."""
from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from fakes import FakeWorker
from gateway_fleet import DIGEST, MODEL, _cfg, fleet, wait_until

from router.config import ConfigError
from router.fleet.worker import State

METADATA = "169.254.169.254"


@pytest.mark.parametrize("events,status,where", [
    ({"endpoint": f"tcp://{METADATA}:5557"}, 403, "events.endpoint"),
    ({"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://8.8.8.8:5558"}, 403, "events.replay_endpoint"),
    ({"endpoint": "tcp://[::ffff:169.254.169.254]:5557"}, 403, "events.endpoint"),
    ({"endpoint": f"tcp://127.0.0.1;{METADATA}:5557"}, 403, "events.endpoint"),
    ({"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "ipc:///tmp/kvroute-replay"}, 400, "tcp://"),
])
async def test_the_admin_api_refuses_event_endpoints_outside_the_networks(events: dict[str, Any], status: int,
                                                                          where: str) -> None:
    async with fleet([FakeWorker("w", DIGEST)]) as (gw, url):
        body = {"id": "x", "url": gw.pool.workers["w"].url, "kind": "vllm", "events": events}
        async with aiohttp.ClientSession() as s, s.post(url + "/admin/workers", json=body) as r:
            err = (await r.json())["error"]
            assert r.status == status and where in err["message"], err
        assert "x" not in gw.pool.workers


@pytest.mark.parametrize("worker,field", [
    ({"url": f"http://{METADATA}:80"}, "workers[0].url"),
    ({"url": "http://127.0.0.1:9", "kind": "vllm", "events": {"endpoint": f"tcp://{METADATA}:5557"}},
     "workers[0].events.endpoint"),
    ({"url": "http://127.0.0.1:9", "kind": "vllm",
      "events": {"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://8.8.8.8:5558"}},
     "workers[0].events.replay_endpoint"),
])
def test_a_config_naming_an_address_outside_the_networks_fails_at_start(worker: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        _cfg(workers=[{"id": "w", "model": MODEL, **worker}])
    assert field in str(ei.value) and "admin.worker_networks" in str(ei.value)


def test_the_config_file_may_still_use_ipc_and_bind() -> None:
    cfg = _cfg(workers=[{"id": "w", "url": "http://127.0.0.1:9", "kind": "vllm",
                         "events": {"endpoint": "tcp://127.0.0.1:5557", "bind": True}},
                        {"id": "v", "url": "http://127.0.0.1:10", "kind": "vllm",
                         "events": {"endpoint": "ipc:///tmp/kvroute-events"}}])
    assert [w.id for w in cfg.workers] == ["w", "v"]


@pytest.mark.parametrize("events,why", [
    ({"endpoint": "ipc:///tmp/kvroute-advertised", "replay_endpoint": None, "topic": "kv"}, "must be tcp://"),
    ({"endpoint": "tcp://127.0.0.1:5999", "replay_endpoint": f"tcp://{METADATA}:5558", "topic": "kv"},
     "outside the networks"),
])
async def test_a_worker_advertising_endpoints_outside_the_policy_is_refused(events: dict[str, Any], why: str) -> None:
    bad, good = FakeWorker("bad", DIGEST, events=events), FakeWorker("good", DIGEST)
    async with fleet([bad, good], ready=False) as (gw, _):
        w = gw.pool.workers["bad"]
        await wait_until(lambda: w.state is State.REFUSED, 5.0, "the worker refused")
        assert why in w.reason and not w.in_index
        await wait_until(lambda: gw.pool.workers["good"].state is State.HEALTHY, 5.0, "the good worker healthy")


async def test_a_name_that_later_resolves_off_the_networks_is_not_connected_to() -> None:
    """DNS rebinding: the gateway's HTTP client re-checks every resolution."""
    import socket

    from aiohttp.abc import AbstractResolver, ResolveResult

    from router.fleet.netpolicy import NetworkPolicy, PolicyResolver

    class Answers(AbstractResolver):
        def __init__(self) -> None:
            self.hosts = ["10.0.0.7"]

        async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET,
                          ) -> list[ResolveResult]:
            return [ResolveResult(hostname=host, host=h, port=port, family=family, proto=0, flags=0)
                    for h in self.hosts]

        async def close(self) -> None:
            pass

    inner = Answers()
    r = PolicyResolver(NetworkPolicy(["10.0.0.0/8"]), inner)
    assert [x["host"] for x in await r.resolve("worker.internal", 80)] == ["10.0.0.7"]
    inner.hosts = [METADATA, "10.0.0.8"]
    assert [x["host"] for x in await r.resolve("worker.internal", 80)] == ["10.0.0.8"]
    inner.hosts = [METADATA]
    with pytest.raises(OSError, match="outside the networks"):
        await r.resolve("worker.internal", 80)


async def test_a_name_that_does_not_resolve_yet_is_not_refused() -> None:
    """A worker whose DNS name is not there yet (its pod not up) is retried, not refused."""
    from router.fleet.fleetconfig import WorkerConfig

    cfg = _cfg()
    cfg.workers = [WorkerConfig(id="later", url="http://worker-not-yet.invalid:9000", model=MODEL)]
    async with fleet([FakeWorker("good", DIGEST)], cfg) as (gw, _):
        w = gw.pool.workers["later"]
        await wait_until(lambda: "does not resolve" in (w.last_error or ""), 5.0, "a registration attempt")
        assert w.state is not State.REFUSED and not w.in_index
