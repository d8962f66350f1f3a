"""Model defaults from a hardware/model profile YAML (configs/profiles/*.yaml), read as data.

The gateway never imports `workers` (docs/design.md §3), but a profile is the single source
of a simulated fleet's namespace and speeds, so the gateway reads the same YAML: the
model id, KV dtype, parallel layout and block size give the namespace (which must equal
what the workers report in /info), and the geometry, compute and tier sections give
cost defaults used until a worker's own /load report arrives (and for vLLM workers,
which never send one).
"""
from __future__ import annotations

from typing import Any

from .fleet.fleetconfig import CostConfig, LinkConfig, NamespaceConfig


def namespace_from_profile(p: dict[str, Any]) -> NamespaceConfig:
    return NamespaceConfig(
        revision=str(p.get("revision", "")),
        tokenizer_revision=str(p.get("tokenizer_revision", "")),
        kv_dtype=str(p.get("kv_dtype", "auto")),
        parallel=str(p.get("parallel", "tp1")),
        block_size=int(p.get("block_size", 16)),
    )


def cost_from_profile(p: dict[str, Any]) -> CostConfig:
    """Cost defaults: block bytes from the KV geometry, speeds, and one link per tier."""
    g = p["geometry"]
    bs = int(p.get("block_size", 16))
    block_bytes = 2 * int(g["layers"]) * int(g["kv_heads"]) * int(g["head_dim"]) * int(g["dtype_bytes"]) * bs
    c = p["compute"]
    links = {}
    for section, tier in (("cpu", "CPU"), ("disk", "DISK"), ("remote", "REMOTE"), ("peer", "PEER")):
        s = p.get(section)
        if isinstance(s, dict) and s.get("read_Bps"):
            links[tier] = LinkConfig(read_Bps=float(s["read_Bps"]), latency_s=float(s.get("latency_s", 0.0)))
    return CostConfig(
        block_bytes=block_bytes,
        prefill_tokens_per_s=float(c["prefill_tokens_per_s"]),
        prefill_attn_s_per_token2=float(c.get("prefill_attn_s_per_token2", 0.0)),
        prefill_overhead_s=float(c.get("prefill_overhead_s", 0.0)),
        decode_step_s=float(c.get("decode_base_s", 0.0)),
        links=links,
    )
