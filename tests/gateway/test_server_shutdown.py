"""The gateway's uvicorn shutdown: a request already sent on a connection accepted just
before the shutdown is answered, not reset (router/server.py, ReadBeforeClose); streams
still running when the drain ends close with an error event (DrainingServer)."""
from __future__ import annotations

import asyncio
import logging
import math
import signal
import socket

import msgspec
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from router.server import ReadBeforeClose


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


def _read_all(client: socket.socket) -> bytes:
    out = b""
    try:
        while chunk := client.recv(65536):
            out += chunk
    except ConnectionError:
        return b""
    return out


class _Plain(uvicorn.Server):
    """uvicorn's own shutdown, for the contrast."""


class _Embedded(ReadBeforeClose):
    def install_signal_handlers(self) -> None:  # the test's loop owns the signals
        pass


async def _request_racing_shutdown(cls: type[uvicorn.Server]) -> bytes:
    """Connect, let the server accept, send a request and shut the server down before it
    has read it; what the client gets back (b"" on a reset or a bare close)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = cls(uvicorn.Config(_app, loop="none", http="httptools", lifespan="off", log_level="error"))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        try:
            while not server.server_state.connections:  # accepted, nothing sent yet
                await asyncio.sleep(0.001)
            client.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")  # in its socket, not read by the server
            stop = asyncio.ensure_future(server.shutdown([sock]))
            await asyncio.sleep(0)  # the shutdown runs to its first await: connections shut down
            data = await asyncio.to_thread(_read_all, client)
            await stop
            return data
        finally:
            client.close()
    finally:
        server.should_exit = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        sock.close()


async def test_a_request_sent_just_before_the_shutdown_is_answered() -> None:
    data = await _request_racing_shutdown(_Embedded)
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"ok")


async def test_plain_uvicorn_drops_it_which_is_what_the_pause_is_for() -> None:
    assert await _request_racing_shutdown(_Plain) == b""


# --------------------------------------------------------------------------- the drain's end


async def _open_stream(port: int, path: str, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A streaming request, read until its first SSE event: (reader, writer, what came)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (path.encode(), len(body), body))
    got = b""
    while b"data: " not in got:
        chunk = await asyncio.wait_for(reader.read(65536), 30)
        assert chunk, got
        got += chunk
    return reader, writer, got


async def _rest(reader: asyncio.StreamReader) -> bytes:
    out = b""
    while chunk := await asyncio.wait_for(reader.read(65536), 30):
        out += chunk
    return out


@pytest.mark.parametrize("kind", ["kvroute", "vllm"])
async def test_streams_alive_when_the_drain_ends_close_with_an_error_event(
        kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """SIGTERM with six streams that outlive the drain: each ends with an SSE error event,
    `[DONE]` and the chunked body's last chunk; nothing is logged as a traceback."""
    from fakes import FakeWorker, serve_fake
    from gateway_fleet import DIGEST, MODEL, _cfg

    from router.api.app import GatewayAPI
    from router.fleet.fleetconfig import WorkerConfig
    from router.gateway import Gateway
    from router.server import GatewayServer

    drain_s = 0.5
    fake = FakeWorker("w", DIGEST, kind=kind, token_delay_s=0.05)
    async with serve_fake(fake):
        cfg = _cfg(shutdown={"grace_s": 0, "drain_timeout_s": drain_s})
        cfg.workers = [WorkerConfig(id="w", url=fake.url, model=MODEL, kind=kind)]  # type: ignore[arg-type]
        gw = await Gateway.create(cfg)
        assert await gw.pool.wait_ready(10)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        ucfg = uvicorn.Config(GatewayAPI(gw, manage_lifespan=False), loop="none", http="httptools", lifespan="off",
                              log_level="warning")
        ucfg.timeout_graceful_shutdown = int(math.ceil(drain_s))  # as `serve` sets it
        server = GatewayServer(ucfg, gw, 0.0, None)
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        streams = []
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            for i in range(6):
                chat = i % 2 == 0
                body = {"model": MODEL, "max_tokens": 400, "stream": True,
                        **({"messages": [{"role": "user", "content": f"hi {i}"}]} if chat else {"prompt": f"hi {i}"})}
                streams.append(await _open_stream(port, "/v1/chat/completions" if chat else "/v1/completions",
                                                  msgspec.json.encode(body)))
            with caplog.at_level(logging.INFO):
                server.handle_exit(signal.SIGTERM, None)
                ends = await asyncio.gather(*(_rest(r) for r, _, _ in streams))
                await asyncio.wait_for(task, 30)
        finally:
            for _, w, _ in streams:
                w.close()
            server.should_exit = True
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await gw.close()
            sock.close()
    for (_, _, head), end in zip(streams, ends, strict=True):
        whole = head + end
        assert whole.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in whole.lower()
        assert whole.endswith(b"0\r\n\r\n"), whole[-300:]  # the chunked body's last chunk
        events = [e for e in whole.split(b"\n\n") if b"data: " in e]
        assert b'"code":"shutting_down"' in events[-2] and events[-1].endswith(b"data: [DONE]"), events[-3:]
    bad = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()
           or "CancelledError" in r.getMessage() or "Exception in ASGI" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]
