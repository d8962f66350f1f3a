"""`/admin/route/explain` support: a decision with every worker's cost breakdown.

Asking must not change routing: the policy is copied (round-robin cursors and random
generators of the original stay as they were; calibration is shared read-only).
kv_cost/kv_cost_true_state evaluate every worker for it (no pruning); for the other policies the
estimates come from the cost model with their calibration, as those workers would
really serve the request (no prefetch, no peer pull planned).
"""
from __future__ import annotations

import copy
import random
from collections.abc import Sequence

from .base import PolicyBase
from .cost import estimate_all
from .load import at_cap, outstanding_requests
from .types import Decision, Policy, RouteRequest, WorkerView


def explain(policy: Policy, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
    """What `policy` would decide for `req` now, with `estimates` for every worker."""
    twin = copy.copy(policy)
    for k, v in vars(twin).items():
        if isinstance(v, random.Random):
            setattr(twin, k, copy.deepcopy(v))
    if hasattr(twin, "all_estimates"):
        twin.all_estimates = True
    d = twin.choose(req, workers)
    if d.estimates or not workers:
        return d
    scales = policy.scales if isinstance(policy, PolicyBase) else None
    d.estimates = estimate_all(req, workers, prefetch=False, peer=False, scales=scales)
    for w, e in zip(workers, d.estimates, strict=False):
        e.load = outstanding_requests(w)
        if at_cap(w) and e.eligible:
            e.eligible = False
            e.note = f"at max_waiting={w.max_waiting}"
    return d
