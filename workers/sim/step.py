"""One GPU step of the simulated engine, or a span of identical decode steps.

A step that only decodes, with nothing else that could change the batch before a
request finishes, is one event for `k` steps: step `j` lasts `a + slope·j` (the
context grows by one token per sequence per step), so the span ends at
`start + k·a + slope·k(k−1)/2`. A change (an arrival, a landed load, a cancel) cuts
the span at the end of the step in progress. This is what makes a virtual-clock
replay cost events per request rather than per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .job import Job


@dataclass(slots=True, eq=False)
class Step:
    """The GPU step (or decode span) in progress."""

    start: float
    end: float
    prefill: list[tuple[Job, int]]
    decode: list[Job]
    k: int  # decode steps in this event (1 unless a span)
    prefill_s: float
    a: float  # duration of the first decode step
    slope: float  # growth of the decode step duration per step

    def end_after(self, k: int) -> float:
        return self.start + self.prefill_s + k * self.a + self.slope * k * (k - 1) / 2

    def boundary_after(self, t: float) -> int:
        """Steps of this span completed once the step running at time `t` ends (>= 1)."""
        if self.k <= 1:
            return 1
        dt = t - self.start - self.prefill_s
        if dt <= 0:
            return 1
        a, s = self.a, self.slope
        if s <= 0:
            k = math.ceil(dt / a) if a > 0 else 1
        else:
            b = a - s / 2
            k = math.ceil((-b + math.sqrt(b * b + 2 * s * dt)) / s)
        k = min(max(k, 1), self.k)
        end_after = self.end_after
        while k > 1 and end_after(k - 1) >= t:
            k -= 1
        while k < self.k and end_after(k) < t:
            k += 1
        return k

    def cut(self, t: float) -> None:
        """Shorten a span so it ends at the first step boundary at or after `t`."""
        if self.k > 1:
            k = self.boundary_after(t)
            if k < self.k:
                self.k = k
                self.end = self.end_after(k)

    def end_now(self, now: float) -> float:
        """When the step running at `now` ends (a span ends early once cut there)."""
        return self.end if self.k <= 1 else self.end_after(self.boundary_after(now))
