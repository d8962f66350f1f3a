"""Per-tenant rate of large request bodies: one tenant's huge bodies cannot take the
gateway's event loop from the others.

Receiving, joining and screening a body (screen.py) costs the gateway CPU in proportion
to its bytes, on the one event loop every tenant shares: ~30 ms per 8 MB body measured
(loadtest huge_prompts). Two tenants sending such bodies back to back kept it half busy
and doubled another tenant's latency. Each tenant has a token bucket of body bytes
(`limits.tenant_large_body_bytes_per_s`, burst one maximal body: a burst of
huge bodies is what stalls the loop); a body of
`SCREEN_BYTES` or more is charged its declared size (the body limit when undeclared)
before it is read, and refused with 429 and the time its bucket needs as Retry-After
when the bucket is short. Smaller bodies are never charged: ordinary traffic is not
rate-limited here. The bucket map is bounded by the configured tenants.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


class BodyRate:
    """Token buckets of body bytes per tenant id (see the module doc). Event-loop only."""

    def __init__(self, bytes_per_s: float | None, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = bytes_per_s
        self.burst = float(burst)
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, tenant: str, n: int) -> float:
        """Charge `n` bytes to `tenant`: 0.0 when admitted, else the seconds until it would be."""
        if self.rate is None:
            return 0.0
        now = self._clock()
        b = self._buckets.get(tenant)
        if b is None:
            b = self._buckets[tenant] = _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate)
        b.at = now
        if b.tokens >= n:
            b.tokens -= n
            return 0.0
        return (n - b.tokens) / self.rate
