"""Middle parts of a streamed response written straight to uvicorn's connection.

A long stream's gateway cost is per token, and ASGI's `send` costs a message dict, a
coroutine and uvicorn's checks per part. Under uvicorn's httptools server, once a
chunked response has started, a part that neither ends the response nor has to wait
for the client (flow control) is framed and written to the connection's transport
here, exactly as uvicorn's `send` would; everything else (the start, the last part,
a paused connection) still goes through `send`, so uvicorn keeps its own state.
Under any other server, or a `send` wrapped by middleware, `attach` finds nothing
and every part goes through `send`.
"""
from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle as _Cycle  # router/server.py's

# What is read of uvicorn's response cycle; a version without one of them is not written to.
_USED = ("transport", "flow", "disconnected", "response_started", "response_complete", "chunked_encoding", "scope")


class DirectBody:
    """Writes a started chunked response's middle parts on the cycle's transport."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: Any) -> None:
        self.cycle = cycle

    @classmethod
    def attach(cls, send: Any) -> DirectBody | None:
        """The writer for this ASGI `send`, or None when it is not uvicorn's httptools
        cycle itself (another server, a middleware's wrapper, an unknown version)."""
        cycle = getattr(send, "__self__", None)
        if type(cycle) is not _Cycle or not all(hasattr(cycle, a) for a in _USED):
            return None
        if not hasattr(cycle.flow, "write_paused"):
            return None
        return cls(cycle)

    def write(self, data: bytes) -> bool:
        """Send `data` (not the last part) now; False when `send` must do it: the response
        is not a started chunked one, or the connection waits for the client to read."""
        c = self.cycle
        if c.flow.write_paused or not c.response_started or c.response_complete or c.chunked_encoding is not True \
                or c.scope["method"] == "HEAD":
            return False
        if c.disconnected:
            return True  # dropped, as `send` drops it
        if data:
            c.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True
