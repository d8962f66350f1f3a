"""The gateway's uvicorn shutdown: a request already sent on a connection accepted just
before the shutdown is answered, not reset (router/server.py, ReadBeforeClose)."""
from __future__ import annotations

import asyncio
import socket

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
