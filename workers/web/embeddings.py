"""POST /v1/embeddings in OpenAI's shape, for an engine that embeds (workers.api.Embeds).

Texts are tokenized as a completion prompt is (prompts.py's rules: the engine's
tokenizer, its special tokens), token ids are taken as given; each input becomes one
vector, `float` lists or `base64` of little-endian float32 (what OpenAI's SDK asks
for by default), with usage counting the tokens.
"""
from __future__ import annotations

import base64
import struct
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from workers.api import Embeds, Tokenizer
from workers.errors import BadRequest, RequestTooLarge
from workers.schema import EmbeddingBody

from .common import Limits, ServedModels, Unsupported, json_response, read_body
from .prompts import check_ids

_DEC = msgspec.json.Decoder(EmbeddingBody)
_FORMATS = ("float", "base64")


class EmbeddingHandlers:
    """POST /v1/embeddings over one engine."""

    def __init__(self, engine: Embeds, tokenizer: Tokenizer, models: ServedModels, limits: Limits) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.models = models
        self.limits = limits

    async def embeddings(self, request: Request) -> Response:
        b = _DEC.decode(await read_body(request, self.limits.max_body_bytes))
        name = self.models.resolve(b.model)
        fmt = b.encoding_format or "float"
        if fmt not in _FORMATS:
            raise Unsupported("encoding_format", f"encoding_format={fmt!r}")
        data: list[dict[str, Any]] = []
        tokens = 0
        for i, ids in enumerate(self._inputs(b.input)):
            try:
                vec = self.engine.embed(ids, b.dimensions)
            except ValueError as e:
                raise BadRequest(str(e), param="dimensions") from None
            tokens += len(ids)
            out: Any = vec if fmt == "float" else base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": out})
        return json_response({"object": "list", "data": data, "model": name,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _inputs(self, inp: str | list[str | int | list[int]]) -> list[list[int]]:
        """Each input's token ids, checked against the context."""
        if isinstance(inp, str):
            seqs = [self.tokenizer.encode(inp)]
        elif not inp:
            raise BadRequest("the input is empty", param="input")
        elif all(isinstance(x, str) for x in inp):
            seqs = [self.tokenizer.encode(x) for x in inp if isinstance(x, str)]
        elif all(isinstance(x, int) for x in inp):
            seqs = [[x for x in inp if isinstance(x, int)]]
        elif all(isinstance(x, list) for x in inp):
            seqs = [x for x in inp if isinstance(x, list)]
        else:
            raise BadRequest("input must be a text, texts, token ids or lists of token ids, not a mix",
                             param="input")
        ctx = self.limits.max_context_tokens
        for ids in seqs:
            check_ids(ids, self.tokenizer.max_token_id, "input")
            if ctx and len(ids) > ctx:
                raise RequestTooLarge(f"an input has {len(ids)} tokens, more than the model's context ({ctx})",
                                      param="input")
        return seqs
