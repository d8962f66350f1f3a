"""A large body's prompt measured before the body is decoded, so that a prompt too long to
serve is refused without building it.

Decoding a body builds one Python object per JSON value, on the event loop: an 8 MB
prompt of token ids is 1.6 M ints (~150 ms and ~100 MB), a conversation of thousands of
messages as many dicts, while every other tenant waits. For a body of `SCREEN_BYTES` or
more the prompt is first read as raw JSON (msgspec `Raw`: validated, nothing built): the
token ids of a flat array are its commas plus one, a text is decoded alone (one string),
messages are counted and their string contents decoded one by one. The Preparer refuses
from these numbers exactly what its full checks would refuse for length. What cannot be
measured this cheaply (a batch, content parts, invalid JSON) is left to the full decode.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

SCREEN_BYTES = 64 * 1024  # below this a body decodes in well under a millisecond: no screen

_NULL = msgspec.Raw(b"null")


class _Msg(msgspec.Struct, forbid_unknown_fields=False):
    content: msgspec.Raw = _NULL


class _Body(msgspec.Struct, forbid_unknown_fields=False):
    model: msgspec.Raw = _NULL
    prompt: msgspec.Raw = _NULL
    messages: msgspec.Raw = _NULL


_body_dec = msgspec.json.Decoder(_Body)
_msgs_dec = msgspec.json.Decoder(list[_Msg])
_str_dec = msgspec.json.Decoder(str)


@dataclass(frozen=True, slots=True)
class PromptSize:
    """What a body's prompt is made of, as far as raw JSON shows it cheaply."""

    model: str
    chars: int | None = None  # characters of a text prompt, or of a chat's string contents
    ids: int | None = None  # token ids of a flat array prompt
    messages: int | None = None  # messages of a chat


def measure(body: bytes, chat: bool) -> PromptSize | None:
    """The prompt's size, or None when the body cannot be measured without decoding it."""
    try:
        b = _body_dec.decode(body)
        model = _str_dec.decode(b.model)
        if chat:
            return _chat(model, b.messages)
        return _completion(model, b.prompt)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None  # not JSON, nested too deep, or not of the usual shape: the full decode says why


def _first(raw: msgspec.Raw) -> bytes:
    """The first byte of a raw JSON value (it starts at its first character), without a copy."""
    return bytes(memoryview(raw)[:1])


def _chat(model: str, raw: msgspec.Raw) -> PromptSize | None:
    if _first(raw) != b"[":
        return None
    msgs = _msgs_dec.decode(raw)
    chars = 0
    for m in msgs:
        if _first(m.content) == b'"':
            chars += len(_str_dec.decode(m.content))
    return PromptSize(model, chars=chars, messages=len(msgs))


def _completion(model: str, raw: msgspec.Raw) -> PromptSize | None:
    first = _first(raw)
    if first == b'"':
        return PromptSize(model, chars=len(_str_dec.decode(raw)))
    if first != b"[":
        return None
    flat = bytes(raw)  # bytes.count runs in C; a copy of the prompt alone
    if flat.count(b"[") == 1 and b'"' not in flat:
        commas = flat.count(b",")  # a flat array of numbers: nothing else holds a comma
        return PromptSize(model, ids=commas + 1) if commas else None
    return None
