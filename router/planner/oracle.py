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

from .kv_cost import KVCostPolicy


class OraclePolicy(KVCostPolicy):
    name = "oracle"
    exact_queue = True

    def __init__(
        self,
        *,
        max_ttft_s: float | None = None,
        tie_margin: float = 0.03,
        tie_abs_s: float = 0.001,
        balance_eps: float | None = None,
        balance_slack: float = 2.0,
        prefetch: bool = True,
        peer_pull: bool = True,
        min_prefetch_blocks: int = 1,
        all_estimates: bool = False,
        calibrate: bool = True,
        interference_weight: float = 1.0,
        interference_slack_s: float = 0.05,
    ) -> None:
        super().__init__(
            max_ttft_s=max_ttft_s,
            tie_margin=tie_margin,
            tie_abs_s=tie_abs_s,
            balance_eps=balance_eps,
            balance_slack=balance_slack,
            prefetch=prefetch,
            peer_pull=peer_pull,
            min_prefetch_blocks=min_prefetch_blocks,
            all_estimates=all_estimates,
            calibrate=calibrate,
            interference_weight=interference_weight,
            interference_slack_s=interference_slack_s,
        )
