"""OpenAI response objects, built from the worker's completion chunks.

Workers always answer as `/v1/completions` (the router sends token ids); chat clients
get `chat.completion` / `chat.completion.chunk` objects re-shaped from those chunks,
completion clients get `text_completion` objects under their own id and model name.
Structs + one msgspec encoder: a chunk costs a few microseconds.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

_enc = msgspec.json.Encoder()
_CHAT = "chat.completion.chunk"
_COMP = "text_completion"


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: None = None


class ChatChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: dict[str, Any] | None = None


class CompChunkChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompChunkChoice]
    usage: dict[str, Any] | None = None


def sse(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# What a client is told when its stream breaks after the first byte (the details, with the
# worker and the library's error, go to the gateway's log under the request id).
STREAM_FAILED = "The worker failed while generating; the answer is incomplete."


def sse_error(message: str, type_: str, code: str | None, request_id: str) -> bytes:
    return sse({"error": {"message": message, "type": type_, "param": None, "code": code, "request_id": request_id}})


def chat_first_chunk(rid: str, created: int, model: str) -> bytes:
    return sse(ChatChunk(rid, _CHAT, created, model, [ChatChunkChoice(0, Delta(role="assistant", content=""), None)]))


def chat_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> bytes:
    return sse(ChatChunk(rid, _CHAT, created, model, [ChatChunkChoice(0, Delta(content=text), finish)]))


def comp_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> bytes:
    return sse(CompChunk(rid, _COMP, created, model, [CompChunkChoice(0, text, finish)]))


# Our worker's token event (docs/wire.md, "Token events"): its text sits between these two,
# already a JSON string.
_UP_TEXT = b',"choices":[{"index":0,"text":'
_UP_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'
_CUT_TEXT, _CUT_TAIL = len(_UP_TEXT), -len(_UP_TAIL)


class ChunkFrame:
    """A streaming client's chunks for one request, their constant parts encoded once:
    `render` encodes only the text (and a finish reason), `translate` copies a token
    event's text as our worker encoded it. The relay builds one per request for both."""

    __slots__ = ("pre", "mid", "tail_null")

    def __init__(self, chat: bool, rid: str, created: int, model: str) -> None:
        head = _enc.encode(ChatChunk(rid, _CHAT, created, model, []) if chat
                           else CompChunk(rid, _COMP, created, model, []))
        assert head.endswith(b"[]}")
        self.pre = b"data: " + head[:-2] + (b'{"index":0,"delta":{"content":' if chat else b'{"index":0,"text":')
        self.mid = b'},"finish_reason":' if chat else b',"finish_reason":'
        self.tail_null = self.mid + b'null,"logprobs":null}]}\n\n'

    def render(self, text: str, finish: str | None) -> bytes:
        """`chat_chunk` / `comp_chunk`, byte for byte."""
        if finish is None:
            return self.pre + _enc.encode(text) + self.tail_null
        return self.pre + _enc.encode(text) + self.mid + _enc.encode(finish) + b',"logprobs":null}]}\n\n'

    def translate(self, event: bytes) -> bytes | None:
        """One whole upstream SSE event -> the client's chunk for it, as `render` would
        write it, when the event is our worker's plain token event; None for anything else
        (finish, usage, errors, another layout), which the caller decodes instead.

        The text is copied as the worker encoded it, not decoded and encoded again: a long
        stream's per-token cost. It is taken only when the span holds no quote but its own
        two, so an unexpected structure can never be mistaken for text. b"" is an empty
        text (nothing to send)."""
        if not event.endswith(_UP_TAIL):
            return None
        i = event.find(_UP_TEXT)
        if i < 0:
            return None
        text = event[i + _CUT_TEXT : _CUT_TAIL]
        if text.count(b'"') != 2 or text[:1] != b'"' or text[-1:] != b'"':
            return None
        return self.pre + text + self.tail_null if len(text) > 2 else b""


def chunk_renderer(chat: bool, rid: str, created: int, model: str) -> Callable[[str, str | None], bytes]:
    """`ChunkFrame.render` for one request."""
    return ChunkFrame(chat, rid, created, model).render


def token_translator(chat: bool, rid: str, created: int, model: str) -> Callable[[bytes], bytes | None]:
    """`ChunkFrame.translate` for one request."""
    return ChunkFrame(chat, rid, created, model).translate


def usage_chunk(chat: bool, rid: str, created: int, model: str, usage: dict[str, Any]) -> bytes:
    if chat:
        return sse(ChatChunk(rid, _CHAT, created, model, [], usage=usage))
    return sse(CompChunk(rid, _COMP, created, model, [], usage=usage))


def chat_response(rid: str, created: int, model: str, text: str, finish: str | None, usage: dict[str, Any]) -> bytes:
    return _enc.encode(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": finish or "stop",
                    "logprobs": None,
                }
            ],
            "usage": usage,
        }
    )


def comp_response(rid: str, created: int, model: str, text: str, finish: str | None, usage: dict[str, Any]) -> bytes:
    return _enc.encode(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish or "stop", "logprobs": None}],
            "usage": usage,
        }
    )


def client_usage(up: dict[str, Any] | None, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The usage the client sees: the worker's (with `kv`), or the router's own count."""
    if up is None:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    u = dict(up)
    u.setdefault("prompt_tokens", prompt_tokens)
    u.setdefault("completion_tokens", completion_tokens)
    u.setdefault("total_tokens", u["prompt_tokens"] + u["completion_tokens"])
    d = u.get("prompt_tokens_details")
    if not isinstance(d, dict) or "cached_tokens" not in d:
        u["prompt_tokens_details"] = {"cached_tokens": 0}
    return u
