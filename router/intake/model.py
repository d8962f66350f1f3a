"""One served model at run time: its tokenizer, namespace, key planner and prefix index.

Everything a request would otherwise rebuild is built once here (the model-level
Namespace, the BlockHasher with it absorbed, the shared prefixes' token ids).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from kvindex.index import PrefixIndex
from kvindex.keys import Namespace

from ..fleet.fleetconfig import CostConfig, ModelConfig, SharedPrefixConfig
from .keyplan import KeyPlan, KeyPlanner, SharedPrefix
from .tokenize import Tokenizer


class ModelRuntime:
    def __init__(self, cfg: ModelConfig, tokenizer: Tokenizer, *, max_workers: int = 256) -> None:
        self.cfg = cfg
        self.id = cfg.id
        self.tokenizer = tokenizer
        ns = cfg.namespace
        self.namespace = Namespace(cfg.id, ns.revision, ns.tokenizer_revision, ns.kv_dtype, ns.parallel, ns.block_size)
        self.digest_hex = self.namespace.digest.hex()
        self.block_size = ns.block_size
        self.keys = KeyPlanner(self.namespace)
        self.index = PrefixIndex(ns.block_size, max_workers=max_workers)
        self.cost: CostConfig = cfg.cost
        self.max_context = cfg.max_context_tokens
        # LoRA adapters of this model that some worker has listed in its /v1/models (a
        # request names one as its `model`; only the workers listing it serve it)
        self.adapters: set[str] = set()

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
        self.keys.add_shared(out)
        return out

    def key_plan(self, ids: array[int], tenant_salt: str, cache_salt: str | None, lora: str | None = None) -> KeyPlan:
        return self.keys.plan(ids, tenant_salt, cache_salt, lora)


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

    def adapter_of(self, name: str) -> ModelRuntime | None:
        """The base model of LoRA adapter `name`, as the workers listed it (None: no such adapter)."""
        if name in self.by_name:
            return None
        return next((rt for rt in self.by_id.values() if name in rt.adapters), None)
