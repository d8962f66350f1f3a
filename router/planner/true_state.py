"""`kv_cost_true_state`: the kv_cost model fed the simulator's true instantaneous state.

Not a bound (formerly called `oracle`): it knows the present exactly, not the future,
and still routes greedily, so a policy that schedules (holds, reorders) can beat it.
The simulator's physical limit is `ideal` (loadtest/ideal.py).

Meant for the offline simulator (loadtest), which fills each WorkerView with the
engine's exact `estimate_queue_s(now)` at decision time (every dispatched request is
already inside the engine, index always current, `report_age_s` 0). It is better
informed than kv_cost in what it believes, not in a different formula: it takes
`est_queue_s` as exact (no ageing by report age, no in-flight guesses that could
double count), and it drops the bounded-load guard by default, since that guard only
exists to contain wrong estimates. Behind the gateway (stale reports) it would herd:
do not route production traffic with it. It prices the delay a new prefill imposes on
requests still loading (kv_cost's interference term) from the same
`WorkerView.inflight_loads` as kv_cost: the simulator's engines do not expose
per-request load progress, so those are the landing times it predicted itself at each
dispatch (from the exact state then), not observed truth.
"""
from __future__ import annotations

from typing import Any, ClassVar

from .kv_cost import KVCostPolicy


class TrueStatePolicy(KVCostPolicy):
    name = "kv_cost_true_state"
    exact_queue = True
    # The simulator feeds this policy the engines' truth instead of the gateway's view.
    true_state: ClassVar[bool] = True

    def __init__(self, *, balance_eps: float | None = None, **params: Any) -> None:
        """kv_cost's parameters; only the bounded-load guard is off by default (see above)."""
        super().__init__(balance_eps=balance_eps, **params)
