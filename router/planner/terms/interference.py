"""Interference: the delay a new prefill imposes on requests still loading their KV.

The engine serves prefills in the order they started and lets a request whose KV is
still arriving be overtaken: a newcomer that starts prefilling before such a load
lands takes the step budget first, and that request waits for the rest of the
newcomer's prefill. T_ttft prices only the newcomer's own wait; kv_cost adds this
delay to its score (docs/planner.md, "Interference").

The loading requests are `WorkerView.inflight_loads`: per request the router sent there
that loads KV from below GPU and has no first token yet, the seconds until its load is
predicted to land (dispatch + its t_queue + t_load, less the time elapsed; slightly
negative once predicted landed) and its predicted prefill seconds.
"""
from __future__ import annotations

from collections.abc import Sequence


def interference_delays(
    loads: Sequence[tuple[float, float]],
    queue_s: float,
    own_load_s: float,
    prefill_s: float,
    overlap: bool,
    slack_s: float = 0.0,
) -> list[float]:
    """Delay a new request imposes on each request still loading on a worker (the module doc).

    `loads`: `(ready_s, prefill_s)` of each (WorkerView.inflight_loads); `queue_s`,
    `own_load_s` (total, no overlap) and `prefill_s`: the new request's terms. Its queue
    counts those requests' own prefill work, which it does not really wait for (they are
    not prefilling yet), so that work is taken off to find when it starts prefilling.
    `slack_s`: a load counts as not landed until `ready_s + slack_s` (predicted landings
    are uncertain, and one a millisecond late costs the whole new prefill).
    """
    q = queue_s
    for _, p in loads:
        q -= p
    if q < 0.0:
        q = 0.0
    if overlap:
        start = own_load_s if own_load_s > q else q
    else:
        start = q + own_load_s
    end = start + prefill_s
    return [(end - ready if ready > start else prefill_s) if start < ready + slack_s and ready < end else 0.0
            for ready, _ in loads]
