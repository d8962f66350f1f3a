"""Raw ASGI plumbing for the completion hot path: response writer, body reader, disconnects.

The completion routes write with the ASGI `send` they are given (no response object
per chunk), read the body with a size cap before anything else, and watch for the
client leaving, which cancels the handler (closing the upstream connection, which
cancels the request on the worker, and cancelling its prefetch).
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from starlette.types import Receive, Scope, Send

from kvwire.linger import drain

from ..upstream.attempt import JSON_HEADERS
from .direct_body import DirectBody
from .errors import ApiError, bad_request, too_large

__all__ = ["AsgiOut", "ClientGone", "Receive", "Scope", "Send", "duplicate_credentials", "headers_of", "read_body",
           "watch_disconnect"]
_enc = msgspec.json.Encoder()


class AsgiOut:
    """`Out` over ASGI send; remembers whether the response has started. A stream's
    middle parts go straight to the connection where the server allows it
    (router/api/direct_body.py)."""

    __slots__ = ("send", "started", "status", "sse", "direct", "ended", "rid")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.started = False
        self.status = 0
        self.sse = False
        self.direct: DirectBody | None = None
        self.ended = False  # the body's last part was sent
        self.rid = ""  # the request's id, once known (an error event names it)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        self.sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        if self.sse:
            self.direct = DirectBody.attach(self.send)

    async def body(self, data: bytes, more: bool = False) -> None:
        if not more:
            self.ended = True
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    def write_now(self, data: bytes) -> bool:
        d = self.direct
        return d is not None and d.write(data)

    async def json(self, status: int, obj: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        await self.start(status, JSON_HEADERS + (extra or []))
        await self.body(obj if isinstance(obj, bytes) else _enc.encode(obj))

    async def error(self, e: ApiError, request_id: str | None = None, unread: Receive | None = None) -> None:
        """The error; `unread`: the request's receive, its body not read to the end, which
        is drained (bounded) before the answer's last byte so the client reads it."""
        hdrs = [(k.encode(), v.encode()) for k, v in e.response_headers().items()]
        if unread is None:
            await self.json(e.status, e.body(request_id), hdrs)
            return
        await self.start(e.status, JSON_HEADERS + hdrs)
        await self.body(e.body(request_id), more=True)
        await drain(unread)
        await self.body(b"")


class ClientGone(Exception):
    """The client disconnected before its request body arrived: nothing to answer."""


_CREDENTIALS = (b"authorization", b"api-key", b"x-admin-token")


def duplicate_credentials(scope: Scope) -> str | None:
    """The name of a credential header the request carries more than once, else None.
    Which copy counts would differ between parsers and proxies (the last silently won
    here): such a request is refused rather than guessed at."""
    seen: set[bytes] = set()
    for k, _ in scope["headers"]:
        name: bytes = k.lower()
        if name in _CREDENTIALS:
            if name in seen:
                return name.decode()
            seen.add(name)
    return None


def headers_of(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


async def read_body(receive: Receive, limit: int, declared: str | None) -> bytes:
    """The whole body, refused with 413 as soon as it (or its Content-Length) passes `limit`."""
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large(limit)
        except ValueError:
            raise bad_request("Invalid Content-Length header.") from None
    chunks = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        b = msg.get("body", b"")
        if b:
            size += len(b)
            if size > limit:
                raise too_large(limit, unread=msg.get("more_body", False))
            chunks.append(b)
        if not msg.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def watch_disconnect(receive: Receive, task: asyncio.Task[Any], gone: asyncio.Event) -> None:
    """Cancel `task` when the client disconnects (the body was read already)."""
    while not task.done():
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not task.done():
                gone.set()
                task.cancel()
            return
