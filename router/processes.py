"""`kvroute serve --processes N`: N gateway processes on one port (SO_REUSEPORT).

One Python process routes on one core; the kernel spreads connections over every
process bound to the port with SO_REUSEPORT. Each child is a full replica: it
subscribes to every worker's KV events (ZMQ PUB fans out), polls load, and keeps its
own index; each counts its own dispatches not yet in a load report N times, for the
others' it cannot see (routing.replicas; docs/replicas.md). An admin change taken by
one child reaches every other before it is answered (router/fleet/replica_sync.py, through
a private folder made here). This parent only supervises: signals are forwarded
(SIGTERM stops each gracefully, SIGHUP reloads each), a child that dies is restarted,
too many deaths stop everything.
"""
from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from types import FrameType

log = logging.getLogger("kvroute.processes")

RESTARTS_PER_MINUTE = 5


class Supervisor:
    def __init__(self, n: int, config_path: Path, host: str, port: int) -> None:
        self.n = n
        self.sync_dir = Path(tempfile.mkdtemp(prefix="kvroute-admin-"))  # mode 0700: this user only
        self.cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config_path), "--host", host,
                    "--port", str(port), "--reuse-port", "--replicas", str(n), "--admin-sync", str(self.sync_dir),
                    "--process-count", str(n)]
        self.children: list[subprocess.Popen[bytes] | None] = [None] * n
        self.stopping = False
        self.deaths: deque[float] = deque()
        self.failed = False

    def _spawn(self, i: int) -> None:
        self.children[i] = subprocess.Popen([*self.cmd, "--process-index", str(i)])
        log.info("gateway process %d started (pid %d)", i, self.children[i].pid)  # type: ignore[union-attr]

    def _forward(self, sig: int, frame: FrameType | None) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT):
            self.stopping = True
        for c in self.children:
            if c is not None and c.poll() is None:
                c.send_signal(sig)

    def run(self) -> int:
        old = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            for i in range(self.n):
                self._spawn(i)
            while any(c is not None and c.poll() is None for c in self.children):
                time.sleep(0.2)
                if not self.stopping:
                    self._restart_dead()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            shutil.rmtree(self.sync_dir, ignore_errors=True)
        codes = [c.returncode for c in self.children if c is not None]
        return 1 if self.failed or any(code not in (0, -signal.SIGINT) for code in codes) else 0

    def _restart_dead(self) -> None:
        now = time.monotonic()
        for i, c in enumerate(self.children):
            if c is None or c.poll() is None:
                continue
            self.deaths.append(now)
            while self.deaths and now - self.deaths[0] > 60:
                self.deaths.popleft()
            if len(self.deaths) > RESTARTS_PER_MINUTE:
                log.error("gateway processes died %d times within a minute: stopping all", len(self.deaths))
                self.failed = True
                self._forward(signal.SIGTERM, None)
                return
            log.warning("gateway process %d exited (code %s): restarting it", i, c.returncode)
            self._spawn(i)

