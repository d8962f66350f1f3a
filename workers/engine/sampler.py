"""Picking the next token from the last logits: greedy, or sampled with temperature and top-p.

Greedy rows are one batched argmax. A sampled row draws from its own request's
`torch.Generator`, seeded from the request's `seed` (or at random), so a seeded request
gives the same tokens whatever it is batched with, and across runs.

`min_tokens` (vLLM's): while a request has generated fewer tokens, its EOS tokens' logits
are -inf, so it cannot end on one (unless `ignore_eos`, where EOS ends nothing anyway).
Log-probabilities, when asked, are those of the model's logits as the sampler received
them, before that mask and before temperature and top-p: vLLM's default
`logprobs_mode` ("raw_logprobs").
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from workers.api import TokenLogprob

from .sequence import Sequence


class Sampler:
    def __init__(self, eos_ids: Iterable[int] = ()) -> None:
        self.eos_ids = sorted(eos_ids)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per sequence from `logits` [len(seqs), vocab] (left as they are)."""
        logits = self._mask_eos(seqs, logits)
        out = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                out[row] = self._draw(seq, logits[row])
        return [int(t) for t in out]

    def _mask_eos(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """`logits`, or a copy with EOS at -inf in the rows of sequences short of their min_tokens."""
        rows = [i for i, s in enumerate(seqs) if s.num_output < s.params.min_tokens and not s.params.ignore_eos]
        if not rows or not self.eos_ids:
            return logits
        masked = logits.clone()
        r = torch.tensor(rows, device=logits.device)[:, None]
        c = torch.tensor(self.eos_ids, device=logits.device)[None, :]
        masked[r, c] = float("-inf")
        return masked

    def logprobs(self, seqs: list[Sequence], logits: torch.Tensor, tokens: list[int]) -> dict[int, TokenLogprob]:
        """Row -> the sampled token's log-probability and the `params.logprobs` most likely
        tokens', for the rows whose request asked (log_softmax of the unprocessed logits)."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        if not rows:
            return {}
        lp = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen = lp[torch.arange(len(rows), device=lp.device), torch.tensor([tokens[i] for i in rows],
                                                                             device=lp.device)].tolist()
        kmax = max(seqs[i].params.logprobs or 0 for i in rows)
        top_v: list[list[float]] = []
        top_i: list[list[int]] = []
        if kmax:
            v, ix = lp.topk(kmax, dim=-1)
            top_v, top_i = v.tolist(), ix.tolist()
        out = {}
        for j, i in enumerate(rows):
            k = seqs[i].params.logprobs or 0
            top = list(zip(top_i[j][:k], top_v[j][:k], strict=True)) if k else []
            out[i] = TokenLogprob(float(chosen[j]), top)
        return out

    def _draw(self, seq: Sequence, logits: torch.Tensor) -> int:
        p = seq.params
        gen = seq.generator
        if gen is None:
            gen = seq.generator = torch.Generator(device=logits.device)
            if p.seed is None:
                gen.seed()
            else:
                gen.manual_seed(p.seed)
        probs = torch.softmax(logits.float() / p.temperature, dim=-1)
        if p.top_p < 1.0:
            probs = _top_p(probs, p.top_p)
        return int(torch.multinomial(probs, 1, generator=gen).item())


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The smallest set of most likely tokens whose mass reaches `top_p`, renormalised."""
    sorted_p, idx = probs.sort(descending=True)
    before = sorted_p.cumsum(0) - sorted_p  # mass of the tokens ranked above each one
    sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
    kept = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return kept / kept.sum()
