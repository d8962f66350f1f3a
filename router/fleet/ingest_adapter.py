"""KV-event ingestion for the pool: one `kvindex.ingest.IngestManager` per model index.

The pool's membership changes are synchronous (a request that sees a refused
connection takes its worker out at once), while stopping a ZMQ subscriber is a
coroutine. So removal drops the worker's index entries immediately — routing never
trusts a dead worker's cache for a moment longer — and closes the subscriber in the
background; a worker that comes back before that finished is re-subscribed after it.
All managers share one zmq.asyncio context.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvindex.index import PrefixIndex
from kvindex.ingest import IngestManager

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("kvroute.ingest")

# Per worker, from each subscriber's health. Counters restart from 0 when a worker is
# subscribed afresh (Prometheus' rate() takes the reset in its stride).
_COUNTERS = (
    ("batches", "kvroute_ingest_batches", "KV-event batches applied"),
    ("events", "kvroute_ingest_events", "KV events applied"),
    ("gaps", "kvroute_ingest_gaps", "Sequence gaps seen"),
    ("replays", "kvroute_ingest_replays", "Replay requests sent"),
    ("resyncs", "kvroute_ingest_resyncs", "Times the worker's entries were dropped and rebuilt"),
    ("tail_probes", "kvroute_ingest_tail_probes", "Replays asked for after the last applied sequence"),
    ("tail_recovered", "kvroute_ingest_tail_recovered", "Batches those probes found the live stream had lost"),
    ("decode_errors", "kvroute_ingest_decode_errors", "Payloads that were not event batches"),
    ("bad_events", "kvroute_ingest_bad_events", "Events the index rejected"),
    ("orphans", "kvroute_ingest_orphans", "Blocks stored under an unknown parent"),
    ("unknown_removed", "kvroute_ingest_unknown_removed", "Removals of unknown blocks"),
    ("digests_verified", "kvroute_ingest_digests_verified",
     "Sampled chain roots recomputed to check a trusted worker's digests"),
    ("digest_mismatches", "kvroute_ingest_digest_mismatches",
     "Sampled digests that differed from our recomputed keys (namespace drift)"),
)



class PoolIngest:
    def __init__(self, replay_timeout_s: float = 1.0) -> None:
        self._ctx = zmq.asyncio.Context()
        self._replay_timeout_s = replay_timeout_s
        self._managers: dict[int, IngestManager] = {}
        self._pending: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.errors = 0

    def _manager(self, index: PrefixIndex) -> IngestManager:
        m = self._managers.get(id(index))
        if m is None:
            m = self._managers[id(index)] = IngestManager(index, replay_timeout_s=self._replay_timeout_s, ctx=self._ctx)
        return m

    def add_worker(self, w: Worker) -> None:
        """Register `w` in its model's index and subscribe to its events (raises on a bad endpoint)."""
        pending = self._pending.get(w.id)
        if pending is not None and not pending.done():
            # the previous subscription is still closing: register now, subscribe after it
            idx = w.model.index
            if not idx.has_worker(w.id):
                idx.add_worker(
                    w.id, w.model.namespace.digest, w.block_size, w.remote_group, trusted_digests=w.trusted_digests
                )
            self._spawn(self._add_after(pending, w))
            return
        self._subscribe(w)

    def _subscribe(self, w: Worker) -> None:
        ev = w.events
        assert ev is not None
        self._manager(w.model.index).add_worker(
            w.id,
            ev.endpoint,
            replay_endpoint=ev.replay_endpoint,
            topic=ev.topic,
            bind=ev.bind,
            ns_digest=w.model.namespace.digest,
            block_size=w.block_size,
            remote_group=w.remote_group,
            trusted_digests=w.trusted_digests,
            join=not w.trusted_digests,  # vLLM: its replay buffer at once; ours republish on request
        )

    def indexed(self, w: Worker, target_seq: int | None) -> bool:
        """The worker's events are in the index: the join replay is done and, when
        `target_seq` is given, the batch with that sequence number has been applied."""
        m = self._managers.get(id(w.model.index))
        sub = m.subscriber(w.id) if m is not None else None
        if sub is None:
            return w.id not in self._pending  # not subscribed (no events): nothing to wait for
        if not sub.joined:
            return False
        last = sub.health.last_seq
        done = target_seq is None or (last is not None and last >= target_seq)
        if not done:
            sub.request_probe()  # the republished batch may have gone out before the subscription took
        return done

    async def _add_after(self, pending: asyncio.Task[None], w: Worker) -> None:
        try:
            await pending
        except Exception:
            pass
        if not w.in_index:
            return  # it left again meanwhile
        try:
            self._subscribe(w)
        except Exception as e:  # the worker stays routable by load; its cache is unknown
            self.errors += 1
            log.error("worker %s: cannot subscribe to KV events at %s: %s", w.id, w.events, e)

    def probe(self, w: Worker) -> None:
        """Ask the worker's replay socket soon for batches the live stream may have lost."""
        m = self._managers.get(id(w.model.index))
        if m is not None:
            m.probe(w.id)

    def remove_worker(self, w: Worker) -> None:
        idx = w.model.index
        if idx.has_worker(w.id):
            idx.remove_worker(w.id)
        m = self._managers.get(id(idx))
        if m is not None and m.subscriber(w.id) is not None:
            self._pending[w.id] = self._spawn(m.remove_worker(w.id, forget=False))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def health(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for m in self._managers.values():
            out.update(m.health())
        return out

    def metric_families(self) -> Iterable[Metric]:
        health = self.health()
        fams: list[Metric] = []
        for key, name, doc in _COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["worker"])
            for wid, h in health.items():
                v = h.get(key)
                if isinstance(v, (int, float)):
                    c.add_metric([wid], float(v))
            fams.append(c)
        age = GaugeMetricFamily("kvroute_ingest_last_event_age_seconds",
                                "Seconds since the worker's last KV-event batch (ingest lag)", labels=["worker"])
        live = GaugeMetricFamily("kvroute_ingest_live", "1 if the worker's event stream is live", labels=["worker"])
        for wid, h in health.items():
            if isinstance(h.get("last_event_age_s"), (int, float)):
                age.add_metric([wid], float(h["last_event_age_s"]))
            live.add_metric([wid], 1.0 if h.get("state") == "live" else 0.0)
        return [*fams, age, live]

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for m in self._managers.values():
            await m.close()
        self._ctx.term()
