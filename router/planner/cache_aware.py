"""`cache_aware`: SGLang-router-style longest prefix match unless load is imbalanced.

As SGLang's router decides (re-implemented from its documented behaviour): when the
fleet is imbalanced — `max_load - min_load > balance_abs_threshold` and
`max_load > balance_rel_threshold * min_load`, load = outstanding requests — send to
the least loaded worker. Otherwise take the worker with the longest prefix match if
it covers more than `cache_threshold` of the prompt; below that, the worker with the
most free GPU blocks once the prompts already queued there are admitted (SGLang: the
smallest radix tree, which grows the moment it routes; a polled free count alone would
send every miss between two polls to the same worker). SGLang's tree mirrors only what
it routed, with no notion of tiers; here the match
comes from the global index and counts blocks in any tier (`gpu_only` narrows it to
the leading GPU run). Ties go to the less loaded worker.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvindex.tiers import Tier

from .base import PolicyBase, check_bool, check_number
from .load import free_blocks_after_queue, outstanding_requests
from .types import Decision, RouteRequest, WorkerView


class CacheAwarePolicy(PolicyBase):
    name = "cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.5,
        balance_abs_threshold: float = 32,
        balance_rel_threshold: float = 1.0001,
        gpu_only: bool = False,
        calibrate: bool = True,
    ) -> None:
        super().__init__(calibrate=calibrate)
        self.cache_threshold = check_number("cache_threshold", cache_threshold, lo=0.0, hi=1.0)
        self.balance_abs_threshold = check_number("balance_abs_threshold", balance_abs_threshold, lo=0.0)
        self.balance_rel_threshold = check_number("balance_rel_threshold", balance_rel_threshold, lo=1.0)
        self.gpu_only = check_bool("gpu_only", gpu_only)

    def _matched(self, req: RouteRequest, w: WorkerView) -> int:
        m = req.matches.get(w.worker_id)
        if m is None:
            return 0
        if self.gpu_only:
            return m.runs[0][1] if m.runs and m.runs[0][0] is Tier.GPU else 0
        return m.blocks

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        ok = self._split_capped(workers)
        if not ok:
            return self._shed_capped(workers)
        loads = [outstanding_requests(w) for w in ok]
        hi, lo = max(loads), min(loads)
        by_load = sorted(range(len(ok)), key=loads.__getitem__)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            pick, reason = by_load[0], "imbalanced"
        else:
            matched = [self._matched(req, w) for w in ok]
            best = min(range(len(ok)), key=lambda i: (-matched[i], loads[i]))
            rate = matched[best] * ok[best].cost.block_size / max(req.prompt_tokens, 1)
            if matched[best] and rate > self.cache_threshold:
                pick, reason = best, "cache_hit"
            else:
                room = [free_blocks_after_queue(w) for w in ok]
                pick = min(range(len(ok)), key=lambda i: (-room[i], loads[i]))
                reason = "cache_miss"
        ranked = [ok[pick].worker_id] + [ok[i].worker_id for i in by_load if i != pick]
        return self._decide(req, ok[pick], ranked, reason)
