"""A small HTTP/1.1 client on raw asyncio sockets, for what a library would hide.

The suite must tell apart an answer that never came (hung), a connection that died
with nothing or with half a body (lost), a stream that ended without `[DONE]`, and a
well-formed answer; it must also read slowly, leave mid-stream, send a body that is
too large and reuse the connection afterwards. So every request goes through
`request()`, which records exactly what came back and when: the status, headers,
every body byte, whether the message ended as HTTP says it should (Content-Length
reached, the last chunk of a chunked body, or the close of a close-delimited one),
the time of the first response byte, and whether the deadline passed first.
"""
from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

_enc = msgspec.json.Encoder()


@dataclass
class Reply:
    """What came back for one request (partial when `complete` is False)."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    complete: bool = False  # the HTTP message ended as its framing says
    timed_out: bool = False  # the deadline passed before it ended
    error: str | None = None  # why the connection failed (text of the exception)
    refused: bool = False  # the connection was refused: nothing listened, the request was never sent
    abandoned: bool = False  # this client left on purpose (the `abort` option)
    t_first: float | None = None  # seconds from sending to the first response byte
    elapsed: float = 0.0
    chunks: int = 0  # body reads (chunks of a chunked body)

    @property
    def sse(self) -> bool:
        return self.headers.get("content-type", "").startswith("text/event-stream")

    def json(self) -> Any:
        return msgspec.json.decode(self.body)


def encode_body(body: Any) -> bytes:
    if body is None:
        return b""
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    if isinstance(body, str):
        return body.encode()
    return _enc.encode(body)


async def request(
    host: str, port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, *,
    timeout: float = 30.0, rcvbuf: int | None = None, read_size: int = 65536, read_pause: float = 0.0,
    abort: str | None = None, keep_open: bool = False, abandon_after: float | None = None,
) -> Reply:
    """One request on a fresh connection (`Connection: close` unless `keep_open`).

    `abort`: leave on purpose — "before_body" (headers sent, body never), "mid_body" (half
    the body), "after_headers" (once the response status arrived), "after_first_chunk";
    `abandon_after`: leave after that many seconds, whatever arrived by then.
    `rcvbuf`/`read_size`/`read_pause`: a slow reader (small socket buffer, small reads, a
    pause between them). The reply is returned, never raised, whatever happens."""
    rep = Reply()
    data = encode_body(body)
    t0 = time.monotonic()
    task = asyncio.ensure_future(_exchange(rep, t0, host, port, method, path, data, headers or {}, rcvbuf,
                                           read_size, read_pause, abort, keep_open))
    try:
        if abandon_after is not None and abandon_after < timeout:
            done, _ = await asyncio.wait({task}, timeout=abandon_after)
            if not done:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                rep.abandoned = True
        else:
            await asyncio.wait_for(task, timeout)
    except TimeoutError:
        rep.timed_out = True
    except asyncio.CancelledError:
        task.cancel()
        raise
    except Exception as e:  # pragma: no cover - _exchange records its own errors
        rep.error = f"{type(e).__name__}: {e}"
    rep.elapsed = time.monotonic() - t0
    return rep


def head_bytes(method: str, path: str, host: str, port: int, headers: dict[str, str], length: int | None,
               keep_open: bool) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}"]
    low = {k.lower() for k in headers}
    if "content-type" not in low and length is not None:
        lines.append("Content-Type: application/json")
    if length is not None and "content-length" not in low:
        lines.append(f"Content-Length: {length}")
    if not keep_open and "connection" not in low:
        lines.append("Connection: close")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def open_conn(host: str, port: int, rcvbuf: int | None = None, limit: int = 1 << 20,
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    if rcvbuf is None:
        return await asyncio.open_connection(host, port, limit=limit)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (host, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=limit)


async def _exchange(rep: Reply, t0: float, host: str, port: int, method: str, path: str, data: bytes,
                    headers: dict[str, str], rcvbuf: int | None, read_size: int, read_pause: float,
                    abort: str | None, keep_open: bool) -> None:
    try:
        reader, writer = await open_conn(host, port, rcvbuf, limit=max(1024, min(read_size, 1 << 20)))
    except ConnectionRefusedError as e:
        rep.refused = True
        rep.error = f"connection refused: {e}"
        return
    except OSError as e:
        rep.error = f"connect failed: {e}"
        return
    try:
        length = len(data) if (data or method in ("POST", "PUT", "PATCH")) else None
        writer.write(head_bytes(method, path, host, port, headers, length, keep_open))
        if abort == "before_body":
            await writer.drain()
            await asyncio.sleep(0.05)
            rep.abandoned = True
            return
        if abort == "mid_body":
            writer.write(data[: len(data) // 2])
            await writer.drain()
            await asyncio.sleep(0.05)
            rep.abandoned = True
            return
        writer.write(data)
        await writer.drain()
        await read_response(rep, t0, reader, read_size, read_pause, abort, method == "HEAD")
    except (ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
        rep.error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        writer.transport.abort()
        raise
    finally:
        if rep.abandoned:
            writer.transport.abort()
        else:
            writer.close()


async def read_response(rep: Reply, t0: float, reader: asyncio.StreamReader, read_size: int = 65536,
                        read_pause: float = 0.0, abort: str | None = None, head_only: bool = False,
                        on_continue: Any = None) -> None:
    """Read one response into `rep` (status, headers, body, complete); may raise connection errors.
    Interim 1xx responses are skipped (`on_continue()` is awaited on a `100 Continue`)."""
    while True:
        line = await reader.readline()
        if not line:
            rep.error = "connection closed before any response byte"
            return
        if rep.t_first is None:
            rep.t_first = time.monotonic() - t0
        parts = line.decode("latin-1").split(" ", 2)
        rep.status = int(parts[1])
        rep.headers = {}
        while True:
            h = await reader.readline()
            if not h:
                rep.error = "connection closed inside the response headers"
                return
            if h in (b"\r\n", b"\n"):
                break
            k, _, v = h.decode("latin-1").partition(":")
            rep.headers[k.strip().lower()] = v.strip()
        if 100 <= rep.status < 200 and rep.status != 101:
            if rep.status == 100 and on_continue is not None:
                await on_continue()
            continue
        break
    if abort == "after_headers":
        rep.abandoned = True
        return
    if head_only or rep.status in (204, 304) or 100 <= rep.status < 200:
        rep.complete = True
        return
    buf = bytearray()
    te = rep.headers.get("transfer-encoding", "").lower()
    try:
        if "chunked" in te:
            while True:
                size_line = await reader.readline()
                if not size_line:
                    rep.error = "connection closed inside a chunked body"
                    return
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass
                    rep.complete = True
                    return
                while size > 0:
                    piece = await reader.read(min(size, read_size))
                    if not piece:
                        rep.error = "connection closed inside a chunk"
                        return
                    buf += piece
                    size -= len(piece)
                    if read_pause:
                        await asyncio.sleep(read_pause)
                crlf = await reader.readexactly(2)
                if crlf != b"\r\n":
                    rep.error = "bad chunk framing"
                    return
                rep.chunks += 1
                if abort == "after_first_chunk":
                    rep.abandoned = True
                    return
        elif "content-length" in rep.headers:
            left = int(rep.headers["content-length"])
            while left > 0:
                piece = await reader.read(min(left, read_size))
                if not piece:
                    rep.error = f"connection closed with {left} body bytes missing"
                    return
                buf += piece
                left -= len(piece)
                rep.chunks += 1
                if read_pause:
                    await asyncio.sleep(read_pause)
                if abort == "after_first_chunk":
                    rep.abandoned = True
                    return
            rep.complete = True
        else:  # delimited by the close of the connection
            while True:
                piece = await reader.read(read_size)
                if not piece:
                    rep.complete = True
                    return
                buf += piece
                rep.chunks += 1
                if read_pause:
                    await asyncio.sleep(read_pause)
                if abort == "after_first_chunk":
                    rep.abandoned = True
                    return
    finally:
        rep.body = bytes(buf)


def sse_events(body: bytes) -> tuple[list[bytes], bool, int]:
    """The `data:` payloads of an SSE body before `data: [DONE]`, whether that came, and
    how many payloads followed it (anything after [DONE] is malformed)."""
    out: list[bytes] = []
    done = False
    after = 0
    for ev in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if done:
                after += 1
            elif payload == b"[DONE]":
                done = True
            else:
                out.append(payload)
    return out, done, after
