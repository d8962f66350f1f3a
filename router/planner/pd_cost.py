"""`pd_cost`: the pair decision by cost (pd.py): the option with the least predicted time to
the last token, `TTFT + (max_tokens - 1) * TPOT(decode worker)`, over every `both` worker
alone, every (prefill-capable, decode-capable) pair and every decode worker's bypass.
Near-ties (within TIE_S) go to the decode worker with fewer outstanding requests.
Reasons: min_cost, tie_less_load, shed_capped, no_workers."""
from __future__ import annotations

from collections.abc import Sequence

from .context import RequestContext
from .load import outstanding_requests
from .pd import PairPolicyBase
from .types import PDOption, RouteRequest, WorkerView

TIE_S = 1e-3


class PDCostPolicy(PairPolicyBase):
    name = "pd_cost"

    def _pick(self, req: RouteRequest, ctx: RequestContext, workers: Sequence[WorkerView],
              options: list[PDOption]) -> tuple[PDOption, str]:
        best = min(options, key=lambda o: o.score)
        load = {w.worker_id: outstanding_requests(w) for w in workers}
        near = [o for o in options if o.score <= best.score + TIE_S]
        chosen = min(near, key=lambda o: (load[o.decode_worker], o.score))
        return chosen, "min_cost" if chosen is best else "tie_less_load"
