"""`GET /load`: what a worker reports about its queue, its blocks and its speeds.

One struct for the engine that writes it, the gateway that polls it and the offline
simulator that models the gateway, so the three cannot drift apart. Unknown fields
are ignored on decode (a newer worker may add some).
"""
from __future__ import annotations

import msgspec


class BlockCounts(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """Blocks of one tier: `capacity` 0 means unknown (then used + free)."""

    used: int = 0
    free: int = 0
    capacity: int = 0

    @property
    def total(self) -> int:
        return self.capacity or self.used + self.free


class Speeds(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """Prefill of `n` new tokens after `c` cached ones takes
    `prefill_overhead_s + n / prefill_tokens_per_s + prefill_attn_s_per_token2 * n * (c + n / 2)`;
    a decode step of the current batch takes `decode_step_s`. None = not measured."""

    prefill_tokens_per_s: float | None = None
    prefill_attn_s_per_token2: float | None = None
    prefill_overhead_s: float | None = None
    decode_step_s: float | None = None


class TierLink(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """How fast KV moves from a tier into GPU memory: `bytes / read_Bps + latency_s`."""

    read_Bps: float
    latency_s: float = 0.0


class LoadReport(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    """The `/load` body (docs/wire.md). Tier names key `blocks` and `tiers`."""

    worker_id: str = ""
    ts: float = 0.0
    waiting_requests: int = 0
    waiting_prefill_tokens: int = 0
    running_requests: int = 0
    running_prefill_tokens: int = 0
    est_queue_s: float = 0.0
    blocks: dict[str, BlockCounts] = {}
    speeds: Speeds | None = None
    tiers: dict[str, TierLink] = {}
    prefetch_queue: int = 0
    max_waiting: int | None = None
    block_size: int | None = None
    profile: str | None = None


load_report_decoder = msgspec.json.Decoder(LoadReport)
