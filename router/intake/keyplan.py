"""A request's block keys under its scope: tenant salt, cache salt, shared prefixes.

Routing, prefetch and the wire share one `KeyPlan` per request, so the keys the index
is asked about are the keys the worker computes (docs/wire.md, "Block keys"). Scoped
namespaces (whose extra keys and wire salt are cached on the object) are kept in a
small LRU: a request costs one lookup, not a namespace build.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from kvindex.keys import BlockHasher, Namespace, digests64

SCOPED_CACHE_SIZE = 4096


@dataclass(slots=True)
class SharedPrefix:
    """A prompt prefix shared across tenants on purpose: its full blocks stay unsalted."""

    name: str
    ids: array[int]
    blocks: int


@dataclass(slots=True)
class KeyPlan:
    """A request's keys under its scope (what routing, prefetch and the wire share)."""

    scoped: Namespace
    keys: list[bytes]
    digests: list[int]
    wire_salt: str | None
    shared_blocks: int
    # vLLM workers salt from block 0 (they do not know shared prefixes): their digests
    # differ from `digests` only when `shared_blocks` > 0 and a salt applies.
    vllm_digests: list[int] | None = None


class KeyPlanner:
    def __init__(self, namespace: Namespace) -> None:
        self.namespace = namespace
        self.block_size = namespace.block_size
        self.hasher = BlockHasher.for_namespace(namespace)
        self.shared: list[SharedPrefix] = []  # longest first
        self.has_vllm_workers = False
        self._scoped: OrderedDict[tuple[str, str, int, str], Namespace] = OrderedDict()

    def add_shared(self, sp: SharedPrefix) -> None:
        self.shared.append(sp)
        self.shared.sort(key=lambda s: len(s.ids), reverse=True)

    def shared_blocks(self, ids: array[int]) -> int:
        """Leading blocks of `ids` covered by the longest declared shared prefix it starts with."""
        for sp in self.shared:
            n = len(sp.ids)
            if sp.blocks and len(ids) >= n and ids[:n] == sp.ids:
                return sp.blocks
        return 0

    def scoped(self, tenant_salt: str, cache_salt: str, shared_blocks: int, lora: str | None = None) -> Namespace:
        key = (tenant_salt, cache_salt, shared_blocks, lora or "")
        ns = self._scoped.get(key)
        if ns is None:
            ns = self.namespace.scoped(lora=lora, tenant_salt=tenant_salt, cache_salt=cache_salt,
                                       shared_prefix_blocks=shared_blocks)
            self._scoped[key] = ns
            if len(self._scoped) > SCOPED_CACHE_SIZE:
                self._scoped.popitem(last=False)
        else:
            self._scoped.move_to_end(key)
        return ns

    def plan(self, ids: array[int], tenant_salt: str, cache_salt: str | None, lora: str | None = None) -> KeyPlan:
        """`lora`: the adapter the request runs under; its name is in every block's extra
        keys (as vLLM and our engine key an adapter's blocks), so no base or other
        adapter's block ever matches."""
        salted = bool(tenant_salt or cache_salt)
        spb = self.shared_blocks(ids) if (salted and self.shared) else 0
        ns = self.scoped(tenant_salt, cache_salt or "", spb, lora)
        buf = ids.tobytes()
        n_blocks = len(ids) // self.block_size
        keys = self.hasher.keys(buf, ns.extra_keys(n_blocks))
        plan = KeyPlan(ns, keys, digests64(keys), ns.wire_salt, spb)
        if spb and self.has_vllm_workers:
            ns0 = self.scoped(tenant_salt, cache_salt or "", 0, lora)
            plan.vllm_digests = digests64(self.hasher.keys(buf, ns0.extra_keys(n_blocks)))
        return plan
