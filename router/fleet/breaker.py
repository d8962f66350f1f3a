"""A worker's circuit breaker: failures the proxy sees take it out of routing for a while.

Requests that time out, are reset or get a 5xx say a worker is in trouble, not that it
is dead (only its `/health` probes decide that), so its cache stays indexed. After
`threshold` failures in a row it stops getting requests for `base_s`; when that passes
it is tried again (half-open): one success closes the breaker, one more failure opens
it again for twice as long, up to `max_s`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Breaker:
    threshold: int
    base_s: float
    max_s: float
    fails: int = 0  # in a row
    open_until: float = 0.0
    backoff_s: float = 0.0
    trips: int = 0  # times opened, all time

    def failure(self, now: float) -> bool:
        """Count a failure; True when it opens the breaker (now or again)."""
        self.fails += 1
        if self.fails < self.threshold:
            return False
        self.backoff_s = self.base_s if self.backoff_s == 0.0 else min(self.max_s, 2.0 * self.backoff_s)
        self.open_until = now + self.backoff_s
        self.trips += 1
        return True

    def success(self) -> None:
        self.fails = 0
        self.backoff_s = 0.0
        self.open_until = 0.0

    def is_open(self, now: float) -> bool:
        return now < self.open_until

    def retry_after_s(self, now: float) -> float:
        return max(0.0, self.open_until - now)
