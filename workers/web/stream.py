"""The response of an accepted generation: SSE chunks or one JSON body, per OpenAI.

Chunks are built from byte templates (no JSON encoding of the whole object per token);
a request asking for log-probabilities or token ids (vLLM's `return_token_ids`: the
prompt's ids in the first chunk, each chunk's generated ids) gets its choice encoded
whole instead. A client that goes away cancels the generation at once, streaming or not: a listener
on the ASGI receive channel sees `http.disconnect` while the response waits for tokens.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from workers.api import GenChunk, GenStream, TokenLogprob
from workers.errors import EngineError

from .common import ENCODER, from_engine_error, json_response
from .logprobs import TokenText


class GenResponse(Response):
    """Runs one accepted generation to the client, cancelling it if the client disconnects first."""

    def __init__(
        self,
        stream: GenStream,
        *,
        chat: bool,
        model: str,
        streaming: bool,
        include_usage: bool,
        on_done: Callable[[GenStream], None],
        logprobs: TokenText | None = None,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.stream = stream
        self.logprobs = logprobs  # set: the request asked for log-probabilities
        self.prompt_ids = prompt_ids  # set: the request asked for token ids (`return_token_ids`)
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
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        try:
            async for ch in stream:
                texts.append(ch.text)
                ids += ch.token_ids
                if ch.logprobs:
                    lps += ch.logprobs
        except EngineError as e:
            await send_response(send, from_engine_error(e))
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
        tt = self.logprobs
        if tt is not None:
            choice["logprobs"] = {"content": tt.chat(ids, lps)} if self.chat else tt.legacy(ids, lps)
        body: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.model,
            "choices": [choice],
            "usage": stream.usage.to_dict(),
        }
        kvt = getattr(stream, "kv_transfer_params", None)
        if kvt is not None:  # a prefill for a remote decode: what the decode worker needs (vLLM's field)
            body["kv_transfer_params"] = kvt
        if self.prompt_ids is not None:
            choice["token_ids"] = ids
            if self.chat:
                body["prompt_token_ids"] = self.prompt_ids
            else:
                choice["prompt_token_ids"] = self.prompt_ids
        self.on_done(stream)
        await send_response(send, json_response(body))

    def _templates(self, rid: str, created: int) -> tuple[bytes, bytes, bytes]:
        """(chunk prefix up to the model, token chunk head, token chunk tail)."""
        head = ENCODER.encode(rid)
        model = ENCODER.encode(self.model)
        if self.chat:
            pre = b'data: {"id":' + head + b',"object":"chat.completion.chunk","created":%d,"model":' % created + model
            head_tok = pre + b',"choices":[{"index":0,"delta":{"content":'
            return pre, head_tok, b'},"logprobs":null,"finish_reason":null}]}\n\n'
        pre = b'data: {"id":' + head + b',"object":"text_completion","created":%d,"model":' % created + model
        return pre, pre + b',"choices":[{"index":0,"text":', b',"logprobs":null,"finish_reason":null}]}\n\n'

    async def _sse(self, send: Send) -> None:
        stream = self.stream
        rid, created = self._ids()
        pre, tok_pre, tok_post = self._templates(rid, created)
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
        enc = ENCODER.encode
        if self.chat:
            role = (
                b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                b'"logprobs":null,"finish_reason":null}]}'
            )
            prompt = b"" if self.prompt_ids is None else b',"prompt_token_ids":' + enc(self.prompt_ids)
            body["body"] = pre + prompt + role + b"\n\n"
            await send(body)
        whole = self.logprobs is not None or self.prompt_ids is not None
        first = True
        sent = 0  # characters of text sent
        try:
            async for ch in stream:
                if whole:
                    body["body"] = pre + b',"choices":[' + enc(self._choice(ch, first, sent)) + b"]}\n\n"
                    first = False
                    sent += len(ch.text)
                else:
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
        self.on_done(stream)
        await send({"type": "http.response.body", "body": self._tail(pre), "more_body": False})

    def _choice(self, ch: GenChunk, first: bool, sent: int) -> dict[str, Any]:
        """A token chunk's choice with its log-probabilities and token ids, as asked."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": ch.text}
        else:
            choice["text"] = ch.text
        tt = self.logprobs
        lps = ch.logprobs or []
        if tt is None:
            choice["logprobs"] = None
        elif self.chat:
            choice["logprobs"] = {"content": tt.chat(ch.token_ids, lps)}
        else:
            tt.offset = sent  # vLLM's streamed text_offset: from the text sent before this chunk
            choice["logprobs"] = tt.legacy(ch.token_ids, lps)
        choice["finish_reason"] = None
        if self.prompt_ids is not None:
            choice["token_ids"] = ch.token_ids
            if first and not self.chat:
                choice["prompt_token_ids"] = self.prompt_ids
        return choice

    def _tail(self, pre: bytes) -> bytes:
        """The finish chunk, the usage chunk when asked for, and [DONE]."""
        stream = self.stream
        enc = ENCODER.encode
        finish = enc(stream.finish_reason or "length")
        if self.chat:
            tail = pre + b',"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":' + finish + b"}]}\n\n"
        else:
            tail = pre + b',"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":' + finish + b"}]}\n\n"
        kvt = getattr(stream, "kv_transfer_params", None)
        if kvt is not None:  # a prefill for a remote decode, streamed: the fields ride on the finish chunk
            tail = tail[:-3] + b',"kv_transfer_params":' + enc(kvt) + b"}\n\n"
        if self.include_usage and stream.usage is not None:
            tail += pre + b',"choices":[],"usage":' + enc(stream.usage.to_dict()) + b"}\n\n"
        return tail + b"data: [DONE]\n\n"


async def send_response(send: Send, resp: Response) -> None:
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body, "more_body": False})
