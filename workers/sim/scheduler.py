"""The simulated scheduler's state: requests in flight (`Job`) and GPU steps (`Step`).

vLLM-like: a waiting queue served first-come-first-served; each step has a token
budget shared by the running decodes (one token each) and prefill chunks (running
prefills first, then newly scheduled requests); a request is scheduled only when the
GPU pool can hold all its blocks; a request whose cached prefix sits below GPU waits
for its loads before its first chunk (vLLM's WAITING_FOR_REMOTE_KVS), without holding
up the others.

A step that only decodes, with nothing else that could change the batch before a
request finishes, is simulated as a *span* of `k` identical decode steps in one event:
step `j` lasts `a + slope·j` (the context grows by one token per sequence per step), so
the span ends at `start + k·a + slope·k(k−1)/2`. A new arrival, a finished load or a
cancel cuts the span at the end of the step in progress. This is what lets a fleet
replay a trace on a virtual clock in seconds: events per request, not per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from workers.usage import Usage


class Phase(IntEnum):
    WAITING = 0  # queued, nothing allocated
    LOADING = 1  # scheduled: blocks reserved, cached prefix being loaded into GPU
    PREFILL = 2  # prompt being computed in chunks
    DECODE = 3  # generating
    DONE = 4


@dataclass(slots=True, eq=False)
class Job:
    """One request inside the engine."""

    req: Any  # the SimRequest
    rid: str
    prompt: int
    max_tokens: int
    keys: list[bytes]
    cacheable: int  # leading blocks that may be taken from cache (never the whole prompt)
    extra: list[tuple[Any, ...] | None] | None
    salt: str | None
    salt_from: int
    arrival: float
    usage: Usage
    phase: Phase = Phase.WAITING
    gpu_hint: int = 0  # leading blocks found on GPU at arrival (queue estimate only)
    computed: int = 0  # prompt tokens whose KV is (or, once loads land, will be) present
    generated: int = 0
    pinned: list[bytes] = field(default_factory=list)
    anon: int = 0
    pending: int = 0  # loads not landed yet
    load_from: int = 0  # blocks [load_from, load_to) are loaded (or awaited) from below GPU
    load_to: int = 0
    loads: list[tuple[str, list[bytes], bool]] = field(default_factory=list)  # (tier, keys, prefetched)
    cut: bool = False  # a purge or a damaged block shortened the loads or the keyed chain
    scheduled_at: float = math.nan
    loaded_at: float = math.nan
    first_at: float = math.nan
    streaming: bool = False  # has an on_tokens callback: decode step by step


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
