"""One registered worker as the gateway tracks it: config, state, what `/info` said.

Its routing state (the planner's `WorkerView`, the in-flight ledger, the last report's
time) is a `FleetWorker` from router/planner/fleet.py, the very object the offline
simulator keeps per worker, so both update it the same way.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from yarl import URL  # aiohttp's own URL type (a hard dependency of aiohttp)

from kvwire import WorkerInfo

from ..intake.model import ModelRuntime
from ..planner.fleet import FleetWorker
from ..planner.inflight import Ticket
from ..planner.types import WorkerView
from ..upstream.http1 import fast_url
from .breaker import Breaker
from .credentials import head_lines, resolve
from .dp_ranks import rank_headers
from .fleetconfig import EventsConfig, WorkerConfig

# Engines the gateway forwards the client's body to unchanged (docs/workers.md).
PASS_THROUGH_KINDS = frozenset({"vllm", "sglang"})


class State(StrEnum):
    PENDING = "pending"  # not registered yet (starting, or came back)
    HEALTHY = "healthy"
    DRAINING = "draining"  # finishing its requests; no new ones
    UNHEALTHY = "unhealthy"  # failed checks; out of routing and index
    REFUSED = "refused"  # incompatible (namespace, block size): never routed


@dataclass(eq=False)
class Worker:
    cfg: WorkerConfig
    model: ModelRuntime
    fleet: FleetWorker
    state: State = State.PENDING
    reason: str = ""
    fails: int = 0
    info: WorkerInfo | None = None
    events: EventsConfig | None = None
    block_size: int = 0
    block_bytes: int = 0
    remote_group: str | None = None
    capabilities: set[str] = field(default_factory=set)
    in_index: bool = False
    task: asyncio.Task[None] | None = None
    probe_task: asyncio.Task[None] | None = None  # measuring its speeds at join (router/fleet/speed_probe.py)
    served: int = 0
    failures_total: int = 0
    last_error: str = ""
    max_inflight: int | None = None
    served_model: str = ""  # the name the worker serves the model under (its /v1/models), sent upstream
    adapters: frozenset[str] = frozenset()  # LoRA adapters of the model it lists in /v1/models
    breaker: Breaker = field(default_factory=lambda: Breaker(5, 1.0, 30.0))
    failing_since: float = 0.0  # when the current run of failed health probes began
    index_target: int | None = None  # the event sequence that carries its republished state
    registered_at: float = 0.0
    # drained through the admin API: kept when it (re)registers, not only while healthy now
    admin_drained: bool = False
    last_refused: bool = False  # the last probe found nothing listening
    completions_url: URL | None = None  # parsed once: aiohttp re-parses a str URL per request
    # (host, port) when router/upstream/http1.py's lean client can reach it (plain http), else None
    fast_key: tuple[str, int] | None = field(init=False)
    # headers on every call to it: its credentials (router/fleet/credentials.py) and, for one
    # data-parallel rank of a server, the rank (router/fleet/dp_ranks.py); for aiohttp, and
    # as the lean client's head lines
    call_headers: dict[str, str] = field(init=False, repr=False)
    call_head: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.fast_key = fast_url(self.cfg.url)
        self.call_headers = resolve(self.cfg.auth) | rank_headers(self.cfg)
        self.call_head = head_lines(self.call_headers)

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str] | None:
        """Headers for an aiohttp call to it: `extra` plus its credentials (None: none)."""
        if not self.call_headers:
            return dict(extra) if extra else None
        return {**extra, **self.call_headers} if extra else self.call_headers

    @property
    def id(self) -> str:
        return self.cfg.id

    @property
    def view(self) -> WorkerView:
        return self.fleet.view

    @property
    def inflight(self) -> set[Ticket]:
        """The router's requests in flight on this worker (dispatched, not finished)."""
        return self.fleet.ledger.live

    @property
    def url(self) -> str:
        return self.cfg.url

    @property
    def kind(self) -> str:
        return self.cfg.kind

    @property
    def passes_through(self) -> bool:
        """A foreign engine (vLLM, SGLang): the client's body is forwarded unchanged."""
        return self.cfg.kind in PASS_THROUGH_KINDS

    @property
    def trusted_digests(self) -> bool:
        """Our workers publish digest64 of our own chained keys (docs/wire.md), so the index
        applies them without re-hashing token ids (sampled roots are still verified);
        vLLM's block hashes are its own and are always recomputed from the event's tokens."""
        return self.cfg.kind == "kvroute"

    def summary(self) -> dict[str, Any]:
        v = self.view
        load_t = self.fleet.load_t
        return {
            "id": self.id,
            "url": self.url,
            "kind": self.kind,
            "role": self.cfg.role,
            "model": self.model.id,
            "state": self.state.value,
            "reason": self.reason,
            "block_size": self.block_size,
            "remote_group": self.remote_group,
            "auth": self.cfg.auth.described() if self.cfg.auth is not None else None,
            "data_parallel_rank": self.cfg.data_parallel_rank,
            "data_parallel_size": self.cfg.data_parallel_size,
            "capabilities": sorted(self.capabilities),
            "adapters": sorted(self.adapters),
            "inflight": len(self.inflight),
            "served": self.served,
            "failures": self.failures_total,
            "last_error": self.last_error,
            "load": {
                "waiting_requests": v.waiting_requests,
                "waiting_prefill_tokens": v.waiting_prefill_tokens,
                "running_requests": v.running_requests,
                "est_queue_s": v.est_queue_s,
                "gpu_free_blocks": v.gpu_free_blocks,
                "gpu_capacity_blocks": v.gpu_capacity_blocks,
                "report_age_s": round(time.monotonic() - load_t, 3) if load_t is not None else None,
            },
            "events": None if self.events is None else self.events.model_dump(),
        }


@dataclass(slots=True, eq=False)
class Inflight:
    """One dispatched request: its worker and its ticket in that worker's ledger."""

    worker: Worker
    ticket: Ticket

    @property
    def prefilled(self) -> bool:
        return self.ticket.prefilled
