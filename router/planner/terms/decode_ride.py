"""T_decode: the decode steps a prefill carries on a busy worker.

Each step of a chunked prefill also runs one token of every running sequence, from
the same token budget, so on a worker with running decodes the prefill spans more
steps, each a decode step longer than on an idle one. Left out, predictions on busy
workers came out a whole decode step too low (docs/planner.md, "The cost model").
"""
from __future__ import annotations

from ..types import CostParams, WorkerView


def decode_ride_seconds(cost: CostParams, prefill_tokens: int, decodes: int) -> float:
    """Decode time the steps of a prefill carry: each step of a chunked prefill also runs
    the worker's `decodes` sequences (one token each, from the same token budget), so a
    prefill spanning `s` steps on a busy worker takes `s` decode steps longer than on an
    idle one. `decode_step_s` is the step time the worker last reported for its batch."""
    if decodes <= 0 or prefill_tokens <= 0:
        return 0.0
    measured = cost.ride_per_running_s * decodes  # a SpeedFit's own measure (speedfit.py)
    if cost.decode_step_s <= 0.0:
        return measured
    # A report with more decodes than the budget (not a sane engine) leaves an eighth of it.
    per_step = max(cost.max_batched_tokens - decodes, cost.max_batched_tokens // 8, 1)
    return -(-prefill_tokens // per_step) * cost.decode_step_s + measured


def running_decodes(w: WorkerView) -> int:
    """The worker's running requests as of its report, bounded by the router's own
    in-flight count there once its ledger is in use: a report taken while a request ran
    must not price decode steps after it ended. (With gateway replicas, or clients that
    reach the worker directly, this undercounts: the ride is then priced low, as before
    the term existed.)"""
    n = w.running_requests
    if w.inflight_since_report_requests is not None and w.inflight_requests < n:
        return w.inflight_requests
    return n
