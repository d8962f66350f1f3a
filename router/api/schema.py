"""OpenAI request and upstream response shapes at the gateway's edge (msgspec).

A body is decoded once into a dict (what pass-through workers receive, unchanged) and
converted into a typed view of the fields the gateway reads, so a wrong type is a 400
naming the field. The checks split in two: what every request must satisfy, and what
kvroute's own workers cannot serve (`ours_problem`, from kvwire's list of implemented
fields), which decides where the request may go rather than refusing it outright.
"""
from __future__ import annotations

import re
from array import array
from typing import Any

import msgspec
import numpy as np

from kvwire.openai import unsupported_content, unsupported_fields

from .errors import ApiError, bad_request

_ROLES = {"system", "user", "assistant", "tool", "developer", "function"}


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


class Message(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM: usage on every chunk, with include_usage


class _Common(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None
    # vLLM's extensions, understood by our workers (docs/wire.md)
    cache_salt: str | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None  # no end (EOS, stop string) before this many tokens


class ChatRequest(_Common, kw_only=True):
    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: Any = None
    tool_choice: Any = None
    top_logprobs: Any = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]  # text, token ids, or a batch of one of either
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_raw_dec = msgspec.json.Decoder(dict[str, Any])


def decode_object(body: bytes) -> dict[str, Any]:
    """A request body as the JSON object it must be; a 400 saying why otherwise."""
    try:
        return _raw_dec.decode(body)
    except RecursionError:
        raise bad_request("The request body is nested too deeply.", None, "invalid_json") from None
    except msgspec.ValidationError:
        raise bad_request("The request body must be a JSON object.") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"We could not parse the JSON body of your request: {e}", None, "invalid_json") from None


def decode_request(body: bytes, chat: bool) -> tuple[dict[str, Any], ChatRequest | CompletionRequest]:
    """The client's body as it came (forwarded unchanged to pass-through workers) and the
    typed view of the fields the gateway reads; a wrong type is a 400 naming the field."""
    raw = decode_object(body)
    try:
        req: ChatRequest | CompletionRequest = (
            msgspec.convert(raw, ChatRequest) if chat else msgspec.convert(raw, CompletionRequest))
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH.search(msg)
        raise bad_request(f"Invalid request: {msg}", m.group(1) if m and m.group(1) else None) from None
    return raw, req


def decode_chat(body: bytes) -> ChatRequest:
    req = decode_request(body, True)[1]
    assert isinstance(req, ChatRequest)
    return req


def decode_completion(body: bytes) -> CompletionRequest:
    req = decode_request(body, False)[1]
    assert isinstance(req, CompletionRequest)
    return req


def _check_common(r: _Common) -> None:
    """What every request must satisfy, whichever worker serves it."""
    if not r.model:
        raise bad_request("`model` must be a non-empty string.", "model")
    if r.stream_options is not None and not r.stream:
        raise bad_request("`stream_options` is only allowed when `stream` is true.", "stream_options")
    if r.cache_salt is not None and not (0 < len(r.cache_salt) <= 256):
        raise bad_request("`cache_salt` must be 1 to 256 characters.", "cache_salt")
    mt = requested_max_tokens(r)
    if r.min_tokens is not None:
        if r.min_tokens < 0:
            raise bad_request("`min_tokens` must be at least 0.", "min_tokens")
        if mt is not None and r.min_tokens > mt:
            raise bad_request(f"`min_tokens` ({r.min_tokens}) must be at most the maximum length asked ({mt}).",
                              "min_tokens")


def ours_problem(raw: dict[str, Any], r: ChatRequest | CompletionRequest, max_stop: int) -> ApiError | None:
    """Why kvroute's own workers cannot serve this request as asked (None: they can).

    Such a request goes only to workers that implement what it asks (vLLM); where none
    serves the model, this is the client's 400 — never a silently dropped field."""
    chat = isinstance(r, ChatRequest)
    fields = unsupported_fields(raw, chat)
    if fields:
        f = fields[0]
        return bad_request(f"`{f}` is not supported by this model's workers.", f, "unsupported_parameter")
    so = r.stream_options
    if so is not None and so.include_usage and so.continuous_usage_stats:
        f = "stream_options.continuous_usage_stats"
        return bad_request(f"`{f}` is not supported by this model's workers.", f, "unsupported_parameter")
    part = unsupported_content(raw.get("messages")) if chat else None
    if part is not None:
        return bad_request(f"Only text content parts are supported by this model's workers ({part} is not text).",
                           part, "unsupported_content")
    if isinstance(r, CompletionRequest) and isinstance(r.prompt, list) and len(r.prompt) > 1 \
            and isinstance(r.prompt[0], (str, list)):
        return bad_request("Batched prompts are not supported by this model's workers; send one prompt per request.",
                           "prompt", "unsupported_parameter")
    return _sampling_problem(r, max_stop)


def _sampling_problem(r: _Common, max_stop: int) -> ApiError | None:
    if r.temperature is not None and not 0.0 <= r.temperature <= 2.0:
        return bad_request("`temperature` must be between 0 and 2.", "temperature")
    if r.top_p is not None and not 0.0 < r.top_p <= 1.0:
        return bad_request("`top_p` must be in (0, 1].", "top_p")
    if r.stop is not None:
        stops = [r.stop] if isinstance(r.stop, str) else r.stop
        if len(stops) > max_stop:
            return bad_request(f"At most {max_stop} stop sequences are allowed.", "stop")
        if any(not s for s in stops):
            return bad_request("Stop sequences must be non-empty strings.", "stop")
    return None


def requested_max_tokens(r: _Common) -> int | None:
    v = r.max_completion_tokens if isinstance(r, ChatRequest) and r.max_completion_tokens is not None else r.max_tokens
    if v is not None and v < 1:
        param = "max_completion_tokens" if isinstance(r, ChatRequest) and r.max_completion_tokens is not None \
            else "max_tokens"
        raise bad_request(f"`{param}` must be at least 1.", param)
    return v


def check_chat(r: ChatRequest, max_messages: int) -> list[dict[str, Any]]:
    """Checks a chat request; returns the messages as the chat template renders them for
    keying (text parts joined; other parts are the worker's to render and are not keyed)."""
    _check_common(r)
    if not r.messages:
        raise bad_request("`messages` must contain at least one message.", "messages")
    if len(r.messages) > max_messages:
        raise bad_request(f"At most {max_messages} messages are allowed.", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(r.messages):
        if m.role not in _ROLES:
            raise bad_request(f"Invalid role {m.role!r} in messages[{i}].", f"messages[{i}].role")
        c = m.content
        if c is None:
            text = ""
        elif isinstance(c, str):
            text = c
        else:
            text = "".join(p.text for p in c if p.type == "text" and p.text is not None)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": text})
    return out


def check_completion(r: CompletionRequest, vocab_size: int) -> str | array[int]:
    """Checks a completion request; returns the prompt to key (text or token ids; the first
    of a batch, which only pass-through workers take)."""
    _check_common(r)
    p: Any = r.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, list):
        if not p:
            raise bad_request("`prompt` must not be empty.", "prompt")
        try:
            ids = array("I", p)  # C-speed check: ints in [0, 2**32)
        except (TypeError, OverflowError):
            raise bad_request("`prompt` token ids must be non-negative integers.", "prompt") from None
        top = int(np.frombuffer(ids, dtype=np.uint32).max())  # 8k ids: ~5 µs instead of ~200
        if top >= vocab_size:
            raise bad_request(f"Token id {top} is outside the vocabulary (0..{vocab_size - 1}).", "prompt")
        return ids
    if not isinstance(p, str):
        raise bad_request("`prompt` must be a string or a list of token ids.", "prompt")
    return p


# ------------------------------------------------------------------------ upstream


class UpChoice(msgspec.Struct, forbid_unknown_fields=False):
    text: str = ""
    index: int = 0
    finish_reason: str | None = None


class UpChunk(msgspec.Struct, forbid_unknown_fields=False):
    """One upstream /v1/completions chunk (or the whole non-stream body)."""

    choices: list[UpChoice] = []
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


up_chunk_decoder = msgspec.json.Decoder(UpChunk)


def upstream_error_message(body: bytes) -> tuple[str, str | None, str | None]:
    """(message, type, code) out of a worker's error body, whatever its shape."""
    try:
        d = msgspec.json.decode(body)
        e = d.get("error", d) if isinstance(d, dict) else {}
        if isinstance(e, dict):
            return str(e.get("message") or body[:200].decode(errors="replace")), e.get("type"), e.get("code")
    except msgspec.DecodeError:
        pass
    return body[:200].decode(errors="replace") or "worker error", None, None


def api_error_from_upstream(status: int, body: bytes) -> ApiError:
    msg, typ, code = upstream_error_message(body)
    if status == 429:
        return ApiError(429, "The model's workers are overloaded; retry later.", "rate_limit_error", None,
                        "overloaded", 1.0)
    if 400 <= status < 500:
        return ApiError(400 if status not in (404, 413) else status, msg, typ or "invalid_request_error", None, code)
    return ApiError(502, "A worker failed to answer.", "upstream_error", None, "worker_failed")
