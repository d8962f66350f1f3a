"""Prefill/decode disaggregation: the `kv_transfer_params` of a request, read and written.

The exchange is vLLM's (docs/engine.md § Prefill/decode roles): a request carrying
`do_remote_decode: true` is a prefill for another worker; its answer carries the fields a
decode worker needs (`do_remote_prefill: true`, the prefill worker's id, block keys, host
and port of its peer path). A request carrying those fields is a decode: the listed blocks
are pulled from that worker's `/kv/blocks` before it is scheduled.
"""
from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from workers.errors import BadRequest, EngineError

PARAM = "kv_transfer_params"
KEY_HEX = 64  # a block key (32 bytes) in hex


class PeerPullFailed(EngineError):
    """The decode side could not pull the prefill worker's blocks (unreachable, refused, gone)."""

    status = 502
    type = "server_error"
    code = "kv_transfer_failed"


class PeerPullTimeout(EngineError):
    status = 504
    type = "server_error"
    code = "kv_transfer_timeout"


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A decode's source: the prefill worker's peer URL and the blocks to pull, in chain order."""

    url: str
    keys: list[bytes]
    engine_id: str | None


def _flag(p: Mapping[str, Any], name: str) -> bool:
    v = p.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"{PARAM}.{name} must be a boolean", param=f"{PARAM}.{name}")
    return v


def parse(p: Mapping[str, Any], max_blocks: int) -> str | RemotePrefill | None:
    """What a request's `kv_transfer_params` ask: "prefill" (prefill for a remote decode), a
    `RemotePrefill` (decode after a remote prefill), or None (nothing: run it here)."""
    decode_elsewhere = _flag(p, "do_remote_decode")
    prefilled_elsewhere = _flag(p, "do_remote_prefill")
    if decode_elsewhere and prefilled_elsewhere:
        raise BadRequest(f"{PARAM}: do_remote_decode and do_remote_prefill cannot both be true", param=PARAM)
    if decode_elsewhere:
        return "prefill"
    if not prefilled_elsewhere:
        return None
    ids = p.get("remote_block_ids")
    if not isinstance(ids, list):
        raise BadRequest(f"{PARAM}.remote_block_ids must be a list of block keys (hex)",
                         param=f"{PARAM}.remote_block_ids")
    if len(ids) > max_blocks:
        raise BadRequest(f"{PARAM}.remote_block_ids lists {len(ids)} blocks, more than this worker's context "
                         f"holds ({max_blocks})", param=f"{PARAM}.remote_block_ids")
    keys = []
    for k in ids:
        if not isinstance(k, str) or len(k) != KEY_HEX:
            raise BadRequest(f"{PARAM}.remote_block_ids must be kvroute block keys ({KEY_HEX} hex digits each); "
                             "a vLLM prefill worker's block ids cannot be pulled by this engine",
                             param=f"{PARAM}.remote_block_ids")
        try:
            keys.append(bytes.fromhex(k))
        except ValueError:
            raise BadRequest(f"{PARAM}.remote_block_ids holds a key that is not hex: {k[:16]!r}...",
                             param=f"{PARAM}.remote_block_ids") from None
    host = p.get("remote_host")
    port = p.get("remote_port")
    if not isinstance(host, str) or not host or any(c in host for c in "/?#@ \t\r\n"):
        raise BadRequest(f"{PARAM}.remote_host must be a host name or address", param=f"{PARAM}.remote_host")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise BadRequest(f"{PARAM}.remote_port must be a port number", param=f"{PARAM}.remote_port")
    engine_id = p.get("remote_engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        raise BadRequest(f"{PARAM}.remote_engine_id must be a string", param=f"{PARAM}.remote_engine_id")
    scheme = p.get("kvroute_scheme", "http")
    if scheme not in ("http", "https"):
        raise BadRequest(f"{PARAM}.kvroute_scheme must be http or https", param=f"{PARAM}.kvroute_scheme")
    netloc = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return RemotePrefill(f"{scheme}://{netloc}:{port}", keys, engine_id)


def prefill_answer(*, worker_id: str, url: str, request_id: str, keys: list[bytes], block_size: int,
                   pin_id: str, pin_s: float) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill for a remote decode answers with: vLLM's fields,
    the block ids being our block keys (hex, chain order), host and port those of this
    worker's peer path; ours prefixed `kvroute_`."""
    u = urllib.parse.urlsplit(url) if url else None
    host = u.hostname if u is not None else None
    port = u.port if u is not None else None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": worker_id,
        "remote_block_ids": [k.hex() for k in keys],
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id,
        "kvroute_scheme": u.scheme if u is not None and u.scheme else "http",
        "kvroute_block_size": block_size,
        "kvroute_tokens": len(keys) * block_size,
        "kvroute_pin_id": pin_id,
        "kvroute_pin_s": pin_s,
    }


@dataclass(slots=True, eq=False)
class PdPin:
    """The prompt blocks a prefill for a remote decode keeps for the decode worker: `bids`
    referenced (not evictable, not offloaded) until every key of `pending` was exported to a
    peer or `deadline` (the engine clock) passed."""

    keys: list[bytes]
    bids: list[int]
    pending: set[bytes]
    deadline: float
