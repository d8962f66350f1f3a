"""A worker slow to accept a connection is overloaded, not failing (router/upstream/proxy.py).

Before, aiohttp's connect timeout surfaced as "no response within 30 s" (the header
window's message) and counted toward the worker's circuit breaker."""
from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from router.upstream.proxy import UpstreamError, post


class _SlowAccept:
    """A session whose every connection attempt times out, as aiohttp reports it."""

    async def post(self, *_a: Any, **_kw: Any) -> Any:
        raise aiohttp.ConnectionTimeoutError("Connection timeout to host http://127.0.0.1:9")


async def test_connect_timeout_is_named_and_not_worker_trouble() -> None:
    timeout = aiohttp.ClientTimeout(total=60, connect=5)
    with pytest.raises(UpstreamError) as ei:
        await post(_SlowAccept(), "http://127.0.0.1:9/v1/completions", b"{}", "w1", timeout,  # type: ignore[arg-type]
                   header_timeout_s=30.0)
    e = ei.value
    assert e.retryable and not e.fatal and e.phase == "connect_timeout"
    assert "did not accept the connection within 5" in str(e) and "30 s" not in str(e)
    assert not e.worker_trouble


def test_other_failures_still_count_for_the_breaker() -> None:
    assert UpstreamError("x", True).worker_trouble
    assert UpstreamError("x", True, phase="status", status=500).worker_trouble
    assert not UpstreamError("x", True, phase="status", status=503).worker_trouble


async def test_idle_connections_expire_before_a_workers_server_closes_them() -> None:
    """vLLM's and our workers' uvicorn close idle keep-alive connections after 5 s; a request
    written into one just as it closes fails before its first byte. The gateway drops idle
    connections sooner (both of its clients)."""
    from gateway_fleet import _cfg

    from router.server import running_gateway
    from router.upstream import http1 as upstream

    async with running_gateway(_cfg(), ready_timeout=None) as (gw, _url):
        conn = gw.session.connector
        assert conn is not None and conn._keepalive_timeout < 5.0  # type: ignore[attr-defined]
    assert upstream.MAX_IDLE_S < 5.0


async def test_the_lean_clients_connect_timeout_is_not_worker_trouble() -> None:
    """Streams to plain-http workers connect through router/upstream/http1.py: a worker too busy
    to accept (its listen backlog full, so further SYNs are dropped) fails the attempt as
    `connect_timeout` there too; it said "unreachable: TimeoutError" and opened breakers
    under a burst."""
    import socket
    from types import SimpleNamespace

    from router.upstream.exchange import _connect
    from router.upstream.http1 import UpstreamPool

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    fillers = []
    for _ in range(3):  # fill the backlog: nobody accepts them
        f = socket.socket()
        f.setblocking(False)
        f.connect_ex(("127.0.0.1", port))
        fillers.append(f)
    upstream = UpstreamPool(0.3)
    try:
        with pytest.raises(UpstreamError) as ei:
            await _connect(upstream, ("127.0.0.1", port), SimpleNamespace(id="w1"),  # type: ignore[arg-type]
                           SimpleNamespace(task=None), None)  # type: ignore[arg-type]
    finally:
        upstream.close()
        for f in fillers:
            f.close()
        srv.close()
    e = ei.value
    assert e.retryable and not e.fatal and e.phase == "connect_timeout" and not e.worker_trouble
    assert "did not accept the connection within 0.3 s" in str(e)
