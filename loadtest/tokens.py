"""Deterministic token ids for a trace's block ids, with prefix sharing kept exact.

Each block id `h` becomes `block_tokens` token ids; a request's prompt is the
concatenation of its ids' blocks, the last one cut to the prompt's length (a
partial last block is a prefix of that id's block). So two prompts share exactly
the tokens their id lists share.

Why the sharing survives at any fleet block size B: the keys of B-token blocks
chain, so two prompts share exactly floor(LCP / B) fleet blocks, LCP being the
length of their longest common token prefix. Where two id lists first differ, the
two ids follow the same parent id (trace ids are prefix-chained: an id determines
its whole prefix), and the first token of every block is a *sibling
discriminator*: the id's rank among the children of its parent, in order of first
appearance. Siblings therefore differ at their very first token, the LCP is
exactly what the ids say, and so is the fleet's sharing, whether B divides the
trace block (16 into 512), is a multiple of it, or neither. The guarantee needs
fewer than `vocab_size - reserved` children per parent; `TokenSynth.for_trace`
counts the parents that exceed it (`overflow_parents`; 0 on the Mooncake trace,
whose widest fan-out is 3,627). Tokens 1..3 carry `h` itself in base
`vocab_size - reserved`, and the rest come from a seeded random table, so blocks
look like varied text to an engine.

Token ids lie in [reserved, vocab_size): the gateway checks ids against its
tokenizer's vocabulary, and the low ids are often special tokens.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .trace import Trace, TraceError, TraceRequest

_TABLE = 1 << 16
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class TokenSynth:
    """Block id → token ids (see the module doc)."""

    def __init__(
        self,
        block_tokens: int,
        *,
        vocab_size: int = 8192,
        seed: int = 0,
        reserved: int = 16,
        discriminators: Mapping[int, int] | None = None,
    ) -> None:
        if block_tokens <= 0:
            raise TraceError("block_tokens must be positive")
        if reserved < 0 or vocab_size - reserved < 2:
            raise TraceError(f"vocab_size {vocab_size} leaves no room above {reserved} reserved ids")
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self.reserved = reserved
        self.span = vocab_size - reserved
        self._disc: Mapping[int, int] = discriminators or {}
        self.overflow_parents = 0
        rng = np.random.default_rng(seed)
        self._table = rng.integers(reserved, vocab_size, size=_TABLE + block_tokens, dtype=np.uint32)

    @classmethod
    def for_trace(cls, trace: Trace, *, vocab_size: int = 8192, seed: int = 0, reserved: int = 16) -> TokenSynth:
        """A synthesiser whose sibling discriminators come from `trace`'s prefix tree."""
        span = vocab_size - reserved
        disc: dict[int, int] = {}
        fanout: dict[int, int] = {}
        root = -1
        for r in trace.requests:
            parent = root
            for h in r.hash_ids:
                if h not in disc:
                    n = fanout.get(parent, 0)
                    disc[h] = n
                    fanout[parent] = n + 1
                parent = h
        synth = cls(trace.block_tokens, vocab_size=vocab_size, seed=seed, reserved=reserved, discriminators=disc)
        synth.overflow_parents = sum(1 for n in fanout.values() if n > span)
        return synth

    def block(self, h: int) -> np.ndarray:
        """The `block_tokens` token ids of block id `h` (uint32)."""
        bt = self.block_tokens
        mixed = _mix64(h ^ (self.seed * 0x9E3779B1))
        off = mixed % _TABLE
        b = self._table[off : off + bt].copy()
        r, span = self.reserved, self.span
        d = self._disc.get(h)
        b[0] = r + ((d if d is not None else mixed >> 16) % span)
        x = h
        for i in range(1, min(bt, 4)):
            b[i] = r + x % span
            x //= span
        return b

    def tokens(self, req: TraceRequest) -> np.ndarray:
        """The request's prompt as uint32 token ids (`input_length` of them)."""
        if not req.hash_ids:
            raise TraceError(f"request {req.index} has no hash_ids")
        bt = self.block_tokens
        if len(req.hash_ids) * bt < req.input_length:
            raise TraceError(
                f"request {req.index}: {len(req.hash_ids)} blocks of {bt} cannot cover {req.input_length} tokens"
            )
        out = np.concatenate([self.block(h) for h in req.hash_ids])
        return out[: req.input_length]

    def token_list(self, req: TraceRequest) -> list[int]:
        ids: list[int] = self.tokens(req).tolist()  # numpy types `tolist()` as Any
        return ids

    def token_bytes(self, req: TraceRequest) -> bytes:
        """u32 little-endian bytes, the form kvindex hashes (no list of ints built)."""
        return self.tokens(req).astype("<u4", copy=False).tobytes()
