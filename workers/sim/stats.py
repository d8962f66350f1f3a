"""The simulated engine's counters: one object shared by its scheduler and its loader,
read by /metrics (workers/sim/driver.py), benchmarks and tests."""
from __future__ import annotations

from dataclasses import dataclass, field


def _per_lower_tier() -> dict[str, int]:
    return dict.fromkeys(("CPU", "DISK", "REMOTE", "PEER"), 0)


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters of one simulated worker."""

    submitted: int = 0
    finished: int = 0
    cancelled: int = 0
    rejected_too_large: int = 0
    rejected_queue_full: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    loaded_blocks: dict[str, int] = field(default_factory=_per_lower_tier)
    steps: int = 0
    prefetch_requests: int = 0
    prefetch_blocks_accepted: int = 0
    prefetch_blocks_landed: int = 0
    prefetch_transfers_dropped: int = 0
