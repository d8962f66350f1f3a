"""Copies into the device pool for one link thread.

On a CPU device a copy is direct. On CUDA it goes through the link's own stream, staging
bytes in pinned memory, waiting first for the offload copies of the blocks it overwrites
(`begin`), and synchronised before the blocks are used (`finish`).
"""
from __future__ import annotations

from typing import Any

import torch

from .blockio import write_block
from .kvpool import KVPool


class Copier:
    """See the module doc. One per link thread: not shared between threads."""

    STAGING = 32

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.cuda = pool.device.type == "cuda"
        self.stream: Any = None
        self.staging: torch.Tensor | None = None
        self.used = 0
        if self.cuda:
            self.stream = torch.cuda.Stream(pool.device)  # type: ignore[no-untyped-call]
            self.staging = torch.empty((self.STAGING, *pool.data.shape[1:]), dtype=pool.data.dtype, pin_memory=True)

    def begin(self, after: Any) -> None:
        if self.cuda and after is not None:
            self.stream.wait_event(after)

    def from_host(self, dst: int, src: torch.Tensor) -> None:
        if not self.cuda:
            self.pool.data[dst].copy_(src)
            return
        with torch.cuda.stream(self.stream):
            self.pool.data[dst].copy_(src, non_blocking=True)

    def from_bytes(self, dst: int, payload: bytes) -> None:
        if not self.cuda:
            write_block(self.pool.data[dst], payload)
            return
        assert self.staging is not None
        if self.used == self.STAGING:
            self.stream.synchronize()
            self.used = 0
        buf = self.staging[self.used]
        self.used += 1
        write_block(buf, payload)
        with torch.cuda.stream(self.stream):
            self.pool.data[dst].copy_(buf, non_blocking=True)

    def finish(self) -> None:
        if self.cuda:
            self.stream.synchronize()
            self.used = 0
