"""Picking the next token from the last logits: greedy, or sampled with temperature and top-p.

Greedy rows are one batched argmax. A sampled row draws from its own request's
`torch.Generator`, seeded from the request's `seed` (or at random), so a seeded request
gives the same tokens whatever it is batched with, and across runs.
"""
from __future__ import annotations

import torch

from .sequence import Sequence


class Sampler:
    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per sequence from `logits` [len(seqs), vocab]."""
        out = logits.argmax(dim=-1).tolist()
        for row, seq in enumerate(seqs):
            if not seq.params.greedy:
                out[row] = self._draw(seq, logits[row])
        return [int(t) for t in out]

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
