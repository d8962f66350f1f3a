"""A worker's health as the pool decides it: `/health` probes (consecutive failures over
a minimum time, or a refused connection) and, for what the proxy sees fail, the
worker's circuit breaker (router/fleet/breaker.py), which keeps its index entries."""
from __future__ import annotations

import logging
import time

from ..config import PoolConfig
from .pool_roster import Roster
from .probe import Probe
from .worker import State, Worker

log = logging.getLogger("kvroute.pool")

SELF_DRAINING = "worker reports draining"


class Health:
    def __init__(self, cfg: PoolConfig, roster: Roster, probe: Probe) -> None:
        self.cfg = cfg
        self.roster = roster
        self.probe = probe

    async def check(self, w: Worker) -> bool:
        """One `/health` probe: False when it failed; our worker's own draining followed."""
        st = await self.probe.health(w)
        if st is None:
            return False
        if w.kind == "kvroute":
            roster = self.roster
            if st == "draining" and w.state is State.HEALTHY:
                roster.set_state(w, State.DRAINING, SELF_DRAINING)
                if w.in_index:
                    w.model.index.set_draining(w.id, True)
            elif st == "ok" and w.state is State.DRAINING and w.reason == SELF_DRAINING:
                roster.set_state(w, State.HEALTHY, "")  # it stopped draining by itself
                if w.in_index:
                    w.model.index.set_draining(w.id, False)
        return True

    def failed(self, w: Worker, why: str, refused: bool = False) -> None:
        """A failed `/health` probe: dead when refused (nothing listens), or after
        `unhealthy_after` failures in a row over at least `unhealthy_min_s`."""
        now = time.monotonic()
        if w.fails == 0:
            w.failing_since = now
        w.fails += 1
        w.failures_total += 1
        cfg = self.cfg
        long_enough = w.fails >= cfg.unhealthy_after and now - w.failing_since >= cfg.unhealthy_min_s
        if w.state in (State.HEALTHY, State.DRAINING) and (refused or long_enough):
            self.roster.leave(w)
            self.roster.set_state(w, State.UNHEALTHY, why)

    def report_failure(self, w: Worker, why: str, fatal: bool) -> None:
        """The proxy saw the worker fail: a refused connection takes it out at once (its
        process is gone); anything else counts toward its circuit breaker."""
        w.last_error = why
        if fatal:
            self.failed(w, why, refused=True)  # (counts the failure)
            return
        w.failures_total += 1
        now = time.monotonic()
        was_open = w.breaker.is_open(now)
        if w.breaker.failure(now) and not was_open:
            roster = self.roster
            roster.breakers_until = max(roster.breakers_until, w.breaker.open_until)
            log.warning("worker %s: circuit open for %.1f s after %d failures in a row (%s)", w.id,
                        w.breaker.backoff_s, w.breaker.fails, why)
            roster.changed.set()

    def report_success(self, w: Worker) -> None:
        """A first token arrived: the breaker closes."""
        if w.breaker.fails:
            if w.breaker.open_until:
                log.info("worker %s: circuit closed", w.id)
            w.breaker.success()
