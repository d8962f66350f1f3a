"""One served model at run time: tokenizer, namespace, hasher, prefix index, shared prefixes.

Everything a request would otherwise recompute is built once here: the model-level
Namespace and its BlockHasher (SHA-256 states with the namespace absorbed), the
per-(tenant salt, cache salt, shared blocks) scoped namespaces (whose extra keys and wire
salt are cached on the object), the shared prefixes' token ids.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from kvindex.index import PrefixIndex
from kvindex.keys import BlockHasher, Namespace

from .config import CostConfig, ModelConfig, SharedPrefixConfig
from .tokenize import Tokenizer


@dataclass(slots=True)
class SharedPrefix:
    name: str
    ids: array
    blocks: int  # full blocks of `ids` that stay unsalted


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


class ModelRuntime:
    def __init__(self, cfg: ModelConfig, tokenizer: Tokenizer, *, max_workers: int = 256) -> None:
        self.cfg = cfg
        self.id = cfg.id
        self.tokenizer = tokenizer
        ns = cfg.namespace
        self.namespace = Namespace(cfg.id, ns.revision, ns.tokenizer_revision, ns.kv_dtype, ns.parallel, ns.block_size)
        self.digest_hex = self.namespace.digest.hex()
        self.block_size = ns.block_size
        self.hasher = BlockHasher.for_namespace(self.namespace)
        self.index = PrefixIndex(ns.block_size, max_workers=max_workers)
        self.cost: CostConfig = cfg.cost
        self.max_context = cfg.max_context_tokens
        self.shared: list[SharedPrefix] = []
        self.has_vllm_workers = False
        self._scoped: OrderedDict[tuple[str, str, int], Namespace] = OrderedDict()

    def add_shared_prefix(self, sp: SharedPrefixConfig) -> SharedPrefix:
        """Resolve a declared shared prefix to token ids (at start; see SharedPrefixConfig)."""
        tok = self.tokenizer
        if sp.token_ids is not None:
            ids = array("I", sp.token_ids)
        elif sp.text is not None:
            ids = tok.encode_text(sp.text, add_special_tokens=True)
        else:
            assert sp.messages is not None
            ids = tok.encode_text(tok.render_chat(sp.messages, add_generation_prompt=False), add_special_tokens=False)
        out = SharedPrefix(sp.name, ids, len(ids) // self.block_size)
        self.shared.append(out)
        self.shared.sort(key=lambda s: len(s.ids), reverse=True)
        return out

    def shared_blocks(self, ids: array) -> int:
        """Leading blocks of `ids` covered by the longest declared shared prefix it starts with."""
        for sp in self.shared:
            n = len(sp.ids)
            if sp.blocks and len(ids) >= n and ids[:n] == sp.ids:
                return sp.blocks
        return 0

    def scoped(self, tenant_salt: str, cache_salt: str, shared_blocks: int) -> Namespace:
        key = (tenant_salt, cache_salt, shared_blocks)
        ns = self._scoped.get(key)
        if ns is None:
            ns = self.namespace.scoped(tenant_salt=tenant_salt, cache_salt=cache_salt, shared_prefix_blocks=shared_blocks)
            self._scoped[key] = ns
            if len(self._scoped) > 4096:
                self._scoped.popitem(last=False)
        else:
            self._scoped.move_to_end(key)
        return ns

    def key_plan(self, ids: array, tenant_salt: str, cache_salt: str | None) -> KeyPlan:
        from kvindex.keys import digests64

        salted = bool(tenant_salt or cache_salt)
        spb = self.shared_blocks(ids) if (salted and self.shared) else 0
        ns = self.scoped(tenant_salt, cache_salt or "", spb)
        buf = ids.tobytes()
        n_blocks = len(ids) // self.block_size
        keys = self.hasher.keys(buf, ns.extra_keys(n_blocks))
        plan = KeyPlan(ns, keys, digests64(keys), ns.wire_salt, spb)
        if spb and self.has_vllm_workers:
            ns0 = self.scoped(tenant_salt, cache_salt or "", 0)
            plan.vllm_digests = digests64(self.hasher.keys(buf, ns0.extra_keys(n_blocks)))
        return plan


@dataclass(slots=True)
class ModelTable:
    """Served names → runtimes (aliases resolve to the same object)."""

    by_name: dict[str, ModelRuntime] = field(default_factory=dict)
    by_id: dict[str, ModelRuntime] = field(default_factory=dict)

    def add(self, rt: ModelRuntime) -> None:
        self.by_id[rt.id] = rt
        for n in (rt.id, *rt.cfg.served_names):
            self.by_name[n] = rt

    def get(self, name: str) -> ModelRuntime | None:
        return self.by_name.get(name)
