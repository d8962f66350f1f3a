"""Relaying a request to a vLLM worker without changing what it would answer.

The client's own body goes to the same path (chat stays chat, with tools, images,
`n`, logprobs and every vLLM extension), plus only what routing adds: the model name
the worker serves, `cache_salt` (tenant isolation) and an `X-Request-Id` header.
Streams are relayed event by event as the worker wrote them; only events that carry
usage or an error are parsed. To measure usage the gateway asks for it on every
stream and drops that final usage-only event when the client did not ask for it.
Errors (4xx) come back with the worker's status and body. Before its first byte a
failing worker is replaced by the next best; after it the stream ends with an
explicit SSE error event (the one thing the gateway adds to a stream).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec

from ..fleet.pool import WorkerPool
from ..fleet.worker import Worker
from ..telemetry.observe import Observer
from .attempt import JSON_HEADERS, SSE_HEADERS, Attempt, Out, Render, Result
from .client import UpstreamClient
from .exchange import ClientStream, Exchange, fail_mid_stream
from .proxy import UpstreamError, read_within, status_error

if TYPE_CHECKING:
    from ..intake.prepare import Prepared

_enc = msgspec.json.Encoder()
_MAX_EVENT = 8 << 20
_MAX_WHOLE = 256 << 20  # a whole answer (n choices with logprobs can be large)
_USAGE_NULL = (b'"usage":null', b'"usage": null')


class _AnyObject(msgspec.Struct):
    """Decodes any JSON object without building it: checks a worker's event is JSON."""


_check_json = msgspec.json.Decoder(_AnyObject).decode


def client_body(prep: Prepared, w: Worker) -> dict[str, Any]:
    """The client's body as the worker gets it: its model name and `cache_salt` set."""
    assert prep.raw is not None
    body: dict[str, Any] = dict(prep.raw)
    body["model"] = prep.lora or w.served_model or prep.model.id
    salt = prep.plan.wire_salt
    if salt:
        body["cache_salt"] = salt
    return body


class PassThrough:
    def __init__(self, client: UpstreamClient, pool: WorkerPool, observer: Observer) -> None:
        # Streams to plain-http workers go over the client's lean transport (callbacks, no
        # task wakeup per event); whole answers and other URLs over aiohttp.
        self.client = client
        self.pool = pool
        self.observer = observer
        self.timeouts = client.timeouts

    def payload(self, a: Attempt) -> bytes:
        """The client's body with the routing additions (module doc); on the decode leg of
        a pair, the prefill worker's `kv_transfer_params` as it wrote them."""
        prep = a.prep
        body = client_body(prep, a.worker)
        if a.kv_transfer is not None:
            body["kv_transfer_params"] = a.kv_transfer
        if prep.stream:
            so = body.get("stream_options")
            so = {**(so if isinstance(so, dict) else {}), "include_usage": True}
            if not prep.include_usage and so.get("continuous_usage_stats"):
                # vLLM sends per-chunk usage only when both are set; include_usage is set here
                # for the gateway's own count, so per-chunk usage the client did not get
                # from vLLM is not asked for either (the same answer as without the gateway).
                so["continuous_usage_stats"] = False
            body["stream_options"] = so
        return _enc.encode(body)

    async def run(self, a: Attempt, out: Out) -> int:
        """Relay one attempt; raises UpstreamError (retryable) before the first byte."""
        w = a.worker
        if a.prep.stream and w.fast_key is not None:
            return await self._run_fast(a, out, w.fast_key)
        path = "/v1/chat/completions" if a.prep.chat else "/v1/completions"
        headers = {"content-type": "application/json", "x-request-id": a.prep.request_id,
                   "accept": "text/event-stream" if a.prep.stream else "application/json"}
        a.t_dispatch = time.monotonic()
        # A stream's status line comes at once (within the first-byte window); a whole
        # answer's only when it is done.
        t = self.timeouts
        head_s = t.first_byte_s(a.predicted) if a.prep.stream else t.whole_answer_s(a.predicted, a.prep.max_tokens)
        resp = await self.client.send(w, path, self.payload(a), headers, head_s, a.rec.ticket)
        a.rec.ticket.abort = resp.close  # the worker died: end this request now
        self.pool.accepted(a.rec)
        try:
            if resp.status != 200:
                return await self._relay_error(a, resp, out)
            if a.prep.stream and resp.content_type == "text/event-stream":
                return await self._relay_stream(a, resp, out)
            return await self._relay_whole(a, resp, out)
        finally:
            resp.release()

    async def _run_fast(self, a: Attempt, out: Out, key: tuple[str, int]) -> int:
        """A stream over router/upstream/http1.py: the same phases, failures and bytes as the
        aiohttp path, but after the first events each network read is written to the
        client in the connection's callback."""
        prep = a.prep
        t = self.timeouts
        rid = prep.request_id
        extra = b"x-request-id: " + rid.encode() + b"\r\n" if rid.isascii() else b""
        path = "/v1/chat/completions" if prep.chat else "/v1/completions"
        ex = self.client.exchange(PassFold(not prep.include_usage), a)
        a.t_dispatch = time.monotonic()
        a.rec.ticket.abort = ex.abort
        try:
            batch = await self.client.open(ex, key, path, self.payload(a), extra, t.first_byte_s(a.predicted),
                                           lambda: self.pool.accepted(a.rec))
            if batch is None:
                return await self._answered_whole(a, ex, out)
            return await self._stream_fast(a, ex, batch, out)
        finally:
            ex.finish()
            a.rec.ticket.abort = None  # no cycle ticket -> exchange -> attempt -> ticket left

    async def _answered_whole(self, a: Attempt, ex: Exchange, out: Out) -> int:
        """A stream asked for, a whole answer given: the worker's own 4xx, or a 200 body."""
        status = ex.status or 0
        body = bytes(ex.err_body)
        retryable = status in (408, 429, 503) or status >= 500
        if status != 200 and not (400 <= status < 500 and not retryable):
            raise status_error(a.worker.id, status, body, retryable)
        conn = ex.conn
        ctype = conn.content_type.decode("latin-1") if conn is not None and conn.content_type else ""
        if status != 200:
            self.pool.accepted(a.rec)
            return await self._error_body(a, status, ctype, body, out)
        return await self._whole_body(a, ctype, body, out)

    async def _stream_fast(self, a: Attempt, ex: Exchange, batch: list[bytes], out: Out) -> int:
        w, res = a.worker, ex.res
        err, parts = ex.fold.absorb(res, batch, a.prep, None)
        if err is not None:
            raise UpstreamError(f"worker {w.id} sent {err}", True, phase="first")
        res.t_first = time.monotonic()
        self.pool.first_token(a.rec)
        w.served += 1
        stream = ClientStream(out, SSE_HEADERS + a.route_headers())
        try:
            if not ex.done:
                await stream.flush(parts)
                err, parts = await ex.stream(stream, None)
                if err is not None:
                    await stream.flush(parts)
                    raise UpstreamError(f"worker {w.id} sent {err}", False, phase="stream")
        except UpstreamError as e:
            return await fail_mid_stream(self.observer, a, e, res, stream)
        await stream.flush(parts, more=False)
        self.observer.done(a, res, True)
        return 200

    async def _relay_error(self, a: Attempt, resp: aiohttp.ClientResponse, out: Out) -> int:
        """The worker's own 4xx, as it sent it (the client's request was wrong for it)."""
        body = await _read(resp, a.worker)
        return await self._error_body(a, resp.status, resp.headers.get("content-type") or "", body, out)

    async def _error_body(self, a: Attempt, status: int, ctype: str, body: bytes, out: Out) -> int:
        self.pool.first_token(a.rec)
        await out.start(status, _content_type(ctype, JSON_HEADERS) + a.route_headers())
        await out.body(body)
        return status

    async def _relay_whole(self, a: Attempt, resp: aiohttp.ClientResponse, out: Out) -> int:
        body = await read_whole(resp, a.worker, self.timeouts.idle_timeout_s)
        return await self._whole_body(a, resp.headers.get("content-type") or "", body, out)

    async def _whole_body(self, a: Attempt, ctype: str, body: bytes, out: Out) -> int:
        if ctype.split(";", 1)[0].strip().lower() == "application/json" and not _is_json(body):
            raise UpstreamError(f"worker {a.worker.id} answered 200 with a body that is not JSON", True,
                                phase="first")
        self.pool.first_token(a.rec)
        a.worker.served += 1
        res = Result(t_last=time.monotonic())
        res.usage = _usage_of(body)
        await out.start(200, _content_type(ctype, JSON_HEADERS) + a.route_headers())
        await out.body(body)
        self.observer.done(a, res, True)
        return 200

    async def _relay_stream(self, a: Attempt, resp: aiohttp.ClientResponse, out: Out) -> int:
        res = Result()
        t = self.timeouts
        relay = _StreamRelay(a, res, out, not a.prep.include_usage, t.first_byte_s(a.predicted), t.idle_timeout_s)
        try:
            await relay.first(resp, self.pool)
        except UpstreamError as e:
            e.before_first()
            raise
        try:
            await relay.rest(resp)
        except UpstreamError as e:
            stream = ClientStream(out, [])
            stream.started = True
            return await fail_mid_stream(self.observer, a, e, res, stream)
        self.observer.done(a, res, True)
        return 200


class _StreamRelay:
    """Splits the worker's SSE into events, forwards them per network read."""

    def __init__(self, a: Attempt, res: Result, out: Out, drop_usage: bool, first_timeout_s: float,
                 idle_timeout_s: float) -> None:
        self.a = a
        self.res = res
        self.out = out
        self.rest_buf = b""
        self.done = False
        self.fold = PassFold(drop_usage)
        self.timeout_s = first_timeout_s  # until the first event, then `idle_timeout_s`
        self.idle_timeout_s = idle_timeout_s

    async def first(self, resp: aiohttp.ClientResponse, pool: WorkerPool) -> None:
        """Until the first event: then the request counts as started (no retry after)."""
        parts: list[bytes] = []
        while not parts and not self.done:
            parts = self._events(await self._read(resp))
        self.res.t_first = time.monotonic()
        self.timeout_s = self.idle_timeout_s
        pool.first_token(self.a.rec)
        self.a.worker.served += 1
        await self.out.start(200, SSE_HEADERS + self.a.route_headers())
        await self.out.body(b"".join(parts), not self.done)

    async def rest(self, resp: aiohttp.ClientResponse) -> None:
        out = self.out
        while not self.done:
            parts = self._events(await self._read(resp))
            if self.done:
                await out.body(b"".join(parts))
            elif parts:
                data = b"".join(parts)
                if not out.write_now(data):  # straight to the connection when it needs no wait
                    await out.body(data, True)

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes:
        w = self.a.worker
        try:
            data = await read_within(resp.content, self.timeout_s, w.id, self.res.t_first is None)
        except (aiohttp.ClientError, ConnectionError) as e:
            raise UpstreamError(f"worker {w.id} stream failed: {type(e).__name__}: {e}", False, phase="stream") \
                from None
        if not data:
            raise UpstreamError(f"worker {w.id} closed the stream before [DONE]", False, phase="stream")
        return data

    def _events(self, data: bytes) -> list[bytes]:
        """Complete events of this read, each with its separator, minus a dropped usage event."""
        events, self.rest_buf, done = self.fold.split(self.rest_buf, data, self.a.worker.id)
        self.done = self.done or done
        err, parts = self.fold.absorb(self.res, events, self.a.prep, None)
        if err is not None:
            raise UpstreamError(f"worker {self.a.worker.id} sent {err}", False, phase="stream")
        return parts


class PassFold:
    """A vLLM worker's stream as it wrote it (exchange.Fold): events split at their blank
    line and passed on whole; only those that carry usage are parsed (the usage-only
    event the gateway asked for is dropped when the client did not ask for it)."""

    __slots__ = ("drop_usage",)

    def __init__(self, drop_usage: bool) -> None:
        self.drop_usage = drop_usage

    def streams(self, status: int, content_type: bytes) -> bool:
        return status == 200 and content_type.lower().startswith(b"text/event-stream")

    def split(self, rest: bytes, data: bytes, worker_id: str) -> tuple[list[bytes], bytes, bool]:
        buf = rest + data if rest else data
        if len(buf) > _MAX_EVENT:
            raise UpstreamError(f"worker {worker_id} sent an oversized event", False, phase="stream")
        *events, rest = buf.split(b"\n\n")
        out: list[bytes] = []
        for ev in events:
            if ev:
                out.append(ev)
                if ev.startswith(b"data: [DONE]") or ev.startswith(b"data:[DONE]"):
                    return out, rest, True
        return out, rest, False

    def absorb(self, res: Result, batch: list[bytes], prep: Prepared,
               render: Render | None) -> tuple[str | None, list[bytes]]:
        parts: list[bytes] = []
        now = time.monotonic()
        for ev in batch:
            if ev.startswith(b"data: [DONE]") or ev.startswith(b"data:[DONE]"):
                pass
            elif ev.startswith(b"data:") and not _is_json(_data_of(ev)):
                return "an event that is not JSON", parts
            elif b'"usage"' in ev and not any(u in ev for u in _USAGE_NULL):
                if self._usage_event(res, ev):
                    continue
            else:
                res.chunks += 1
                res.t_last = now
            parts.append(ev + b"\n\n")
        return None, parts

    def _usage_event(self, res: Result, ev: bytes) -> bool:
        """Take the usage; True when the event is the usage-only one to drop."""
        payload = ev.split(b"data:", 1)[-1].strip()
        try:
            d = msgspec.json.decode(payload)
        except msgspec.DecodeError:
            return False
        if not isinstance(d, dict) or not isinstance(d.get("usage"), dict):
            return False
        res.usage = d["usage"]
        if d.get("choices"):
            res.chunks += 1
            return False
        return self.drop_usage


async def _read(resp: aiohttp.ClientResponse, w: Worker) -> bytes:
    try:
        return await resp.read()
    except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
        raise UpstreamError(f"worker {w.id} failed while answering: {type(e).__name__}: {e}", True,
                            phase="first") from None


async def read_whole(resp: aiohttp.ClientResponse, w: Worker, idle_s: float) -> bytes:
    """A whole answer, each read within `idle_s` (a worker that stops mid-body is
    stuck); nothing was sent to the client yet, so any failure is retryable."""
    chunks: list[bytes] = []
    size = 0
    try:
        while data := await read_within(resp.content, idle_s, w.id, False):
            size += len(data)
            if size > _MAX_WHOLE:
                raise UpstreamError(f"worker {w.id} sent an answer over {_MAX_WHOLE} bytes", True, phase="first")
            chunks.append(data)
    except UpstreamError as e:
        e.retryable = True
        raise
    except (aiohttp.ClientError, ConnectionError) as e:
        raise UpstreamError(f"worker {w.id} failed while answering: {type(e).__name__}: {e}", True,
                            phase="first") from None
    return b"".join(chunks)


def _content_type(ct: str, default: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", ct.encode("latin-1"))] if ct else list(default)


def _data_of(ev: bytes) -> bytes:
    """An SSE event's data (its `data:` lines joined), the event starting with one."""
    if b"\ndata:" not in ev:
        return ev[5:]
    return b"\n".join(line[5:] for line in ev.split(b"\n") if line.startswith(b"data:"))


def _is_json(payload: bytes) -> bool:
    try:
        _check_json(payload)
    except msgspec.DecodeError:
        return False
    return True


def _usage_of(body: bytes) -> dict[str, Any] | None:
    try:
        d = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    u = d.get("usage") if isinstance(d, dict) else None
    return u if isinstance(u, dict) else None
