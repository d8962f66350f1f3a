"""Gateway trace recording in the Mooncake format (opt-in: observability.trace.enabled).

One JSON line per finished request with `hash_ids` that keep the traffic's exact
prefix-sharing structure and none of its content: chained block keys (scoped by
tenant), HMAC'd with the recording salt, numbered in order of first appearance.
Never text, never token ids. Bounded id map; buffered writes. Details: docs/gateway.md.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from array import array
from pathlib import Path

import msgspec

from kvindex.keys import ROOT_KEY, BlockHasher, Namespace

log = logging.getLogger("kvroute.recorder")


class _Line(msgspec.Struct):
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


class TraceRecorder:
    def __init__(
        self, path: str | Path, salt: str | None = None, block_tokens: int = 512, max_ids: int = 10_000_000
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab", buffering=1 << 16)
        self._key = (salt or os.urandom(32).hex()).encode()
        self.block_tokens = block_tokens
        self.max_ids = max_ids
        self._ids: dict[bytes, int] = {}
        self._t0 = time.monotonic()
        self._last_flush = self._t0
        self._enc = msgspec.json.Encoder()
        self._hashers: dict[bytes, BlockHasher] = {}
        self.lines = 0
        self.stopped = False

    def hash_ids(self, ids: array[int], scoped: Namespace) -> list[int]:
        ns = scoped.model_level()
        hasher = self._hashers.get(ns.digest)
        if hasher is None:
            hasher = self._hashers[ns.digest] = BlockHasher(ns.digest, self.block_tokens)
        buf = ids.tobytes()
        n_full = len(ids) // self.block_tokens
        # The scope's salt marks block 0 here (the recording's own block size).
        extra = [(scoped.wire_salt,)] + [None] * (n_full - 1) if scoped.wire_salt and n_full else None
        keys = hasher.keys(buf, extra)
        rest = len(ids) - n_full * self.block_tokens
        if rest:
            parent = keys[-1] if keys else ROOT_KEY
            salt = (scoped.wire_salt or "").encode()
            keys.append(hashlib.sha256(b"partial" + salt + parent + buf[n_full * self.block_tokens * 4 :]).digest())
        out = []
        table = self._ids
        for k in keys:
            h = hmac.new(self._key, k, hashlib.sha256).digest()[:16]
            i = table.get(h)
            if i is None:
                i = table[h] = len(table)
            out.append(i)
        return out

    def record(self, arrival_t: float, ids: array[int], scoped: Namespace, output_length: int) -> None:
        """Append a line for a finished request (`arrival_t` on the monotonic clock)."""
        if self.stopped:
            return
        if len(self._ids) >= self.max_ids:
            self.stopped = True
            log.warning("trace recording stopped: %d distinct block ids reached (max_ids)", self.max_ids)
            return
        line = _Line(int((arrival_t - self._t0) * 1000), len(ids), output_length, self.hash_ids(ids, scoped))
        self._f.write(self._enc.encode(line) + b"\n")
        self.lines += 1
        now = time.monotonic()
        if now - self._last_flush > 1.0:
            self._f.flush()
            self._last_flush = now

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            self._f.close()
