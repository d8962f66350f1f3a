"""kv_cost with other constants than a fleet runs, for the tests of each rule.

The constants are not settings (make_policy refuses them); a test reaches them the way
an ablation does, through the policy's private `_tuning` argument.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

from router.planner.kv_cost import KVCostPolicy
from router.planner.kv_cost_tuning import KVCostTuning
from router.planner.true_state import TrueStatePolicy

_CLASSES: dict[str, type[KVCostPolicy]] = {"kv_cost": KVCostPolicy, "kv_cost_true_state": TrueStatePolicy}
_TUNING = {f.name for f in fields(KVCostTuning)}


def tuned(name: str = "kv_cost", **kw: Any) -> KVCostPolicy:
    """Policy `name`: KVCostTuning fields in `kw` go to its tuning, `all_estimates` turns
    pruning off (every worker estimated, as explain asks), the rest are its settings."""
    every = bool(kw.pop("all_estimates", False))
    tuning = KVCostTuning(**{k: v for k, v in kw.items() if k in _TUNING})
    policy = _CLASSES[name](_tuning=tuning, **{k: v for k, v in kw.items() if k not in _TUNING})
    policy.all_estimates = every
    return policy
