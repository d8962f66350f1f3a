"""What may be written to a store that wears out: a frequency filter and a byte budget.

DISK is an SSD. Most blocks are seen once and never again (one-off prompts), so writing
every block evicted from CPU would burn write endurance on blocks nobody reads; NVIDIA
Dynamo's KVBM writes a block to disk only once it has been offloaded a few times. The
budget caps the sustained write rate whatever the traffic.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

Clock = Callable[[], float]


class AdmissionFilter:
    """Admits a key on its `admit_after`-th sighting within a window.

    Counts live in a count-min sketch (4 rows of saturating 8-bit counters, conservative
    update), in two generations: the current one and the previous one. A sighting is
    remembered for one to two windows, then forgotten wholesale when the generations turn,
    which happens every `window_s` seconds or every `width // 4` sightings, whichever comes
    first, so collisions stay rare however busy the store is. Memory is fixed:
    2 * 4 * width bytes. A collision can only over-count, i.e. admit a block early.
    Keys are hashed with a per-process salt so crafted keys cannot pin counters.
    Not thread-safe: the store calls it under its lock.
    """

    ROWS = 4

    def __init__(self, admit_after: int, window_s: float, width: int, clock: Clock) -> None:
        if admit_after < 1 or window_s <= 0 or width < 64 or width & (width - 1):
            raise ValueError("admit_after >= 1, window_s > 0, width a power of two >= 64")
        self.admit_after = admit_after
        self.window_s = window_s
        self._width = width
        self._clock = clock
        self._salt = os.urandom(16)
        self._cur = bytearray(self.ROWS * width)
        self._prev = bytearray(self.ROWS * width)
        self._started = clock()
        self._sightings = 0

    def admit(self, key: bytes) -> bool:
        """Count one sighting of `key`; True once it has been seen `admit_after` times."""
        if self.admit_after <= 1:
            return True
        self._maybe_turn()
        slots = self._slots(key)
        cur, prev = self._cur, self._prev
        low = min(cur[s] for s in slots)
        if low < 255:
            for s in slots:
                if cur[s] == low:
                    cur[s] = low + 1
        self._sightings += 1
        return min(cur[s] + prev[s] for s in slots) >= self.admit_after

    def _slots(self, key: bytes) -> list[int]:
        digest = hashlib.blake2b(key, digest_size=4 * self.ROWS, key=self._salt).digest()
        mask = self._width - 1
        return [row * self._width + (int.from_bytes(digest[4 * row : 4 * row + 4], "little") & mask)
                for row in range(self.ROWS)]

    def _maybe_turn(self) -> None:
        elapsed = self._clock() - self._started
        if elapsed < self.window_s and self._sightings < self._width // 4:
            return
        stale = elapsed >= 2 * self.window_s
        self._prev = bytearray(len(self._cur)) if stale else self._cur
        self._cur = bytearray(len(self._prev))
        self._started = self._clock()
        self._sightings = 0


class TokenBucket:
    """At most `rate` bytes per second on average, `burst` at once. Not thread-safe."""

    def __init__(self, rate: float, burst: int, clock: Clock) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()

    def take(self, n: int) -> bool:
        """Spend n bytes if the bucket holds them; False (nothing spent) otherwise."""
        now = self._clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens < n:
            return False
        self._tokens -= n
        return True
