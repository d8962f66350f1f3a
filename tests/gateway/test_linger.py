"""Lingering close (kvwire/linger.py): a refusal sent before the request body was read
reaches a client that is still sending, on a real uvicorn server over TCP, for the
worker app (a 413 on the declared length, a 403 from /kv/blocks without a peer token)."""
from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn
from hangs import patience

from kvwire.linger import LingeringClose, drain
from workers.app import build_app
from workers.sim.driver import SimDriver
from workers.sim.engine import SimEngine
from workers.sim.testing import make_profile


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[int]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    cfg = uvicorn.Config(app, loop="none", lifespan="off", access_log=False, log_level="critical")
    server = uvicorn.Server(cfg)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.005)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = server.force_exit = True
        await asyncio.wait_for(task, patience(5))
        sock.close()


async def send_slowly(port: int, path: str, size: int) -> bytes:
    """Headers first; the body after the server had time to refuse; what the client reads."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                 % (path.encode(), size))
    await asyncio.sleep(0.2)
    try:
        for i in range(0, size, 65536):
            writer.write(b"x" * min(65536, size - i))
            await writer.drain()
    except ConnectionError:
        pass
    try:
        head = await asyncio.wait_for(reader.read(4096), patience(5.0))
    except ConnectionError as e:
        head = repr(e).encode()
    writer.close()
    return head


@pytest.fixture
async def worker_port() -> AsyncIterator[int]:
    d = SimDriver(SimEngine("w0", make_profile(gpu_blocks=64, max_context_tokens=1024)))
    await d.start()
    try:
        async with serving(build_app(d, max_body_bytes=4096)) as port:
            yield port
    finally:
        await d.close()


@pytest.mark.parametrize(("path", "status"), [("/v1/completions", b"413"), ("/kv/blocks", b"403")])
async def test_a_worker_refusal_reaches_a_client_still_sending(worker_port: int, path: str, status: bytes) -> None:
    for _ in range(3):
        head = await send_slowly(worker_port, path, 2_000_000)
        assert head.startswith(b"HTTP/1.1 " + status), head[:80]


async def test_without_the_drain_the_refusal_can_be_lost() -> None:
    """The same refusal from a bare app, to show the test above can fail."""

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"text/plain"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": b"too large"})

    async with serving(refuse) as port:
        heads = [await send_slowly(port, "/x", 2_000_000) for _ in range(3)]
    assert any(not h.startswith(b"HTTP/1.1 413") for h in heads), heads
    async with serving(LingeringClose(refuse)) as port:
        heads = [await send_slowly(port, "/x", 2_000_000) for _ in range(3)]
    assert all(h.startswith(b"HTTP/1.1 413") for h in heads), heads


async def test_drain_is_bounded() -> None:
    """A body that never ends is dropped for at most `max_s`; one too large stops early."""

    async def forever() -> dict[str, Any]:
        await asyncio.sleep(0.01)
        return {"type": "http.request", "body": b"x" * 1000, "more_body": True}

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert not await drain(forever, max_bytes=1 << 30, max_s=0.2)
    assert 0.15 < loop.time() - t0 < 1.0
    t0 = loop.time()
    assert not await drain(forever, max_bytes=5000, max_s=10.0)
    assert loop.time() - t0 < 1.0

    async def disconnect() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    assert not await drain(disconnect)
