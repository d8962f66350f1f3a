"""Where a large body is screened (screen.py): in a helper process when it is very large.

Screening parses the whole body in one C call that holds the GIL: ~5-15 ms for an 8 MB
body, during which the event loop serves no one (a thread would hold the GIL as long).
Bodies of `OFFLOAD_BYTES` or more are measured by one helper process instead
(`python -m router.intake.screenhelper`, which imports only `router.intake.screen`): the loop writes the
bytes to its stdin and reads a few numbers back. Smaller bodies are measured inline
(under a millisecond). The helper is started when the first body of that size is announced (its
Content-Length), in the background while the body arrives; it measures one body at a time
(large bodies queue for it, held by the gateway's body budget), and is killed and
replaced when it fails or takes longer than `timeout_s`, that body being measured inline;
after three failures in a row every body is measured inline, with one warning.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

import msgspec

from .screen import PromptSize, measure

OFFLOAD_BYTES = 1024 * 1024
_ROOT = str(Path(__file__).resolve().parents[2])  # where the `router` package is, for the helper
log = logging.getLogger("kvroute.gateway")


class Screener:
    """See the module doc. One per gateway, event-loop only; `aclose` stops the helper."""

    def __init__(self, offload_bytes: int = OFFLOAD_BYTES, timeout_s: float = 10.0) -> None:
        self.offload_bytes = offload_bytes
        self.timeout_s = timeout_s
        self.inline_only = False  # set after repeated helper failures: measured here from then on
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._failures = 0
        self._warming: asyncio.Future[None] | None = None

    def warm(self) -> None:
        """A large body is on its way: start the helper now, in the background, so that its
        start overlaps the body's transfer instead of delaying the body (and everyone else)."""
        running = self._proc is not None and self._proc.returncode is None
        if not (self.inline_only or running or self._warming is not None):
            self._warming = asyncio.ensure_future(self._start())

    async def _start(self) -> None:
        try:
            async with self._lock:
                await self._helper()
        except OSError as e:
            self._failed(e)
        finally:
            self._warming = None

    async def measure(self, body: bytes, chat: bool) -> PromptSize | None:
        if len(body) < self.offload_bytes or self.inline_only:
            return measure(body, chat)
        async with self._lock:
            try:
                got = await asyncio.wait_for(self._ask(body, chat), self.timeout_s)
                self._failures = 0
                return got
            except (OSError, EOFError, asyncio.IncompleteReadError, TimeoutError, msgspec.DecodeError,
                    TypeError, ValueError) as e:
                self._failed(e)
        return measure(body, chat)

    async def _ask(self, body: bytes, chat: bool) -> PromptSize | None:
        proc = await self._helper()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(bytes([1 if chat else 0]) + len(body).to_bytes(8, "little"))
        proc.stdin.write(body)
        await proc.stdin.drain()
        n = int.from_bytes(await proc.stdout.readexactly(4), "little")
        got = msgspec.msgpack.decode(await proc.stdout.readexactly(n))
        return None if got is None else PromptSize(*got)

    async def _helper(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.intake.screenhelper", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
        return self._proc

    def _failed(self, e: BaseException) -> None:
        self._kill()
        self._failures += 1
        if self._failures >= 3 and not self.inline_only:
            self.inline_only = True
            log.warning("screen helper failed %d times (%r): large bodies are screened in the gateway process",
                        self._failures, e)

    @property
    def helper_pids(self) -> list[int]:
        """The helper process's pid, if it runs (for reports of the gateway's memory)."""
        p = self._proc
        return [p.pid] if p is not None and p.returncode is None else []

    def _kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
        self._proc = None

    async def aclose(self) -> None:
        """Stop the helper and wait for it (its pipes closed while the loop still runs)."""
        proc = self._proc
        if self._warming is not None:
            self._warming.cancel()
        self._kill()
        if proc is not None:
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                pass
