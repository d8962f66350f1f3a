"""`pd_round_robin`: the pairing baseline: the next prefill-capable worker in turn and the
next decode-capable one in turn (two cursors); on a fleet of `both` workers, plain round
robin. No bypass while a pair is open: when every pair is closed (its prefill workers at
their waiting cap), the cheapest option left. Priced by pd.py like every pair policy.
Reason: round_robin."""
from __future__ import annotations

from collections.abc import Sequence

from .context import RequestContext
from .pd import BYPASS_MAX_TOKENS, PairPolicyBase, can_decode, can_prefill
from .types import PDOption, RouteRequest, WorkerView


class PDRoundRobinPolicy(PairPolicyBase):
    name = "pd_round_robin"

    def __init__(self, *, bypass_max_tokens: int = BYPASS_MAX_TOKENS, calibrate: bool = True) -> None:
        super().__init__(bypass_max_tokens=bypass_max_tokens, calibrate=calibrate)
        self._p = 0
        self._d = 0

    def _pick(self, req: RouteRequest, ctx: RequestContext, workers: Sequence[WorkerView],
              options: list[PDOption]) -> tuple[PDOption, str]:
        singles = {o.decode_worker: o for o in options if o.kind == "single"}
        pairs = {(o.prefill_worker, o.decode_worker): o for o in options if o.kind == "pair"}
        ps = [w.worker_id for w in workers if can_prefill(w) and w.role != "both"]
        ds = [w.worker_id for w in workers if can_decode(w) and w.role != "both"]
        if not ps or not ds:  # no split roles: round robin over the workers serving whole requests
            return _next(self, "_d", [w.worker_id for w in workers], singles, options), "round_robin"
        for _ in range(len(ps) * len(ds)):
            p, d = ps[self._p % len(ps)], ds[self._d % len(ds)]
            self._p += 1
            self._d += 1
            o = pairs.get((p, d))
            if o is not None:
                return o, "round_robin"
        return min(options, key=lambda o: o.score), "round_robin"


def _next(pol: PDRoundRobinPolicy, attr: str, ids: list[str], singles: dict[str, PDOption],
          options: list[PDOption]) -> PDOption:
    for _ in range(len(ids)):
        i = getattr(pol, attr)
        setattr(pol, attr, i + 1)
        o = singles.get(ids[i % len(ids)])
        if o is not None:
            return o
    return min(options, key=lambda o: o.score)
