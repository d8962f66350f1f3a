"""OpenAI's and vLLM's model endpoints, so any OpenAI-compatible router (sglang-router,
vllm-router) can front a kvroute fleet: GET /v1/models (+ /{model_id}), and POST
/tokenize, /detokenize in vLLM's shapes. Tokenizing goes through prompts.py with the
engine's tokenizer, exactly as the generation routes do, so the ids are the same.
"""
from __future__ import annotations

import time
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from workers.api import Tokenizer
from workers.errors import BadRequest
from workers.schema import DetokenizeBody, TokenizeBody

from .common import Limits, ServedModels, Unsupported, decode_object, json_response, read_body
from .prompts import chat_messages, check_ids, refuse_non_text

_DEC_DETOKENIZE = msgspec.json.Decoder(DetokenizeBody)


class ModelHandlers:
    """GET /v1/models, GET /v1/models/{model_id}, POST /tokenize, POST /detokenize."""

    def __init__(self, tokenizer: Tokenizer, models: ServedModels, limits: Limits) -> None:
        self.tokenizer = tokenizer
        self.models = models
        self.limits = limits
        self.created = int(time.time())

    def _card(self, name: str) -> dict[str, Any]:
        m = self.models
        parent = m.adapters.get(name)
        if parent is not None:  # a LoRA adapter, listed as vLLM lists one: `parent` names its base model
            return {"id": name, "object": "model", "created": self.created, "owned_by": "kvroute", "root": name,
                    "parent": parent, "max_model_len": None}
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kvroute", "root": m.root,
                "parent": None, "max_model_len": m.max_model_len}

    async def list_models(self, request: Request) -> Response:
        names = [*self.models.names, *self.models.adapters]
        return json_response({"object": "list", "data": [self._card(n) for n in names]})

    async def get_model(self, request: Request) -> Response:
        return json_response(self._card(self.models.resolve(request.path_params["model_id"])))

    async def tokenize(self, request: Request) -> Response:
        d = decode_object(await read_body(request, self.limits.max_body_bytes))
        chat = d.get("messages") is not None
        refuse_non_text(d.get("messages"))
        b = msgspec.convert(d, TokenizeBody)
        self.models.resolve(b.model)
        _refuse_unless(not b.return_token_strs, "return_token_strs", "return_token_strs=true")
        ids = self._chat_ids(b) if chat else self._prompt_ids(b)
        return json_response({"count": len(ids), "max_model_len": self.models.max_model_len, "tokens": ids})

    def _prompt_ids(self, b: TokenizeBody) -> list[int]:
        """A completion prompt: encoded with the special tokens, as /v1/completions does."""
        if b.prompt is None:
            raise BadRequest("send prompt (text) or messages", param="prompt")
        special = b.add_special_tokens is not False
        _refuse_unless(special, "add_special_tokens", "add_special_tokens=false with a prompt")
        return self.tokenizer.encode(b.prompt)

    def _chat_ids(self, b: TokenizeBody) -> list[int]:
        """Chat messages: the template with the generation prompt, as /v1/chat/completions does."""
        if b.prompt is not None:
            raise BadRequest("send prompt or messages, not both", param="prompt")
        _refuse_unless(not b.add_special_tokens, "add_special_tokens", "add_special_tokens=true with messages")
        _refuse_unless(b.add_generation_prompt, "add_generation_prompt", "add_generation_prompt=false")
        _refuse_unless(not b.continue_final_message, "continue_final_message", "continue_final_message=true")
        return self.tokenizer.apply_chat_template(chat_messages(b.messages or []))

    async def detokenize(self, request: Request) -> Response:
        b = _DEC_DETOKENIZE.decode(await read_body(request, self.limits.max_body_bytes))
        self.models.resolve(b.model)
        check_ids(b.tokens, self.tokenizer.max_token_id, "tokens", allow_empty=True)
        return json_response({"prompt": self.tokenizer.decode(b.tokens) if b.tokens else ""})


def _refuse_unless(ok: bool, field: str, what: str) -> None:
    """The tokenizer applies one value of each option (the one the generation routes use)."""
    if not ok:
        raise Unsupported(field, what)
