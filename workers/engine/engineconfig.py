"""What an engine is asked to be (`EngineConfig`), and the size of its KV pool from it.

The pool is sized once at start: from `num_blocks`, `kv_bytes`, or the device (most of the
free CUDA memory after the weights, or a fixed 512 MiB of host memory on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import LoadedModel
from .tierstate import TierConfig

ROLES = ("prefill", "decode", "both")
CPU_DEFAULT_KV_BYTES = 512 << 20
CUDA_KV_FRACTION = 0.85  # of the device memory free after loading the weights...
CUDA_RESERVE_BYTES = 1 << 30  # ...minus room for activations


@dataclass(frozen=True, slots=True)
class EngineConfig:
    worker_id: str = "w0"
    block_size: int = 16
    num_blocks: int | None = None  # exclusive with kv_bytes; neither: a device default
    kv_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_waiting: int = 64
    parallel: str = "tp1"
    tiers: TierConfig | None = None  # CPU / DISK / REMOTE below the pool, peer pulls; None: GPU only
    # Prefill/decode disaggregation (docs/engine.md § Prefill/decode roles): what this worker
    # is for ("prefill", "decode" or "both"), and how long a prefill keeps the prompt's blocks
    # pinned for the decode worker to pull them.
    role: str = "both"
    pd_pin_s: float = 30.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"unknown worker role {self.role!r}; choose one of: {', '.join(ROLES)}")
        if not self.pd_pin_s > 0:
            raise ValueError("pd_pin_s must be positive")



def resolve_num_blocks(cfg: EngineConfig, lm: LoadedModel) -> int:
    """Pool size from `num_blocks`, `kv_bytes`, or the device: most of the free CUDA memory, or
    a fixed 512 MiB of host memory on CPU."""
    block_bytes = lm.kv.token_bytes * cfg.block_size
    if cfg.num_blocks is not None and cfg.kv_bytes is not None:
        raise ValueError("give num_blocks or kv_bytes, not both")
    if cfg.num_blocks is not None:
        n = cfg.num_blocks
    elif cfg.kv_bytes is not None:
        n = cfg.kv_bytes // block_bytes
    elif lm.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(lm.device)
        n = int(free * CUDA_KV_FRACTION - CUDA_RESERVE_BYTES) // block_bytes
    else:
        n = CPU_DEFAULT_KV_BYTES // block_bytes
    if n < 1:
        raise ValueError(f"the KV pool holds no block ({block_bytes} bytes each): give more kv_bytes / num_blocks")
    return int(n)
