"""The OpenAI routes of the gateway: completions and chat (the hot path), models,
tokenize/detokenize with the gateway's own tokenizer (embeddings: router/api/embeddings.py).

Completions are handled on raw ASGI (router/api/asgi.py): the body is read with a cap,
the request counted once by its final status, every error answered in OpenAI's shape
and never a silent truncation once a stream has started.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvwire.linger import expects_continue

from ..gateway import Gateway
from ..intake.model import ModelRuntime
from ..intake.screen import SCREEN_BYTES
from ..intake.screener import OFFLOAD_BYTES
from ..intake.tokenize import TokenizerError
from .asgi import AsgiOut, ClientGone, Receive, Scope, Send, headers_of, read_body, watch_disconnect
from .errors import ApiError, bad_request, internal, model_not_found, rate_limited, unavailable
from .responses import SSE_DONE, sse_error

log = logging.getLogger("kvroute.api")
END_WRITE_S = 2.0
SHUTTING_DOWN = "The gateway is shutting down; the answer is incomplete. Retry the request."


class CompletionRoute:
    """POST /v1/completions or /v1/chat/completions, end to end."""

    def __init__(self, gw: Gateway, chat: bool) -> None:
        self.gw = gw
        self.chat = chat
        self.route = "/v1/chat/completions" if chat else "/v1/completions"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        out = AsgiOut(send)
        gw = self.gw
        me = asyncio.current_task()
        assert me is not None
        try:
            gw.inflight.add(me)
            try:
                await self._handle(scope, receive, out)
            finally:
                gw.inflight.discard(me)
        except asyncio.CancelledError:
            if not gw.inflight.ended:
                raise
            me.uncancel()  # the drain ended (router/fleet/drain.py): end the response here
            gw.metrics.count_request(self.route, await end_drained(out), "-")
        except ApiError as e:
            if not out.started:
                unread = e.headers.get("connection") == "close" and not expects_continue(scope)
                await out.error(e, unread=receive if unread else None)
            gw.metrics.count_request(self.route, e.status, "-")
        except ClientGone:
            gw.metrics.disconnects.inc()
        except Exception:
            rid = "req-" + os.urandom(8).hex()
            log.exception("unhandled error in %s (request id %s)", self.route, rid)
            gw.metrics.internal_errors.inc()
            await _end_with_error(out, rid)

    async def _handle(self, scope: Scope, receive: Receive, out: AsgiOut) -> None:
        """Admission before any work: the tenant, its concurrency slot and a share of the
        body budget are taken before the body is read or anything tokenized."""
        gw = self.gw
        headers = headers_of(scope)
        try:
            tenant = gw.tenancy.authenticate(headers)
            gw.tenancy.acquire(tenant)
        except ApiError as e:  # refused before its body was read: the connection cannot be reused
            e.headers.setdefault("connection", "close")
            raise
        try:
            size = self._reserve(headers, tenant.id)
            try:
                await self._with_body(scope, receive, out, headers, tenant)
            finally:
                gw.body_budget.give(size)
                gw.memtrim.after_body(size)
        finally:
            gw.tenancy.release(tenant)

    def _reserve(self, headers: dict[str, str], tenant: str) -> int:
        """Reserve the body's declared size (the limit when undeclared) in the gateway's budget,
        after charging a large declared one to the tenant's body rate (bodyrate.py)."""
        gw = self.gw
        limit = gw.cfg.limits.max_body_bytes
        declared = headers.get("content-length")
        known = declared is not None and declared.isdigit() and int(declared) <= limit
        size = int(declared) if known and declared is not None else limit
        if known:
            self._charge(tenant, size, unread=True)
        if size >= OFFLOAD_BYTES:
            gw.preparer.screener.warm()  # its screen helper starts while the body arrives
        if not gw.body_budget.try_take(size):
            gw.metrics.child(gw.metrics.shed, "body_budget").inc()
            e = rate_limited("The gateway is busy with other large requests; retry shortly.", 1.0, "gateway_busy")
            e.headers["connection"] = "close"  # the body stays unread
            raise e
        return size

    def _charge(self, tenant: str, size: int, *, unread: bool) -> None:
        """A large body against the tenant's body rate: 429 + Retry-After when over it."""
        gw = self.gw
        wait = gw.body_rate.take(tenant, size) if size >= SCREEN_BYTES else 0.0
        if wait > 0:
            gw.metrics.child(gw.metrics.shed, "tenant_body_rate").inc()
            e = rate_limited("You are sending large request bodies faster than this gateway accepts them from one "
                             "client; retry after the time given.", wait, "body_rate_exceeded")
            if unread:
                e.headers["connection"] = "close"  # the body stays unread
            raise e

    async def _with_body(self, scope: Scope, receive: Receive, out: AsgiOut, headers: dict[str, str],
                         tenant: Any) -> None:
        gw = self.gw
        body = await read_body(receive, gw.cfg.limits.max_body_bytes, headers.get("content-length"))
        if headers.get("content-length") is None:  # chunked: charged what came, before any decoding
            self._charge(tenant.id, len(body), unread=False)
        # Completions may run for minutes: from now on, watch for the client leaving.
        me = asyncio.current_task()
        assert me is not None
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(watch_disconnect(receive, me, gone))
        try:
            await self._complete(body, headers, tenant, out)
        except asyncio.CancelledError:
            if not gone.is_set():
                raise
            # The client left: the request was cancelled (upstream closed, prefetch cancelled).
            me.uncancel()
            gw.metrics.count_request(self.route, 499, "-")
        finally:
            watcher.cancel()

    async def _complete(self, body: bytes, headers: dict[str, str], tenant: Any, out: AsgiOut) -> None:
        """Counts the request once, by its final status, and answers every ApiError itself."""
        gw = self.gw
        try:
            prep = await gw.prepare(self.chat, body, headers, tenant)
        except ApiError as e:
            gw.metrics.count_request(self.route, e.status, "-")
            await out.error(e)
            return
        out.rid = prep.rid
        try:
            status = await gw.complete(prep, out)
        except ApiError as e:
            gw.metrics.count_request(self.route, e.status, prep.model.id)
            if out.started:
                log.warning("request %s: error after the response started: %s", prep.rid, e)
                return
            await out.error(e, prep.rid)
            return
        gw.metrics.count_request(self.route, status, prep.model.id)


async def end_drained(out: AsgiOut) -> int:
    """End a response the drain's end cut (router/fleet/drain.py): a 503 when nothing was sent,
    else an SSE error event, `[DONE]` and the body's last chunk. Returns the status sent."""
    try:
        async with asyncio.timeout(END_WRITE_S):  # a client that reads nothing holds no one up
            if not out.started:
                await out.error(unavailable("The gateway is shutting down; retry the request.", 1.0,
                                            "shutting_down"), out.rid or None)
                return 503
            if not out.ended:
                tail = sse_error(SHUTTING_DOWN, "service_unavailable", "shutting_down", out.rid) + SSE_DONE
                await out.body(tail if out.sse else b"", False)
    except (TimeoutError, OSError, RuntimeError):  # the client is gone or stopped reading
        pass
    return out.status


async def _end_with_error(out: AsgiOut, rid: str) -> None:
    if not out.started:
        await out.error(internal(rid), rid)
        return
    # never a silent truncation: an explicit error event, then the end
    tail = sse_error(f"Internal error (request id {rid}).", "internal_error", "internal_error", rid) + SSE_DONE
    try:
        await out.body(tail if out.sse else b"", False)
    except Exception:
        pass


# --------------------------------------------------------------------------- models


def model_card(name: str, rt: ModelRuntime) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvroute", "root": rt.id,
            "max_model_len": rt.max_context}


def adapter_card(name: str, rt: ModelRuntime) -> dict[str, Any]:
    """A LoRA adapter some worker serves, listed as vLLM lists one (its base as `parent`)."""
    return {**model_card(name, rt), "root": name, "parent": rt.id}


def models_list(gw: Gateway) -> dict[str, Any]:
    cards = [model_card(name, rt) for name, rt in gw.models.by_name.items()]
    cards += [adapter_card(a, rt) for rt in gw.models.by_id.values() for a in sorted(rt.adapters)]
    return {"object": "list", "data": cards}


def model_of(gw: Gateway, name: str) -> ModelRuntime:
    rt = gw.models.get(name) or gw.models.adapter_of(name)
    if rt is None:
        raise model_not_found(name)
    return rt


# --------------------------------------------------------------------------- tokenize


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a text `prompt`, or chat `messages` rendered with the template.
    Other fields are collected (not dropped) so that `refuse_unknown` can name them all."""

    model_config = ConfigDict(extra="allow")
    model: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    tokens: list[int] = Field(min_length=0)


def refuse_unknown(req: BaseModel, route: str) -> None:
    """A 400 naming every field the route does not implement: ignored, such a field would
    make the answer silently differ from what the client asked (null counts as absent)."""
    unknown = [k for k, v in (req.model_extra or {}).items() if v is not None]
    if unknown:
        names = ", ".join(f"`{k}`" for k in unknown)
        raise bad_request(f"{route} does not support {names}; supported: "
                          f"{', '.join(f'`{k}`' for k in type(req).model_fields)}.", unknown[0],
                          "unsupported_parameter")


async def tokenize(gw: Gateway, req: TokenizeRequest, scope: str) -> dict[str, Any]:
    """The ids the gateway keys with, in vLLM's /tokenize shape (`scope`: the tenant's cache);
    `token_strs` as vLLM fills it: the tokenizer's string for each id."""
    refuse_unknown(req, "/tokenize")
    rt = model_of(gw, req.model)
    tok = rt.tokenizer
    tz = gw.tokenization
    try:
        if req.messages is not None:
            extra: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt}
            if req.tools:
                extra["tools"] = req.tools
            if req.add_special_tokens:
                text = tok.render_chat(req.messages, **extra)
                ids = await tz.encode_text(tok, text, True, scope)
            else:
                ids = await tz.encode_chat(tok, req.messages, extra, scope)
        elif req.prompt is not None:
            if req.tools:
                raise bad_request("`tools` applies to `messages` only.", "tools")
            specials = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await tz.encode_text(tok, req.prompt, specials, scope)
        else:
            raise bad_request("Either `prompt` or `messages` is required.", "prompt")
    except TokenizerError as e:
        raise bad_request(str(e), "messages" if req.messages is not None else "prompt") from None
    tokens = ids.tolist()
    strs = tok.hf.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    return {"count": len(tokens), "max_model_len": rt.max_context, "tokens": tokens, "token_strs": strs}


def detokenize(gw: Gateway, req: DetokenizeRequest) -> dict[str, Any]:
    refuse_unknown(req, "/detokenize")
    rt = model_of(gw, req.model)
    vocab = rt.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"Token id {bad} is outside the vocabulary (0..{vocab - 1}).", "tokens")
    return {"prompt": rt.tokenizer.hf.decode(req.tokens)}
