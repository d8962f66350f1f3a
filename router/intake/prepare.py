"""Turning a client's body into a routable request: validate, tokenize, check limits, key.

Everything here happens before a worker is chosen, so every refusal is a 4xx that
costs no worker anything. The gateway's own tokenization and chat rendering serve
block keys and limits only: our workers receive the token ids computed here, vLLM
workers the client's own body (`raw`) with what routing adds.
"""
from __future__ import annotations

import os
import random
import time
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..api.errors import ApiError, bad_request, model_not_found
from ..api.schema import (
    ChatRequest,
    CompletionRequest,
    check_chat,
    check_completion,
    decode_request,
    ours_problem,
    requested_max_tokens,
)
from ..config import LimitsConfig
from ..telemetry.logs import client_request_id
from ..telemetry.metrics import GatewayMetrics
from .keyplan import KeyPlan
from .model import ModelRuntime, ModelTable
from .screen import SCREEN_BYTES
from .screener import Screener
from .tenancy import Tenancy, Tenant
from .tokenize import Tokenization, TokenizerError

# Sampling fields our workers implement, sent to them as given (kvwire/openai.py lists
# every field they implement; a request using any other goes to vLLM workers only).
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "stop", "ignore_eos", "min_tokens")


@dataclass(slots=True)
class Prepared:
    """A validated, tokenized, keyed request, ready to route."""

    rid: str
    chat: bool
    tenant: Tenant
    model: ModelRuntime
    model_name: str  # as the client asked
    ids: array[int]
    plan: KeyPlan
    max_tokens: int
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]
    cache_salt: str | None
    t_arrival: float
    created: int
    keys_s: float = 0.0  # seconds spent computing the block keys (part of the routing decision)
    raw: dict[str, Any] | None = None  # the client's body, for pass-through workers
    max_tokens_asked: bool = True  # False: `max_tokens` is the gateway's default, not the client's
    ours_error: ApiError | None = None  # why our own workers cannot serve it (None: they can)
    request_id: str = ""  # the client's X-Request-Id, else `rid`: in logs, and sent to the worker
    lora: str | None = None  # the LoRA adapter asked for as `model` (None: the base model)


class Preparer:
    def __init__(
        self, limits: LimitsConfig, models: ModelTable, tenancy: Tenancy, tokenization: Tokenization,
        metrics: GatewayMetrics,
    ) -> None:
        self.limits = limits
        self.models = models
        self.tenancy = tenancy
        self.tokenization = tokenization
        self.metrics = metrics
        self.screener = Screener()  # large bodies measured before they are decoded
        # request ids: unique, not secret; seeded once so a request costs no getrandom syscall
        self._rid_rng = random.Random(os.urandom(16))

    async def prepare(
        self, chat: bool, body: bytes, headers: Mapping[str, str], tenant: Tenant | None = None
    ) -> Prepared:
        t0 = time.monotonic()
        if tenant is None:
            tenant = self.tenancy.authenticate(headers)
        if len(body) >= SCREEN_BYTES:
            await self._screen(chat, body)
        raw, req, model, prompt, lora = self._decode(chat, body)
        self._check_chars(chat, model, prompt)
        ids = await self._tokenize(chat, model, prompt, req, tenant.id)
        n = len(ids)
        mt = self._check_lengths(chat, req, model, n)
        tk = time.perf_counter()
        plan = model.key_plan(ids, tenant.salt, req.cache_salt, lora)
        keys_s = time.perf_counter() - tk
        sampling = {k: v for k in SAMPLING_FIELDS if (v := getattr(req, k)) is not None}
        include_usage = bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)
        rid = ("chatcmpl-" if chat else "cmpl-") + f"{self._rid_rng.getrandbits(96):024x}"
        return Prepared(
            rid, chat, tenant, model, req.model, ids, plan, mt, req.stream, include_usage, sampling,
            req.cache_salt, t0, int(time.time()), keys_s, raw, requested_max_tokens(req) is not None,
            ours_problem(raw, req, self.limits.max_stop_sequences), client_request_id(headers) or rid, lora,
        )

    def _decode(
        self, chat: bool, body: bytes
    ) -> tuple[dict[str, Any], ChatRequest | CompletionRequest, ModelRuntime, Any, str | None]:
        """The raw body, its typed view, its model, what to key (messages, text or ids), and
        the LoRA adapter the `model` names (None: a model's own name)."""
        raw, req = decode_request(body, chat)
        model, lora = self.models.get(req.model), None
        if model is None:  # an adapter's name: its base model's runtime
            model, lora = self.models.adapter_of(req.model), req.model
        if model is None:
            raise model_not_found(req.model)
        if isinstance(req, ChatRequest):
            return raw, req, model, check_chat(req, self.limits.max_messages), lora
        assert isinstance(req, CompletionRequest)
        return raw, req, model, check_completion(req, model.tokenizer.vocab_size), lora

    async def _screen(self, chat: bool, body: bytes) -> None:
        """A large body's prompt refused for length before the body is decoded (screen.py):
        the same 400s as the checks after decoding, without building what they refuse."""
        size = await self.screener.measure(body, chat)
        model = self.models.get(size.model) if size is not None else None
        if size is None or model is None:
            return
        if size.messages is not None and size.messages > self.limits.max_messages:
            raise bad_request(f"At most {self.limits.max_messages} messages are allowed.", "messages")
        if size.ids is not None:
            self._refuse_tokens(chat, model, size.ids)
        if size.chars is not None:
            self._refuse_chars(chat, model, size.chars)

    def _check_chars(self, chat: bool, model: ModelRuntime, prompt: Any) -> None:
        """Refuse, unread, a prompt whose characters alone prove it longer than the limit: no
        token spans more than `max_token_chars` characters, so this costs no tokenization."""
        if chat:
            chars = sum(len(m["content"]) for m in prompt)
        elif isinstance(prompt, str):
            chars = len(prompt)
        else:
            return  # token ids: counted exactly, for free
        self._refuse_chars(chat, model, chars)

    def _refuse_tokens(self, chat: bool, model: ModelRuntime, n: int) -> None:
        max_prompt = self._max_prompt(model)
        if n >= max_prompt:
            raise bad_request(
                f"This model's maximum context length is {model.max_context} tokens and prompts are limited to "
                f"{max_prompt - 1} tokens; your prompt has {n} tokens.",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )

    def _refuse_chars(self, chat: bool, model: ModelRuntime, chars: int) -> None:
        limit = self._max_prompt(model)
        if chars > limit * model.tokenizer.max_token_chars:
            raise bad_request(
                f"The prompt has {chars} characters, more than {limit - 1} tokens can hold; this model's "
                f"prompts are limited to {limit - 1} tokens.", "messages" if chat else "prompt",
                "context_length_exceeded")

    def _max_prompt(self, model: ModelRuntime) -> int:
        ctx = model.max_context
        return min(self.limits.max_prompt_tokens or ctx, ctx)

    async def _tokenize(
        self, chat: bool, model: ModelRuntime, prompt: Any, req: ChatRequest | CompletionRequest, scope: str
    ) -> array[int]:
        tok = model.tokenizer
        tt = time.perf_counter()
        try:
            if chat:
                # Tools enter the rendering as the worker's template will render them.
                extra = {"tools": req.tools} if isinstance(req, ChatRequest) and req.tools else {}
                ids = await self.tokenization.encode_chat(tok, prompt, extra, scope)
            elif isinstance(prompt, str):
                ids = await self.tokenization.encode_text(tok, prompt, True, scope)
            else:
                ids = prompt
        except TokenizerError as e:
            raise bad_request(str(e), "messages" if chat else "prompt") from None
        self.metrics.child(self.metrics.tokenize, model.id).observe(time.perf_counter() - tt)
        return ids

    def _check_lengths(self, chat: bool, req: ChatRequest | CompletionRequest, model: ModelRuntime, n: int) -> int:
        """The request's max_tokens, after checking prompt and completion fit the context."""
        lim = self.limits
        ctx = model.max_context
        if n == 0:
            raise bad_request("The prompt is empty after tokenization.", "prompt")
        self._refuse_tokens(chat, model, n)
        asked = requested_max_tokens(req)
        # without a max, the gateway's default length, never below the client's minimum
        mt = asked if asked is not None else max(min(lim.default_max_tokens, ctx - n), req.min_tokens or 0)
        if n + mt > ctx:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens. However, you requested {n + mt} tokens "
                f"({n} in the prompt, {mt} for the completion). Please reduce the prompt or the completion length.",
                "max_tokens" if asked is not None else "min_tokens",
                "context_length_exceeded",
            )
        return mt
