"""Relaying one worker's answer to the client, and learning from it.

The worker always streams (router/proxy.py); the client gets a stream or one JSON
body in its own format (chat or completion). Writes are batched: each socket write is
a large share of a request's CPU, so a stream complete in one read goes out as headers
plus one write. After the first token the request is observed: TTFT, usage, the
planner's calibration, prefetch used or wasted, the optional trace recorder.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec
from yarl import URL

from .errors import ApiError
from .metrics import GatewayMetrics
from .planner.types import Policy, RouteRequest
from .pool import WorkerPool
from .prefetch import Prefetch
from .prepare import Prepared
from .proxy import UpstreamError, UpstreamStream, open_stream
from .recorder import TraceRecorder
from .responses import (
    SSE_DONE,
    chat_chunk,
    chat_first_chunk,
    chat_response,
    client_usage,
    comp_chunk,
    comp_response,
    sse_error,
    usage_chunk,
)
from .schema import up_chunk_decoder
from .worker import Inflight, Worker

log = logging.getLogger("kvroute.relay")
_enc = msgspec.json.Encoder()
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]
Render = Callable[[str, int, str, str, "str | None"], bytes]


class Out(Protocol):
    """Where a response goes (the ASGI send, in router/app.py)."""

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    async def body(self, data: bytes, more: bool = False) -> None: ...


@dataclass(slots=True)
class Result:
    """What the worker sent, folded chunk by chunk."""

    text: list[str] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    chunks: int = 0
    t_first: float = 0.0
    t_last: float = 0.0

    @property
    def completion_tokens(self) -> int:
        u = self.usage
        if u is not None and isinstance(u.get("completion_tokens"), int):
            return int(u["completion_tokens"])
        return self.chunks


@dataclass(slots=True)
class Attempt:
    """One try of a request on one worker."""

    prep: Prepared
    worker: Worker
    rec: Inflight
    rr: RouteRequest
    predicted: float | None
    prefetch: Prefetch | None
    t_dispatch: float = 0.0


class Relay:
    def __init__(
        self, session: aiohttp.ClientSession, pool: WorkerPool, policy: Policy, metrics: GatewayMetrics,
        recorder: TraceRecorder | None, timeout: aiohttp.ClientTimeout,
    ) -> None:
        self.session = session
        self.pool = pool
        self.policy = policy
        self.metrics = metrics
        self.recorder = recorder
        self.timeout = timeout

    def payload(self, prep: Prepared, w: Worker) -> bytes:
        """The upstream body: token ids, always streamed with usage, plus what routing adds."""
        body: dict[str, Any] = {
            "model": (w.info.model if w.info is not None else "") or prep.model.id,
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
        url = w.completions_url
        if url is None:
            url = w.completions_url = URL(w.url + "/v1/completions")
        up = await open_stream(self.session, url, self.payload(a.prep, w), w.id, self.timeout)
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
            e.retryable, e.phase = True, "first"
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
        render: Render | None = (chat_chunk if prep.chat else comp_chunk) if prep.stream else None
        batches = up.batches()
        err: str | None = None
        try:
            parts = await self._first(a, batches, res, render)
        except _MidStream as e:
            err, parts = e.message, e.parts
        hdrs = (SSE_HEADERS if prep.stream else JSON_HEADERS) + self._route_headers(a)
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
        self._observe(a, res, True)
        return 200

    @staticmethod
    def _route_headers(a: Attempt) -> list[tuple[bytes, bytes]]:
        """Which worker served, and what the planner expected (loadtest/replay.py reads these)."""
        hdrs = [(b"x-kvroute-worker", a.worker.id.encode())]
        if a.predicted is not None:
            hdrs.append((b"x-kvroute-predicted-ttft-ms", b"%.3f" % (a.predicted * 1000)))
        return hdrs

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
            raise ApiError(502, f"The worker failed while generating: {e}", "upstream_error", None,
                           "worker_failed") from None
        await stream.flush([sse_error(str(e), "upstream_error", "worker_failed", prep.rid) + SSE_DONE], more=False)
        self._observe(a, res, False)
        return 200

    def _absorb(
        self, res: Result, batch: list[bytes], prep: Prepared, render: Render | None
    ) -> tuple[str | None, list[bytes]]:
        """Fold upstream chunks into the result; returns (error message or None, client SSE parts).

        `render` (chat_chunk / comp_chunk, None for a non-streaming client) turns each
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
                    parts.append(render(prep.rid, prep.created, prep.model_name, ch.text, ch.finish_reason))
            if c.usage is not None:
                res.usage = c.usage
        return None, parts

    def _observe(self, a: Attempt, res: Result, ok: bool) -> None:
        """Metrics, calibration and prefetch accounting once the request is over."""
        prep, w = a.prep, a.worker
        m = self.metrics
        model = prep.model.id
        m.child(m.ttft, model).observe(res.t_first - prep.t_arrival)
        m.child(m.e2e, model).observe(time.monotonic() - prep.t_arrival)
        ct = res.completion_tokens
        if ct > 1 and res.t_last > res.t_first:
            m.child(m.tpot, model).observe((res.t_last - res.t_first) / (ct - 1))
        m.child(m.prompt_tokens, model).inc(len(prep.ids))
        usage = res.usage or {}
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            m.child(m.cached_tokens, model).inc(details["cached_tokens"])
        kv = usage.get("kv") if isinstance(usage.get("kv"), dict) else None
        match = a.rr.matches.get(w.id)
        if match is not None:
            for tier, n in match.per_tier().items():
                m.child(m.matched_tokens, tier.name).inc(n * prep.model.block_size)
        self._calibrate(a, res, kv)
        if a.prefetch is not None:
            self._prefetch_outcome(a.prefetch, w, kv)
        if self.recorder is not None and ok:
            self.recorder.record(prep.t_arrival, prep.ids, prep.plan.scoped, ct)

    def _calibrate(self, a: Attempt, res: Result, kv: dict[str, Any] | None) -> None:
        # The model predicts from dispatch on (queue + load + prefill); compare like with like.
        m, w, predicted = self.metrics, a.worker, a.predicted
        measured = res.t_first - a.t_dispatch
        if predicted is not None and predicted > 0:
            m.child(m.ttft_ratio, w.id).observe(measured / predicted)
            m.child(m.ttft_abs_err, w.id).observe(abs(measured - predicted))
        try:
            self.policy.observe(w.id, predicted, measured, kv)
        except Exception:  # calibration must never fail a request
            log.exception("policy.observe failed")

    def _prefetch_outcome(self, pf: Prefetch, w: Worker, kv: dict[str, Any] | None) -> None:
        m = self.metrics
        used = kv.get("prefetched_tokens", 0) if kv else 0
        used = used if isinstance(used, int) else 0
        wasted = max(0, pf.requested_tokens - used)
        m.prefetch_used_tokens.inc(min(used, pf.requested_tokens))
        if wasted:
            m.prefetch_wasted_tokens.inc(wasted)
            cost = w.view.cost
            m.prefetch_wasted_bytes.inc(wasted * cost.block_bytes // max(1, cost.block_size))


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
