"""What the engine needs from a block store below host memory (DISK, REMOTE).

A store keeps opaque blobs by 32-byte block key: the block's KV tensors serialized by
the engine, plus opaque metadata (parent key, token ids, extra keys) that lets a
worker restarted over the same store publish `BlockStored` for what it finds. Every
store is a cache, never the source of truth: a missing, truncated or corrupt record,
an I/O error or an unreachable server is a miss (`get` returns None), counted in
`stats`, and the bad key is dropped and reported through `on_drop`, so the engine
publishes its removal and recomputes. Calls are synchronous and thread-safe: the
engine calls them from its transfer threads, never from the event loop.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class StoreStats:
    """Monotonic counters a store exports (as `kvroute_worker_<name>_total{tier}`)."""

    puts: int = 0
    put_bytes: int = 0
    refused: int = 0  # not admitted (admission filter), over the write budget, or full
    gets: int = 0
    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    checksum_errors: int = 0
    truncated: int = 0
    io_errors: int = 0
    evicted: int = 0
    dropped: int = 0  # bad records removed after a failed read
    mac_failures: int = 0  # REMOTE: values whose keyed MAC did not verify (forged, or another fleet's)
    breaker_trips: int = 0  # REMOTE: times the circuit breaker opened
    breaker_skips: int = 0  # REMOTE: calls answered without trying while it was open


@dataclass(frozen=True, slots=True)
class Record:
    key: bytes
    meta: bytes
    payload: bytes


class BlockStore(Protocol):
    tier: str  # "DISK" | "REMOTE"
    stats: StoreStats
    # Called with keys the store lost on its own (eviction, a bad record found, TTL
    # expiry noticed): the engine publishes BlockRemoved for them.
    on_drop: Callable[[list[bytes]], None] | None

    def put(self, key: bytes, meta: bytes, payload: bytes) -> bool:
        """Store one block; False when refused (admission, budget, capacity, error)."""
        ...

    def get(self, key: bytes) -> Record | None:
        """The block, verified; None on a miss of any kind (counted, bad record dropped)."""
        ...

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        """Which keys the store believes it holds (its index; no data read)."""
        ...

    def discard(self, keys: Iterable[bytes]) -> int:
        """Drop keys (purge); returns how many were held."""
        ...

    def scan(self) -> Iterator[tuple[bytes, bytes]]:
        """(key, meta) of every block held, for publishing after a restart."""
        ...

    def close(self) -> None: ...
