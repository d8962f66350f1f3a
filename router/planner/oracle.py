"""`oracle`: the kv_cost model fed the simulator's true instantaneous state.

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
per-request load progress, so those are the landing times the oracle itself predicted
at each dispatch (from the exact state then), not observed truth.
"""
from __future__ import annotations

from typing import Any

from .kv_cost import KVCostPolicy


class OraclePolicy(KVCostPolicy):
    name = "oracle"
    exact_queue = True

    def __init__(self, *, balance_eps: float | None = None, **params: Any) -> None:
        """kv_cost's parameters; only the bounded-load guard is off by default (see above)."""
        super().__init__(balance_eps=balance_eps, **params)
