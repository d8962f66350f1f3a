"""The gateway's one client of its workers: chat, completions, pass-through and embeddings
all reach a worker through `UpstreamClient`.

Its operations, whatever the transport:

- `send`: one request, its answer's status line waited for (the body not read yet);
- `stream` / `exchange`: a streamed answer opened, up to its first chunk;
- the first-chunk rule (`before_first`, proxy.py): until the client got a byte, any
  failure is retryable on the next best worker; after it, the stream ends with an error;
- cancel: each opened request leaves its abort on the attempt's ticket
  (`Inflight.ticket.abort`), which the pool calls when it declares the worker dead.

Every call carries the worker's own headers (`Worker.call_headers`: its credentials and,
for one data-parallel rank of a server, the rank), whichever route made it.

Two transports behind it: aiohttp (any URL, TLS, whole answers, the fallback) and the
lean HTTP/1.1 client of http1.py (plain-http workers' streams, relayed in the
connection's callbacks by exchange.py).
"""
from __future__ import annotations

from collections.abc import Callable

import aiohttp
from yarl import URL

from ..config import PoolConfig
from ..fleet.worker import Worker
from .attempt import Attempt
from .exchange import Exchange, Fold, open_exchange
from .http1 import UpstreamPool, request_head
from .proxy import JSON_SSE, Abortable, UpstreamStream, open_stream, post


class UpstreamClient:
    """Both transports, the pool's timeouts, and the operations every route uses."""

    __slots__ = ("session", "lean", "timeouts", "timeout")

    def __init__(self, session: aiohttp.ClientSession, timeouts: PoolConfig) -> None:
        self.session = session
        # Plain-http workers are streamed through http1.py's keep-alive connections
        # (callbacks, no task wakeup per chunk); the rest through aiohttp.
        self.lean = UpstreamPool(timeouts.connect_timeout_s)
        self.timeouts = timeouts
        self.timeout = aiohttp.ClientTimeout(total=timeouts.request_timeout_s, connect=timeouts.connect_timeout_s)

    def close(self) -> None:
        self.lean.close()

    async def send(self, w: Worker, path: str, body: bytes, headers: dict[str, str], header_timeout_s: float,
                   slot: Abortable | None, relay_4xx: bool = True) -> aiohttp.ClientResponse:
        """POST `body` to the worker's `path` over aiohttp; the answer's head (proxy.post)."""
        if w.call_headers:
            headers = {**headers, **w.call_headers}
        return await post(self.session, w.url + path, body, w.id, self.timeout, headers, relay_4xx=relay_4xx,
                          header_timeout_s=header_timeout_s, slot=slot)

    async def stream(self, url: str | URL, body: bytes, w: Worker, first_s: float, slot: Abortable | None,
                     headers: dict[str, str] = JSON_SSE) -> UpstreamStream:
        """Our worker's SSE stream over aiohttp (proxy.open_stream): status line and first
        event within `first_s`, then the idle timeout between reads."""
        if w.call_headers:
            headers = {**headers, **w.call_headers}
        return await open_stream(self.session, url, body, w.id, self.timeout, first_s, self.timeouts.idle_timeout_s,
                                 slot=slot, headers=headers)

    def exchange(self, fold: Fold, a: Attempt) -> Exchange:
        """A stream over the lean transport, for `open`: relayed in the connection's callbacks."""
        t = self.timeouts
        return Exchange(fold, a, t.idle_timeout_s, t.request_timeout_s)

    async def open(self, ex: Exchange, key: tuple[str, int], path: str, body: bytes, extra: bytes, first_s: float,
                   accepted: Callable[[], None]) -> list[bytes] | None:
        """Send over the lean transport and wait for the first batch (exchange.open_exchange)."""
        head = request_head(key[0], key[1], path, len(body), extra + ex.a.worker.call_head)
        return await open_exchange(self.lean, ex, key, head, body, first_s, accepted)
