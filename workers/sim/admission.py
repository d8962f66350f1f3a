"""SSD admission filter: a block is written to DISK only once it was used N times
within a window (as Dynamo's KVBM filters by frequency), so one-off prompts never
wear the SSD or push reused blocks out of it.

Uses are counted in two `Counter`s (this window and the previous one), rotated by
time: a block qualifies on `uses(current) + uses(previous) >= N`, i.e. within a
window of between W and 2W. `Counter.update` counts a request's keys in C, which
keeps the per-block cost of the filter negligible.
"""
from __future__ import annotations

from collections import Counter


class AdmissionFilter:
    __slots__ = ("min_uses", "window_s", "_cur", "_prev", "_start")

    def __init__(self, min_uses: int, window_s: float) -> None:
        self.min_uses = min_uses
        self.window_s = window_s
        self._cur: Counter[bytes] = Counter()
        self._prev: Counter[bytes] = Counter()
        self._start = 0.0

    @property
    def active(self) -> bool:
        return self.min_uses > 1

    def seen(self, keys: list[bytes], now: float) -> None:
        """Count one use of each of these blocks at time `now`."""
        if self.min_uses <= 1:
            return
        if now - self._start >= self.window_s:
            expired_both = now - self._start >= 2 * self.window_s
            self._prev = Counter() if expired_both else self._cur
            self._cur = Counter()
            self._start = now
        self._cur.update(keys)

    def admits(self, key: bytes) -> bool:
        if self.min_uses <= 1:
            return True
        return self._cur.get(key, 0) + self._prev.get(key, 0) >= self.min_uses

    def __len__(self) -> int:
        return len(self._cur) + len(self._prev)
