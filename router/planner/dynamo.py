"""`dynamo`: NVIDIA Dynamo KV-router style score, overlap credit + load in blocks.

As Dynamo documents its KV router (re-implemented from its docs):

    prefill_blocks = pending prefill blocks on w + request blocks - overlap credit
    decode_blocks  = active KV blocks on w + request blocks
    cost           = overlap_score_weight * prefill_blocks + decode_blocks

The overlap credit counts the request's matched blocks on w's GPU, plus
`offload_credit` (0..1) of each matched block in a lower tier (newer Dynamo releases
credit host/disk hits too; 0 = device only, the classic behaviour). Pending prefill
comes from the report + in-flight accounting (router/planner/load.py), active blocks
from `WorkerView.active_kv_tokens` when the gateway tracks them, else the GPU blocks
in use. `temperature` 0 picks the argmin (random among exact ties); above 0 it samples
from softmax(-cost / max_cost / temperature), seeded for reproducibility.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

from kvindex.tiers import Tier

from .base import PolicyBase, check_int, check_number
from .load import pending_prefill_tokens
from .types import Decision, RouteRequest, WorkerView


class DynamoPolicy(PolicyBase):
    name = "dynamo"

    def __init__(
        self,
        *,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
        offload_credit: float = 0.0,
        seed: int = 0,
        calibrate: bool = True,
    ) -> None:
        super().__init__(calibrate=calibrate)
        self.overlap_score_weight = check_number("overlap_score_weight", overlap_score_weight, lo=0.0)
        self.temperature = check_number("temperature", temperature, lo=0.0, hi=100.0)
        self.offload_credit = check_number("offload_credit", offload_credit, lo=0.0, hi=1.0)
        self._rng = random.Random(check_int("seed", seed))

    def cost(self, req: RouteRequest, w: WorkerView) -> float:
        """The Dynamo-style cost of sending `req` to `w` (in blocks)."""
        B = w.cost.block_size or 1
        req_blocks = req.prompt_tokens / B
        credit = 0.0
        m = req.matches.get(w.worker_id)
        if m is not None:
            for tier, n in m.runs:
                credit += n if tier is Tier.GPU else n * self.offload_credit
        if w.active_kv_tokens is not None:
            active = w.active_kv_tokens / B
        elif w.gpu_capacity_blocks > 0:
            active = max(0, w.gpu_capacity_blocks - w.gpu_free_blocks)
        else:
            active = 0.0
        prefill = pending_prefill_tokens(w) / B + max(0.0, req_blocks - credit)
        return self.overlap_score_weight * prefill + active + req_blocks

    def choose(self, req: RouteRequest, workers: Sequence[WorkerView]) -> Decision:
        ok = self._split_capped(workers)
        if not ok:
            return self._shed_capped(workers)
        costs = [self.cost(req, w) for w in ok]
        order = sorted(range(len(ok)), key=costs.__getitem__)
        if self.temperature == 0.0:
            lowest = costs[order[0]]
            ties = [i for i in order if costs[i] == lowest]
            pick = ties[self._rng.randrange(len(ties))] if len(ties) > 1 else order[0]
            reason = "min_cost"
        else:
            top = max(costs) or 1.0
            low = costs[order[0]]  # shifted so the best weighs 1: no underflow to all-zero
            weights = [math.exp(-((c - low) / top) / self.temperature) for c in costs]
            pick = self._rng.choices(range(len(ok)), weights=weights)[0]
            reason = "sampled"
        ranked = [ok[pick].worker_id] + [ok[i].worker_id for i in order if i != pick]
        return self._decide(req, ok[pick], ranked, reason)
