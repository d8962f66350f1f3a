"""Waits in the default test run are bounds against a hang, never measurements.

A test waits for something that must happen (a worker marked unhealthy, an event
indexed) with a bound given for an idle machine; on a busy one (a CI runner, two other
CPU-heavy jobs) the same thing takes longer, so `patience` stretches the bound by the
machine's load per core and a margin. How fast something is belongs to the benchmarks
and the harden report (`kvroute loadtest harden`), which scale their bounds the same way.
"""
from __future__ import annotations

from loadtest.harden.load import load_factor

HANG_S = 60.0  # what a bounded operation never takes, however busy the machine: only a hang reaches it
MARGIN = 3.0  # beyond the load: a burst the 1-minute average has not caught up with yet


def patience(seconds: float) -> float:
    """How long to wait for what takes at most `seconds` on an idle machine."""
    return seconds * MARGIN * load_factor()
