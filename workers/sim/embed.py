"""Deterministic embedding vectors for the simulated engine.

The simulated worker models an engine's timing, not its weights, but a client of
`/v1/embeddings` needs vectors that behave like embeddings: the same text always gives
the same vector, texts sharing tokens are closer than strangers, every vector has unit
length. Each token id is hashed into a fixed pseudo-random vector (splitmix64 per
coordinate, so any u32 id works without a table), a text's vector is the normalised
mean of its tokens' vectors.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DIMS = 64
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _MIX1
    x = x ^ (x >> np.uint64(27))
    x = x * _MIX2
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def token_vectors(ids: Sequence[int], dims: int = DIMS) -> np.ndarray:
    """One pseudo-random vector per token id, each coordinate uniform in [-1, 1)."""
    t = np.asarray(ids, dtype=np.uint64)[:, None]
    j = np.arange(dims, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        h = _splitmix(t * _GOLDEN + j + np.uint64(1))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 52) - 1.0


def embed(ids: Sequence[int], dimensions: int | None = None) -> np.ndarray:
    """The unit vector of a token sequence; `dimensions`: its first coordinates only,
    normalised again (as models trained for shortened embeddings answer)."""
    if not ids:
        raise ValueError("no tokens to embed")
    dims = DIMS if dimensions is None else dimensions
    if not 1 <= dims <= DIMS:
        raise ValueError(f"dimensions must be in [1, {DIMS}]")
    v = token_vectors(ids, DIMS).mean(axis=0)[:dims]
    n = float(np.linalg.norm(v))
    out: np.ndarray = (v / n if n > 0 else v).astype(np.float32)
    return out
