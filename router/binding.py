"""Late binding at the gateway: the planner's GatewayQueue driven by the event loop.

Routing on arrival sends a request to a worker at once, where it waits out that
worker's queue however long it turns out. When every worker of a model predicts more
than `hold_target_s` of queue, the gateway holds the request instead, and binds it
once a worker drains under the target, with the index and the queues of that moment:
in effect to the worker that frees first, with whatever cache moved meanwhile.
`max_hold_s` bounds the wait (held that long, a request is bound anyway) and
`max_held` the memory (beyond it, requests route on arrival). docs/planner.md,
"Scheduling", has the measurements.

Checks run on an arrival, on each load report, and at the oldest request's deadline.
One request is released per check; the next check is queued by the released request
itself and runs after its first real await, when it is already counted on its worker,
so each check sees the queues the previous binding left.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from .config import GatewayQueueConfig
from .planner.gateway_queue import GatewayQueue
from .telemetry.metrics import GatewayMetrics

# model id -> the predicted queue (seconds) of each worker that could take its requests now
Queues = Callable[[str], list[float]]


class Binder:
    """Holds requests per model (a model's queue never blocks another's)."""

    def __init__(self, cfg: GatewayQueueConfig, queues: Queues, metrics: GatewayMetrics) -> None:
        self.cfg = cfg
        self._queues = queues
        self._metrics = metrics
        self._held: dict[str, GatewayQueue[asyncio.Future[None]]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    @property
    def enabled(self) -> bool:
        return self.cfg.hold_target_s is not None

    def held(self, model_id: str) -> int:
        gq = self._held.get(model_id)
        return len(gq) if gq is not None else 0

    async def turn(self, model_id: str, size: Callable[[], float], tenant: str) -> float:
        """Return when the request may be bound; the seconds it was held (0: not held).
        `size`: its predicted prefill tokens (asked only when it is held)."""
        if not self.enabled:
            return 0.0
        gq = self._held.get(model_id)
        if gq is None:
            gq = self._held[model_id] = GatewayQueue(self.cfg.order, self.cfg.hold_target_s, self.cfg.max_hold_s)
        if not gq and not gq.over_target(self._queues(model_id)):
            return 0.0
        m = self._metrics
        if len(gq) >= self.cfg.max_held:
            m.child(m.hold_overflow, model_id).inc()
            return 0.0
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        since = time.monotonic()
        h = gq.push(fut, size(), since, tenant)
        gauge = m.child(m.held, model_id)
        gauge.inc()
        try:
            self.check(model_id)
            await fut
        except asyncio.CancelledError:  # the client left while held
            gq.drop(h)
            raise
        finally:
            gauge.dec()
            loop.call_soon(self.check, model_id)
        held = time.monotonic() - since
        m.child(m.hold, model_id).observe(held)
        return held

    def check(self, model_id: str) -> None:
        """Release the next request of the model unless every worker is still over the
        target (and none has waited `max_hold_s`)."""
        gq = self._held.get(model_id)
        if not gq:
            return
        now = time.monotonic()
        queues = self._queues(model_id)
        while len(gq):
            if gq.should_hold(queues, now):
                self._arm(model_id, gq)
                return
            fut = gq.pop(now)
            if fut is not None and not fut.done():
                fut.set_result(None)
                return

    def _arm(self, model_id: str, gq: GatewayQueue[asyncio.Future[None]]) -> None:
        """A check at the oldest held request's deadline (the fairness bound)."""
        oldest = gq.oldest_arrival()
        if oldest is None:
            return
        old = self._timers.pop(model_id, None)
        if old is not None:
            old.cancel()
        delay = max(0.0, oldest + self.cfg.max_hold_s - time.monotonic())
        self._timers[model_id] = asyncio.get_running_loop().call_later(delay, self.check, model_id)

    def close(self) -> None:
        """Bind everything held now (the gateway is stopping: nothing may wait out its bound)."""
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()
        for gq in self._held.values():
            while len(gq):
                fut = gq.pop(time.monotonic())
                if fut is not None and not fut.done():
                    fut.set_result(None)
