"""The upstream side of a request: one POST to a worker's /v1/completions, read as SSE.

The router always asks for a stream with usage: the first chunk is the measured TTFT,
a worker that dies before it can be replaced, and the usage chunk carries the `kv`
report calibration needs. `UpstreamError` says whether a failure is retryable (before
the first chunk), fatal for the worker (connection refused) or the client's own 4xx.
Details: docs/gateway.md.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from yarl import URL

from ..api.errors import ApiError
from ..api.schema import api_error_from_upstream, upstream_error_message

_DONE = b"[DONE]"
_MAX_EVENT = 8 << 20
JSON_SSE = {"content-type": "application/json", "accept": "text/event-stream"}


@dataclass(slots=True)
class UpstreamError(Exception):
    message: str
    retryable: bool
    fatal: bool = False  # the worker is gone (connection refused): take it out now
    api_error: ApiError | None = None  # what the client should see if not retried
    phase: str = "connect"
    status: int | None = None  # the worker's HTTP status, when it answered with one
    said: str | None = None  # a 5xx answer's own message, as the worker wrote it (router/upstream/redact.py)

    @property
    def worker_trouble(self) -> bool:
        """A failure that says the worker is in trouble (for its circuit breaker): no
        answer, a broken stream, a 5xx; not an overloaded (429) or draining (503) one."""
        if self.phase == "connect_timeout":  # slow to accept is overload, not a failure
            return False
        return self.status is None or (self.status >= 500 and self.status != 503)

    def before_first(self) -> None:
        """The first-chunk rule: a failure before the client got anything is retried on
        the next best worker (a broken stream counts as a failed first chunk)."""
        self.retryable = True
        if self.phase == "stream":
            self.phase = "first"

    def __str__(self) -> str:
        return self.message


class UpstreamStream:
    """An open upstream SSE response; iterate `events()` for each `data:` payload."""

    __slots__ = ("resp", "worker_id", "done", "first_timeout_s", "idle_timeout_s")

    def __init__(self, resp: aiohttp.ClientResponse, worker_id: str, first_timeout_s: float = 600.0,
                 idle_timeout_s: float = 600.0) -> None:
        self.resp = resp
        self.worker_id = worker_id
        self.first_timeout_s = first_timeout_s  # for the first event
        self.idle_timeout_s = idle_timeout_s  # between reads after it
        # Set before the last batch is yielded (the one that ended at [DONE]), so the
        # consumer can fold that batch, the usage chunk and [DONE] into one client
        # write: on a small CPU host each socket write is a large share of a request's CPU.
        self.done = False

    async def batches(self) -> AsyncIterator[list[bytes]]:
        """The `data:` payloads of the SSE events, grouped per network read.

        Everything already buffered is taken at once, so under load (many events
        queued) one wakeup handles them all and the client gets one write, not one
        per token. Ends at `[DONE]`; an upstream that closes before it is an error.
        """
        content = self.resp.content
        rest = b""
        timeout = self.first_timeout_s
        try:
            while True:
                data = await read_within(content, timeout, self.worker_id, timeout is self.first_timeout_s)
                timeout = self.idle_timeout_s
                if not data:
                    raise UpstreamError(
                        f"worker {self.worker_id} closed the stream before [DONE]", False, phase="stream"
                    )
                out, rest, self.done = sse_payloads(rest, data, self.worker_id)
                if out:
                    yield out
                if self.done:
                    return
        except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
            raise UpstreamError(f"worker {self.worker_id} stream failed: {type(e).__name__}: {e}", False,
                                phase="stream") from None

    def close(self) -> None:
        self.resp.close()


def sse_payloads(rest: bytes, data: bytes, worker_id: str) -> tuple[list[bytes], bytes, bool]:
    """The `data:` payloads of the complete SSE events in `rest + data`, the unfinished
    event left over, and whether `[DONE]` came (nothing after it is read)."""
    buf = rest + data if rest else data
    if len(buf) > _MAX_EVENT:
        raise UpstreamError(f"worker {worker_id} sent an oversized event", False, phase="stream")
    *events, rest = buf.split(b"\n\n")
    out: list[bytes] = []
    for ev in events:
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, event:/id: fields
            payload = line[5:].strip()
            if payload == _DONE:
                return out, rest, True
            out.append(payload)
    return out, rest, False


class Abortable(Protocol):
    """Where the pool finds how to end a request whose worker it declared dead."""

    abort: Callable[[], None] | None


async def post(
    session: aiohttp.ClientSession, url: str | URL, payload: bytes, worker_id: str, timeout: aiohttp.ClientTimeout,
    headers: dict[str, str] = JSON_SSE, relay_4xx: bool = False, header_timeout_s: float | None = None,
    slot: Abortable | None = None,
) -> aiohttp.ClientResponse:
    """POST and check the status; the body is not read yet. A 200 (and, with `relay_4xx`,
    the worker's own 4xx answer, which a pass-through client must see as sent) comes
    back; anything else raises UpstreamError (retryable: 408, 429, 5xx).

    `header_timeout_s` bounds the wait for the status line (a worker that accepts the
    connection and never answers), retryable elsewhere; `slot.abort` ends the wait when
    the pool declares the worker dead meanwhile."""
    try:
        resp = await _send(session, url, payload, headers, timeout, header_timeout_s, slot)
    except _Aborted:
        raise UpstreamError(f"worker {worker_id} was declared unhealthy before it answered", True) from None
    except _NoHeaders:
        raise UpstreamError(f"worker {worker_id}: no response within {header_timeout_s:.0f} s", True,
                            phase="first_byte_timeout") from None
    except aiohttp.ServerTimeoutError:
        raise UpstreamError(f"worker {worker_id} did not accept the connection within {timeout.connect} s", True,
                            phase="connect_timeout") from None
    except aiohttp.ClientConnectorError as e:
        refused = isinstance(e.os_error, ConnectionRefusedError) or "refused" in str(e).lower()
        raise UpstreamError(f"worker {worker_id} unreachable: {e}", True, fatal=refused) from None
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise UpstreamError(f"worker {worker_id} failed: {type(e).__name__}: {e}", True) from None
    retryable = resp.status in (408, 429, 503) or resp.status >= 500
    if resp.status == 200 or (relay_4xx and 400 <= resp.status < 500 and not retryable):
        return resp
    try:
        body = await resp.read()
    except (TimeoutError, aiohttp.ClientError):
        body = b""
    finally:
        resp.release()
    raise status_error(worker_id, resp.status, body, retryable)


def status_error(worker_id: str, status: int, body: bytes, retryable: bool) -> UpstreamError:
    """A worker's answer with a status the relay does not pass on as it is."""
    said = upstream_error_message(body)[0] if status >= 500 and body else None
    return UpstreamError(f"worker {worker_id} answered HTTP {status}", retryable,
                         api_error=api_error_from_upstream(status, body), phase="status", status=status, said=said)


class _Aborted(Exception):
    pass


class _NoHeaders(Exception):
    pass


async def _send(
    session: aiohttp.ClientSession, url: str | URL, payload: bytes, headers: dict[str, str],
    timeout: aiohttp.ClientTimeout, header_timeout_s: float | None, slot: Abortable | None,
) -> aiohttp.ClientResponse:
    """The POST until its status line, cancellable through `slot.abort` (the pool calls it
    from the event loop; the cancellation is told apart from the client's own)."""
    task = asyncio.current_task()
    aborted = False

    def abort() -> None:
        nonlocal aborted
        if task is not None and not aborted:
            aborted = True
            task.cancel()

    if slot is not None:
        slot.abort = abort
    try:
        async with asyncio.timeout(header_timeout_s):
            return await session.post(url, data=payload, headers=headers, timeout=timeout)
    except asyncio.CancelledError:
        if aborted and task is not None and task.uncancel() == 0:
            raise _Aborted from None
        raise
    except TimeoutError as e:
        if header_timeout_s is not None and not aborted and not isinstance(e, aiohttp.ServerTimeoutError):
            raise _NoHeaders from None
        raise
    finally:
        if slot is not None:
            slot.abort = None


async def open_stream(
    session: aiohttp.ClientSession, url: str | URL, payload: bytes, worker_id: str, timeout: aiohttp.ClientTimeout,
    first_timeout_s: float = 600.0, idle_timeout_s: float = 600.0, slot: Abortable | None = None,
    headers: dict[str, str] = JSON_SSE,
) -> UpstreamStream:
    """POST to our worker and check the status; the stream is not read yet. The status
    line and the first event share one `first_timeout_s` window."""
    t0 = time.monotonic()
    resp = await post(session, url, payload, worker_id, timeout, headers, header_timeout_s=first_timeout_s, slot=slot)
    left = max(0.001, first_timeout_s - (time.monotonic() - t0))
    return UpstreamStream(resp, worker_id, left, idle_timeout_s)


async def read_within(content: aiohttp.StreamReader, timeout_s: float, worker_id: str, first: bool) -> bytes:
    """The next network read of a stream, or an UpstreamError when the worker says nothing
    for `timeout_s` (before the first event: retryable elsewhere)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await content.readany()
    except TimeoutError:
        what = "first byte" if first else "next chunk"
        raise UpstreamError(f"worker {worker_id}: no {what} within {timeout_s:.0f} s", first,
                            phase="first_byte_timeout" if first else "idle_timeout") from None
