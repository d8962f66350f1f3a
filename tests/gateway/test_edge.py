"""The connection's edge (router/api/edge.py): request heads bounded in size and time.

An endless header, a huge request line, too many header fields are refused (414/431 in
OpenAI's error shape) and the connection closed; a connection that sends half a request
line, or nothing, or blank lines forever, is closed after the head timeout; ordinary
requests (heads in pieces, keep-alive) are untouched. Waits here are bounds against a
hang only, many times the configured timeouts, never a measurement (the harden cases
`header_flood` and `slow_loris` measure)."""
from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from gateway_fleet import _cfg

from router.server import running_gateway

HEAD_TIMEOUT_S = 0.5
HANG_S = 60.0  # far beyond any timeout here: only a server that never closes reaches it


@asynccontextmanager
async def gateway(**listen: Any) -> AsyncIterator[tuple[str, int]]:
    cfg = _cfg(listen={"header_timeout_s": HEAD_TIMEOUT_S, "max_header_bytes": 8192,
                       "max_request_line_bytes": 2048, "max_header_count": 20, **listen})
    async with running_gateway(cfg) as (_, url):
        host, port = url.split("//")[1].split(":")
        yield host, int(port)


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes (a reset after its answer counts as closed)."""
    out = b""
    try:
        async with asyncio.timeout(HANG_S):
            while chunk := await reader.read(65536):
                out += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    return out


def _status_and_error(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"connection: close" in head.lower()
    return status, json.loads(body)["error"]


async def _health(host: str, port: int, extra: bytes = b"") -> bytes:
    r, w = await asyncio.open_connection(host, port)
    w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n" + extra + b"Connection: close\r\n\r\n")
    out = await _read_all(r)
    w.close()
    return out


async def test_an_endless_header_is_cut_off_and_others_are_served() -> None:
    async with gateway() as (host, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32768)  # `sent` close to what the server took
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
        sock.connect((host, port))
        r, w = await asyncio.open_connection(sock=sock)
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            while sent < 16 << 20 and not r.at_eof():  # without a limit all of it is taken in
                w.write(b"a" * 65536)
                await w.drain()
                sent += 65536
        except (ConnectionResetError, BrokenPipeError):
            pass
        assert sent < 2 << 20, f"{sent} bytes of one header accepted"
        await _read_all(r)  # closed (a hang fails here)
        assert (await _health(host, port)).startswith(b"HTTP/1.1 200")


async def test_header_fields_past_the_limits_are_a_431_in_openai_shape() -> None:
    async with gateway() as (host, port):
        one_big = b"X-Big: " + b"a" * 9000 + b"\r\n"
        many = b"".join(b"X-%d: v\r\n" % i for i in range(30))
        for extra in (one_big, many):
            status, err = _status_and_error(await _health(host, port, extra))
            assert status == 431 and err["code"] == "request_header_fields_too_large", err
        # under the limits: served
        assert (await _health(host, port, b"X-Fine: " + b"a" * 4000 + b"\r\n")).startswith(b"HTTP/1.1 200")


async def test_a_request_line_past_the_limit_is_a_414() -> None:
    async with gateway() as (host, port):
        r, w = await asyncio.open_connection(host, port)
        w.write(b"GET /health?" + b"q" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        status, err = _status_and_error(await _read_all(r))
        assert status == 414 and err["message"], err


async def test_slow_loris_connections_are_closed_after_the_head_timeout() -> None:
    async with gateway() as (host, port):
        conns = []
        for opening in (b"GET /hea", b"", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a"):
            r, w = await asyncio.open_connection(host, port)
            if opening:
                w.write(opening)
            conns.append((opening, r, w))
        crlf_r, crlf_w = await asyncio.open_connection(host, port)

        async def trickle() -> None:  # blank lines before a request line, forever
            try:
                for _ in range(int(HANG_S / 0.1)):
                    crlf_w.write(b"\r\n")
                    await crlf_w.drain()
                    await asyncio.sleep(0.1)
            except (ConnectionResetError, BrokenPipeError):
                pass

        t = asyncio.create_task(trickle())
        for opening, r, _ in conns:
            raw = await _read_all(r)  # returns once the server closed
            if opening:  # a request had begun: told why
                assert _status_and_error(raw)[0] == 408
            else:
                assert raw == b""
        assert await _read_all(crlf_r) == b""
        await asyncio.wait_for(t, HANG_S)
        assert (await _health(host, port)).startswith(b"HTTP/1.1 200")


async def test_heads_in_pieces_and_keep_alive_are_served() -> None:
    async with gateway(header_timeout_s=30.0) as (host, port):
        r, w = await asyncio.open_connection(host, port)
        for _ in range(3):
            for piece in (b"GET /hea", b"lth HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
                w.write(piece)
                await w.drain()
                await asyncio.sleep(0.02)
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), HANG_S)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                          if ln.lower().startswith(b"content-length"))
            await r.readexactly(length)
        w.close()


async def test_a_slow_head_pipelined_behind_a_request_is_closed_too() -> None:
    async with gateway(idle_timeout_s=600.0) as (host, port):
        r, w = await asyncio.open_connection(host, port)
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")  # a second head begun, never finished

        async def trickle() -> None:  # one byte now and then: no idle connection
            try:
                for _ in range(int(HANG_S / 0.2)):
                    await asyncio.sleep(0.2)
                    w.write(b"a")
                    await w.drain()
            except (ConnectionResetError, BrokenPipeError):
                pass

        t = asyncio.create_task(trickle())
        raw = await _read_all(r)
        assert raw.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in raw, raw[-300:]
        await asyncio.wait_for(t, HANG_S)
