"""Policies by name: `make_policy(name, **params)` and `POLICY_NAMES`.

Configs and the simulator's `--policies a,b` name policies; a typo must fail at
start with the valid choices, never route silently with defaults.
"""
from __future__ import annotations

import inspect

from .cache_aware import CacheAwarePolicy
from .dynamo import DynamoPolicy
from .kv_cost import KVCostPolicy
from .least_loaded import LeastLoadedPolicy
from .prefix_hash import PrefixHashPolicy
from .round_robin import RoundRobinPolicy
from .true_state import TrueStatePolicy
from .types import Policy

_CLASSES: dict[str, type] = {
    c.name: c
    for c in (
        RoundRobinPolicy,
        LeastLoadedPolicy,
        PrefixHashPolicy,
        CacheAwarePolicy,
        DynamoPolicy,
        KVCostPolicy,
        TrueStatePolicy,
    )
}

POLICY_NAMES: tuple[str, ...] = tuple(_CLASSES)
# Old names that were renamed: a config naming one fails with the new name.
_RENAMED = {"oracle": "kv_cost_true_state (it was never a bound; the physical limit is the simulator's `ideal`)"}


def policy_params(name: str) -> dict[str, object]:
    """A policy's parameters and their defaults."""
    return _keyword_params(_policy_class(name))


def _keyword_params(cls: type) -> dict[str, object]:
    """Keyword-only parameters of `cls.__init__`, plus its parent's when it forwards `**params`."""
    params = inspect.signature(cls).parameters.values()
    out: dict[str, object] = {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        out.update(_keyword_params(cls.__mro__[1]))
    out.update({p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY})
    return out


def _policy_class(name: str) -> type:
    cls = _CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        hint = f" ({name!r} is now {_RENAMED[name]})" if isinstance(name, str) and name in _RENAMED else ""
        raise ValueError(f"unknown routing policy {name!r}{hint}; choose one of: {', '.join(POLICY_NAMES)}")
    return cls


def make_policy(name: str, **params: object) -> Policy:
    """A fresh policy instance; ValueError on an unknown name, parameter or bad value."""
    cls = _policy_class(name)
    known = policy_params(name)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(map(repr, unknown))} for policy {name!r}; "
            f"valid: {', '.join(known) or '(none)'}"
        )
    policy: Policy = cls(**params)
    return policy
