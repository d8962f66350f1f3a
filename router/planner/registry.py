"""Policies by name: `make_policy(name, **params)` and `POLICY_NAMES`.

Configs and the simulator's `--policies a,b` name policies; a typo must fail at
start with the valid choices, never route silently with defaults.
"""
from __future__ import annotations

import inspect

from .cache_aware import CacheAwarePolicy
from .dynamo import DynamoPolicy
from .kv_cost import KVCostPolicy
from .kv_cost_tuning import REMOVED
from .least_loaded import LeastLoadedPolicy
from .pd_cost import PDCostPolicy
from .pd_prefix import PDPrefixPolicy
from .pd_round_robin import PDRoundRobinPolicy
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
        PDCostPolicy,
        PDRoundRobinPolicy,
        PDPrefixPolicy,
    )
}

POLICY_NAMES: tuple[str, ...] = tuple(_CLASSES)
# Old names that were renamed: a config naming one fails with the new name.
_RENAMED = {"oracle": "kv_cost_true_state (it was never a bound; the physical limit is the simulator's `ideal`)"}


def policy_params(name: str) -> dict[str, object]:
    """A policy's parameters and their defaults."""
    return _keyword_params(_policy_class(name))


def _keyword_params(cls: type) -> dict[str, object]:
    """Keyword-only parameters of `cls.__init__`, plus its parent's when it forwards `**params`.
    A leading underscore marks a private one (kv_cost's `_tuning`): never a setting."""
    params = inspect.signature(cls).parameters.values()
    out: dict[str, object] = {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        out.update(_keyword_params(cls.__mro__[1]))
    out.update({p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY and not p.name.startswith("_")})
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
        raise ValueError(_unknown_message(name, unknown, known))
    policy: Policy = cls(**params)
    return policy


def _unknown_message(name: str, unknown: list[str], known: dict[str, object]) -> str:
    """Names no policy setting; a former kv_cost setting says what it became."""
    removed = [f"{n!r} is no longer a setting: {REMOVED[n]}" for n in unknown if n in REMOVED]
    head = f"unknown parameter(s) {', '.join(map(repr, unknown))} for policy {name!r}"
    return "; ".join([head, *removed, f"valid: {', '.join(known) or '(none)'}"])
