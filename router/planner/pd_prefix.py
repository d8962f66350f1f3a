"""`pd_prefix`: the prefix-only pairing baseline: the prefill-capable worker holding the
longest prefix of the prompt (ties: fewer outstanding requests), and the decode-capable
worker with the fewest outstanding requests. On a fleet of `both` workers, the longest
prefix alone. No bypass while a pair is open (otherwise the cheapest option left). Priced
by pd.py like every pair policy. Reason: prefix."""
from __future__ import annotations

from collections.abc import Sequence

from .context import RequestContext
from .load import outstanding_requests
from .pd import PairPolicyBase, can_decode, can_prefill
from .types import PDOption, RouteRequest, WorkerView


class PDPrefixPolicy(PairPolicyBase):
    name = "pd_prefix"

    def _pick(self, req: RouteRequest, ctx: RequestContext, workers: Sequence[WorkerView],
              options: list[PDOption]) -> tuple[PDOption, str]:
        order = {w.worker_id: i for i, w in enumerate(workers)}
        load = {w.worker_id: outstanding_requests(w) for w in workers}

        def held(wid: str) -> int:
            m = ctx.matches.get(wid)
            return m.blocks if m is not None else 0

        def by_prefix(o: PDOption) -> tuple[int, int, int]:
            p = o.prefill_worker or o.decode_worker
            return (-held(p), load[p], order[p])

        split = any(w.role != "both" for w in workers if can_prefill(w)) and \
            any(w.role != "both" for w in workers if can_decode(w))
        if not split:
            singles = [o for o in options if o.kind == "single"]
            return min(singles or options, key=by_prefix), "prefix"
        pairs = [o for o in options if o.kind == "pair"]
        if not pairs:
            return min(options, key=lambda o: o.score), "prefix"
        best_p = min(pairs, key=by_prefix).prefill_worker
        cands = [o for o in pairs if o.prefill_worker == best_p]
        return min(cands, key=lambda o: (load[o.decode_worker], order[o.decode_worker])), "prefix"
