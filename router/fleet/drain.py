"""The requests in flight when a drain ends, and how each one is ended.

On SIGTERM the gateway stops taking requests and gives those in flight
`shutdown.drain_timeout_s` to finish (router/server.py). A stream still running then
must not be cut silently — no error event, no `[DONE]`, an unterminated chunked body,
and a CancelledError traceback per request in the log, which is what the server's own
cancellation gives. Instead every request handler registers here, and at the drain's
end `end_all` cancels each with a marker its handler recognises: the handler then ends
its own response (an SSE error event, `[DONE]` and the body's last chunk for a stream;
a 503 when nothing was sent yet) and returns normally.
"""
from __future__ import annotations

import asyncio
from typing import Any

DRAIN_ENDED = "kvroute: the drain timeout ended"


class InFlight:
    """The handler tasks of the requests in flight (one per request)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.ended = False

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, task: asyncio.Task[Any]) -> None:
        """Register a request's handler task (plain calls: this is on every request's path);
        once the drain has ended, it ends at once."""
        self._tasks.add(task)
        if self.ended:
            task.cancel(DRAIN_ENDED)

    def discard(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)

    def end_all(self) -> int:
        """End every request in flight (module doc); returns how many."""
        self.ended = True
        for t in self._tasks:
            t.cancel(DRAIN_ENDED)
        return len(self._tasks)
