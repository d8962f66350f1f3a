"""REMOTE tier: blocks in a Redis/Valkey server shared by a group of workers.

Keys are `<namespace>:<group>:<64 hex of the block key>`, so workers of one group (same
model deployment) share blocks and other groups on the same server never see them. Each
value is a record in the DISK format (record.py), so a corrupt, truncated or misplaced
value is detected; with a `BlockMac` (the engine always gives one) the record is followed
by its 32-byte keyed MAC (mac.py) over the REMOTE scope, the key prefix, the block key,
meta and payload, so a value written by anyone without the fleet secret is a miss too
(counted in `mac_failures`, deleted). Values are written with SET PX ttl; a hit refreshes the TTL (GETEX),
so retention is by last use. Capacity is the server's job (maxmemory + allkeys-lru).

`contains` asks the server (pipelined EXISTS, one round trip per batch) rather than a
local view: the blocks are written by the whole group and expire on their own, so only
the server knows. `scan` walks SCAN MATCH <prefix>* and reads each record's header+meta
with GETRANGE, verified by the header checksum.

A dead or slow server is a miss, never a hang: short connect/read timeouts, no retries,
and a circuit breaker that, after `breaker_failures` consecutive connection failures,
answers every call as a miss without trying for a backoff period (doubling while trial
calls keep failing). A nil GET is reported through on_drop (the block expired or was
evicted by the server); connection failures are not (the block may well still be there).
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.engine.store.admission import Clock
from workers.engine.store.base import Record, StoreStats
from workers.engine.store.mac import MAC_SIZE, BlockMac, ForgedBlock
from workers.engine.store.record import (
    HEADER_SIZE,
    KEY_SIZE,
    CorruptRecord,
    RecordError,
    TruncatedRecord,
    check_key,
    decode,
    encode,
    read_header,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_META_GUESS = 4096  # GETRANGE this much meta in scan; a longer meta costs a second read


@dataclass(frozen=True, slots=True)
class RedisConfig:
    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    namespace: str = "kvroute"
    group: str = "default"  # workers sharing blocks: same model deployment
    ttl_s: float | None = 3600.0  # None: no expiry (then maxmemory must evict)
    refresh_ttl_on_get: bool = True  # GETEX (Redis >= 6.2, Valkey)
    connect_timeout_s: float = 0.1
    timeout_s: float = 0.2
    max_connections: int = 64  # one per concurrent transfer thread is enough
    breaker_failures: int = 3
    breaker_backoff_s: float = 1.0
    breaker_max_backoff_s: float = 30.0
    scan_batch: int = 256

    def __post_init__(self) -> None:
        for name in (self.namespace, self.group):
            if not _NAME_RE.match(name):
                raise ValueError(f"namespace/group must match {_NAME_RE.pattern}: {name!r}")
        if self.ttl_s is not None and self.ttl_s < 0.001:
            raise ValueError("ttl_s must be at least 1 ms (or None)")
        if self.breaker_failures < 1 or self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("breaker_failures >= 1 and positive timeouts")

    @property
    def prefix(self) -> bytes:
        return f"{self.namespace}:{self.group}:".encode()


class CircuitBreaker:
    """Closed → (N consecutive failures) → open for `backoff` → one trial call →
    closed on success, or open again for twice as long (up to `max_backoff`). Thread-safe."""

    def __init__(self, failures: int, backoff_s: float, max_backoff_s: float, clock: Clock) -> None:
        self._failures = failures
        self._base = backoff_s
        self._max = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._backoff = backoff_s
        self._open_until: float | None = None
        self._trial = False

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until is not None

    def allow(self) -> bool:
        """May a call go to the server now?"""
        with self._lock:
            if self._open_until is None:
                return True
            if self._trial or self._clock() < self._open_until:
                return False
            self._trial = True
            return True

    def success(self) -> None:
        with self._lock:
            self._consecutive = 0
            self._open_until = None
            self._trial = False
            self._backoff = self._base

    def failure(self) -> bool:
        """Record a failed call; True when this opened the breaker."""
        with self._lock:
            self._consecutive += 1
            if self._trial:
                self._trial = False
                self._backoff = min(self._max, self._backoff * 2)
                self._open_until = self._clock() + self._backoff
                return True
            if self._open_until is None and self._consecutive >= self._failures:
                self._open_until = self._clock() + self._backoff
                return True
            return False


class _Unavailable(Exception):
    """The call did not reach a working server (counted already)."""


class RedisStore:
    """BlockStore over Redis/Valkey (see the module docstring)."""

    tier = "REMOTE"

    def __init__(self, config: RedisConfig, *, on_drop: Callable[[list[bytes]], None] | None = None,
                 clock: Clock = time.monotonic, mac: BlockMac | None = None) -> None:
        self.config = config
        self.mac = mac
        self.scope = b"REMOTE\0" + config.prefix  # what a tag is bound to besides the block
        self.stats = StoreStats()
        self.on_drop = on_drop
        self._lock = threading.Lock()  # guards stats
        self._prefix = config.prefix
        self._ttl_ms = None if config.ttl_s is None else max(1, int(config.ttl_s * 1000))
        self._refresh = config.refresh_ttl_on_get and self._ttl_ms is not None
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_backoff_s,
                                      config.breaker_max_backoff_s, clock)
        self._client = redis.Redis(
            host=config.host, port=config.port, db=config.db, username=config.username,
            password=config.password, ssl=config.ssl,
            socket_connect_timeout=config.connect_timeout_s, socket_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), 0),  # the breaker decides about retrying, not redis-py
            max_connections=config.max_connections, health_check_interval=0,
        )

    # --- BlockStore -----------------------------------------------------------------

    def put(self, key: bytes, meta: bytes, payload: bytes) -> bool:
        """SET with the TTL; False when the server is unavailable or refuses (e.g. OOM)."""
        check_key(key)
        value = encode(key, meta, payload)
        if self.mac is not None:
            value += self.mac.tag(self.scope, key, meta, payload)
        try:
            self._call(lambda r: r.set(self._name(key), value, px=self._ttl_ms))
        except _Unavailable:
            return False
        self._count(puts=1, put_bytes=len(payload))
        return True

    def get(self, key: bytes) -> Record | None:
        """GET(EX) and verify; a corrupt value is deleted and dropped."""
        name = self._name(key)
        self._count(gets=1)

        def fetch(r: redis.Redis) -> bytes | None:
            return cast(bytes | None, r.getex(name, px=self._ttl_ms) if self._refresh else r.get(name))

        try:
            value = self._call(fetch)
        except _Unavailable:
            self._count(misses=1)
            return None
        if value is None:
            self._count(misses=1)
            self._notify([key])
            return None
        try:
            record = self._open(value, key)
        except RecordError as err:
            self._drop_corrupt(key, err)
            self._count(misses=1)
            return None
        self._count(hits=1, get_bytes=len(record.payload))
        return record

    def contains(self, keys: Iterable[bytes]) -> list[bool]:
        """Pipelined EXISTS (one round trip); all False when the server is unavailable."""
        names = [self._name(k) for k in keys]
        if not names:
            return []

        def exists(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for n in names:
                pipe.exists(n)
            return pipe.execute()

        try:
            return [bool(x) for x in self._call(exists)]
        except _Unavailable:
            return [False] * len(names)

    def discard(self, keys: Iterable[bytes]) -> int:
        """DEL for the whole group (a purge); how many existed. 0 when unavailable."""
        names = list(dict.fromkeys(self._name(k) for k in keys))
        deleted = 0
        for i in range(0, len(names), 1000):
            chunk = names[i : i + 1000]
            try:
                deleted += self._call(partial(_delete, chunk))
            except _Unavailable:
                break
        return deleted

    def scan(self) -> Iterator[tuple[bytes, bytes]]:
        """(key, meta) of every block of the group; stops quietly if the server goes away."""
        seen: set[bytes] = set()
        cursor = 0

        def page(r: redis.Redis) -> tuple[int, list[bytes]]:
            found = r.scan(cursor, match=self._prefix + b"*", count=self.config.scan_batch)
            return cast(tuple[int, list[bytes]], found)

        while True:
            try:
                cursor, names = self._call(page)
            except _Unavailable:
                return
            fresh = [(n, k) for n in names if (k := self._key(n)) is not None and k not in seen]
            seen.update(k for _, k in fresh)
            yield from self._metas(fresh)
            if cursor == 0:
                return

    def close(self) -> None:
        self._client.close()

    # --- helpers ----------------------------------------------------------------------

    def _open(self, value: bytes, key: bytes) -> Record:
        """The record in a value, its crcs and (with a MAC) its tag verified."""
        if self.mac is None:
            return decode(value, key)
        if len(value) < HEADER_SIZE + MAC_SIZE:
            raise TruncatedRecord(f"{len(value)} bytes: no room for a record and its MAC")
        record = decode(value[:-MAC_SIZE], key)
        if not self.mac.verify(self.scope, key, record.meta, record.payload, value[-MAC_SIZE:]):
            raise ForgedBlock("MAC mismatch")
        return record

    def _name(self, key: bytes) -> bytes:
        check_key(key)
        return self._prefix + key.hex().encode()

    def _key(self, name: bytes) -> bytes | None:
        tail = name[len(self._prefix) :]
        if not name.startswith(self._prefix) or len(tail) != 2 * KEY_SIZE:
            return None
        try:
            return bytes.fromhex(tail.decode())
        except ValueError:
            return None

    def _metas(self, batch: list[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
        """Header+meta of a SCAN batch (one pipelined GETRANGE each), verified."""
        if not batch:
            return

        def heads(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for name, _ in batch:
                pipe.getrange(name, 0, HEADER_SIZE + _META_GUESS - 1)
            return pipe.execute()

        try:
            values = self._call(heads)
        except _Unavailable:
            return
        for (name, key), head in zip(batch, values, strict=True):
            meta = self._verified_meta(name, key, head)
            if meta is not None:
                yield key, meta

    def _verified_meta(self, name: bytes, key: bytes, head: bytes) -> bytes | None:
        if not head:
            return None  # expired since SCAN saw it
        try:
            h = read_header(head)
            if h.meta_len > _META_GUESS:
                head = cast(bytes, self._call(lambda r: r.getrange(name, 0, HEADER_SIZE + h.meta_len - 1)))
            meta = head[HEADER_SIZE : HEADER_SIZE + h.meta_len]
            if len(meta) < h.meta_len:
                raise TruncatedRecord("value shorter than its header says")
            h.check_head(meta)
            if h.key != key or h.tombstone:
                raise CorruptRecord("record is for another key")
        except RecordError as err:
            self._drop_corrupt(key, err)
            return None
        except _Unavailable:
            return None
        return meta

    def _drop_corrupt(self, key: bytes, err: RecordError) -> None:
        log.warning("REMOTE dropped block %s: %s", key.hex()[:16], err)
        self._count(**{err.stat: 1, "dropped": 1})
        try:
            self._call(lambda r: r.delete(self._name(key)))
        except _Unavailable:
            pass
        self._notify([key])

    def _call(self, op: Callable[[redis.Redis], T]) -> T:
        """Run op against the server through the breaker; _Unavailable on any failure."""
        if not self.breaker.allow():
            self._count(breaker_skips=1)
            raise _Unavailable
        try:
            result = op(self._client)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as err:
            self._count(io_errors=1)
            if self.breaker.failure():
                self._count(breaker_trips=1)
                log.warning("REMOTE %s:%d unavailable (%s): breaker open", self.config.host, self.config.port, err)
            raise _Unavailable from err
        except redis.RedisError as err:  # the server answered, with an error (OOM, ...)
            self._count(io_errors=1)
            self.breaker.success()
            log.warning("REMOTE error: %s", err)
            raise _Unavailable from err
        self.breaker.success()
        return result

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + n)

    def _notify(self, keys: list[bytes]) -> None:
        if keys and self.on_drop is not None:
            try:
                self.on_drop(keys)
            except Exception:
                log.exception("REMOTE on_drop callback failed")


def _delete(names: list[bytes], r: redis.Redis) -> int:
    return int(r.delete(*names))
