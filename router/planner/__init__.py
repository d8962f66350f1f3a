"""The planner: cost model and routing policies. Pure (no I/O, no web framework),
so the offline simulator runs the very same code as the gateway.

Entry points: `make_policy(name, **params)` / `POLICY_NAMES` (registry.py), the
`Policy` contract and its data types (types.py), the cost model (cost.py composing the
terms of terms/, and load.py), online calibration (calibration.py) and `explain` for
/admin/route/explain.
"""
from __future__ import annotations

from .calibration import Calibrator, ErrorStats
from .explain import explain
from .registry import POLICY_NAMES, make_policy, policy_params
from .types import CostParams, Decision, Estimate, Link, Policy, RouteRequest, WorkerView

__all__ = [
    "POLICY_NAMES",
    "Calibrator",
    "CostParams",
    "Decision",
    "ErrorStats",
    "Estimate",
    "Link",
    "Policy",
    "RouteRequest",
    "WorkerView",
    "explain",
    "make_policy",
    "policy_params",
]
