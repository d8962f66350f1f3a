"""T_prefill: computing the prompt tokens that are not loaded from cache.

Linear in the new tokens plus an attention term that grows with the context each new
token attends to (the cached tokens and the new ones before it), plus a per-request
overhead: the wire formula of docs/wire.md (/load speeds), the same one a worker's
measured speeds are fitted to, so prediction and measurement use one shape.
"""
from __future__ import annotations

from ..types import CostParams


def prefill_seconds(cost: CostParams, new_tokens: int, cached_tokens: int, scale: float = 1.0) -> float:
    """The wire formula (docs/wire.md /load speeds): prefill `new_tokens` after `cached_tokens`."""
    n = new_tokens
    t = cost.prefill_overhead_s + n / cost.prefill_tokens_per_s
    t += cost.prefill_attn_s_per_token2 * n * (cached_tokens + n * 0.5)
    return t * scale
