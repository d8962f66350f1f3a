"""Block keys and namespaces (DESIGN.md §4.1).

Only full blocks are keyed. Each key chains the previous one:

    key_i = SHA-256( ns_i || key_{i-1} || tokens_i )        key_{-1} = ROOT_KEY

`tokens_i` are the block's token ids as unsigned 32-bit little-endian integers,
`ns_i` is the 32-byte namespace digest of block i: the model-level digest
(`Namespace.digest`), or, for a block that carries extra keys (LoRA name,
multimodal hashes, cache salt: the per-block `extra_keys` that vLLM publishes),
SHA-256(model digest || msgpack(extra_keys_i)). Because every key chains its
parent, an extra key set on block j changes the keys of j and every later block;
this is how a tenant salt isolates everything after a deliberately shared prefix.

SHA-256, not a fast non-cryptographic hash: with a 64-bit FNV or xxhash a crafted
prompt can collide with another tenant's block. The index may keep `digest64`
(the first 8 bytes, little-endian) because routing is advisory; engines keep full
keys and verify them.

Speed: the namespace prefix is absorbed once into a SHA-256 state that is copied
per block (no re-hashing of the constant 32 bytes), the prompt is packed to bytes
once with `array`, and digests are sliced out of one joined buffer by numpy.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec
import numpy as np

ROOT_KEY = bytes(32)
KEY_BYTES = 32
_ENC = msgspec.msgpack.Encoder()

ExtraKeys = tuple[Any, ...]


def tokens_to_bytes(tokens: Sequence[int] | bytes | memoryview) -> bytes:
    """Token ids as u32 little-endian bytes (the byte form every key is computed over)."""
    if isinstance(tokens, (bytes, memoryview)):
        return bytes(tokens)
    a = array("I", tokens)  # raises OverflowError on ids outside [0, 2**32)
    if a.itemsize != 4:  # pragma: no cover - 'I' is 4 bytes on every platform we run on
        a = array("L", tokens)
    return a.tobytes()


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV non-interchangeable (DESIGN.md §4.1).

    The model-level part (model id, weight revision, tokenizer revision, KV dtype,
    parallel layout, block size) is fixed per deployment and hashed into `digest`.
    The request-level part (LoRA adapter, multimodal input hashes, tenant salt,
    request cache salt) becomes per-block extra keys, exactly where vLLM puts them,
    so keys recomputed from a vLLM `BlockStored` event match the router's.
    """

    model: str
    revision: str = ""
    tokenizer_revision: str = ""
    kv_dtype: str = "auto"
    parallel: str = "tp1"
    block_size: int = 16
    lora: str | None = None
    mm_hashes: tuple[str, ...] = ()
    tenant_salt: str = ""
    cache_salt: str = ""
    # Leading blocks declared shared across tenants (public system prompts); the salt
    # is attached to the first block after them instead of block 0.
    shared_prefix_blocks: int = 0
    _extra_cache: dict[int, list[ExtraKeys | None] | None] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    @cached_property
    def digest(self) -> bytes:
        """32-byte digest of the model-level fields (what every block shares)."""
        return hashlib.sha256(
            _ENC.encode(
                [
                    "kvroute-ns-v1",
                    self.model,
                    self.revision,
                    self.tokenizer_revision,
                    self.kv_dtype,
                    self.parallel,
                    self.block_size,
                ]
            )
        ).digest()

    def model_level(self) -> Namespace:
        """The same deployment without any request-level field."""
        return Namespace(
            self.model, self.revision, self.tokenizer_revision, self.kv_dtype, self.parallel, self.block_size
        )

    def scoped(
        self,
        *,
        lora: str | None = None,
        mm_hashes: tuple[str, ...] = (),
        tenant_salt: str = "",
        cache_salt: str = "",
        shared_prefix_blocks: int = 0,
    ) -> Namespace:
        """This deployment narrowed to one request's adapter, inputs and tenant."""
        return Namespace(
            self.model,
            self.revision,
            self.tokenizer_revision,
            self.kv_dtype,
            self.parallel,
            self.block_size,
            lora,
            tuple(mm_hashes),
            tenant_salt,
            cache_salt,
            shared_prefix_blocks,
        )

    @cached_property
    def wire_salt(self) -> str | None:
        """The single `cache_salt` string sent to workers (vLLM's field).

        The tenant salt is never sent as is: it is folded with the request's own
        salt through SHA-256, so a worker log shows neither.
        """
        if not self.tenant_salt:
            return self.cache_salt or None
        h = hashlib.sha256(f"{self.tenant_salt}\x00{self.cache_salt}".encode()).hexdigest()
        return "t:" + h[:32]

    def extra_keys(self, n_blocks: int) -> list[ExtraKeys | None] | None:
        """Per-block extra keys in vLLM's order: LoRA name, multimodal hashes, salt.

        The LoRA name marks every block (as in vLLM); multimodal hashes mark block 0
        (input positions are not modelled yet, so the whole chain depends on them);
        the salt marks block `shared_prefix_blocks` (0 unless a shared prefix is
        declared). Returns None when no block carries anything.
        """
        cached = self._extra_cache.get(n_blocks, ...)
        if cached is not ...:
            return cached  # type: ignore[return-value]
        salt = self.wire_salt
        if not (self.lora or self.mm_hashes or salt):
            out: list[ExtraKeys | None] | None = None
        else:
            out = []
            for i in range(n_blocks):
                items: list[Any] = []
                if self.lora:
                    items.append(self.lora)
                if i == 0:
                    items.extend(self.mm_hashes)
                if salt and i == self.shared_prefix_blocks:
                    items.append(salt)
                out.append(tuple(items) if items else None)
        if len(self._extra_cache) < 64:
            self._extra_cache[n_blocks] = out
        return out


class BlockHasher:
    """Computes chained keys for one model-level namespace.

    Holds SHA-256 states with each distinct `ns_i` already absorbed (bounded), so
    hashing a block costs one state copy and one update.
    """

    __slots__ = ("block_size", "base", "_states", "_max_states")

    def __init__(self, base_digest: bytes, block_size: int, max_states: int = 4096) -> None:
        if len(base_digest) != KEY_BYTES:
            raise ValueError("namespace digest must be 32 bytes")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.base = base_digest
        self._max_states = max_states
        root = hashlib.sha256(base_digest)
        self._states: dict[bytes, Any] = {b"": root}

    @classmethod
    def for_namespace(cls, ns: Namespace) -> BlockHasher:
        return cls(ns.digest, ns.block_size)

    def _state(self, extra: ExtraKeys | None) -> Any:
        if not extra:
            return self._states[b""]
        packed = _ENC.encode(list(extra))
        st = self._states.get(packed)
        if st is None:
            ns_i = hashlib.sha256(self.base + packed).digest()
            st = hashlib.sha256(ns_i)
            if len(self._states) >= self._max_states:
                # keep the root state; drop the rest (cheap to rebuild)
                self._states = {b"": self._states[b""]}
            self._states[packed] = st
        return st

    def keys(
        self,
        tokens: Sequence[int] | bytes,
        extra_keys: Sequence[ExtraKeys | None] | None = None,
        parent: bytes = ROOT_KEY,
        max_blocks: int | None = None,
    ) -> list[bytes]:
        """Keys of every full block of `tokens` (a trailing partial block is not keyed)."""
        buf = tokens_to_bytes(tokens)
        step = self.block_size * 4
        n = len(buf) // step
        if max_blocks is not None:
            n = min(n, max_blocks)
        out: list[bytes] = []
        append = out.append
        prev = parent
        if extra_keys is None:
            root = self._states[b""]
            copy = root.copy
            for off in range(0, n * step, step):
                h = copy()
                h.update(prev + buf[off : off + step])
                prev = h.digest()
                append(prev)
            return out
        state = self._state
        for i in range(n):
            extra = extra_keys[i] if i < len(extra_keys) else None
            h = state(extra).copy()
            off = i * step
            h.update(prev + buf[off : off + step])
            prev = h.digest()
            append(prev)
        return out

    def keys_for(self, tokens: Sequence[int] | bytes, ns: Namespace) -> list[bytes]:
        """Keys of `tokens` under `ns`'s request-level scope (LoRA, salts, mm hashes)."""
        n_blocks = (len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)) // self.block_size
        return self.keys(tokens, ns.extra_keys(n_blocks))


def digest64(key: bytes) -> int:
    """The index's 64-bit form of a key: its first 8 bytes, little-endian."""
    return int.from_bytes(key[:8], "little")


def digests64(keys: Sequence[bytes]) -> list[int]:
    """`digest64` of many keys at once (one join, one numpy view)."""
    if not keys:
        return []
    return np.frombuffer(b"".join(keys), dtype="<u8")[:: KEY_BYTES // 8].tolist()
