"""OpenAI completions and chat on a worker: token-id or text prompts, stream or not.

The engine deals in token ids only; here a text prompt goes through the engine's
tokenizer and chat messages through its chat template (with the gateway's rule that
the `developer` role is the template's `system`).
"""
from __future__ import annotations

import uuid

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from workers.api import Engine, GenRequest, GenStream, Tokenizer
from workers.errors import BadRequest, Draining
from workers.metrics import WorkerMetrics
from workers.schema import ChatBody, CompletionBody

from .common import Limits, ServedModels, decode_object, read_body
from .logprobs import MAX_LOGPROBS, TokenText
from .prompts import chat_messages, check_ids, refuse_unsupported
from .stream import GenResponse

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # chat has no default length in OpenAI; bounded here


class CompletionHandlers:
    """POST /v1/completions and /v1/chat/completions.

    A body is decoded once to a dict, checked against the shared fields rule
    (`kvwire.openai`, see prompts.py), then converted to its msgspec struct (validated in
    C, no second JSON parse)."""

    def __init__(self, engine: Engine, metrics: WorkerMetrics, models: ServedModels, limits: Limits) -> None:
        self.engine = engine
        self.metrics = metrics
        self.limits = limits
        self.tokenizer: Tokenizer = engine.tokenizer
        self.models = models

    async def completions(self, request: Request) -> Response:
        d = decode_object(await read_body(request, self.limits.max_body_bytes))
        refuse_unsupported(d, chat=False)
        _refuse_batch(d.get("prompt"))
        b = msgspec.convert(d, CompletionBody)
        p = b.prompt
        if p is None:
            raise BadRequest("prompt is required", param="prompt")
        ids = self.tokenizer.encode(p) if isinstance(p, str) else p
        model = self.models.resolve(b.model)
        return await self._start(self._gen_request(b, ids, COMPLETION_DEFAULT_MAX_TOKENS), b, model, chat=False)

    async def chat(self, request: Request) -> Response:
        d = decode_object(await read_body(request, self.limits.max_body_bytes))
        refuse_unsupported(d, chat=True)
        b = msgspec.convert(d, ChatBody)
        msgs = chat_messages(b.messages)
        if b.max_completion_tokens is not None and b.max_tokens is None:
            b.max_tokens = b.max_completion_tokens
        ids = self.tokenizer.apply_chat_template(msgs)
        model = self.models.resolve(b.model)
        default_max = CHAT_DEFAULT_MAX_TOKENS
        max_ctx = self.limits.max_context_tokens
        if max_ctx:
            default_max = max(1, min(default_max, max_ctx - len(ids)))
        return await self._start(self._gen_request(b, ids, default_max), b, model, chat=True)

    def _gen_request(self, b: CompletionBody | ChatBody, ids: list[int], default_max: int) -> GenRequest:
        """Checks shared by both endpoints, then the engine's view of the request."""
        check_ids(ids, self.tokenizer.max_token_id, "prompt")
        mt = default_max if b.max_tokens is None else b.max_tokens
        if mt < 1:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        if b.min_tokens < 0:
            raise BadRequest("min_tokens must be >= 0", param="min_tokens")
        if b.min_tokens > mt:
            if b.max_tokens is not None:
                raise BadRequest(f"min_tokens ({b.min_tokens}) must be <= max_tokens ({mt})", param="min_tokens")
            mt = b.min_tokens  # this worker's default length gives way to the client's minimum
        spb = b.kv.shared_prefix_blocks if b.kv is not None else 0
        if spb < 0:
            raise BadRequest("kv.shared_prefix_blocks must be >= 0", param="kv.shared_prefix_blocks")
        rid = b.kv.request_id if b.kv is not None and b.kv.request_id else uuid.uuid4().hex
        if len(rid) > 200:
            raise BadRequest("kv.request_id is longer than 200 characters", param="kv.request_id")
        return GenRequest(rid, ids, mt, b.cache_salt or None, spb, b.lora, b.ignore_eos,
                          b.temperature, b.top_p, b.seed, b.stop, b.min_tokens, _logprobs(b),
                          b.kv_transfer_params)

    async def _start(self, gen: GenRequest, b: CompletionBody | ChatBody, model: str, chat: bool) -> Response:
        adapter = self.models.adapter_of(model)
        if adapter is not None:  # the model asked for is a LoRA adapter: run with it, keys scoped by it
            if gen.lora and gen.lora != adapter:
                raise BadRequest(f"lora {gen.lora!r} contradicts model {model!r}", param="lora")
            gen.lora = adapter
        if self.engine.draining:
            raise Draining("this worker is draining: send the request elsewhere", retry_after=1.0)
        stream = await self.engine.generate(gen)
        usage = bool(b.stream_options and b.stream_options.include_usage)
        tokens = TokenText(self.tokenizer) if gen.logprobs is not None else None
        prompt_ids = gen.prompt_ids if b.return_token_ids else None
        return GenResponse(stream, chat=chat, model=model, streaming=b.stream, include_usage=usage, on_done=self._done,
                           logprobs=tokens, prompt_ids=prompt_ids)

    def _done(self, stream: GenStream) -> None:
        if stream.usage is not None:
            self.metrics.observe(stream.usage)


def _logprobs(b: CompletionBody | ChatBody) -> int | None:
    """How many alternatives per token the request wants log-probabilities of (None: no
    log-probabilities): chat's `logprobs` + `top_logprobs`, the legacy `logprobs` count."""
    if isinstance(b, ChatBody):
        k = b.top_logprobs
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        if k and not b.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return (k or 0) if b.logprobs else None
    k = b.logprobs
    if k is None or k is False:
        return None
    k = int(k)
    if not 0 <= k <= MAX_LOGPROBS:
        raise BadRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
    return k


def _refuse_batch(prompt: object) -> None:
    """A list of prompts (OpenAI's batch) gets its own message, not a type error."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise BadRequest("batched prompts are not supported: send one prompt per request", param="prompt")
