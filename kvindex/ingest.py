"""KV-event ingestion: the subscribers of one gateway, on the asyncio loop that owns the index.

An `IngestManager` runs one `WorkerSubscriber` (subscriber.py) per worker on the loop
that owns the index (which is not thread-safe), shares one ZMQ context, and starts,
probes and stops them. docs/ingest.md: usage, health fields, sequence rules.
"""
from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from .index import DEFAULT_VERIFY_EVERY, PrefixIndex
from .subscriber import WorkerSubscriber

__all__ = ["IngestManager", "WorkerSubscriber"]


class IngestManager:
    """All subscribers of one gateway, on one asyncio loop.

    Constructor: `IngestManager(index, *, replay_timeout_s=1.0, max_replay_batches=100_000,
    tail_probe_s=5.0, ctx=None)`; pass a `zmq.asyncio.Context` to share one, otherwise the manager owns
    (and on `close()` terminates) its own.
    """

    def __init__(
        self,
        index: PrefixIndex,
        *,
        replay_timeout_s: float = 1.0,
        max_replay_batches: int = 100_000,
        tail_probe_s: float | None = 5.0,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.index = index
        self._tail_probe_s = tail_probe_s
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._replay_timeout_s = replay_timeout_s
        self._max_replay = max_replay_batches
        self._subs: dict[str, WorkerSubscriber] = {}

    def add_worker(
        self,
        worker_id: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "kv",
        bind: bool = False,
        ns_digest: bytes | None = None,
        block_size: int | None = None,
        remote_group: str | None = None,
        trusted_digests: bool = False,
        verify_every: int = DEFAULT_VERIFY_EVERY,
        join: bool = False,
    ) -> WorkerSubscriber:
        """Subscribe to a worker's events; call from inside the running loop. With `join`,
        the replay socket is asked at once for what it holds (`WorkerSubscriber.start`).

        Registers the worker in the index first unless it is registered already
        (then `ns_digest` may be omitted, and the registration's own
        `trusted_digests` / `verify_every` apply, not these). `trusted_digests=True`
        for our own workers (kind "kvroute"; see `PrefixIndex.add_worker`). Raises
        ValueError when already subscribed, an IndexError_ subclass for a refused
        registration (kvindex/errors.py, e.g. BadBlockSize), zmq.ZMQError for an
        endpoint that cannot be bound or parsed.
        """
        if worker_id in self._subs:
            raise ValueError(f"worker {worker_id!r} is already subscribed")
        asyncio.get_running_loop()  # RuntimeError outside a loop, before any side effect
        registered = False
        if not self.index.has_worker(worker_id):
            if ns_digest is None:
                raise ValueError(f"worker {worker_id!r} is not in the index: pass ns_digest to register it")
            self.index.add_worker(worker_id, ns_digest, block_size, remote_group, trusted_digests, verify_every)
            registered = True
        try:
            sub = WorkerSubscriber(
                worker_id,
                self.index,
                self._ctx,
                endpoint,
                replay_endpoint=replay_endpoint,
                topic=topic,
                bind=bind,
                replay_timeout_s=self._replay_timeout_s,
                max_replay_batches=self._max_replay,
                tail_probe_s=self._tail_probe_s,
            )
        except Exception:
            if registered:
                self.index.remove_worker(worker_id)
            raise
        self._subs[worker_id] = sub
        sub.start(clear=not registered, join=join)
        return sub

    async def remove_worker(self, worker_id: str, *, forget: bool = True) -> None:
        """Stop following a worker; with `forget`, also remove it from the index."""
        sub = self._subs.pop(worker_id, None)
        if sub is not None:
            await sub.close()
        if forget and self.index.has_worker(worker_id):
            self.index.remove_worker(worker_id)

    def resync(self, worker_id: str) -> None:
        """Drop a worker's entries and rebuild them from its replay buffer and live stream."""
        sub = self._subs.get(worker_id)
        if sub is None:
            raise KeyError(worker_id)
        sub.request_resync()

    def probe(self, worker_id: str) -> None:
        """Ask a worker's replay socket soon for batches the live stream may have lost."""
        sub = self._subs.get(worker_id)
        if sub is not None:
            sub.request_probe()

    def subscriber(self, worker_id: str) -> WorkerSubscriber | None:
        return self._subs.get(worker_id)

    def health(self) -> dict[str, dict[str, Any]]:
        return {wid: sub.snapshot() for wid, sub in self._subs.items()}

    async def close(self) -> None:
        """Stop every subscriber (the index keeps its entries) and release the context."""
        subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            await sub.close()
        if self._own_ctx:
            self._ctx.term()
