"""OpenAI completions and chat on a worker: token-id or text prompts, stream or not.

The engine deals in token ids only; here a text prompt goes through the engine's
tokenizer and chat messages through its chat template (with the gateway's rule that
the `developer` role is the template's `system`).
"""
from __future__ import annotations

import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from kvwire import WorkerInfo
from workers.api import Engine, GenRequest, GenStream, Tokenizer
from workers.errors import BadRequest, Draining, NotFound
from workers.metrics import WorkerMetrics
from workers.schema import ChatBody, ChatMessage, CompletionAny, CompletionIds

from .common import Limits, read_body
from .stream import GenResponse

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # chat has no default length in OpenAI; bounded here
_DEC_IDS = msgspec.json.Decoder(CompletionIds)
_DEC_ANY = msgspec.json.Decoder(CompletionAny)
_DEC_CHAT = msgspec.json.Decoder(ChatBody)


class CompletionHandlers:
    """POST /v1/completions and /v1/chat/completions."""

    def __init__(self, engine: Engine, metrics: WorkerMetrics, info: WorkerInfo, limits: Limits) -> None:
        self.engine = engine
        self.metrics = metrics
        self.limits = limits
        self.tokenizer: Tokenizer = engine.tokenizer
        self.served = set(info.served_model_names) | {info.model}
        self.default_model = (info.served_model_names or [info.model])[0]

    async def completions(self, request: Request) -> Response:
        b, ids = self._decode_completion(await read_body(request, self.limits.max_body_bytes))
        if b.echo:
            raise BadRequest("echo is not supported by this worker", param="echo")
        model = self._model(b.model)
        return await self._start(self._gen_request(b, ids, COMPLETION_DEFAULT_MAX_TOKENS), b, model, chat=False)

    async def chat(self, request: Request) -> Response:
        b = _DEC_CHAT.decode(await read_body(request, self.limits.max_body_bytes))
        msgs = _chat_messages(b.messages)
        if b.max_completion_tokens is not None and b.max_tokens is None:
            b.max_tokens = b.max_completion_tokens
        ids = self.tokenizer.apply_chat_template(msgs)
        model = self._model(b.model)
        default_max = CHAT_DEFAULT_MAX_TOKENS
        max_ctx = self.limits.max_context_tokens
        if max_ctx:
            default_max = max(1, min(default_max, max_ctx - len(ids)))
        return await self._start(self._gen_request(b, ids, default_max), b, model, chat=True)

    def _decode_completion(self, raw: bytes) -> tuple[Any, list[int]]:
        """The body and its prompt's ids: token ids as sent (the router's fast path), or text tokenized here."""
        try:
            ids_body = _DEC_IDS.decode(raw)
            return ids_body, ids_body.prompt
        except msgspec.ValidationError:
            pass
        b = _DEC_ANY.decode(raw)
        p = b.prompt
        if isinstance(p, str):
            return b, self.tokenizer.encode(p)
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            raise BadRequest("batched prompts are not supported: send one prompt per request", param="prompt")
        if p is None:
            raise BadRequest("prompt is required", param="prompt")
        raise BadRequest("prompt must be a string or a list of token ids", param="prompt")

    def _model(self, model: str | None) -> str:
        if model is None or model == "":
            return self.default_model
        if model not in self.served:
            raise NotFound(f"The model `{model}` does not exist on this worker", param="model")
        return model

    def _gen_request(self, b: Any, ids: list[int], default_max: int) -> GenRequest:
        """Checks shared by both endpoints, then the engine's view of the request."""
        if b.n != 1:
            raise BadRequest("only n=1 is supported", param="n")
        if b.logprobs not in (None, False, 0):
            raise BadRequest("logprobs are not supported by this worker", param="logprobs")
        if not ids:
            raise BadRequest("the prompt is empty", param="prompt")
        top = self.tokenizer.max_token_id
        if min(ids) < 0 or max(ids) > top:
            raise BadRequest(f"prompt token ids must be in [0, {top}]", param="prompt")
        mt = default_max if b.max_tokens is None else b.max_tokens
        if mt < 1:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        spb = b.kv.shared_prefix_blocks if b.kv is not None else 0
        if spb < 0:
            raise BadRequest("kv.shared_prefix_blocks must be >= 0", param="kv.shared_prefix_blocks")
        rid = b.kv.request_id if b.kv is not None and b.kv.request_id else uuid.uuid4().hex
        if len(rid) > 200:
            raise BadRequest("kv.request_id is longer than 200 characters", param="kv.request_id")
        return GenRequest(rid, ids, mt, b.cache_salt or None, spb, b.lora, b.ignore_eos)

    async def _start(self, gen: GenRequest, b: Any, model: str, chat: bool) -> Response:
        if self.engine.draining:
            raise Draining("this worker is draining: send the request elsewhere", retry_after=1.0)
        stream = await self.engine.generate(gen)
        usage = bool(b.stream_options and b.stream_options.include_usage)
        return GenResponse(stream, chat=chat, model=model, streaming=b.stream, include_usage=usage, on_done=self._done)

    def _done(self, stream: GenStream) -> None:
        if stream.usage is not None:
            self.metrics.observe(stream.usage)


def _chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template wants them: text content only, parts joined."""
    if not messages:
        raise BadRequest("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
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
            raise BadRequest(
                "message content must be a string or a list of text parts", param=f"messages[{i}].content"
            )
        out.append({"role": "system" if m.role == "developer" else m.role, "content": c})
    return out
