"""A lean HTTP/1.1 client for the hot path: keep-alive connections to our workers.

The relay to our workers (router/upstream/relay.py) is the gateway's per-request and per-chunk
cost. aiohttp's client spends a few hundred microseconds per request (request and
response objects, header multidicts, timers, a stream reader) and, per streamed chunk,
a task wakeup through its StreamReader. Here a connection is an asyncio Protocol whose
response is parsed by httptools (C, chunked decoding included) and handed to a `Sink`
through plain callbacks: the relay folds each network read into the client's stream
right there, without waking a task per chunk.

Only plain `http://host:port` workers without a path prefix take this path (the
relay's `fast_url`); anything else goes through aiohttp as before. Connections are
kept per (host, port), reused once their response was read to the end, and closed on
any error, on cancellation and on close.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

MAX_IDLE_PER_HOST = 512
# An idle connection older than this is not reused: a worker's server closes idle
# keep-alive connections after a few seconds (uvicorn and vLLM: 5 s), and a request
# written into one it is closing right then would fail as if the worker were in trouble.
# A second of margin; shorter would reconnect often at a few requests per second.
MAX_IDLE_S = 4.0


class Sink(Protocol):
    """Where a response goes, callback by callback (on the event loop)."""

    def head(self, status: int) -> None: ...
    def body(self, data: bytes) -> None: ...
    def complete(self) -> None: ...
    def lost(self, exc: BaseException | None) -> None: ...


def fast_url(url: str) -> tuple[str, int] | None:
    """(host, port) of a worker URL this client can serve (plain http, no path), else None."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        return None
    if u.scheme != "http" or not u.hostname or (u.path not in ("", "/")) or u.query or u.username:
        return None
    return u.hostname, port or 80


class Conn(asyncio.Protocol):
    """One keep-alive connection; one exchange at a time."""

    __slots__ = ("pool", "key", "transport", "parser", "sink", "keep", "complete", "closed", "reuse_when_complete",
                 "idle_since", "content_type")

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.sink: Sink | None = None
        self.keep = True
        self.complete = True  # no response in progress
        self.closed = False
        self.reuse_when_complete = False
        self.idle_since = 0.0
        self.content_type = b""  # the current response's, as sent

    # ---------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"malformed HTTP response: {e}"))

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.pool.forget(self)
        sink, self.sink = self.sink, None
        if sink is not None and not self.complete:
            sink.lost(exc or ConnectionResetError("the worker closed the connection"))

    # ---------------------------------------------------------------- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"connection" and value.lower() == b"close":
            self.keep = False
        elif n == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        if self.sink is not None:
            self.sink.head(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            self.sink.body(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if not self.parser.should_keep_alive():
            self.keep = False
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.complete()
        if self.reuse_when_complete:
            self.reuse_when_complete = False
            self.pool.put(self)

    # ---------------------------------------------------------------- use

    def send(self, head: bytes, body: bytes, sink: Sink) -> None:
        assert self.transport is not None
        self.sink = sink
        self.complete = False
        self.content_type = b""
        self.transport.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.transport.write(body)

    def _fail(self, exc: BaseException) -> None:
        sink, self.sink = self.sink, None
        self.close()
        if sink is not None:
            sink.lost(exc)

    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def release(self) -> None:
        """The exchange is over: back to the pool once its response was read to the end."""
        self.sink = None
        if self.closed or not self.keep:
            self.close()
        elif self.complete:
            self.pool.put(self)
        else:
            self.reuse_when_complete = True  # the last bytes (the final empty chunk) are on their way

    def close(self) -> None:
        self.keep = False
        self.reuse_when_complete = False
        if self.transport is not None:
            self.transport.abort()  # never reused: a half-read response must not reach the next request


class UpstreamPool:
    """Idle keep-alive connections per (host, port)."""

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[Conn]] = {}
        self._closed = False

    async def get(self, key: tuple[str, int]) -> Conn:
        loop = asyncio.get_running_loop()
        idle = self._idle.get(key)
        if idle:
            fresh = loop.time() - MAX_IDLE_S
            while idle:
                c = idle.pop()
                if c.idle_since >= fresh and not c.closed and c.transport is not None \
                        and not c.transport.is_closing():
                    return c
                c.close()
        async with asyncio.timeout(self.connect_timeout_s):
            _, proto = await loop.create_connection(lambda: Conn(self, key), key[0], key[1])
        return proto

    def put(self, c: Conn) -> None:
        if self._closed or c.closed or not c.keep:
            c.close()
            return
        idle = self._idle.setdefault(c.key, [])
        if len(idle) >= MAX_IDLE_PER_HOST:
            c.close()
            return
        c.idle_since = asyncio.get_running_loop().time()
        idle.append(c)

    def forget(self, c: Conn) -> None:
        idle = self._idle.get(c.key)
        if idle and c in idle:
            idle.remove(c)

    def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for c in list(idle):
                c.close()
        self._idle.clear()


def request_head(host: str, port: int, path: str, length: int, extra: bytes = b"") -> bytes:
    """A POST's head: JSON in, SSE out, keep-alive; `extra`: more header lines."""
    h = f"[{host}]" if ":" in host else host
    return (b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\naccept: text/event-stream\r\n"
            b"content-length: %d\r\n%s\r\n") % (path.encode(), h.encode("idna"), port, length, extra)


class _Collect:
    """A Sink that keeps the whole response (a probe's small JSON answer)."""

    __slots__ = ("fut", "status", "parts", "size")

    def __init__(self, fut: asyncio.Future[tuple[int, bytes]]) -> None:
        self.fut = fut
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0

    def head(self, status: int) -> None:
        self.status = status

    def body(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > MAX_GET_BODY:
            if not self.fut.done():
                self.fut.set_exception(ValueError(f"answer over {MAX_GET_BODY} bytes"))
            return
        self.parts.append(data)

    def complete(self) -> None:
        if not self.fut.done():
            self.fut.set_result((self.status, b"".join(self.parts)))

    def lost(self, exc: BaseException | None) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc or ConnectionResetError("the worker closed the connection"))


MAX_GET_BODY = 64 << 20


async def get(pool: UpstreamPool, key: tuple[str, int], path: str, timeout_s: float,
              extra: bytes = b"") -> tuple[int, bytes]:
    """GET `path` on a keep-alive connection: (status, body); `extra`: more header lines.
    Raises OSError (refused: ConnectionRefusedError), TimeoutError or ValueError (a
    malformed or oversized answer)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[tuple[int, bytes]] = loop.create_future()
    c: Conn | None = None
    h = f"[{key[0]}]" if ":" in key[0] else key[0]
    try:
        async with asyncio.timeout(timeout_s):
            c = await pool.get(key)
            c.send(b"GET %s HTTP/1.1\r\nhost: %s:%d\r\n%s\r\n" % (path.encode(), h.encode("idna"), key[1], extra),
                   b"", _Collect(fut))
            status, body = await fut
    except BaseException:
        if c is not None:
            c.close()
        if fut.done() and not fut.cancelled():
            fut.exception()
        raise
    c.release()
    return status, body
