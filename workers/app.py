"""The worker HTTP surface (DESIGN.md §4.3, docs/wire.md), one app for every engine.

`build_app(engine, ...)` returns a Starlette app over any `workers.api.Engine`:
OpenAI completions and chat (token-id or text prompts, streaming or not, `usage` with
`prompt_tokens_details.cached_tokens` and the `kv` extension), `/kv/prefetch` (+ DELETE
to cancel), `/kv/blocks` (peer export, bearer token), `/kv/purge`, `/load`, `/info`,
`/health`, `/metrics`. Every error is OpenAI-shaped (`{"error": {message, type, param,
code}}`) with a 4xx status for bad input, 429 + Retry-After when full, 503 draining; an
unexpected exception becomes an OpenAI-shaped 500 carrying a request id that is logged.

Streaming: SSE `data: {json}\\n\\n` chunks ending with `data: [DONE]`; with
`stream_options.include_usage` a last chunk carries `choices: []` and `usage`. Chunks
are built from byte templates (no per-token JSON encoding of the whole object). A
client that goes away cancels the generation at once, streaming or not: a listener on
the ASGI receive channel sees `http.disconnect` while the response waits for tokens.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvwire import EventsInfo
from workers.api import Engine, GenRequest, GenStream, PeerRef, PrefetchSpec
from workers.errors import BadRequest, Draining, EngineError, NotFound
from workers.metrics import WorkerMetrics
from workers.schema import BlocksBody, ChatBody, CompletionAny, CompletionIds, PrefetchBody, PurgeBody

log = logging.getLogger(__name__)

KEY_BYTES = 32
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_DEADLINE_MS = 600_000.0
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # chat has no default length in OpenAI; bounded here
_ENC = msgspec.json.Encoder()
_DEC_IDS = msgspec.json.Decoder(CompletionIds)
_DEC_ANY = msgspec.json.Decoder(CompletionAny)
_DEC_CHAT = msgspec.json.Decoder(ChatBody)
_DEC_PREFETCH = msgspec.json.Decoder(PrefetchBody)
_DEC_BLOCKS = msgspec.json.Decoder(BlocksBody)
_DEC_PURGE = msgspec.json.Decoder(PurgeBody)
_JSON = "application/json"


# ---------------------------------------------------------------------- errors


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    retry_after: float | None = None,
) -> Response:
    headers = {"Retry-After": str(max(1, int(retry_after + 0.999)))} if retry_after is not None else None
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return Response(_ENC.encode(body), status_code=status, media_type=_JSON, headers=headers)


def _from_engine_error(e: EngineError) -> Response:
    retry = e.retry_after if e.retry_after is not None else (1.0 if e.status in (429, 503) else None)
    return error_response(e.status, e.message, type=e.type, param=e.param, code=e.code, retry_after=retry)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_ENC.encode(obj), status_code=status, media_type=_JSON)


def _decode_error(e: msgspec.MsgspecError) -> BadRequest:
    msg = str(e)
    param = None
    if " - at `$." in msg:
        param = msg.rsplit("`$.", 1)[1].rstrip("`").split("[")[0]
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        return BadRequest(f"request body is not valid JSON: {msg}")
    return BadRequest(f"invalid request: {msg}", param=param)


async def _read_body(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            if int(cl) > limit:
                raise _TooLarge(limit)
        except ValueError:
            raise BadRequest("bad Content-Length header") from None
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class _TooLarge(EngineError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes")


def _keys_from_b64(s: str, max_blocks: int) -> list[bytes]:
    s = s.strip().replace("-", "+").replace("_", "/").replace(" ", "+")
    try:
        raw = base64.b64decode(s + "=" * (-len(s) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("keys_b64 is not valid base64", param="keys_b64") from None
    if len(raw) % KEY_BYTES:
        raise BadRequest(f"keys_b64 must decode to a multiple of {KEY_BYTES} bytes, got {len(raw)}", param="keys_b64")
    n = len(raw) // KEY_BYTES
    if n > max_blocks:
        raise BadRequest(f"{n} keys exceed the limit of {max_blocks}", param="keys_b64")
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


# ---------------------------------------------------------------------- generation response


class _GenResponse(Response):
    """Runs one accepted generation to the client (SSE or one JSON body), cancelling it
    if the client disconnects first."""

    def __init__(
        self,
        stream: GenStream,
        *,
        chat: bool,
        model: str,
        streaming: bool,
        include_usage: bool,
        on_done: Callable[[GenStream], None],
    ) -> None:
        self.stream = stream
        self.chat = chat
        self.model = model
        self.streaming = streaming
        self.include_usage = include_usage
        self.on_done = on_done
        self.background = None
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = self.stream

        async def listen() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    stream.cancel()
                    return

        listener = asyncio.ensure_future(listen())
        try:
            if self.streaming:
                await self._sse(send)
            else:
                await self._whole(send)
        finally:
            listener.cancel()
            stream.cancel()

    def _ids(self) -> tuple[str, int]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return prefix + self.stream.request_id, int(time.time())

    async def _whole(self, send: Send) -> None:
        stream = self.stream
        texts: list[str] = []
        try:
            async for ch in stream:
                texts.append(ch.text)
        except EngineError as e:
            await _send_response(send, _from_engine_error(e))
            return
        if stream.usage is None:  # cancelled: the client is gone
            return
        rid, created = self._ids()
        text = "".join(texts)
        finish = stream.finish_reason or "length"
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        body = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.model,
            "choices": [choice],
            "usage": stream.usage.to_dict(),
        }
        self.on_done(stream)
        await _send_response(send, _json(body))

    async def _sse(self, send: Send) -> None:
        stream = self.stream
        rid, created = self._ids()
        head = _ENC.encode(rid)
        model = _ENC.encode(self.model)
        if self.chat:
            pre = b'data: {"id":' + head + b',"object":"chat.completion.chunk","created":%d,"model":' % created + model
            tok_pre = pre + b',"choices":[{"index":0,"delta":{"content":'
            tok_post = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            pre = b'data: {"id":' + head + b',"object":"text_completion","created":%d,"model":' % created + model
            tok_pre = pre + b',"choices":[{"index":0,"text":'
            tok_post = b',"logprobs":null,"finish_reason":null}]}\n\n'
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-request-id", stream.request_id.encode()),
                ],
            }
        )
        body = {"type": "http.response.body", "body": b"", "more_body": True}
        if self.chat:
            body["body"] = pre + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
            await send(body)
        enc = _ENC.encode
        try:
            async for ch in stream:
                body["body"] = tok_pre + enc(ch.text) + tok_post
                await send(body)
        except EngineError as e:
            err = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
            body["body"] = b"data: " + enc(err) + b"\n\ndata: [DONE]\n\n"
            await send(body)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if stream.usage is None:  # cancelled: the client is gone
            return
        finish = enc(stream.finish_reason or "length")
        if self.chat:
            tail = pre + b',"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":' + finish + b"}]}\n\n"
        else:
            tail = pre + b',"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":' + finish + b"}]}\n\n"
        if self.include_usage:
            tail += pre + b',"choices":[],"usage":' + enc(stream.usage.to_dict()) + b"}\n\n"
        tail += b"data: [DONE]\n\n"
        self.on_done(stream)
        await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _send_response(send: Send, resp: Response) -> None:
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body, "more_body": False})


# ---------------------------------------------------------------------- the app


def build_app(
    engine: Engine,
    *,
    url: str = "",
    events: EventsInfo | None = None,
    peer_token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> Starlette:
    """The worker's Starlette app over `engine` (see the module doc)."""
    metrics = WorkerMetrics(engine)
    info0 = engine.info()
    served = set(info0.served_model_names) | {info0.model}
    default_model = (info0.served_model_names or [info0.model])[0]
    max_ctx = info0.max_context_tokens or 0
    block_size = info0.block_size or 16
    max_blocks = max(1, max_ctx // block_size) if max_ctx else 1 << 16
    tok = engine.tokenizer
    peer_secret = peer_token.encode() if peer_token else None

    def endpoint(name: str) -> Callable[[Callable[[Request], Awaitable[Response]]], Callable[[Request], Awaitable[Response]]]:
        """Uniform error handling + request counting for one route."""

        def wrap(fn: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
            async def handler(request: Request) -> Response:
                try:
                    resp = await fn(request)
                except EngineError as e:
                    resp = _from_engine_error(e)
                except msgspec.MsgspecError as e:
                    resp = _from_engine_error(_decode_error(e))
                except Exception:
                    rid = uuid.uuid4().hex
                    log.exception("unhandled error in %s (request %s)", name, rid)
                    resp = error_response(500, f"internal error (request id {rid})", type="server_error", code="internal_error")
                metrics.count(name, resp.status_code)
                return resp

            return handler

        return wrap

    def check_model(model: str | None) -> str:
        if model is None or model == "":
            return default_model
        if model not in served:
            raise NotFound(f"The model `{model}` does not exist on this worker", param="model")
        return model

    def common(b: Any, ids: list[int], default_max: int) -> GenRequest:
        if b.n != 1:
            raise BadRequest("only n=1 is supported", param="n")
        if b.logprobs not in (None, False, 0):
            raise BadRequest("logprobs are not supported by this worker", param="logprobs")
        if not ids:
            raise BadRequest("the prompt is empty", param="prompt")
        if min(ids) < 0 or max(ids) > tok.max_token_id:
            raise BadRequest(f"prompt token ids must be in [0, {tok.max_token_id}]", param="prompt")
        mt = b.max_tokens
        if mt is None:
            mt = default_max
        if mt < 1:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        spb = b.kv.shared_prefix_blocks if b.kv is not None else 0
        if spb < 0:
            raise BadRequest("kv.shared_prefix_blocks must be >= 0", param="kv.shared_prefix_blocks")
        rid = b.kv.request_id if b.kv is not None and b.kv.request_id else uuid.uuid4().hex
        if len(rid) > 200:
            raise BadRequest("kv.request_id is longer than 200 characters", param="kv.request_id")
        return GenRequest(rid, ids, mt, b.cache_salt or None, spb, b.lora, b.ignore_eos)

    def done(stream: GenStream) -> None:
        if stream.usage is not None:
            metrics.observe(stream.usage)

    async def start(gen: GenRequest, b: Any, model: str, chat: bool) -> Response:
        if engine.draining:
            raise Draining("this worker is draining: send the request elsewhere", retry_after=1.0)
        stream = await engine.generate(gen)
        include = bool(b.stream_options and b.stream_options.include_usage)
        return _GenResponse(stream, chat=chat, model=model, streaming=b.stream, include_usage=include, on_done=done)

    @endpoint("completions")
    async def completions(request: Request) -> Response:
        raw = await _read_body(request, max_body_bytes)
        try:
            b: Any = _DEC_IDS.decode(raw)
            ids = b.prompt
        except msgspec.ValidationError:
            b = _DEC_ANY.decode(raw)
            p = b.prompt
            if isinstance(p, str):
                ids = tok.encode(p)
            elif isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                raise BadRequest("batched prompts are not supported: send one prompt per request", param="prompt")
            elif p is None:
                raise BadRequest("prompt is required", param="prompt")
            else:
                raise BadRequest("prompt must be a string or a list of token ids", param="prompt")
        if b.echo:
            raise BadRequest("echo is not supported by this worker", param="echo")
        model = check_model(b.model)
        return await start(common(b, ids, COMPLETION_DEFAULT_MAX_TOKENS), b, model, chat=False)

    @endpoint("chat")
    async def chat(request: Request) -> Response:
        raw = await _read_body(request, max_body_bytes)
        b = _DEC_CHAT.decode(raw)
        if not b.messages:
            raise BadRequest("messages must not be empty", param="messages")
        msgs = []
        for i, m in enumerate(b.messages):
            c = m.content
            if isinstance(c, list):
                parts = []
                for part in c:
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise BadRequest("only text content parts are supported", param=f"messages[{i}].content")
                    parts.append(part["text"])
                c = "".join(parts)
            elif c is None:
                c = ""
            elif not isinstance(c, str):
                raise BadRequest("message content must be a string or a list of text parts", param=f"messages[{i}].content")
            msgs.append({"role": m.role, "content": c})
        if b.max_completion_tokens is not None and b.max_tokens is None:
            b.max_tokens = b.max_completion_tokens
        ids = tok.apply_chat_template(msgs)
        model = check_model(b.model)
        default_max = CHAT_DEFAULT_MAX_TOKENS
        if max_ctx:
            default_max = max(1, min(default_max, max_ctx - len(ids)))
        return await start(common(b, ids, default_max), b, model, chat=True)

    @endpoint("prefetch")
    async def prefetch(request: Request) -> Response:
        b = _DEC_PREFETCH.decode(await _read_body(request, max_body_bytes))
        if not b.prefetch_id or len(b.prefetch_id) > 200:
            raise BadRequest("prefetch_id must be 1-200 characters", param="prefetch_id")
        if not (0 < b.deadline_ms <= MAX_DEADLINE_MS):
            raise BadRequest(f"deadline_ms must be in (0, {MAX_DEADLINE_MS:.0f}]", param="deadline_ms")
        keys = _keys_from_b64(b.keys_b64, max_blocks)
        peer = PeerRef(b.source_peer.url, b.source_peer.worker_id) if b.source_peer is not None else None
        res = await engine.prefetch(PrefetchSpec(b.prefetch_id, keys, b.deadline_ms / 1000.0, peer))
        return _json({"prefetch_id": res.prefetch_id, "accepted_blocks": res.accepted_blocks, "queued": res.queued}, 202)

    @endpoint("prefetch_cancel")
    async def prefetch_cancel(request: Request) -> Response:
        pid = request.path_params["prefetch_id"]
        if not engine.cancel_prefetch(pid):
            raise NotFound(f"no prefetch {pid!r} in flight", param="prefetch_id")
        return _json({"prefetch_id": pid, "cancelled": True})

    @endpoint("blocks")
    async def blocks(request: Request) -> Response:
        if peer_secret is None:
            return error_response(403, "peer export is disabled on this worker (no peer token)", type="permission_error")
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer ") or not hmac.compare_digest(auth[7:].strip().encode(), peer_secret):
            return error_response(401, "a valid peer bearer token is required", type="authentication_error", code="invalid_token")
        if request.method == "POST":
            b = _DEC_BLOCKS.decode(await _read_body(request, max_body_bytes))
            keys_b64, with_meta = b.keys_b64, b.meta
        else:
            keys_b64 = request.query_params.get("keys_b64")
            if keys_b64 is None:
                raise BadRequest("keys_b64 is required", param="keys_b64")
            with_meta = request.query_params.get("meta", "") in ("1", "true")
        keys = _keys_from_b64(keys_b64, max_blocks)
        held = engine.export_blocks(keys, with_meta)
        out = []
        for x in held:
            d: dict[str, Any] = {"key": x.key.hex(), "tier": x.tier, "bytes": x.nbytes}
            if x.meta is not None:
                d["meta"] = x.meta
            out.append(d)
        return _json({"blocks": out, "missing": len(keys) - len(held)})

    @endpoint("purge")
    async def purge(request: Request) -> Response:
        b = _DEC_PURGE.decode(await _read_body(request, max_body_bytes))
        if b.all:
            n = engine.purge(None, True)
        elif b.cache_salt:
            n = engine.purge(b.cache_salt, False)
        else:
            raise BadRequest('send {"cache_salt": "..."} or {"all": true}', param="cache_salt")
        return _json({"purged_blocks": n})

    @endpoint("load")
    async def load(request: Request) -> Response:
        return _json(engine.load())

    @endpoint("info")
    async def info(request: Request) -> Response:
        return _json(msgspec.structs.replace(engine.info(), url=url, events=events))

    @endpoint("health")
    async def health(request: Request) -> Response:
        return _json({"status": "draining" if engine.draining else "ok"})

    @endpoint("metrics")
    async def metrics_ep(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        typ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type=typ)

    async def any_error(request: Request, exc: Exception) -> Response:  # pragma: no cover - safety net
        rid = uuid.uuid4().hex
        log.error("unhandled error (request %s): %r", rid, exc)
        return error_response(500, f"internal error (request id {rid})", type="server_error", code="internal_error")

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/kv/prefetch", prefetch, methods=["POST"]),
        Route("/kv/prefetch/{prefetch_id}", prefetch_cancel, methods=["DELETE"]),
        Route("/kv/blocks", blocks, methods=["GET", "POST"]),
        Route("/kv/purge", purge, methods=["POST"]),
        Route("/load", load, methods=["GET"]),
        Route("/info", info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_ep, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: any_error})
    app.state.engine = engine
    app.state.metrics = metrics
    return app

