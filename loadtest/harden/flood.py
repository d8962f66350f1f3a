"""Endless-header clients in a process of their own (`python loadtest/harden/flood.py`).

The `header_flood` case measures `/health` for other clients while these run; in the
case's own event loop the attackers' writes would delay its measuring client, so they
run apart. Each of `--connections` clients sends `GET /health`, `Host: x`, then
`X-Big: aaaa...` as fast as the server reads it, on a socket with small buffers (what
counts as sent is near what the server read), and reconnects when the server closes
it, until `--seconds` pass; then one JSON line of counts is printed. 127.0.0.1 only.
Standard library only: the suite runs it as a script, also against another checkout.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from dataclasses import asdict, dataclass

CHUNK = b"a" * 16384


@dataclass
class Flood:
    connections: int = 0
    bytes: int = 0
    max_per_connection: int = 0


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32768)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32768)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        return await asyncio.open_connection(sock=sock)
    except OSError:
        sock.close()
        return None


async def _attacker(port: int, end: float, st: Flood) -> None:
    while time.monotonic() < end:
        conn = await _connect(port)
        if conn is None:
            await asyncio.sleep(0.05)
            continue
        r, w = conn
        st.connections += 1
        closed = asyncio.ensure_future(r.read())  # done when the server answers or closes
        sent = 0
        try:
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
            while time.monotonic() < end and not closed.done():
                w.write(CHUNK)
                await w.drain()
                sent += len(CHUNK)
        except (ConnectionError, OSError):
            pass
        finally:
            closed.cancel()
            w.close()
            st.bytes += sent
            st.max_per_connection = max(st.max_per_connection, sent)
        await asyncio.sleep(0.01)


async def _run(port: int, n: int, seconds: float) -> Flood:
    st = Flood()
    end = time.monotonic() + seconds
    await asyncio.gather(*(_attacker(port, end, st) for _ in range(n)))
    return st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    a = ap.parse_args()
    print(json.dumps(asdict(asyncio.run(_run(a.port, a.connections, a.seconds)))), flush=True)


if __name__ == "__main__":
    main()
