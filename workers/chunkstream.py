"""`ChunkStream`: what every engine's `GenStream` shares, engine side in, `GenChunk`s out.

An engine pushes output into its stream from the event loop (step results, timer
callbacks) and ends it with `_end`; the reader iterates. Whatever was pushed since the
reader's last chunk comes out as one chunk, so a reader that lags gets fewer, larger
chunks and never a backlog of wake-ups. A subclass says only how its pending output
becomes a chunk (`_pending`, `_take`) and what cancelling asks of its engine (`_abort`).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from workers.api import GenChunk
from workers.errors import EngineError
from workers.usage import Usage


class StreamFailed(EngineError):
    """An accepted request that failed mid-way (the app sends it as an error event)."""

    status = 500
    type = "server_error"
    code = "engine_error"


class ChunkStream:
    """One accepted request: pending output in, `GenChunk`s out (see the module doc)."""

    __slots__ = ("request_id", "usage", "finish_reason", "_done", "_error", "_waiter")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.usage: Usage | None = None
        self.finish_reason: str | None = None
        self._done = False
        self._error: str | None = None
        self._waiter: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ what a subclass gives

    def _pending(self) -> bool:
        """True when output arrived since the last chunk."""
        raise NotImplementedError

    def _take(self) -> GenChunk:
        """Everything pending, as one chunk (called only when `_pending()`)."""
        raise NotImplementedError

    def _abort(self) -> None:
        """Ask the engine to drop the request (called once, by the first `cancel`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ engine side

    def _wake(self) -> None:
        """Output or the end arrived: the reader waiting for it goes on."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _end(self, error: str | None = None) -> None:
        """The request ended (with `error`, a failure) and the reader is woken."""
        self._done = True
        if error is not None:
            self._error = error
        self._wake()

    # ------------------------------------------------------------------ reader side

    def __aiter__(self) -> AsyncIterator[GenChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[GenChunk]:
        loop = asyncio.get_running_loop()
        while True:
            if self._pending():  # everything since the last read, as one chunk
                yield self._take()
                continue
            if self._done:
                if self._error is not None:
                    raise StreamFailed(self._error)
                return
            self._waiter = loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def cancel(self) -> None:
        """The client went away: the engine drops the request and frees its blocks (idempotent)."""
        if self._done:
            return
        self._done = True
        self._abort()
        self._wake()
