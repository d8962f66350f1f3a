"""Co-scheduling: the delay a newcomer imposes on requests waiting for the step it would share.

The engine admits requests into a step while its token budget lasts, and each gets its
first token when the whole step ends: a newcomer whose first chunk fits in the budget
that requests not started yet leave over rides in their step, and each of them waits
that chunk longer. kv_cost weighs it in with COSCHEDULE_WEIGHT (0: measured not to pay);
the simulator and the gateway revise those requests' predictions by it (fleet.py).

The waiting requests are `WorkerView.inflight_starts`: per request the router sent there
predicted not to have started its prefill yet, the seconds until its predicted start
(slightly negative once predicted started) and the tokens it computes.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..types import CostParams, Estimate
from .recompute import prefill_seconds

INF = math.inf
COSCHEDULE_SLACK_S = 0.02  # how late a newcomer may start and still ride in their step (a prediction)


def may_coschedule(e: Estimate, overlap: bool) -> bool:
    """Could this estimate's request ride in the step of requests waiting there? An
    eligible one that loads no KV first, or whose load is predicted to land while it
    queues (`overlap`: the worker prefetches, and `t_load`, the load left on the critical
    path, is zero). The engine passes over a request only while its KV is still arriving;
    a short prefetched load lands before the step boundary it waits for."""
    return e.eligible and (e.t_load_total <= 0.0 or (overlap and e.t_load <= 0.0))


def coschedule_load_s(e: Estimate, overlap: bool) -> float:
    """When a request that may ride (`may_coschedule`) has its KV: with prefetch, its
    whole load counts from dispatch."""
    return e.t_load_total if overlap else 0.0


def coschedule_delay(
    starts: Sequence[tuple[float, int]],
    cost: CostParams,
    queue_s: float,
    recompute_tokens: int,
    cached_tokens: int,
    decodes: int,
    slack_s: float = 0.0,
    scale: float = 1.0,
    load_s: float = 0.0,
) -> float:
    """Delay a new request imposes on EACH of the requests waiting, on the same worker, for
    the step it would start in (the module doc).

    `starts`: `(start_s, prefill_tokens)` of each (WorkerView.inflight_starts). The engine
    admits in order while the step's token budget (`max_batched_tokens` less one token
    per running decode) lasts, and a step ends when all its chunks are computed: when
    those requests leave budget over in the step where their work ends (`step_spare`),
    the newcomer's first chunk rides in that step and each of them gets its first token
    that chunk later. That happens when the newcomer starts no later than they do (plus
    `slack_s`: the start is a prediction). Its `queue_s` counts their prefill work, which
    it does not wait for when it rides along, so that is taken off first (as for loads);
    `load_s`: it cannot start before its prefetched KV lands (`coschedule_load_s`).
    """
    if not starts or recompute_tokens <= 0:
        return 0.0
    latest = -INF
    q = queue_s
    for start, tokens in starts:
        q -= prefill_seconds(cost, tokens, 0, scale)
        if start > latest:
            latest = start
    # Its KV must be on GPU when their step starts: at `latest` if they still queue, else at
    # the end of the step in progress (half a decode step away, on average).
    if load_s > max(latest, 0.0) + 0.5 * cost.decode_step_s:
        return 0.0
    spare = step_spare(starts, cost.max_batched_tokens - decodes)
    if spare <= 0 or q > latest + slack_s:
        return 0.0
    n = recompute_tokens if recompute_tokens < spare else spare
    return prefill_seconds(cost, n, cached_tokens, scale)


def step_spare(starts: Sequence[tuple[float, int]], budget: int) -> int:
    """The budget left in the step where the work of `starts` ends, `budget` tokens a step.
    One request longer than a step ends in a later step, with what its last chunk leaves
    (none when it fills it exactly). Several must fit in one step: where the steps fall
    among several depends on which of them have started, itself a prediction, and
    counting across it misplaced the boundary on a trace of many short prompts."""
    if budget <= 0:
        return 0
    total = sum(tokens for _, tokens in starts)
    if len(starts) == 1 and total > budget:
        return (budget - total % budget) % budget
    return budget - total


def coschedule_seconds(
    starts: Sequence[tuple[float, int]],
    cost: CostParams,
    queue_s: float,
    recompute_tokens: int,
    cached_tokens: int,
    decodes: int,
    slack_s: float = 0.0,
    scale: float = 1.0,
    load_s: float = 0.0,
) -> float:
    """The total of `coschedule_delay` over the requests it delays."""
    d = coschedule_delay(starts, cost, queue_s, recompute_tokens, cached_tokens, decodes, slack_s, scale, load_s)
    return len(starts) * d if d > 0.0 else 0.0
