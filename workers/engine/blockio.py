"""A KV block as bytes: its payload, its metadata, and the record stream peers exchange.

One format everywhere below the device pool (docs/engine.md § Tiers, docs/wire.md
§ /kv/blocks): a block leaves the pool as its tensor's raw bytes (`[block_size, layers,
2, kv_heads, head_dim]` in the namespace's dtype, C order, little-endian) and travels as
a record of workers/engine/store/record.py (56-byte header with key and crc32s, meta,
payload) to DISK, to REMOTE and to a peer; toward REMOTE and a peer the record is followed
by its 32-byte keyed MAC (store/mac.py), which the reader checks before the block lands.
The meta is msgpack
`[parent key | b"", token ids, extra keys | None, lora name | None, cache salt | None]`:
enough for whoever lands the block to publish `BlockStored` for it and to purge it by
salt later.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import torch

from workers.api import RECORDS_MEDIA_TYPE  # `Accept` / `Content-Type` of the binary /kv/blocks export
from workers.blockmeta import BlockMeta

from .store.mac import MAC_SIZE, BlockMac, ForgedBlock
from .store.record import HEADER_SIZE, RecordError, TruncatedRecord, decode, encode, read_header

__all__ = ["RECORDS_MEDIA_TYPE", "BadMeta", "block_bytes_of", "decode_meta", "encode_meta", "read_records",
           "record_of", "write_block"]

_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()


class BadMeta(RecordError):
    """A record whose meta (or payload size) is not what this engine writes."""


def encode_meta(meta: BlockMeta, salt: str | None, block_size: int) -> bytes:
    tokens = list(meta.tokens[meta.offset : meta.offset + block_size])
    extra = list(meta.extra) if meta.extra else None
    return _ENC.encode([meta.parent or b"", tokens, extra, meta.lora, salt])


def decode_meta(data: bytes, block_size: int) -> tuple[BlockMeta, str | None]:
    """(metadata, salt); BadMeta when the bytes are not what `encode_meta` writes."""
    try:
        parent, tokens, extra, lora, salt = _DEC.decode(data)
        ok = (isinstance(parent, bytes) and len(parent) in (0, 32) and isinstance(tokens, list)
              and len(tokens) == block_size and all(type(t) is int for t in tokens)
              and (extra is None or isinstance(extra, list)) and (lora is None or isinstance(lora, str))
              and (salt is None or isinstance(salt, str)))
    except (msgspec.DecodeError, TypeError, ValueError):
        ok = False
    if not ok:
        raise BadMeta("undecodable block metadata")
    return BlockMeta(parent or None, tuple(tokens), 0, _tuples(extra) if extra else None, lora), salt


def _tuples(x: Any) -> Any:
    """msgpack gives lists; extra keys are tuples (as `Namespace.extra_keys` makes them)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def block_bytes_of(block: torch.Tensor) -> bytes:
    """A host block tensor's raw bytes (a copy)."""
    return block.reshape(-1).view(torch.uint8).numpy().tobytes()


def write_block(dst: torch.Tensor, payload: bytes | memoryview) -> None:
    """Copy raw bytes into a contiguous host block tensor (no torch warning about read-only
    buffers: the copy goes through numpy)."""
    view = dst.view(-1).view(torch.uint8).numpy()
    if len(payload) != view.size:
        raise TruncatedRecord(f"block payload of {len(payload)} bytes, expected {view.size}")
    view[:] = np.frombuffer(payload, dtype=np.uint8)


def record_of(key: bytes, meta: bytes, payload: bytes) -> bytes:
    return encode(key, meta, payload)


def read_records(read: Callable[[int], bytes], keys: list[bytes], mac: BlockMac,
                 scope: bytes) -> Iterator[tuple[bytes, bytes, bytes]]:
    """Records of a /kv/blocks export, in the order of `keys` (the exporter sends the leading
    run it holds), each followed by its MAC under `scope`: (key, meta, payload) each,
    verified. Stops at a clean end of stream; raises RecordError on a bad or truncated
    record, one for an unexpected key, or ForgedBlock when its MAC does not verify."""
    for want in keys:
        head = _read_exact(read, HEADER_SIZE, allow_eof=True)
        if not head:
            return
        h = read_header(head)
        rest = _read_exact(read, h.meta_len + h.payload_len + MAC_SIZE, allow_eof=False)
        rec = decode(head + rest[:-MAC_SIZE], want)  # checks both crcs and the key
        if not mac.verify(scope, rec.key, rec.meta, rec.payload, rest[-MAC_SIZE:]):
            raise ForgedBlock(f"block {want.hex()[:16]}: MAC mismatch")
        yield rec.key, rec.meta, rec.payload


def _read_exact(read: Callable[[int], bytes], n: int, *, allow_eof: bool) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < n:
        b = read(n - got)
        if not b:
            if allow_eof and got == 0:
                return b""
            raise TruncatedRecord(f"stream ended after {got} of {n} bytes")
        parts.append(b)
        got += len(b)
    return b"".join(parts)
