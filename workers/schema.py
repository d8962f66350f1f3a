"""Request bodies the worker HTTP surface accepts (docs/wire.md), decoded with msgspec,
and the error body it answers with. The same structs give `/openapi.json` its schemas.

Generation bodies hold only the fields the worker reads. Which other OpenAI fields may
appear is not decided here but by `kvwire.openai` (shared with the gateway): the app
checks the raw body against it first, so a field our engines do not implement (n > 1,
echo, response_format, tools, ...) gets a 400 naming it, never a silent drop; what that
list calls implemented or metadata only (temperature, seed, user, ...) is accepted, and
so are the fields the worker hands to its engine, which refuses those it cannot honour
(`ENGINE_FIELDS` of workers/web/prompts.py: min_tokens, logprobs, return_token_ids).
/tokenize and /detokenize refuse any field they do not know.
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class KVExtension(msgspec.Struct):
    """kvroute's extension: blocks shared across tenants, and the router's request id."""

    shared_prefix_blocks: int = 0
    request_id: str | None = None


class _Common(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    ignore_eos: bool = False
    kv: KVExtension | None = None
    lora: str | None = None
    min_tokens: int = 0  # vLLM's: no end (EOS, stop string) before this many tokens
    return_token_ids: bool | None = None  # vLLM's: prompt and generated token ids in the answer
    # vLLM's prefill/decode disaggregation fields (docs/engine.md § Prefill/decode roles)
    kv_transfer_params: dict[str, Any] | None = None


class CompletionBody(_Common):
    """POST /v1/completions: one prompt, as token ids (what the router sends) or text."""

    prompt: str | list[int] | None = None
    # legacy: logprobs of each token and of this many most likely (a bool as vLLM coerces it)
    logprobs: bool | int | None = None


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None


class ChatBody(_Common):
    """POST /v1/chat/completions: messages rendered with the engine's chat template."""

    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /tokenize (vLLM's shape): `prompt` as a completion encodes it, or `messages`
    as a chat completion renders them. Only the values this worker applies are accepted."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /detokenize (vLLM's shape)."""

    tokens: list[int]
    model: str | None = None


class EmbeddingBody(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/embeddings (OpenAI's shape): a text, texts, token ids or lists of them."""

    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: str | None = None  # "float" (the default) or "base64" (little-endian float32)
    dimensions: int | None = None
    user: str | None = None


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


class ErrorInfo(msgspec.Struct, omit_defaults=False):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    """Every error the worker answers with, in OpenAI's shape."""

    error: ErrorInfo


# Bodies documented in /openapi.json under components/schemas (by class name).
DOCUMENTED: tuple[type[msgspec.Struct], ...] = (
    CompletionBody, ChatBody, TokenizeBody, DetokenizeBody, EmbeddingBody, PrefetchBody, BlocksBody, PurgeBody,
    ErrorBody,
)
