"""Per-request usage as the worker reports it (docs/wire.md `usage` + the `kv` extension).

Shared by every engine: the router calibrates its cost model from these numbers, so
both engines must fill them the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOAD_TIERS: tuple[str, ...] = ("GPU", "CPU", "DISK", "REMOTE", "PEER")


def _zero_tiers() -> dict[str, int]:
    return dict.fromkeys(LOAD_TIERS, 0)


@dataclass(slots=True)
class Usage:
    """Token counts and timings of one request.

    `loaded_tokens[tier]`: prompt tokens whose KV came from that tier (GPU = already
    resident); `cached_tokens` is their sum (OpenAI's `prompt_tokens_details.cached_tokens`);
    `recomputed_tokens` = prompt tokens prefilled; `prefetched_tokens`: of the loaded ones,
    those a `/kv/prefetch` had already raised. Times in ms: queue (arrival → scheduled),
    load (scheduled → KV loads done), prefill (loads done → first token), ttft, decode
    (first → last token).
    """

    prompt_tokens: int
    completion_tokens: int = 0
    loaded_tokens: dict[str, int] = field(default_factory=_zero_tiers)
    recomputed_tokens: int = 0
    prefetched_tokens: int = 0
    queue_ms: float = 0.0
    load_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0

    @property
    def cached_tokens(self) -> int:
        return sum(self.loaded_tokens.values())

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI `usage` object with `prompt_tokens_details` and the `kv` extension."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "kv": {
                "loaded_tokens": dict(self.loaded_tokens),
                "recomputed_tokens": self.recomputed_tokens,
                "prefetched_tokens": self.prefetched_tokens,
                "queue_ms": round(self.queue_ms, 3),
                "load_ms": round(self.load_ms, 3),
                "prefill_ms": round(self.prefill_ms, 3),
                "ttft_ms": round(self.ttft_ms, 3),
                "decode_ms": round(self.decode_ms, 3),
            },
        }
