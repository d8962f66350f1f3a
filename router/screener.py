"""Where a large body is screened (screen.py): in a helper process when it is very large.

Screening parses the whole body in one C call that holds the GIL: ~5-15 ms for an 8 MB
body, during which the event loop serves no one (a thread would hold the GIL as long).
Bodies of `OFFLOAD_BYTES` or more are measured by one helper process instead; the loop
only hands it the bytes and awaits a few numbers. Smaller bodies are measured inline
(under a millisecond). The helper is started on first use (spawned: it imports only
`router.screen`), runs one body at a time (queued large bodies wait their turn, held by
the gateway's body budget), and is replaced if it dies, that body being measured inline.
"""
from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from .screen import PromptSize, measure

OFFLOAD_BYTES = 1024 * 1024


class Screener:
    """See the module doc. One per gateway; `close` stops the helper."""

    def __init__(self, offload_bytes: int = OFFLOAD_BYTES) -> None:
        self.offload_bytes = offload_bytes
        self._pool: ProcessPoolExecutor | None = None

    async def measure(self, body: bytes, chat: bool) -> PromptSize | None:
        if len(body) < self.offload_bytes:
            return measure(body, chat)
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        pool = self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, measure, body, chat)
        except BrokenProcessPool:  # the helper died (killed, out of memory): a new one next time
            if self._pool is pool:
                self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            return measure(body, chat)

    @property
    def helper_pids(self) -> list[int]:
        """The helper process's pid, if it runs (for reports of the gateway's memory)."""
        procs = getattr(self._pool, "_processes", None) or {}
        return list(procs)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
