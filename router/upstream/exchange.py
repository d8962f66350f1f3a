"""One attempt's answer relayed from the connection's callbacks (router/upstream/http1.py).

After the first batch, each network read from the worker is folded into what the client
gets and written in the read's own callback, with no task wakeup per chunk; the handler
task wakes once, at the end. A client write that has to wait (flow control) pauses the
upstream read until it is done. What "folding" means is the relay's (`Fold`): our
workers' chunks rebuilt in the client's format (router/upstream/relay.py), or a vLLM worker's
events passed on as they came (router/upstream/passthrough.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from ..api.errors import ApiError
from ..api.responses import SSE_DONE, STREAM_FAILED, sse_error
from ..fleet.worker import Worker
from .attempt import Attempt, Out, Render, Result
from .http1 import Conn, UpstreamPool
from .proxy import UpstreamError

if TYPE_CHECKING:
    from ..intake.prepare import Prepared
    from ..telemetry.observe import Observer

log = logging.getLogger("kvroute.exchange")


class Fold(Protocol):
    """How a relay reads a worker's stream."""

    def streams(self, status: int, content_type: bytes) -> bool:
        """Whether this answer is a stream to relay event by event (else it is read whole)."""
        ...

    def split(self, rest: bytes, data: bytes, worker_id: str) -> tuple[list[bytes], bytes, bool]:
        """The complete events in `rest + data`, what is left over, and whether the stream ended."""
        ...

    def absorb(self, res: Result, batch: list[bytes], prep: Prepared,
               render: Render | None) -> tuple[str | None, list[bytes]]:
        """Fold events into `res`: (an error the worker reported, or None; the client's parts)."""
        ...


class ClientStream:
    """The client side: starts the response on the first write, joins parts per write."""

    __slots__ = ("out", "headers", "started")

    def __init__(self, out: Out, headers: list[tuple[bytes, bytes]]) -> None:
        self.out = out
        self.headers = headers
        self.started = False

    async def flush(self, parts: list[bytes], more: bool = True) -> None:
        if not self.started:
            await self.out.start(200, self.headers)
            self.started = True
        if parts or not more:
            data = b"".join(parts)
            if not more or not self.out.write_now(data):
                await self.out.body(data, more)

    def write_now(self, data: bytes) -> tuple[Coroutine[Any, Any, None], Any] | None:
        """Write from a callback: written at once, or the server's send runs to its end here
        unless it has to wait (flow control), in which case (the coroutine, what it waits
        on) is returned to finish."""
        if self.out.write_now(data):
            return None
        coro = self.out.body(data, True)
        try:
            waits_on = coro.send(None)
        except StopIteration:
            return None
        return coro, waits_on


async def fail_mid_stream(observer: Observer, a: Attempt, e: UpstreamError, res: Result,
                          stream: ClientStream) -> int:
    """A worker failing after the first byte (both relays): an explicit SSE error event and
    `[DONE]`, never a silent truncation; a whole answer not yet sent becomes a 502."""
    m, prep, w = observer.metrics, a.prep, a.worker
    m.child(m.upstream_errors, w.id, "stream").inc()
    log.warning("request %s: worker %s failed after the first byte: %s", prep.rid, w.id, e)
    if not prep.stream:
        raise ApiError(502, "The worker failed while generating; retry the request.", "upstream_error", None,
                       "worker_failed") from None
    await stream.flush([sse_error(STREAM_FAILED, "upstream_error", "worker_failed", prep.rid) + SSE_DONE],
                       more=False)
    observer.done(a, res, False)
    return 200


_MAX_WHOLE_BODY = 1 << 20  # an error body, or a whole answer where a stream was asked for


class Exchange:
    """One attempt's response on an upstream.Conn (its Sink). Until the first batch the
    handler task waits for events (`next_batch`); after it (`stream`) each network read
    is folded and written to the client right in the connection's callback, and the task
    wakes once, at the end. Same SSE reading, errors and timeouts as UpstreamStream."""

    __slots__ = ("fold", "a", "wid", "loop", "conn", "task", "aborted", "status", "streaming", "head_fut",
                 "whole_fut", "err_body", "rest", "pending", "done", "error", "waiter", "res", "out", "render", "end",
                 "writer", "backlog", "idle_s", "total_s", "deadline", "last", "timer", "finished", "translate")

    def __init__(self, fold: Fold, a: Attempt, idle_s: float, total_s: float) -> None:
        self.fold = fold
        self.a = a
        self.wid = a.worker.id
        self.loop = asyncio.get_running_loop()
        self.conn: Conn | None = None
        self.task: asyncio.Task[Any] | None = None  # cancelled by an abort while connecting
        self.aborted = False
        self.status: int | None = None
        self.streaming = False  # the answer is a stream (Fold.streams); else read whole into err_body
        self.head_fut: asyncio.Future[int] = self.loop.create_future()
        self.whole_fut: asyncio.Future[None] = self.loop.create_future()
        self.err_body = bytearray()
        self.rest = b""
        self.pending: list[bytes] = []
        self.done = False  # [DONE] seen
        self.error: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.res = Result()
        self.out: ClientStream | None = None
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
        self.translate: Callable[[bytes], bytes | None] | None = None

    # ---------------------------------------------------------------- upstream.Sink

    def head(self, status: int) -> None:
        self.status = status
        self.streaming = self.fold.streams(status, self.conn.content_type if self.conn is not None else b"")
        if not self.head_fut.done():
            self.head_fut.set_result(status)

    def body(self, data: bytes) -> None:
        if not self.streaming:
            if len(self.err_body) + len(data) <= _MAX_WHOLE_BODY:
                self.err_body += data
            elif self.status == 200:  # an answer cut short must not pass for whole
                self._fail(UpstreamError(f"worker {self.wid} sent an answer over {_MAX_WHOLE_BODY} bytes", True,
                                         phase="first"))
            return
        if self.done or self.error is not None:
            return
        if self.translate is not None and not self.rest and data.find(b"\n\n") == len(data) - 2 \
                and self._token(data):
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
        if not self.streaming:
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
        elif not self.streaming:
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

    async def stream(
        self, out: ClientStream, render: Render | None, translate: Callable[[bytes], bytes | None] | None = None
    ) -> tuple[str | None, list[bytes]]:
        """Relay in the callback until [DONE] or an error; returns (error, parts left to write).
        `translate` (a streaming client's): whole token events are relayed through it."""
        self.out, self.render, self.translate = out, render, translate
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
                me = asyncio.current_task()
                if me is not None and me.cancelling():
                    w.cancel()  # the request is ending (client gone, drain over): no wait on the client
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
            clean = self.error is None and (self.done or (self.status is not None and not self.streaming
                                                          and self.whole_fut.done()))
            if clean:
                c.release()
            else:
                c.close()
        for f in (self.head_fut, self.whole_fut, self.end):
            if f is not None and f.done() and not f.cancelled():
                f.exception()  # retrieved: never "exception was never retrieved"

    # ---------------------------------------------------------------- inside the callbacks

    def _token(self, event: bytes) -> bool:
        """One whole token event relayed without decoding it (`translate`); False: not one."""
        assert self.translate is not None
        out = self.translate(event)
        if out is None:
            return False
        self.last = self.loop.time()
        res = self.res
        res.chunks += 1
        res.t_last = time.monotonic()
        if out:
            self._write(out)
        return True

    def _payloads(self, data: bytes) -> list[bytes]:
        out, self.rest, done = self.fold.split(self.rest, data, self.wid)
        self.done = self.done or done
        return out

    def _fold(self, payloads: list[bytes]) -> None:
        end = self.end
        assert end is not None and self.out is not None
        if end.done():
            return
        err, parts = self.fold.absorb(self.res, payloads, self.a.prep, self.render)
        if err is not None or self.done:
            end.set_result((err, parts))
            return
        if parts:
            self._write(parts[0] if len(parts) == 1 else b"".join(parts))

    def _write(self, data: bytes) -> None:
        end = self.end
        assert end is not None and self.out is not None
        if end.done():
            return
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


async def open_exchange(upstream: UpstreamPool, ex: Exchange, key: tuple[str, int], head: bytes, body: bytes,
                        first_s: float, accepted: Callable[[], None]) -> list[bytes] | None:
    """Send the request and wait for the status line and, for a stream, its first batch,
    all within `first_s` (until then every failure is retryable elsewhere). Returns that
    batch; None when the answer is not a stream: it was read whole (`ex.status`,
    `ex.err_body`). `accepted` runs once a stream's status line came."""
    w = ex.a.worker
    task = asyncio.current_task()
    try:
        async with asyncio.timeout(first_s):
            conn = await _connect(upstream, key, w, ex, task)
            ex.conn = conn
            conn.send(head, body, ex)
            await ex.head_fut
            if not ex.streaming:
                await ex.whole_fut
                return None
            accepted()
            try:
                return await ex.next_batch()
            except UpstreamError as e:
                e.before_first()
                raise
    except TimeoutError:
        what = "response" if ex.status is None else "first byte"
        raise UpstreamError(f"worker {w.id}: no {what} within {first_s:.0f} s", True,
                            phase="first_byte_timeout") from None
    except asyncio.CancelledError:
        if ex.aborted and task is not None and task.uncancel() == 0:
            raise UpstreamError(f"worker {w.id} was declared unhealthy before it answered", True) from None
        raise


async def _connect(upstream: UpstreamPool, key: tuple[str, int], w: Worker, ex: Exchange,
                   task: asyncio.Task[Any] | None) -> Conn:
    """A keep-alive connection; a worker too busy to accept one in time is slow, not dead
    (`connect_timeout`, which the breaker does not count)."""
    ex.task = task  # an abort while connecting cancels the wait
    try:
        return await upstream.get(key)
    except ConnectionRefusedError as e:
        raise UpstreamError(f"worker {w.id} unreachable: {e}", True, fatal=True) from None
    except TimeoutError:
        raise UpstreamError(f"worker {w.id} did not accept the connection within {upstream.connect_timeout_s} s",
                            True, phase="connect_timeout") from None
    except OSError as e:
        raise UpstreamError(f"worker {w.id} unreachable: {type(e).__name__}: {e}", True) from None
    finally:
        ex.task = None
