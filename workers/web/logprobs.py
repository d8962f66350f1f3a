"""Log-probabilities as vLLM's OpenAI server writes them, from the engine's `TokenLogprob`s.

Chat (`logprobs: true`, `top_logprobs: k`): per choice `{"content": [entry, ...]}`, an
entry per generated token `{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}, ...]}` with the k most likely tokens, best first. Completions
(`logprobs: k`): the legacy `{"text_offset", "token_logprobs", "tokens", "top_logprobs"}`,
where each `top_logprobs` item maps the sampled token and the k most likely to their
logprob (k or k + 1 entries). A token's string is the tokenizer's decoding of it alone;
`bytes` its UTF-8; a logprob of -inf is written -9999.0, as vLLM does (JSON has no
infinity).
"""
from __future__ import annotations

from typing import Any

from workers.api import MAX_LOGPROBS, Tokenizer, TokenLogprob

__all__ = ["MAX_LOGPROBS", "TokenText"]

_FLOOR = -9999.0


def _lp(v: float) -> float:
    return v if v > _FLOOR else _FLOOR


class TokenText:
    """One response's token strings (decoded once per distinct id) and logprob objects."""

    __slots__ = ("_decode", "_strs", "offset")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = tokenizer.decode
        self._strs: dict[int, str] = {}
        self.offset = 0  # completions' text_offset of the next token

    def token(self, tid: int) -> str:
        s = self._strs.get(tid)
        if s is None:
            s = self._strs[tid] = self._decode([tid])
        return s

    def _one(self, tid: int, v: float) -> dict[str, Any]:
        s = self.token(tid)
        return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}

    def chat(self, ids: list[int], lps: list[TokenLogprob]) -> list[dict[str, Any]]:
        """Chat's `logprobs.content` entries of `ids`."""
        out = []
        for tid, lp in zip(ids, lps, strict=True):
            e = self._one(tid, lp.logprob)
            e["top_logprobs"] = [self._one(t, v) for t, v in lp.top]
            out.append(e)
        return out

    def legacy(self, ids: list[int], lps: list[TokenLogprob]) -> dict[str, Any]:
        """Completions' logprobs object of `ids`, its `text_offset` going on from `offset`
        (the characters of the text before them) and moving it past them."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for tid, lp in zip(ids, lps, strict=True):
            s = self.token(tid)
            tokens.append(s)
            logprobs.append(_lp(lp.logprob))
            top = {s: _lp(lp.logprob)}
            for t, v in lp.top:
                top.setdefault(self.token(t), _lp(v))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(s)
        return {"text_offset": offsets, "token_logprobs": logprobs, "tokens": tokens, "top_logprobs": tops}
