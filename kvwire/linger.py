"""A lingering close for answers sent before the request body was read.

Gateway and workers refuse some requests before reading their bodies (a 413 on the
declared length, a 401/403, the gateway's body budget). If the server then closes
while the client is still sending, the client's kernel sees unread data die with a
reset and the client may never read the refusal. Reading and dropping the rest of
the body for a bounded time and size before the answer's last byte avoids that, as
HTTP servers' "lingering close" does. Both sides serve through ASGI, so this lives
with the wire contract they share.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

MAX_BYTES = 16 << 20  # drop at most this much of an unwanted body ...
MAX_S = 2.0  # ... for at most this long; past either the connection closes as it is


async def drain(receive: Receive, max_bytes: int = MAX_BYTES, max_s: float = MAX_S) -> bool:
    """Read and drop the rest of a request body; True when it ended within the bounds."""
    got = 0
    try:
        async with asyncio.timeout(max_s):
            while got <= max_bytes:
                msg = await receive()
                if msg["type"] != "http.request":
                    return False
                got += len(msg.get("body", b""))
                if not msg.get("more_body", False):
                    return True
    except TimeoutError:
        pass
    return False


def expects_continue(scope: MutableMapping[str, Any]) -> bool:
    """The client waits for `100 Continue` before it sends the body: nothing to drain
    (asking for the body would invite it to send what nobody reads)."""
    return any(k.lower() == b"expect" and v.lower() == b"100-continue" for k, v in scope.get("headers", ()))


class LingeringClose:
    """ASGI middleware: when the app finishes a response to a request whose body it did
    not read to the end, the rest is drained (bounded) before the answer's last byte."""

    def __init__(self, app: App, max_bytes: int = MAX_BYTES, max_s: float = MAX_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_s = max_s

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        complete = False

        async def recv() -> Message:
            nonlocal complete
            msg = await receive()
            if msg["type"] != "http.request" or not msg.get("more_body", False):
                complete = True
            return msg

        async def snd(msg: Message) -> None:
            if (not complete and msg["type"] == "http.response.body" and not msg.get("more_body", False)
                    and not expects_continue(scope)):
                await send({"type": "http.response.body", "body": msg.get("body", b""), "more_body": True})
                await drain(recv, self.max_bytes, self.max_s)
                msg = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(msg)

        await self.app(scope, recv, snd)
