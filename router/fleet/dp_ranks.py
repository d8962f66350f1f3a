"""A vLLM server's data-parallel ranks, each routed to as a worker of its own.

A server started with `--data-parallel-size N` has N engines behind one URL, each with
its own KV cache, its own queue and its own KV-event stream (vLLM publishes rank r's
events on the configured port + r, and stamps each batch with the rank). Routing to the
URL alone would conflate N caches; so a config entry with `data_parallel_size: N`
becomes N workers `<id>.dp<r>`: each is indexed from its own event stream, priced with
its own queue, and pinned by the `X-data-parallel-rank` header that vLLM (and SGLang)
honour from an external router (vLLM's own balancer is then bypassed). Explain, the
admin API and every per-worker metric name the rank by its worker id.
"""
from __future__ import annotations

import re

from .fleetconfig import EventsConfig, WorkerConfig

RANK_HEADER = "X-data-parallel-rank"
_TCP_PORT = re.compile(r"^(tcp://.+):(\d+)$")


def expand_ranks(wc: WorkerConfig) -> list[WorkerConfig]:
    """One entry per rank: itself when it is one rank already (or has one), else N."""
    if wc.data_parallel_size == 1 or wc.data_parallel_rank is not None:
        return [wc]
    return [wc.model_copy(update={"id": f"{wc.id}.dp{r}", "data_parallel_rank": r,
                                  "events": offset_events(wc.events, r)})
            for r in range(wc.data_parallel_size)]


def offset_events(ev: EventsConfig | None, rank: int) -> EventsConfig | None:
    """Rank `rank`'s event endpoints, as vLLM offsets them: a TCP port + rank, an
    in-process name + `_dp<rank>`."""
    if ev is None or rank == 0:
        return ev
    return ev.model_copy(update={"endpoint": _offset(ev.endpoint, rank),
                                 "replay_endpoint": _offset(ev.replay_endpoint, rank)})


def rank_headers(wc: WorkerConfig) -> dict[str, str]:
    """The header that pins a request to the entry's rank (none for a whole server)."""
    return {} if wc.data_parallel_rank is None else {RANK_HEADER: str(wc.data_parallel_rank)}


def _offset(endpoint: str | None, rank: int) -> str | None:
    if endpoint is None:
        return None
    m = _TCP_PORT.match(endpoint)
    if m is not None:
        return f"{m.group(1)}:{int(m.group(2)) + rank}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    raise ValueError(f"cannot derive data-parallel rank {rank}'s endpoint from {endpoint!r}: "
                     f"give each rank its own entry with data_parallel_rank")
