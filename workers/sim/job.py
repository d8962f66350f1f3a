"""A request as the caller hands it to the simulated engine (`SimRequest`) and as the
engine tracks it from arrival to its last token (`Job`, in one `Phase` at a time).

Kept apart from the scheduler so that the loader and the engine can name a request's
state without depending on how requests are scheduled.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from workers.usage import Usage


@dataclass
class SimRequest:
    """One generation. `keys` (full-block keys) are the fast path; without them the engine
    computes keys from `token_ids`; with neither nothing of the prompt is cacheable.
    Callbacks are described in docs/sim-engine.md § Callbacks."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    keys: list[bytes] | None = None
    token_ids: Sequence[int] | None = None
    cache_salt: str | None = None
    shared_prefix_blocks: int = 0
    lora: str | None = None
    on_first_token: Callable[[float, Usage], None] | None = None
    on_tokens: Callable[[float, int], None] | None = None
    on_finish: Callable[[float, Usage], None] | None = None
    on_error: Callable[[float, str], None] | None = None


class Phase(IntEnum):
    WAITING = 0  # queued, nothing allocated
    LOADING = 1  # scheduled: blocks reserved, cached prefix being loaded into GPU
    PREFILL = 2  # prompt being computed in chunks
    DECODE = 3  # generating
    DONE = 4


@dataclass(slots=True, eq=False)
class Job:
    """One request inside the engine."""

    req: SimRequest
    rid: str
    prompt: int
    max_tokens: int
    keys: list[bytes]
    cacheable: int  # leading blocks that may be taken from cache (never the whole prompt)
    extra: list[tuple[Any, ...] | None] | None
    salt: str | None
    salt_from: int
    arrival: float
    usage: Usage
    phase: Phase = Phase.WAITING
    gpu_hint: int = 0  # leading blocks found on GPU at arrival (queue estimate only)
    cached_hint: int = 0  # leading blocks found in any tier at arrival: loaded, not computed (same)
    computed: int = 0  # prompt tokens whose KV is (or, once loads land, will be) present
    generated: int = 0
    pinned: list[bytes] = field(default_factory=list)
    anon: int = 0
    pending: int = 0  # loads not landed yet
    load_from: int = 0  # blocks [load_from, load_to) are loaded (or awaited) from below GPU
    load_to: int = 0
    loads: list[tuple[str, list[bytes], bool]] = field(default_factory=list)  # (tier, keys, prefetched)
    cut: bool = False  # a purge or a damaged block shortened the loads or the keyed chain
    scheduled_at: float = math.nan
    loaded_at: float = math.nan
    first_at: float = math.nan
    streaming: bool = False  # has an on_tokens callback: decode step by step
    tokens: Sequence[int] = ()  # the prompt's token ids when given (published with its blocks)

    def blocks_needed(self, block_size: int) -> int:
        """GPU blocks the request reserves when scheduled: its prompt and every token it may generate."""
        return -(-(self.prompt + self.max_tokens) // block_size)

    def tokens_left(self) -> int:
        return self.max_tokens - self.generated
