"""Keys derived from the fleet secret (`KVROUTE_PEER_TOKEN`), one per use.

The secret itself never leaves a worker. What a worker sends to a peer, and what the
peer compares, is `peer_bearer(secret)`; the key of the MAC that REMOTE values and peer
records carry is `block_mac_key(secret)` (workers/engine/store/mac.py). Both come from
HKDF-SHA256 (RFC 5869) with fixed context strings, so they are independent: an endpoint
named as a peer learns the bearer and can read blocks, but cannot derive the MAC key and
so cannot plant KV that a worker would serve. Shared by the real and the simulated
engines' HTTP surfaces, hence here and not under either.
"""
from __future__ import annotations

import base64
import hmac

BEARER_CONTEXT = b"kvroute/v1 peer bearer token"
MAC_CONTEXT = b"kvroute/v1 block MAC: REMOTE values and PEER records"


def hkdf_sha256(secret: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 HKDF with SHA-256 and an all-zero salt: `length` bytes for `info`."""
    prk = hmac.digest(b"\0" * 32, secret, "sha256")
    out, block, i = b"", b"", 0
    while len(out) < length:
        i += 1
        block = hmac.digest(prk, block + info + bytes([i]), "sha256")
        out += block
    return out[:length]


def _raw(secret: str | bytes) -> bytes:
    raw = secret.encode() if isinstance(secret, str) else secret
    if not raw:
        raise ValueError("the fleet secret is empty")
    return raw


def peer_bearer(secret: str | bytes) -> str:
    """The bearer token of `/kv/blocks` calls between workers of the fleet."""
    return base64.urlsafe_b64encode(hkdf_sha256(_raw(secret), BEARER_CONTEXT)).decode().rstrip("=")


def block_mac_key(secret: str | bytes) -> bytes:
    """The HMAC-SHA256 key of blocks that leave a worker."""
    return hkdf_sha256(_raw(secret), MAC_CONTEXT)
