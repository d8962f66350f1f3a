"""Helpers to build small profiles and drive engines on a virtual clock (tests, scenarios).

`make_profile` gives a profile with round numbers and tiny capacities (counted in
blocks) so that evictions, cascades and queueing happen with a handful of requests;
`drain` runs an engine (or several) until nothing is left to do.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from .engine import SimEngine
from .profile import (
    ComputeModel,
    DeviceMemory,
    KVGeometry,
    LinkSpec,
    SchedulerSpec,
    SimProfile,
    TierSpec,
)

TEST_GEOMETRY = KVGeometry(layers=1, kv_heads=1, head_dim=8, dtype_bytes=2)  # 32 B per token


def make_profile(
    *,
    name: str = "test",
    block_size: int = 4,
    gpu_blocks: int = 64,
    cpu_blocks: int = 0,
    disk_blocks: int = 0,
    remote_blocks: int = 0,
    peer: bool = True,
    admit_after_uses: int = 1,
    admit_window_s: float = 600.0,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_waiting: int = 64,
    prefetch_queue: int = 8,
    max_context_tokens: int = 4096,
    compute: ComputeModel | None = None,
    cpu_Bps: float = 1e6,
    disk_Bps: float = 2e5,
    remote_Bps: float = 1e5,
    peer_Bps: float = 5e5,
    latency_s: float = 0.001,
    remote_write: str = "evict",
) -> SimProfile:
    bb = TEST_GEOMETRY.bytes_per_token * block_size
    comp = compute or ComputeModel(
        prefill_tokens_per_s=1000.0,
        prefill_attn_s_per_token2=1e-6,
        prefill_overhead_s=0.002,
        decode_base_s=0.01,
        decode_per_seq_s=0.001,
        decode_per_ctx_token_s=1e-6,
    )

    def tier(blocks: int, bps: float, admit_after_uses: int = 1, admit_window_s: float = 600.0) -> TierSpec | None:
        if not blocks:
            return None
        return TierSpec(blocks * bb, bps, latency_s, admit_after_uses=admit_after_uses, admit_window_s=admit_window_s)

    return SimProfile(
        name=name,
        model="test/model",
        geometry=TEST_GEOMETRY,
        memory=DeviceMemory(device_bytes=gpu_blocks * bb, memory_utilization=1.0, weights_bytes=0.0),
        compute=comp,
        block_size=block_size,
        max_context_tokens=max_context_tokens,
        scheduler=SchedulerSpec(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_waiting=max_waiting,
            prefetch_queue=prefetch_queue,
        ),
        cpu=tier(cpu_blocks, cpu_Bps),
        disk=tier(disk_blocks, disk_Bps, admit_after_uses=admit_after_uses, admit_window_s=admit_window_s),
        remote=tier(remote_blocks, remote_Bps),
        peer=LinkSpec(read_Bps=peer_Bps, latency_s=latency_s) if peer else None,
        remote_write=remote_write,  # type: ignore[arg-type]
    )


def drain(engines: SimEngine | Iterable[SimEngine], until: float = math.inf) -> float:
    """Advance engines in global time order until idle (or `until`); returns the last time."""
    engs = [engines] if isinstance(engines, SimEngine) else list(engines)
    last = -math.inf
    while True:
        best = None
        bt = math.inf
        for e in engs:
            t = e.next_event_time()
            if t is not None and t < bt:
                bt, best = t, e
        if best is None or bt > until:
            return last
        best.advance(bt)
        last = bt
