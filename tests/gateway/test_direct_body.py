"""A stream's middle parts written straight to uvicorn's connection (router/api/direct_body.py):
the same bytes as ASGI's send, the connection reusable after, and `send` left to do
whatever must wait or end the response."""
from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from router.api.direct_body import DirectBody

PARTS = [b"data: one\n\n", b"", b"data: two\n\n", b"data: " + b"x" * 70_000 + b"\n\n"]
SSE = [(b"content-type", b"text/event-stream")]


def _app(seen: dict[str, Any]) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        d = DirectBody.attach(send)
        seen["attached"] = d is not None
        if scope["path"] == "/wrapped":  # a middleware's wrapper: nothing to attach to
            async def wrapped(msg: Any) -> None:
                await send(msg)

            seen["wrapped"] = DirectBody.attach(wrapped)
        if d is not None:
            seen["before_start"] = d.write(b"early")  # not started: left to send
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        for p in PARTS:
            if d is None or not d.write(p):
                await send({"type": "http.response.body", "body": p, "more_body": True})
        if d is not None:
            d.cycle.flow.write_paused = True  # the client is not reading: must wait in send
            seen["paused"] = d.write(b"late")
            d.cycle.flow.write_paused = False
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        if d is not None:
            seen["after_end"] = d.write(b"after")

    return app


async def _serve(app: Any, http: str) -> tuple[uvicorn.Server, asyncio.Task[None], str, socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, loop="none", http=http, lifespan="off", log_level="error"))
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, f"http://127.0.0.1:{sock.getsockname()[1]}", sock


@pytest.mark.parametrize("http", ["httptools", "h11"])
async def test_direct_parts_read_as_sent_on_a_reused_connection(http: str) -> None:
    seen: dict[str, Any] = {}
    server, task, url, sock = await _serve(_app(seen), http)
    try:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as client:
            for path in ("/a", "/b", "/wrapped"):
                r = await client.get(url + path)
                assert r.status_code == 200
                assert r.content == b"".join(PARTS) + b"data: [DONE]\n\n"
    finally:
        server.should_exit = True
        await task
        sock.close()
    if http == "h11":
        assert seen["attached"] is False  # another server: every part through send
        return
    assert seen == {"attached": True, "wrapped": None, "before_start": False, "paused": False, "after_end": False}
