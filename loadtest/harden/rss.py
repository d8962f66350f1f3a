"""Resident memory of the processes under test, sampled from /proc/PID/status (VmRSS)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


def rss_bytes(pid: int) -> int | None:
    """VmRSS of `pid` in bytes, or None when it is gone (or this is not Linux)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class Series:
    first: int | None = None
    last: int | None = None
    max: int = 0
    samples: int = 0
    trace: list[tuple[float, int]] = field(default_factory=list)


class RssSampler:
    """Samples every tracked pid every `interval` s in a thread, keeping first, max and last."""

    def __init__(self, interval: float = 0.1, keep_trace: bool = False) -> None:
        self.interval = interval
        self.keep_trace = keep_trace
        self.series: dict[int, Series] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def track(self, pid: int) -> None:
        with self._lock:
            self.series.setdefault(pid, Series())
        self.sample_now(pid)

    def sample_now(self, pid: int) -> int | None:
        v = rss_bytes(pid)
        if v is None:
            return None
        with self._lock:
            s = self.series.setdefault(pid, Series())
            if s.first is None:
                s.first = v
            s.last = v
            s.max = max(s.max, v)
            s.samples += 1
            if self.keep_trace:
                s.trace.append((round(time.monotonic() - self._t0, 2), v))
        return v

    def reset(self, pid: int) -> None:
        """Forget what was seen of `pid` (a phase starts: its baseline is the next sample)."""
        with self._lock:
            self.series[pid] = Series()
        self.sample_now(pid)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                pids = list(self.series)
            for pid in pids:
                self.sample_now(pid)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def mib(self, pid: int) -> dict[str, float]:
        with self._lock:
            s = self.series.get(pid)
            if s is None or s.first is None:
                return {}
            return {"start": round(s.first / 2**20, 1), "max": round(s.max / 2**20, 1),
                    "end": round((s.last or 0) / 2**20, 1)}
