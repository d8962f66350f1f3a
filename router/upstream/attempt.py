"""One try of a request on one worker, and what the worker answered, as both relays
(token ids to our workers, pass-through to vLLM) and the observer share them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from ..fleet.worker import Inflight, Worker
from ..intake.prepare import Prepared
from ..planner.types import RouteRequest
from .prefetch import Prefetch

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
JSON_HEADERS = [(b"content-type", b"application/json")]
# One choice (text, finish reason) as the client's chunk (responses.ChunkFrame.render)
Render = Callable[[str, "str | None"], bytes]


class Out(Protocol):
    """Where a response goes (the ASGI send, in router/api/app.py)."""

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...
    async def body(self, data: bytes, more: bool = False) -> None: ...

    def write_now(self, data: bytes) -> bool:
        """Write a middle part of a started body at once, if that needs no wait; False: use `body`."""
        ...


@dataclass(slots=True)
class Attempt:
    """One try of a request on one worker."""

    prep: Prepared
    worker: Worker
    rec: Inflight
    rr: RouteRequest
    predicted: float | None
    prefetch: Prefetch | None
    t_dispatch: float = 0.0
    reason: str = ""  # why the policy chose this worker (its Decision's reason; "retry" on a retry)
    tries: int = 1  # this attempt's number (1: the first worker tried)
    # The decode leg of a prefill/decode pair (router/upstream/pair.py): the prefill
    # worker's `kv_transfer_params` exactly as it wrote them (sent on to this worker),
    # that worker's id and the prompt tokens whose KV it offers.
    kv_transfer: msgspec.Raw | None = None
    prefill_worker: str | None = None
    kv_moved_tokens: int | None = None

    def predicted_ttft(self) -> float | None:
        """The predicted TTFT from dispatch, with what requests the gateway sent to the same
        worker after this one add to it (FleetWorker.revise_ahead); `predicted` is the
        prediction as first made."""
        if self.predicted is None:
            return None
        return self.predicted + self.rec.ticket.revised_s

    def route_headers(self) -> list[tuple[bytes, bytes]]:
        """Which worker served, and what the planner expected (loadtest/replay.py reads these).
        Sent with the first token, so the prediction includes the revisions until then."""
        hdrs = [(b"x-kvroute-worker", self.worker.id.encode()), (b"x-request-id", self.prep.request_id.encode())]
        if self.prefill_worker is not None:
            hdrs += [(b"x-kvroute-prefill-worker", self.prefill_worker.encode()),
                     (b"x-kvroute-decode-worker", self.worker.id.encode()),
                     (b"x-kvroute-kv-moved-tokens", b"%d" % (self.kv_moved_tokens or 0))]
        p = self.predicted_ttft()
        if p is not None:
            hdrs.append((b"x-kvroute-predicted-ttft-ms", b"%.3f" % (p * 1000)))
        return hdrs


@dataclass(slots=True)
class Result:
    """What the worker sent, folded as it came. `t_first` None: no first-token time is
    known (a non-streamed pass-through answer arrives whole)."""

    text: list[str] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    chunks: int = 0
    t_first: float | None = None
    t_last: float = 0.0

    @property
    def completion_tokens(self) -> int:
        u = self.usage
        if u is not None and isinstance(u.get("completion_tokens"), int):
            return int(u["completion_tokens"])
        return self.chunks

    @property
    def prompt_tokens(self) -> int | None:
        u = self.usage
        v = u.get("prompt_tokens") if u is not None else None
        return v if isinstance(v, int) else None

    @property
    def cached_tokens(self) -> int | None:
        u = self.usage
        d = u.get("prompt_tokens_details") if u is not None else None
        v = d.get("cached_tokens") if isinstance(d, dict) else None
        return v if isinstance(v, int) else None
