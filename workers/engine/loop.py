"""The engine thread: runs `EngineCore` steps one after another, sleeping when idle.

torch releases the GIL inside its kernels, so the asyncio side (HTTP, events) stays
responsive while a forward runs. The two sides share the core under one lock, held for
bookkeeping only (`schedule`, `commit`, and the asyncio side's submit / abort / purge /
reports), never during a forward: a refusal (429, 400) is decided at once against the
real queue, and a purge or a report waits for milliseconds, not for a step. Results go
out through `on_step`, called on this thread after each step; the adapter hands them to
the event loop with `call_soon_threadsafe` (a thread-safe queue of callbacks). The lock
and its condition are the core's: the tiers' link threads take it to land loads and wake
this thread when a request's blocks have arrived.

A step that raises fails the requests in it (each gets an error, their blocks are freed)
and the thread carries on; an error in the bookkeeping itself fails everything in flight.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .core import EngineCore, SeqUpdate
from .sequence import Sequence

log = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, core: EngineCore, on_step: Callable[[list[SeqUpdate]], None], name: str = "engine") -> None:
        self.core = core
        self.on_step = on_step
        self.lock = core.lock  # shared with the tiers' threads (workers/engine/tiers.py)
        self._wake = core.wake  # notified when a load lands, too
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the step in flight, then end the thread (requests left are the caller's)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, seq: Sequence) -> None:
        """Queue a sequence (raises the core's refusals) and wake the thread."""
        with self._wake:
            self.core.add(seq)
            self._wake.notify()

    def abort(self, request_id: str) -> bool:
        with self._wake:
            found = self.core.abort(request_id)
            self._wake.notify()
        return found

    def _run(self) -> None:
        while True:
            try:
                if not self._step():
                    return
            except Exception:  # a bug in the bookkeeping: end every request rather than hang them
                log.exception("engine bookkeeping failed: failing every request in flight")
                try:
                    with self.lock:
                        updates = self.core.fail_all("internal engine error")
                    self.on_step(updates)
                except Exception:
                    log.exception("engine thread stops: cannot fail the requests in flight")
                    return

    def _step(self) -> bool:
        """One step (sleeping first while there is nothing to do); False when stopping."""
        core = self.core
        with self._wake:
            while True:
                if self._stopping:
                    return False
                plan = core.schedule()
                if not plan.empty:
                    break
                self._wake.wait()
        try:
            result = core.execute(plan)
        except Exception as e:  # a bad step (device error, out of memory) fails its requests only
            log.exception("engine step failed")
            with self.lock:
                updates = core.fail(plan, f"the engine failed on this request: {e!r}")
        else:
            with self.lock:
                updates = core.commit(plan, result)
        self.on_step(updates)
        return True
