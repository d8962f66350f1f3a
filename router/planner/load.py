"""How busy a worker is: the queue-wait estimate `T_queue` and the counts guards use.

Load reports lag (they are polled), so every figure joins the worker's last report,
aged by its age, with the router's own in-flight accounting since; without a
since-report split the larger of the two is used, which never counts a request
twice. The formulas: docs/planner.md. `exact=True` (kv_cost_true_state, fed the simulator's
true state) trusts `est_queue_s` as is.
"""
from __future__ import annotations

import math

from .types import CostParams, WorkerView


def pending_seconds(cost: CostParams, tokens: int, requests: int = 0, scale: float = 1.0) -> float:
    """Time to prefill `tokens` queued tokens spread over `requests` prompts (0 = unknown)."""
    if not cost.prefill_tokens_per_s > 0.0:
        return math.inf  # unusable speed (the cost model marks such a worker ineligible)
    if tokens <= 0:
        return requests * cost.prefill_overhead_s * scale if requests > 0 else 0.0
    t = tokens / cost.prefill_tokens_per_s
    if requests > 0:
        t += requests * cost.prefill_overhead_s + cost.prefill_attn_s_per_token2 * tokens * (tokens / requests) * 0.5
    return t * scale


def report_queue_seconds(w: WorkerView, cost: CostParams, scale: float = 1.0) -> float:
    """The wait the last report implies at the time it was taken."""
    if w.est_queue_s > 0.0:
        return w.est_queue_s
    tokens = w.waiting_prefill_tokens + w.running_prefill_tokens
    if tokens > 0 or w.waiting_requests > 0:
        return pending_seconds(cost, tokens, w.waiting_requests, scale)
    return 0.0


def queue_seconds(w: WorkerView, cost: CostParams | None = None, scale: float = 1.0, exact: bool = False) -> float:
    """Predicted wait before `w` starts a request sent now (the module doc's formula), times
    the worker's measured `queue_scale` (speedfit.py: how its real wait follows this one)."""
    c = cost or w.cost
    q = _queue_seconds(w, c, scale, exact)
    return q * c.queue_scale if q > 0.0 else q


def _queue_seconds(w: WorkerView, c: CostParams, scale: float, exact: bool) -> float:
    report = w.est_queue_s
    if report <= 0.0:
        report = report_queue_seconds(w, c, scale)
    if exact:
        return report
    age = w.report_age_s
    aged = report - age if age > 0.0 else report
    if aged < 0.0:
        aged = 0.0
    since_tokens = w.inflight_since_report_prefill_tokens
    if since_tokens is not None:
        return aged + pending_seconds(c, since_tokens, w.inflight_since_report_requests or 0, scale)
    tokens = w.inflight_prefill_tokens
    if tokens > 0:
        mine = pending_seconds(c, tokens, 0, scale)
        if mine > aged:
            return mine
    return aged


def _joined(reported: int, since: int | None, mine: int) -> int:
    """A report's count joined with the router's own (the module doc's two cases): what
    was dispatched since the report adds; without that split, the larger of the two."""
    if since is not None:
        return reported + since
    return reported if reported > mine else mine


def outstanding_requests(w: WorkerView) -> int:
    """Requests on the worker (waiting + running), the load counts compare."""
    return _joined(w.waiting_requests + w.running_requests, w.inflight_since_report_requests, w.inflight_requests)


def waiting_requests(w: WorkerView) -> int:
    """Requests waiting on the worker (not started), for its `max_waiting` cap."""
    return _joined(w.waiting_requests, w.inflight_since_report_requests, w.inflight_requests - w.running_requests)


def pending_prefill_tokens(w: WorkerView) -> int:
    """Prompt tokens queued or being prefilled on the worker."""
    return _joined(w.waiting_prefill_tokens + w.running_prefill_tokens, w.inflight_since_report_prefill_tokens,
                   w.inflight_prefill_tokens)


def queued_prefill_tokens(w: WorkerView) -> int:
    """Prompt tokens sent to the worker that it has not admitted yet (no KV blocks of their
    own so far): the report's waiting tokens plus what was dispatched since it."""
    return _joined(w.waiting_prefill_tokens, w.inflight_since_report_prefill_tokens, w.inflight_prefill_tokens)


def free_blocks_after_queue(w: WorkerView) -> int:
    """GPU blocks free once the queued prompts are admitted (may be negative).

    The report's free count moves only when the worker admits a request, and only at the
    next poll; requests routed meanwhile would all see the same "most room" worker. This
    charges what is already headed there, as SGLang's router grows a worker's tree the
    moment it routes to it. A vLLM worker without `cache_config_info` reports free
    blocks on a per-10k scale (router/fleet/pool.py); the queued blocks then weigh more or less
    than real ones, by the ratio of its true capacity to 10k."""
    queued = queued_prefill_tokens(w)
    if queued <= 0:
        return w.gpu_free_blocks
    return w.gpu_free_blocks - -(-queued // max(w.cost.block_size, 1))


def at_cap(w: WorkerView) -> bool:
    """True when the worker's waiting queue is full (it would answer 429)."""
    return w.max_waiting is not None and waiting_requests(w) >= w.max_waiting
