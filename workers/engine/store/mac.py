"""Keyed MACs of the blocks that leave a worker (REMOTE values, PEER export records).

A crc32 says a block was not torn; it does not say who wrote it. Anyone who can write to
the shared Redis, or answer a `/kv/blocks` pull, could otherwise place well-formed wrong
KV that is served as a hit: silently wrong output. Every block written to REMOTE or sent
to a peer therefore carries HMAC-SHA256 over (scope, block key, meta, payload), keyed
with a key derived from the fleet secret (`KVROUTE_PEER_TOKEN`), and a reader serves it
only when the tag verifies. The scope names the tier and the model namespace (REMOTE:
also the group), and the key is the chained block key (which already binds tenant salt,
model and position), so a valid block cannot be replayed under another key, namespace,
group or tenant. The secret is never used raw: HKDF-SHA256 (RFC 5869) with a fixed
context string gives the MAC key (workers/fleetkeys.py), independent of the bearer token
peers present, which is derived with another context.

HMAC-SHA256 rather than keyed BLAKE2b: stdlib both, but SHA-256 runs on the CPU's SHA
extensions here and is about 2.5x faster (bench/bench_block_mac.py, docs/engine-store.md).
"""
from __future__ import annotations

import hashlib
import hmac
import struct

from workers.fleetkeys import block_mac_key

from .record import RecordError, check_key

MAC_SIZE = 32
_LENGTHS = struct.Struct("<III")  # scope, meta and payload lengths: no two inputs frame alike


class BlockMac:
    """Tags and checks blocks under one fleet secret (see the module doc)."""

    def __init__(self, secret: str | bytes) -> None:
        self._key = block_mac_key(secret)

    def tag(self, scope: bytes, key: bytes, meta: bytes | memoryview, payload: bytes | memoryview) -> bytes:
        """The 32-byte tag of one block under `scope` (tier and namespace)."""
        check_key(key)
        h = hmac.new(self._key, _LENGTHS.pack(len(scope), len(meta), len(payload)), hashlib.sha256)
        h.update(scope)
        h.update(key)
        h.update(meta)
        h.update(payload)
        return h.digest()

    def verify(self, scope: bytes, key: bytes, meta: bytes | memoryview, payload: bytes | memoryview,
               tag: bytes | memoryview) -> bool:
        """Whether `tag` is this block's tag (constant-time comparison)."""
        return len(tag) == MAC_SIZE and hmac.compare_digest(self.tag(scope, key, meta, payload), bytes(tag))


class ForgedBlock(RecordError):
    """A block whose MAC does not verify: written by someone without the fleet secret (or
    under another key, namespace or group). Never served; the tokens are recomputed."""

    stat = "mac_failures"
