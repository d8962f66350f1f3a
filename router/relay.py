"""Relaying our worker's answer to the client in the client's format.

Our workers receive token ids and always stream (router/proxy.py); the client gets a
stream or one JSON body, chat or completion, rebuilt from the chunks. Writes are
batched: each socket write is a large share of a request's CPU, so a stream complete
in one read goes out as headers plus one write. vLLM workers are relayed unchanged
instead (router/passthrough.py); both hand their result to router/observe.py.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
import msgspec
from yarl import URL

from .attempt import JSON_HEADERS, SSE_HEADERS, Attempt, Out, Result
from .config import PoolConfig
from .errors import ApiError
from .observe import Observer
from .pool import WorkerPool
from .prepare import Prepared
from .proxy import JSON_SSE, UpstreamError, UpstreamStream, open_stream
from .responses import (
    SSE_DONE,
    STREAM_FAILED,
    chat_first_chunk,
    chat_response,
    chunk_renderer,
    client_usage,
    comp_response,
    sse_error,
    usage_chunk,
)
from .schema import api_error_from_upstream, up_chunk_decoder
from .upstream import Conn, UpstreamPool, fast_url, request_head
from .worker import Worker

log = logging.getLogger("kvroute.relay")
_enc = msgspec.json.Encoder()
Render = Callable[[str, "str | None"], bytes]


class Relay:
    def __init__(
        self, session: aiohttp.ClientSession, pool: WorkerPool, observer: Observer, timeouts: PoolConfig,
    ) -> None:
        self.session = session
        self.pool = pool
        self.observer = observer
        self.metrics = observer.metrics
        self.timeouts = timeouts
        self.timeout = aiohttp.ClientTimeout(total=timeouts.request_timeout_s, connect=timeouts.connect_timeout_s)
        # Plain-http workers are relayed through router/upstream.py (callbacks, no task
        # wakeup per chunk); `fast`: False sends every request through aiohttp instead.
        self.fast = True
        self.upstream = UpstreamPool(timeouts.connect_timeout_s)
        self._fast_keys: dict[str, tuple[str, int] | None] = {}

    def close(self) -> None:
        self.upstream.close()

    def payload(self, prep: Prepared, w: Worker) -> bytes:
        """The upstream body: token ids, always streamed with usage, plus what routing adds."""
        body: dict[str, Any] = {
            "model": w.served_model or prep.model.id,
            "prompt": prep.ids.tolist(),
            "max_tokens": prep.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        body.update(prep.sampling)
        salt = prep.plan.wire_salt
        if salt:
            body["cache_salt"] = salt
        if w.kind == "kvroute":
            body["kv"] = {"shared_prefix_blocks": prep.plan.shared_blocks, "request_id": prep.rid}
        return _enc.encode(body)

    async def run(self, a: Attempt, out: Out) -> int:
        """Open the upstream stream and relay it; returns the HTTP status sent.
        Raises UpstreamError (retryable) when the worker fails before its first chunk."""
        w = a.worker
        a.t_dispatch = time.monotonic()
        if self.fast:
            if w.url in self._fast_keys:
                key = self._fast_keys[w.url]
            else:
                key = self._fast_keys[w.url] = fast_url(w.url)
            if key is not None:
                return await self._run_fast(a, out, key)
        url = w.completions_url
        if url is None:
            url = w.completions_url = URL(w.url + "/v1/completions")
        t = self.timeouts
        # the engine's id stays ours (unique in flight); the client's own id travels beside it
        hdrs = JSON_SSE if a.prep.request_id == a.prep.rid else {**JSON_SSE, "x-request-id": a.prep.request_id}
        up = await open_stream(self.session, url, self.payload(a.prep, w), w.id, self.timeout,
                               t.first_byte_s(a.predicted), t.idle_timeout_s, slot=a.rec.ticket, headers=hdrs)
        a.rec.ticket.abort = up.close  # the worker died: end this request now
        self.pool.accepted(a.rec)
        try:
            return await self._relay(a, up, out)
        finally:
            up.close()

    async def _first(
        self, a: Attempt, batches: AsyncIterator[list[bytes]], res: Result, render: Render | None
    ) -> list[bytes]:
        """Wait for the first batch: until then a failure is retryable elsewhere."""
        w = a.worker
        try:
            batch = await batches.__anext__()
        except StopAsyncIteration:
            raise UpstreamError(f"worker {w.id} ended the stream without any chunk", True, phase="first") from None
        except UpstreamError as e:
            e.retryable = True
            if e.phase == "stream":
                e.phase = "first"
            raise
        res.t_first = time.monotonic()
        self.pool.first_token(a.rec)
        w.served += 1
        err, parts = self._absorb(res, batch, a.prep, render)
        if err is not None and not res.text:
            raise UpstreamError(f"worker {w.id} sent an error: {err}", True, phase="first")
        if err is not None:
            raise _MidStream(err, parts)
        return parts

    async def _relay(self, a: Attempt, up: UpstreamStream, out: Out) -> int:
        prep, w = a.prep, a.worker
        res = Result()
        render = chunk_renderer(prep.chat, prep.rid, prep.created, prep.model_name) if prep.stream else None
        batches = up.batches()
        err: str | None = None
        try:
            parts = await self._first(a, batches, res, render)
        except _MidStream as e:
            err, parts = e.message, e.parts
        hdrs = (SSE_HEADERS if prep.stream else JSON_HEADERS) + a.route_headers()
        stream = _ClientStream(out, hdrs, prep.stream)
        if prep.stream:
            if prep.chat:
                parts.insert(0, chat_first_chunk(prep.rid, prep.created, prep.model_name))
            if err is not None or not up.done:
                await stream.flush(parts)
                parts = []
        try:
            if err is None:
                async for batch in batches:
                    err, parts = self._absorb(res, batch, prep, render)
                    if err is not None:
                        break
                    if parts and not up.done:
                        await stream.flush(parts)
                        parts = []
            if err is not None:
                if parts:
                    await stream.flush(parts)
                raise UpstreamError(f"worker {w.id} reported an error mid-stream: {err}", False, phase="stream")
        except UpstreamError as e:
            return await self._failed_mid_stream(a, e, res, stream)
        await self._complete(a, res, stream, parts)
        self.observer.done(a, res, True)
        return 200

    async def _complete(self, a: Attempt, res: Result, stream: _ClientStream, parts: list[bytes]) -> None:
        prep = a.prep
        usage = client_usage(res.usage, len(prep.ids), res.completion_tokens)
        if prep.stream:
            if prep.include_usage:
                parts.append(usage_chunk(prep.chat, prep.rid, prep.created, prep.model_name, usage))
            parts.append(SSE_DONE)
            await stream.flush(parts, more=False)
            return
        build = chat_response if prep.chat else comp_response
        await stream.flush([build(prep.rid, prep.created, prep.model_name, "".join(res.text), res.finish, usage)],
                           more=False)

    async def _failed_mid_stream(self, a: Attempt, e: UpstreamError, res: Result, stream: _ClientStream) -> int:
        """After the first byte: an explicit SSE error event, never a silent truncation."""
        m, prep, w = self.metrics, a.prep, a.worker
        m.child(m.upstream_errors, w.id, "stream").inc()
        log.warning("request %s: worker %s failed after the first byte: %s", prep.rid, w.id, e)
        if not prep.stream:
            raise ApiError(502, "The worker failed while generating; retry the request.", "upstream_error", None,
                           "worker_failed") from None
        await stream.flush([sse_error(STREAM_FAILED, "upstream_error", "worker_failed", prep.rid) + SSE_DONE],
                           more=False)
        self.observer.done(a, res, False)
        return 200

    # ------------------------------------------------------------------ the callback path

    async def _run_fast(self, a: Attempt, out: Out, key: tuple[str, int]) -> int:
        """`run` over router/upstream.py: the same phases, failures and writes as the
        aiohttp path, but after the first batch each network read is folded into the
        client's stream in the connection's callback (no task wakeup per chunk)."""
        prep, w = a.prep, a.worker
        t = self.timeouts
        first_s = t.first_byte_s(a.predicted)
        rid = prep.request_id
        extra = b"" if rid == prep.rid or not rid.isascii() else b"x-request-id: " + rid.encode() + b"\r\n"
        body = self.payload(prep, w)
        head = request_head(key[0], key[1], "/v1/completions", len(body), extra)
        ex = _Exchange(self, a, t.idle_timeout_s, t.request_timeout_s)
        task = asyncio.current_task()
        a.rec.ticket.abort = ex.abort
        try:
            try:
                async with asyncio.timeout(first_s):  # the status line and the first event share it
                    conn = await self._connect(key, w, ex, task)
                    ex.conn = conn
                    conn.send(head, body, ex)
                    status = await ex.head_fut
                    if status != 200:
                        await ex.whole_fut
                        retryable = status in (408, 429, 503) or status >= 500
                        raise UpstreamError(f"worker {w.id} answered HTTP {status}", retryable,
                                            api_error=api_error_from_upstream(status, bytes(ex.err_body)),
                                            phase="status", status=status)
                    self.pool.accepted(a.rec)
                    try:
                        batch = await ex.next_batch()
                    except UpstreamError as e:  # before the first chunk: retryable elsewhere
                        e.retryable = True
                        if e.phase == "stream":
                            e.phase = "first"
                        raise
            except TimeoutError:
                if ex.status is None:
                    raise UpstreamError(f"worker {w.id}: no response within {first_s:.0f} s", True,
                                        phase="first_byte_timeout") from None
                raise UpstreamError(f"worker {w.id}: no first byte within {first_s:.0f} s", True,
                                    phase="first_byte_timeout") from None
            except asyncio.CancelledError:
                if ex.aborted and task is not None and task.uncancel() == 0:
                    raise UpstreamError(f"worker {w.id} was declared unhealthy before it answered", True) from None
                raise
            return await self._relay_fast(a, ex, batch, out)
        finally:
            ex.finish()

    async def _connect(self, key: tuple[str, int], w: Worker, ex: _Exchange, task: asyncio.Task[Any] | None) -> Conn:
        ex.task = task  # an abort while connecting cancels the wait
        try:
            return await self.upstream.get(key)
        except ConnectionRefusedError as e:
            raise UpstreamError(f"worker {w.id} unreachable: {e}", True, fatal=True) from None
        except (TimeoutError, OSError) as e:
            raise UpstreamError(f"worker {w.id} unreachable: {type(e).__name__}: {e}", True) from None
        finally:
            ex.task = None

    async def _relay_fast(self, a: Attempt, ex: _Exchange, batch: list[bytes], out: Out) -> int:
        prep, w = a.prep, a.worker
        res = ex.res
        render = chunk_renderer(prep.chat, prep.rid, prep.created, prep.model_name) if prep.stream else None
        err: str | None = None
        if not batch and ex.done:
            raise UpstreamError(f"worker {w.id} ended the stream without any chunk", True, phase="first")
        res.t_first = time.monotonic()
        self.pool.first_token(a.rec)
        w.served += 1
        err, parts = self._absorb(res, batch, prep, render)
        if err is not None and not res.text:
            raise UpstreamError(f"worker {w.id} sent an error: {err}", True, phase="first")
        hdrs = (SSE_HEADERS if prep.stream else JSON_HEADERS) + a.route_headers()
        stream = _ClientStream(out, hdrs, prep.stream)
        if prep.stream:
            if prep.chat:
                parts.insert(0, chat_first_chunk(prep.rid, prep.created, prep.model_name))
            if err is not None or not ex.done:
                await stream.flush(parts)
                parts = []
        try:
            if err is None and not ex.done:
                err, parts = await ex.stream(stream, render)
            if err is not None:
                if parts:
                    await stream.flush(parts)
                raise UpstreamError(f"worker {w.id} reported an error mid-stream: {err}", False, phase="stream")
        except UpstreamError as e:
            return await self._failed_mid_stream(a, e, res, stream)
        await self._complete(a, res, stream, parts)
        self.observer.done(a, res, True)
        return 200

    def _absorb(
        self, res: Result, batch: list[bytes], prep: Prepared, render: Render | None
    ) -> tuple[str | None, list[bytes]]:
        """Fold upstream chunks into the result; returns (error message or None, client SSE parts).

        `render` (responses.chunk_renderer, None for a non-streaming client) turns each
        choice into the client's chunk; the caller writes the parts in one go."""
        parts: list[bytes] = []
        now = time.monotonic()
        for data in batch:
            try:
                c = up_chunk_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                return f"malformed chunk: {e}", parts
            if c.error is not None:
                return str(c.error.get("message") or c.error), parts
            res.chunks += 1
            res.t_last = now
            for ch in c.choices:
                if ch.text:
                    res.text.append(ch.text)
                if ch.finish_reason is not None:
                    res.finish = ch.finish_reason
                if render is not None and (ch.text or ch.finish_reason is not None):
                    parts.append(render(ch.text, ch.finish_reason))
            if c.usage is not None:
                res.usage = c.usage
        return None, parts


class _MidStream(Exception):
    """The first batch carried text and then an error: relay the text, then fail."""

    def __init__(self, message: str, parts: list[bytes]) -> None:
        super().__init__(message)
        self.message = message
        self.parts = parts


class _ClientStream:
    """The client side: starts the response on the first write, joins parts per write."""

    __slots__ = ("out", "headers", "started", "stream")

    def __init__(self, out: Out, headers: list[tuple[bytes, bytes]], stream: bool) -> None:
        self.out = out
        self.headers = headers
        self.started = False
        self.stream = stream

    async def flush(self, parts: list[bytes], more: bool = True) -> None:
        if not self.started:
            await self.out.start(200, self.headers)
            self.started = True
        if parts or not more:
            await self.out.body(b"".join(parts), more)

    def write_now(self, data: bytes) -> tuple[Coroutine[Any, Any, None], Any] | None:
        """Write from a callback: the server's send runs to its end here unless it has to wait
        (flow control), in which case (the coroutine, what it waits on) is returned to finish."""
        coro = self.out.body(data, True)
        try:
            waits_on = coro.send(None)
        except StopIteration:
            return None
        return coro, waits_on


_MAX_EVENT = 8 << 20
_MAX_ERR_BODY = 1 << 20


class _Exchange:
    """One attempt's response on an upstream.Conn (its Sink). Until the first batch the
    handler task waits for events (`next_batch`); after it (`stream`) each network read
    is folded and written to the client right in the connection's callback, and the task
    wakes once, at the end. Same SSE reading, errors and timeouts as UpstreamStream."""

    __slots__ = ("relay", "a", "wid", "loop", "conn", "task", "aborted", "status", "head_fut", "whole_fut",
                 "err_body", "rest", "pending", "done", "error", "waiter", "res", "out", "render", "end", "writer",
                 "backlog", "idle_s", "total_s", "deadline", "last", "timer", "finished")

    def __init__(self, relay: Relay, a: Attempt, idle_s: float, total_s: float) -> None:
        self.relay = relay
        self.a = a
        self.wid = a.worker.id
        self.loop = asyncio.get_running_loop()
        self.conn: Conn | None = None
        self.task: asyncio.Task[Any] | None = None  # cancelled by an abort while connecting
        self.aborted = False
        self.status: int | None = None
        self.head_fut: asyncio.Future[int] = self.loop.create_future()
        self.whole_fut: asyncio.Future[None] = self.loop.create_future()
        self.err_body = bytearray()
        self.rest = b""
        self.pending: list[bytes] = []
        self.done = False  # [DONE] seen
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.res = Result()
        self.out: _ClientStream | None = None
        self.render: Render | None = None
        self.end: asyncio.Future[tuple[str | None, list[bytes]]] | None = None
        self.writer: asyncio.Task[None] | None = None  # a client write waiting on flow control
        self.backlog: list[bytes] = []
        self.idle_s = idle_s
        self.total_s = total_s
        self.deadline = self.loop.time() + total_s
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.finished = False

    # ---------------------------------------------------------------- upstream.Sink

    def head(self, status: int) -> None:
        self.status = status
        if not self.head_fut.done():
            self.head_fut.set_result(status)

    def body(self, data: bytes) -> None:
        if self.status != 200:
            if len(self.err_body) < _MAX_ERR_BODY:
                self.err_body += data
            return
        if self.done or self.error is not None:
            return
        try:
            payloads = self._payloads(data)
        except UpstreamError as e:
            self._fail(e)
            return
        if self.out is None:  # the task reads the first batch itself
            if payloads:
                self.pending.extend(payloads)
            if payloads or self.done:
                self._wake()
            return
        self.last = self.loop.time()
        self._fold(payloads)

    def complete(self) -> None:
        if self.status != 200:
            if not self.whole_fut.done():
                self.whole_fut.set_result(None)
        elif not self.done:
            self._fail(UpstreamError(f"worker {self.wid} closed the stream before [DONE]", False, phase="stream"))

    def lost(self, exc: BaseException | None) -> None:
        if self.status is None:
            if self.aborted:
                self._fail(UpstreamError(f"worker {self.wid} was declared unhealthy before it answered", True))
            else:
                self._fail(UpstreamError(f"worker {self.wid} failed: {type(exc).__name__}: {exc}", True))
        elif self.status != 200:
            if not self.whole_fut.done():
                self.err_body.clear()  # as a failed read of the error body: its status alone is relayed
                self.whole_fut.set_result(None)
        elif not self.done:
            self._fail(UpstreamError(f"worker {self.wid} stream failed: {type(exc).__name__}: {exc}", False,
                                     phase="stream"))

    # ---------------------------------------------------------------- the handler task

    async def next_batch(self) -> list[bytes]:
        """The payloads read so far (waiting for one at least, or the end)."""
        while not self.pending and not self.done:
            if self.error is not None:
                raise self.error
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        batch, self.pending = self.pending, []
        return batch

    async def stream(self, out: _ClientStream, render: Render | None) -> tuple[str | None, list[bytes]]:
        """Relay in the callback until [DONE] or an error; returns (error, parts left to write)."""
        self.out, self.render = out, render
        end = self.end = self.loop.create_future()
        self.last = self.loop.time()
        self.timer = self.loop.call_at(min(self.last + self.idle_s, self.deadline), self._check)
        if self.pending or self.done:  # what came while the first batch was written
            batch, self.pending = self.pending, []
            self._fold(batch)
        if self.error is not None and not end.done():
            end.set_exception(self.error)
        try:
            result: tuple[str | None, list[bytes]] = await end
            return result
        finally:
            w = self.writer
            if w is not None and not w.done():
                await asyncio.wait({w})

    def abort(self) -> None:
        """The pool declared the worker dead: end this request now."""
        self.aborted = True
        if self.conn is not None:
            self.conn.close()  # connection_lost → lost()
        elif self.task is not None:
            self.task.cancel()

    def finish(self) -> None:
        """The attempt is over: the connection goes back to the pool if its response ends
        cleanly, and is closed otherwise (a client gone mid-stream cancels the worker's work)."""
        self.finished = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.writer is not None and not self.writer.done():
            self.writer.cancel()
        c, self.conn = self.conn, None
        if c is not None:
            clean = self.error is None and (self.done or (self.status not in (None, 200) and self.whole_fut.done()))
            if clean:
                c.release()
            else:
                c.close()
        for f in (self.head_fut, self.whole_fut, self.end):
            if f is not None and f.done() and not f.cancelled():
                f.exception()  # retrieved: never "exception was never retrieved"

    # ---------------------------------------------------------------- inside the callbacks

    def _payloads(self, data: bytes) -> list[bytes]:
        buf = self.rest + data if self.rest else data
        if len(buf) > _MAX_EVENT:
            raise UpstreamError(f"worker {self.wid} sent an oversized event", False, phase="stream")
        *events, self.rest = buf.split(b"\n\n")
        out: list[bytes] = []
        for ev in events:
            for line in ev.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments, event:/id: fields
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    return out
                out.append(payload)
        return out

    def _fold(self, payloads: list[bytes]) -> None:
        end = self.end
        assert end is not None and self.out is not None
        if end.done():
            return
        err, parts = self.relay._absorb(self.res, payloads, self.a.prep, self.render)
        if err is not None or self.done:
            end.set_result((err, parts))
            return
        if not parts:
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if self.writer is not None:  # an earlier write waits for the client: keep the order
            self.backlog.append(data)
            return
        try:
            waiting = self.out.write_now(data)
        except Exception as e:  # the server refused the write: the handler raises it
            self.error = e
            end.set_exception(e)
            return
        if waiting is not None:
            if self.conn is not None:
                self.conn.pause()  # backpressure: stop reading the worker until the client reads
            self.writer = self.loop.create_task(self._finish_write(*waiting))

    async def _finish_write(self, coro: Coroutine[Any, Any, None], waits_on: Any) -> None:
        try:
            await _resume(coro, waits_on)
            while self.backlog:
                data, self.backlog = b"".join(self.backlog), []
                assert self.out is not None
                await self.out.out.body(data, True)
        finally:
            self.writer = None
            if self.conn is not None and not self.finished:
                self.last = self.loop.time()
                self.conn.resume()

    def _check(self) -> None:
        """The idle and total timeouts, one timer re-armed lazily (not one per read)."""
        self.timer = None
        if self.end is None or self.end.done():
            return
        now = self.loop.time()
        if now >= self.deadline:
            self._fail(UpstreamError(f"worker {self.wid} stream failed: TimeoutError: over {self.total_s:.0f} s",
                                     False, phase="stream"))
            return
        if self.writer is not None:
            self.last = now  # waiting on the client, not on the worker
        if now - self.last >= self.idle_s:
            self._fail(UpstreamError(f"worker {self.wid}: no next chunk within {self.idle_s:.0f} s", False,
                                     phase="idle_timeout"))
            return
        self.timer = self.loop.call_at(min(self.last + self.idle_s, self.deadline), self._check)

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, err: BaseException) -> None:
        if self.error is not None or self.finished:
            return
        self.error = err
        for f in (self.head_fut, self.waiter, self.end):
            if f is not None and not f.done():
                f.set_exception(err)


async def _resume(coro: Coroutine[Any, Any, None], waits_on: Any) -> None:
    """Run to its end a coroutine that was stepped by hand until it had to wait."""
    try:
        while True:
            if isinstance(waits_on, asyncio.Future):
                waits_on._asyncio_future_blocking = False
                await asyncio.wait({waits_on})
            else:
                await asyncio.sleep(0)
            waits_on = coro.send(None)
    except StopIteration:
        return
    except BaseException:
        coro.close()
        raise
