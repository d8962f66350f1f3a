"""POST /v1/embeddings, through the path every request of the gateway takes.

Admission, body cap, disconnects and the drain are the completion routes' own
(`CompletionRoute`, which this subclasses): the tenant's concurrency slot and the body
budget are taken before the body is read. Then the request goes to the least busy
healthy worker of the model with the served name in `model` and the request id in
`X-Request-Id`, under the pool's timeouts (the status line within the first-byte
window, each read within the idle timeout, the whole within the request timeout),
counted in the worker's in-flight ledger and failed over before anything reached the
client. The answer is held whole, bounded by `limits.max_embeddings_answer_bytes` and
counted in the gateway's body budget while held.

Only what a worker's OpenAI route can legitimately answer is relayed: a 200 whose body
is a JSON object, and the client's own 400/404/413 (422 as 400) with the worker's
message (no internals, router/upstream/redact.py). Anything else — a 202, a redirect, a 401, a
5xx, no answer — is the worker's failure: retried on the next worker, then a 502 (504
when no worker answered in time; 429 when they were overloaded) in OpenAI's shape.
"""
from __future__ import annotations

import logging
import random
import re
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from ..fleet.worker import Inflight, Worker
from ..gateway import Gateway
from ..intake.model import ModelRuntime
from ..telemetry.logs import client_request_id
from ..upstream.attempt import JSON_HEADERS
from ..upstream.proxy import UpstreamError, read_within
from ..upstream.redact import worker_message
from .asgi import AsgiOut
from .errors import ApiError, bad_request, rate_limited, upstream_failed
from .openai import CompletionRoute, model_of
from .schema import decode_object, upstream_error_message

log = logging.getLogger("kvroute.embeddings")
_FIELD = re.compile(r"at `\$\.(\w+)|required field `(\w+)`")
_enc = msgspec.json.Encoder()
_RELAYED = {400: 400, 404: 404, 413: 413, 422: 400}
_HEADERS = {"content-type": "application/json", "accept": "application/json"}


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """What the gateway reads of an embeddings body; every other field is forwarded as sent."""

    model: str
    input: str | list[str | int | list[int]]  # text, texts, token ids, or lists of token ids
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None


class EmbeddingsRoute(CompletionRoute):
    """POST /v1/embeddings (module doc)."""

    def __init__(self, gw: Gateway) -> None:
        super().__init__(gw, False)
        self.route = "/v1/embeddings"
        self._rng = random.Random()

    async def _complete(self, body: bytes, headers: dict[str, str], tenant: Any, out: AsgiOut) -> None:
        """Counts the request once, by its final status, and answers every ApiError itself."""
        gw = self.gw
        model = "-"
        rid = client_request_id(headers) or f"embd-{self._rng.getrandbits(96):024x}"
        out.rid = rid
        try:
            raw = _decode(body)
            rt = model_of(gw, raw["model"])
            model = rt.id
            status = await self._forward(rt, raw, rid, out)
        except ApiError as e:
            gw.metrics.count_request(self.route, e.status, model)
            if not out.started:
                await out.error(e, rid)
            return
        gw.metrics.count_request(self.route, status, model)

    async def _forward(self, rt: ModelRuntime, raw: dict[str, Any], rid: str, out: AsgiOut) -> int:
        """The least busy workers first, failing over until one answers."""
        gw = self.gw
        workers = gw.candidates(rt)
        self._rng.shuffle(workers)
        workers.sort(key=lambda w: len(w.inflight))
        last: tuple[UpstreamError, Worker] | None = None
        for w in workers[: 1 + gw.cfg.routing.retries]:
            try:
                return await self._attempt(w, rt, raw, rid, out)
            except UpstreamError as e:
                m = gw.metrics
                m.child(m.upstream_errors, w.id, e.phase).inc()
                if e.fatal or e.worker_trouble:
                    gw.pool.report_failure(w, str(e), e.fatal)
                log.warning("embeddings %s: worker %s failed: %s", rid, w.id, e)
                last = (e, w)
        assert last is not None
        raise _failure(*last)

    async def _attempt(self, w: Worker, rt: ModelRuntime, raw: dict[str, Any], rid: str, out: AsgiOut) -> int:
        gw = self.gw
        t = gw.cfg.pool
        payload = _enc.encode({**raw, "model": w.served_model or rt.id})
        rec = gw.pool.dispatched(w, max(1, len(payload) // 4), 0)  # ~4 bytes a token: its prefill work
        try:
            resp = await gw.upstream.send(w, "/v1/embeddings", payload, {**_HEADERS, "x-request-id": rid},
                                          t.first_byte_s(None), rec.ticket)
            rec.ticket.abort = resp.close  # the worker was declared dead: end the wait now
            gw.pool.accepted(rec)
            try:
                if resp.status != 200:
                    raise _refusal(resp.status, await _read(resp, w, 1 << 16, t.idle_timeout_s), w)
                return await self._relay(resp, w, rid, out, rec)
            finally:
                resp.release()
        finally:
            gw.pool.finished(rec)

    async def _relay(self, resp: aiohttp.ClientResponse, w: Worker, rid: str, out: AsgiOut, rec: Inflight) -> int:
        """Read the whole answer (bounded, in the budget while held), check it, then send it."""
        gw = self.gw
        limit = gw.cfg.limits.max_embeddings_answer_bytes
        if resp.content_length is not None and resp.content_length > limit:
            raise _too_large(limit)
        taken = [0]
        try:
            body = await self._read_answer(resp, w, limit, taken)
            if not _is_object(body):
                raise UpstreamError(f"worker {w.id} answered 200 with a body that is not a JSON object", True,
                                    phase="first")
            gw.pool.first_token(rec)
            w.served += 1
            # from here on nothing is retried: the client's response has begun
            await out.start(200, JSON_HEADERS + [(b"x-kvroute-worker", w.id.encode()),
                                                 (b"x-request-id", rid.encode())])
            await out.body(body)
            return 200
        finally:
            gw.body_budget.give(taken[0])

    async def _read_answer(self, resp: aiohttp.ClientResponse, w: Worker, limit: int, taken: list[int]) -> bytes:
        """The answer's bytes; `taken[0]`: how many the body budget gave for them so far."""
        gw = self.gw
        chunks: list[bytes] = []
        try:
            while data := await read_within(resp.content, gw.cfg.pool.idle_timeout_s, w.id, False):
                if taken[0] + len(data) > limit:
                    raise _too_large(limit)
                if not gw.body_budget.try_take(len(data)):
                    raise rate_limited("The gateway is busy with other large answers; retry shortly.", 1.0,
                                       "gateway_busy")
                taken[0] += len(data)
                chunks.append(data)
        except (aiohttp.ClientError, ConnectionError) as e:
            raise UpstreamError(f"worker {w.id} failed while answering: {type(e).__name__}: {e}", True,
                                phase="first") from None
        return b"".join(chunks)


def _decode(body: bytes) -> dict[str, Any]:
    """The body as sent (what the worker gets, model aside), its fields checked."""
    raw = decode_object(body)
    try:
        req = msgspec.convert(raw, EmbeddingRequest)
    except msgspec.ValidationError as e:
        m = _FIELD.search(str(e))
        raise bad_request(f"Invalid request: {e}", (m.group(1) or m.group(2)) if m else None) from None
    if not req.model:
        raise bad_request("`model` must be a non-empty string.", "model")
    inp = req.input
    if not inp or (isinstance(inp, list) and any(isinstance(x, (str, list)) and not x for x in inp)):
        raise bad_request("`input` must not be empty.", "input")
    if isinstance(inp, list) and len({type(x) for x in inp}) > 1:
        raise bad_request("`input` must be a text, a list of texts, a list of token ids or a list of such lists.",
                          "input")
    if req.dimensions is not None and req.dimensions < 1:
        raise bad_request("`dimensions` must be at least 1.", "dimensions")
    return raw


def _is_object(body: bytes) -> bool:
    try:
        return isinstance(msgspec.json.decode(body), dict)
    except (msgspec.DecodeError, RecursionError):
        return False


async def _read(resp: aiohttp.ClientResponse, w: Worker, limit: int, idle_s: float) -> bytes:
    """At most `limit` bytes of an error answer (the rest is not needed)."""
    got = b""
    try:
        while len(got) < limit and (data := await read_within(resp.content, idle_s, w.id, False)):
            got += data
    except (UpstreamError, aiohttp.ClientError, ConnectionError):
        pass
    return got[:limit]


def _said(message: str, w: Worker) -> str | None:
    return worker_message(message, (w.id, w.url, urlsplit(w.url).hostname or ""))


def _refusal(status: int, body: bytes, w: Worker) -> Exception:
    """A worker's 4xx: the client's own error (relayed), or the worker's trouble."""
    relayed = _RELAYED.get(status)
    if relayed is None:
        return UpstreamError(f"worker {w.id} answered HTTP {status}", True, phase="status", status=status)
    if relayed == 404:
        return ApiError(404, "This model's workers do not serve embeddings.", "invalid_request_error", "model",
                        "model_not_found")
    msg, _, code = upstream_error_message(body)
    return ApiError(relayed, _said(msg, w) or "The worker refused the request.", "invalid_request_error", None,
                    code if isinstance(code, str) else None)


def _too_large(limit: int) -> ApiError:
    return ApiError(502, f"The embeddings answer is larger than the gateway relays ({limit} bytes, "
                         f"limits.max_embeddings_answer_bytes); send fewer inputs per request.", "upstream_error",
                    None, "answer_too_large")


def _failure(e: UpstreamError, w: Worker) -> ApiError:
    """What the client gets when no worker answered: no worker, host or library named."""
    if e.status == 429:
        return rate_limited("The model's workers are overloaded; retry later.", 1.0)
    if e.status == 503:
        return ApiError(503, "The model's workers are not taking requests right now; retry later.",
                        "service_unavailable", None, "no_healthy_worker", 1.0)
    if e.phase == "first_byte_timeout":
        return ApiError(504, "The worker did not answer in time; retry the request.", "upstream_error", None,
                        "worker_timeout")
    said = _said(e.said, w) if e.said else None
    if said:
        return upstream_failed(f"The worker failed to answer (it said: {said}); retry the request.")
    if e.status is not None:
        return upstream_failed(f"The worker gave an answer the gateway does not relay (HTTP {e.status}).")
    return upstream_failed("The worker failed to answer; retry the request.")

