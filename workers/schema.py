"""Request bodies the worker HTTP surface accepts (docs/wire.md), decoded with msgspec.

Unknown OpenAI fields (temperature, top_p, stop, user, seed, ...) are accepted and
ignored, as an engine that cannot honour them must not fail on them; features that
would change the answer's shape and are not supported (n > 1, echo, logprobs) are
refused by the app with a 400.
"""
from __future__ import annotations

from typing import Any

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class KVExtension(msgspec.Struct):
    shared_prefix_blocks: int = 0
    request_id: str | None = None


class _Common(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False
    kv: KVExtension | None = None
    n: int = 1
    logprobs: Any = None
    lora: str | None = None


class CompletionIds(_Common):
    """`prompt` as token ids (what the router sends): validated in C."""

    prompt: list[int] = []
    echo: bool = False


class CompletionAny(_Common):
    """Any other `prompt` shape; the app accepts a string, refuses batches."""

    prompt: Any = None
    echo: bool = False


class ChatMessage(msgspec.Struct):
    role: str
    content: Any = None


class ChatBody(_Common):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None


class PeerBody(msgspec.Struct):
    url: str
    worker_id: str | None = None


class PrefetchBody(msgspec.Struct):
    prefetch_id: str
    keys_b64: str
    deadline_ms: float = 2000.0
    source_peer: PeerBody | None = None
    namespace: Any = None


class BlocksBody(msgspec.Struct):
    keys_b64: str
    meta: bool = False


class PurgeBody(msgspec.Struct):
    cache_salt: str | None = None
    all: bool = False
