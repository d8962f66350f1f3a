"""Relaying our worker's answer to the client in the client's format.

Our workers receive token ids and always stream (router/upstream/proxy.py); the client gets a
stream or one JSON body, chat or completion, rebuilt from the chunks. Writes are
batched: each socket write is a large share of a request's CPU, so a stream complete
in one read goes out as headers plus one write. vLLM workers are relayed unchanged
instead (router/upstream/passthrough.py); both hand their result to router/telemetry/observe.py.
"""
from __future__ import annotations

import time
from typing import Any, NoReturn

import msgspec
from yarl import URL

from ..api.responses import (
    SSE_DONE,
    ChunkFrame,
    chat_first_chunk,
    chat_response,
    chunk_renderer,
    client_usage,
    comp_response,
    usage_chunk,
)
from ..api.schema import up_chunk_decoder
from ..fleet.pool import WorkerPool
from ..fleet.worker import Worker
from ..intake.prepare import Prepared
from ..telemetry.observe import Observer
from .attempt import JSON_HEADERS, SSE_HEADERS, Attempt, Out, Render, Result
from .client import UpstreamClient
from .exchange import ClientStream, Exchange, fail_mid_stream
from .proxy import JSON_SSE, UpstreamError, UpstreamStream, sse_payloads, status_error

_enc = msgspec.json.Encoder()


def worker_body(prep: Prepared, w: Worker) -> dict[str, Any]:
    """What the relay sends a worker: token ids, streamed with usage, plus what routing adds."""
    body: dict[str, Any] = {
        "model": prep.lora or w.served_model or prep.model.id,
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
    return body


class Relay:
    def __init__(self, client: UpstreamClient, pool: WorkerPool, observer: Observer) -> None:
        # Plain-http workers are relayed over the client's lean transport (callbacks, no
        # task wakeup per chunk); the others over aiohttp.
        self.client = client
        self.pool = pool
        self.observer = observer
        self.metrics = observer.metrics
        self.timeouts = client.timeouts

    def payload(self, prep: Prepared, w: Worker, kv_transfer: msgspec.Raw | None = None) -> bytes:
        """The upstream body: token ids, always streamed with usage, plus what routing adds
        (on the decode leg of a pair, the prefill worker's `kv_transfer_params` as it wrote them)."""
        body = worker_body(prep, w)
        if kv_transfer is not None:
            body["kv_transfer_params"] = kv_transfer
        return _enc.encode(body)

    async def run(self, a: Attempt, out: Out) -> int:
        """Open the upstream stream and relay it; returns the HTTP status sent.
        Raises UpstreamError (retryable) when the worker fails before its first chunk."""
        w = a.worker
        a.t_dispatch = time.monotonic()
        if w.fast_key is not None:
            return await self._run_fast(a, out, w.fast_key)
        url = w.completions_url
        if url is None:
            url = w.completions_url = URL(w.url + "/v1/completions")
        t = self.timeouts
        # the engine's id stays ours (unique in flight); the client's own id travels beside it
        hdrs = JSON_SSE if a.prep.request_id == a.prep.rid else {**JSON_SSE, "x-request-id": a.prep.request_id}
        body = self.payload(a.prep, w, a.kv_transfer)
        up = await self.client.stream(url, body, w, t.first_byte_s(a.predicted), a.rec.ticket, hdrs)
        a.rec.ticket.abort = up.close  # the worker died: end this request now
        self.pool.accepted(a.rec)
        try:
            return await self._relay(a, up, out)
        finally:
            up.close()

    def _took_first(
        self, a: Attempt, res: Result, batch: list[bytes], render: Render | None
    ) -> tuple[str | None, list[bytes]]:
        """The first batch, for both transports: the request has started (TTFT); an error
        with no text yet is retryable elsewhere (the first-chunk rule), one after text is
        relayed mid-stream. Returns (that error or None, the client's parts)."""
        w = a.worker
        res.t_first = time.monotonic()
        self.pool.first_token(a.rec)
        w.served += 1
        err, parts = self.absorb(res, batch, a.prep, render)
        if err is not None and not res.text:
            raise UpstreamError(f"worker {w.id} sent an error: {err}", True, phase="first")
        return err, parts

    async def _relay(self, a: Attempt, up: UpstreamStream, out: Out) -> int:
        prep, w = a.prep, a.worker
        res = Result()
        render = chunk_renderer(prep.chat, prep.rid, prep.created, prep.model_name) if prep.stream else None
        batches = up.batches()
        try:
            batch = await batches.__anext__()
        except StopAsyncIteration:
            raise _no_chunk(w.id) from None
        except UpstreamError as e:
            e.before_first()
            raise
        err, parts = self._took_first(a, res, batch, render)
        stream, parts = await _start_client(a, out, parts, err is not None or not up.done)
        try:
            if err is None:
                async for batch in batches:
                    err, parts = self.absorb(res, batch, prep, render)
                    if err is not None:
                        break
                    if parts and not up.done:
                        await stream.flush(parts)
                        parts = []
            if err is not None:
                await _raise_mid_stream(w.id, err, stream, parts)
        except UpstreamError as e:
            return await fail_mid_stream(self.observer, a, e, res, stream)
        return await self._succeeded(a, res, stream, parts)

    async def _succeeded(self, a: Attempt, res: Result, stream: ClientStream, parts: list[bytes]) -> int:
        await self._complete(a, res, stream, parts)
        self.observer.done(a, res, True)
        return 200

    async def _complete(self, a: Attempt, res: Result, stream: ClientStream, parts: list[bytes]) -> None:
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

    # ------------------------------------------------------------------ the callback path

    async def _run_fast(self, a: Attempt, out: Out, key: tuple[str, int]) -> int:
        """`run` over router/upstream/http1.py: the same phases, failures and writes as the
        aiohttp path, but after the first batch each network read is folded into the
        client's stream in the connection's callback (no task wakeup per chunk)."""
        prep, w = a.prep, a.worker
        t = self.timeouts
        rid = prep.request_id
        extra = b"" if rid == prep.rid or not rid.isascii() else b"x-request-id: " + rid.encode() + b"\r\n"
        ex = self.client.exchange(self, a)
        a.rec.ticket.abort = ex.abort
        try:
            batch = await self.client.open(ex, key, "/v1/completions", self.payload(prep, w, a.kv_transfer), extra,
                                           t.first_byte_s(a.predicted), lambda: self.pool.accepted(a.rec))
            if batch is None:
                status = ex.status or 0
                retryable = status in (408, 429, 503) or status >= 500
                raise status_error(w.id, status, bytes(ex.err_body), retryable)
            return await self._relay_fast(a, ex, batch, out)
        finally:
            ex.finish()
            # Finished, `ex.abort` does nothing; unset, the request's objects are freed now
            # instead of by the cycle collector (ticket -> exchange -> attempt -> ticket).
            a.rec.ticket.abort = None

    async def _relay_fast(self, a: Attempt, ex: Exchange, batch: list[bytes], out: Out) -> int:
        prep, w = a.prep, a.worker
        res = ex.res
        frame = ChunkFrame(prep.chat, prep.rid, prep.created, prep.model_name) if prep.stream else None
        render = frame.render if frame is not None else None
        if not batch and ex.done:
            raise _no_chunk(w.id)
        err, parts = self._took_first(a, res, batch, render)
        stream, parts = await _start_client(a, out, parts, err is not None or not ex.done)
        try:
            if err is None and not ex.done:
                err, parts = await ex.stream(stream, render, frame.translate if frame is not None else None)
            if err is not None:
                await _raise_mid_stream(w.id, err, stream, parts)
        except UpstreamError as e:
            return await fail_mid_stream(self.observer, a, e, res, stream)
        return await self._succeeded(a, res, stream, parts)

    # ---------------------------------------------------------------- exchange.Fold

    def streams(self, status: int, content_type: bytes) -> bool:
        """Our workers answer 200 with a stream, anything else with an error body."""
        return status == 200

    def split(self, rest: bytes, data: bytes, worker_id: str) -> tuple[list[bytes], bytes, bool]:
        return sse_payloads(rest, data, worker_id)

    def absorb(
        self, res: Result, batch: list[bytes], prep: Prepared, render: Render | None
    ) -> tuple[str | None, list[bytes]]:
        """Fold upstream chunks into the result; returns (error message or None, client SSE parts).

        `render` (responses.ChunkFrame.render, None for a non-streaming client) turns each
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


def _no_chunk(worker_id: str) -> UpstreamError:
    return UpstreamError(f"worker {worker_id} ended the stream without any chunk", True, phase="first")


async def _start_client(a: Attempt, out: Out, parts: list[bytes], more: bool) -> tuple[ClientStream, list[bytes]]:
    """The client's response after the first batch: a stream starts now (with chat's role
    chunk) unless the whole answer is already here; a JSON body waits for the end."""
    prep = a.prep
    hdrs = (SSE_HEADERS if prep.stream else JSON_HEADERS) + a.route_headers()
    stream = ClientStream(out, hdrs)
    if prep.stream:
        if prep.chat:
            parts.insert(0, chat_first_chunk(prep.rid, prep.created, prep.model_name))
        if more:
            await stream.flush(parts)
            parts = []
    return stream, parts


async def _raise_mid_stream(worker_id: str, err: str, stream: ClientStream, parts: list[bytes]) -> NoReturn:
    """A worker's error after the client's stream began: what was relayed is flushed, then
    the stream fails (not retryable: the client has output)."""
    if parts:
        await stream.flush(parts)
    raise UpstreamError(f"worker {worker_id} reported an error mid-stream: {err}", False, phase="stream")
