"""Block keys and namespaces.

Only full blocks are keyed. Each key chains the previous one:

    key_i = SHA-256( ns_i || BLOCK_TAG || key_{i-1} || tokens_i )      key_{-1} = ROOT_KEY

`tokens_i` are the block's token ids as unsigned 32-bit little-endian integers,
`ns_i` is the 32-byte namespace digest of block i: the model-level digest
(`Namespace.digest`), or, for a block that carries extra keys (LoRA name,
multimodal hashes, cache salt: the per-block `extra_keys` that vLLM publishes),
SHA-256(model digest || msgpack(extra_keys_i)). Because every key chains its
parent, an extra key set on block j changes the keys of j and every later block;
this is how a tenant salt isolates everything after a deliberately shared prefix,
and why two namespaces never share a key (short of a SHA-256 collision).

SHA-256, not a fast non-cryptographic hash: with a 64-bit FNV or xxhash a crafted
prompt can collide with another tenant's block. The index may keep `digest64`
(the first 8 bytes, little-endian) because routing is advisory; engines keep full
keys and verify them.

Speed (8k tokens at block size 16 in ~0.25 ms here, see bench/bench_keys.py):
- `ns_i || BLOCK_TAG` is exactly one 64-byte SHA-256 block, absorbed once into a
  state that is copied per block, so each block costs two compressions, not three;
- the prompt is packed to u32 bytes once (`array`) and split into blocks by
  `struct.iter_unpack` in C;
- the per-block loop is three C calls (copy, update, digest) and nothing else:
  per-block states for extra keys are laid out before the loop, from the
  namespace's structure rather than by scanning a list;
- `digests64` slices all digests out of one joined buffer with numpy.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgspec
import numpy as np

ROOT_KEY = bytes(32)
KEY_BYTES = 32
# Completes the 32-byte namespace digest to one 64-byte SHA-256 block (see module doc).
BLOCK_TAG = b"kvroute/block-key/v2".ljust(32, b"\0")
_ENC = msgspec.msgpack.Encoder()

ExtraKeys = tuple[Any, ...]
_BIG_ENDIAN = sys.byteorder == "big"
if array("I").itemsize != 4:  # pragma: no cover
    raise ImportError("kvindex.keys needs a 4-byte C unsigned int")


def tokens_to_bytes(tokens: Sequence[int] | bytes | memoryview | np.ndarray) -> bytes:
    """Token ids as u32 little-endian bytes (the byte form every key is computed over).

    Raises OverflowError for an id outside [0, 2**32) and TypeError for a non-int.
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        return bytes(tokens)
    if isinstance(tokens, np.ndarray):
        if tokens.size and (tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() >= 1 << 32):
            raise OverflowError("token ids must be integers in [0, 2**32)")
        return tokens.astype("<u4", copy=False).tobytes()
    a = array("I", tokens)
    if _BIG_ENDIAN:  # pragma: no cover - every platform we run on is little-endian
        a.byteswap()
    return a.tobytes()


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV non-interchangeable.

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

    def extra_layout(self) -> tuple[ExtraKeys | None, tuple[tuple[int, ExtraKeys], ...]] | None:
        """The per-block extra keys in compact form: (every block's, ((index, extra), ...)).

        vLLM's order within a block: LoRA name, multimodal hashes, salt. The LoRA
        name marks every block (as in vLLM); multimodal hashes mark block 0 (input
        positions are not modelled yet, so the whole chain depends on them); the salt
        marks block `shared_prefix_blocks` (0 unless a shared prefix is declared).
        None when no block carries anything.
        """
        salt = self.wire_salt
        if not (self.lora or self.mm_hashes or salt):
            return None
        base: tuple[Any, ...] = (self.lora,) if self.lora else ()
        marks: dict[int, list[Any]] = {}
        if self.mm_hashes:
            marks.setdefault(0, list(base)).extend(self.mm_hashes)
        if salt:
            marks.setdefault(max(0, self.shared_prefix_blocks), list(base)).append(salt)
        return (base or None), tuple((i, tuple(v)) for i, v in sorted(marks.items()))

    def extra_keys(self, n_blocks: int) -> list[ExtraKeys | None] | None:
        """Per-block extra keys, one entry per block (what vLLM publishes as `extra_keys`)."""
        cached = self._extra_cache.get(n_blocks, ...)
        if cached is not ...:
            return cached
        layout = self.extra_layout()
        out: list[ExtraKeys | None] | None = None
        if layout is not None:
            default, marked = layout
            out = [default] * n_blocks
            for i, extra in marked:
                if i < n_blocks:
                    out[i] = extra
        if len(self._extra_cache) < 64:
            self._extra_cache[n_blocks] = out
        return out


class BlockHasher:
    """Computes chained keys for one model-level namespace.

    Holds SHA-256 states with each distinct `ns_i || BLOCK_TAG` already absorbed
    (bounded), so hashing a block costs one state copy, one update and one digest:
    two SHA-256 compressions (the 96 bytes `key_{i-1} || tokens_i` plus padding).
    """

    __slots__ = ("block_size", "base", "_root", "_states", "_max_states", "_split")

    def __init__(self, base_digest: bytes, block_size: int, max_states: int = 4096) -> None:
        if len(base_digest) != KEY_BYTES:
            raise ValueError("namespace digest must be 32 bytes")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.base = base_digest
        self._max_states = max_states
        self._root = hashlib.sha256(base_digest + BLOCK_TAG)
        self._states: dict[bytes, Any] = {}
        # Splits a token buffer into per-block byte strings in C (faster than slicing).
        self._split = struct.Struct(f"{block_size * 4}s").iter_unpack

    @classmethod
    def for_namespace(cls, ns: Namespace) -> BlockHasher:
        return cls(ns.digest, ns.block_size)

    def _state(self, extra: ExtraKeys | None) -> Any:
        """The absorbed prefix state for a block whose extra keys are `extra`."""
        if not extra:
            return self._root
        packed = _ENC.encode(list(extra))
        st = self._states.get(packed)
        if st is None:
            ns_i = hashlib.sha256(self.base + packed).digest()
            st = hashlib.sha256(ns_i + BLOCK_TAG)
            if len(self._states) >= self._max_states:
                self._states.clear()  # bounded; cheap to rebuild
            self._states[packed] = st
        return st

    def states_for(self, extra_keys: Sequence[ExtraKeys | None], n: int) -> list[Any]:
        """One prefix state per block; equal all-string extra keys share one lookup.

        Only all-string tuples are memoised by equality: 1, 1.0 and True are equal
        in Python but not in msgpack, so anything else goes through its encoding.
        """
        root = self._root
        states = [root] * n
        memo: dict[Any, Any] = {}
        for i, extra in enumerate(extra_keys[:n]):
            if not extra:
                continue
            if type(extra) is tuple and all(type(x) is str for x in extra):
                st = memo.get(extra)
                if st is None:
                    st = memo[extra] = self._state(extra)
            else:
                st = self._state(extra)
            states[i] = st
        return states

    def chain(self, buf: bytes, n: int, states: list[Any] | None, parent: bytes = ROOT_KEY) -> list[bytes]:
        """Keys of the first `n` blocks of a u32 token buffer (the hot loop).

        `states` gives each block's prefix state (None: all blocks use the root).
        """
        step = self.block_size * 4
        if len(buf) != n * step:
            buf = buf[: n * step]
        out: list[bytes] = []
        append = out.append
        prev = parent
        if states is None:
            copy = self._root.copy
            for (chunk,) in self._split(buf):
                h = copy()
                h.update(prev + chunk)
                prev = h.digest()
                append(prev)
        else:
            for st, (chunk,) in zip(states, self._split(buf), strict=False):  # buf may hold fewer blocks
                h = st.copy()
                h.update(prev + chunk)
                prev = h.digest()
                append(prev)
        return out

    def keys(
        self,
        tokens: Sequence[int] | bytes,
        extra_keys: Sequence[ExtraKeys | None] | None = None,
        parent: bytes = ROOT_KEY,
        max_blocks: int | None = None,
    ) -> list[bytes]:
        """Keys of every full block of `tokens` (a trailing partial block is not keyed).

        `extra_keys[i]` are block i's extra keys (missing entries mean none);
        `parent` is the key of the block before the first one (ROOT_KEY: none).
        """
        buf = tokens_to_bytes(tokens)
        n = len(buf) // (self.block_size * 4)
        if max_blocks is not None:
            n = min(n, max(max_blocks, 0))
        if not n:
            return []
        states = None if extra_keys is None else self.states_for(extra_keys, n)
        return self.chain(buf, n, states, parent)

    def keys_for(self, tokens: Sequence[int] | bytes, ns: Namespace) -> list[bytes]:
        """Keys of `tokens` under `ns`'s request-level scope (LoRA, salts, mm hashes).

        Builds the per-block states from the namespace's structure (a default for
        every block plus at most two marked blocks) instead of scanning a list.
        """
        buf = tokens_to_bytes(tokens)
        n = len(buf) // (self.block_size * 4)
        if not n:
            return []
        layout = ns.extra_layout()
        if layout is None:
            return self.chain(buf, n, None)
        default, marked = layout
        states = [self._state(default)] * n
        for i, extra in marked:
            if i < n:
                states[i] = self._state(extra)
        return self.chain(buf, n, states)


def digest64(key: bytes) -> int:
    """The index's 64-bit form of a key: its first 8 bytes, little-endian."""
    return int.from_bytes(key[:8], "little")


def digests64(keys: Sequence[bytes]) -> list[int]:
    """`digest64` of many keys at once (one join, one numpy view)."""
    if not keys:
        return []
    out: list[int] = np.frombuffer(b"".join(keys), dtype="<u8")[:: KEY_BYTES // 8].tolist()
    return out
