"""How busy the machine running the suite is, for timing bounds that must hold on a loaded one.

A wall-clock bound measured on an idle machine breaks on a busy one (CI runners, a
laptop compiling): the suite's budgets and its timing checks are scaled by the load
per core, measured when they are applied, never below their idle value.
"""
from __future__ import annotations

import os


def load_factor() -> float:
    """The 1-minute load average per core, at least 1 (an idle or lightly used machine)."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover - no load average on this platform
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def scaled(seconds: float) -> float:
    """`seconds` stretched by the current load factor."""
    return seconds * load_factor()
