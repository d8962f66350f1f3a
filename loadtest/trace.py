"""The in-memory form every trace loader produces.

A trace is a list of requests with an arrival time, prompt and output lengths, and
the prompt's prefix structure as a list of block ids (`hash_ids`): one id per
`block_tokens` tokens of the prompt, the last block possibly partial, equal ids
meaning the same tokens (Mooncake's convention). Loaders of traces that carry no
prefix information synthesise ids with a documented model (`loadtest.sharing`).
Token ids are never stored: `loadtest.tokens` derives them from the ids on demand,
so a 67-M-token trace costs a few MiB.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np


class TraceError(ValueError):
    """A trace file or option that cannot be used; the message names the line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. `arrival_s` is relative to the trace's first arrival."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None
    model: str | None = None
    # Scope fields used by scenarios (tenants, LoRA switches); None = the deployment's.
    cache_salt: str | None = None
    lora: str | None = None


@dataclass(slots=True)
class TraceStats:
    requests: int
    span_s: float
    rate_rps: float
    input_p50: float
    input_p90: float
    input_p99: float
    input_mean: float
    output_p50: float
    output_mean: float
    blocks_total: int
    blocks_unique: int
    # Ideal prefix reuse (one infinite shared cache): share of blocks / tokens already seen.
    ideal_block_reuse: float
    ideal_token_reuse: float

    def to_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(slots=True)
class Trace:
    """Requests in arrival order plus what is needed to turn them into tokens."""

    name: str
    block_tokens: int
    requests: list[TraceRequest]
    source: str = ""
    # How prefix sharing was obtained: "trace" (carried by the file) or the model used.
    sharing: str = "trace"
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.block_tokens <= 0:
            raise TraceError("block_tokens must be positive")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def span_s(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    def window(self, start_s: float = 0.0, duration_s: float | None = None, limit: int | None = None) -> Trace:
        """The requests arriving in [start_s, start_s + duration_s), at most `limit`, re-based to 0."""
        if start_s < 0 or (duration_s is not None and duration_s <= 0) or (limit is not None and limit <= 0):
            raise TraceError("window: start must be >= 0, duration and limit > 0")
        out: list[TraceRequest] = []
        end = math.inf if duration_s is None else start_s + duration_s
        for r in self.requests:
            if r.arrival_s < start_s:
                continue
            if r.arrival_s >= end or (limit is not None and len(out) >= limit):
                break
            out.append(r)
        base = out[0].arrival_s if out else 0.0
        reqs = [replace(r, index=i, arrival_s=r.arrival_s - base) for i, r in enumerate(out)]
        return Trace(self.name, self.block_tokens, reqs, self.source, self.sharing, list(self.notes))

    def scaled(self, speed: float) -> Trace:
        """Arrivals compressed by `speed` (2.0 = twice the request rate); lengths unchanged."""
        if not speed > 0 or not math.isfinite(speed):
            raise TraceError(f"speed must be a positive number, got {speed!r}")
        reqs = [replace(r, arrival_s=r.arrival_s / speed) for r in self.requests]
        return Trace(self.name, self.block_tokens, reqs, self.source, self.sharing, list(self.notes))

    def with_requests(self, requests: Iterable[TraceRequest], name: str | None = None) -> Trace:
        """Same trace metadata, other requests (re-indexed in the given order)."""
        reqs = [replace(r, index=i) for i, r in enumerate(requests)]
        return Trace(name or self.name, self.block_tokens, reqs, self.source, self.sharing, list(self.notes))

    def validate(self) -> None:
        """Every request's ids cover its prompt exactly and arrivals never go back."""
        prev = -math.inf
        bt = self.block_tokens
        for r in self.requests:
            if r.input_length <= 0:
                raise TraceError(f"request {r.index}: input_length must be positive")
            if r.output_length <= 0:
                raise TraceError(f"request {r.index}: output_length must be positive")
            if len(r.hash_ids) != -(-r.input_length // bt):
                raise TraceError(
                    f"request {r.index}: {len(r.hash_ids)} hash_ids for {r.input_length} tokens "
                    f"(expected ceil({r.input_length}/{bt}) = {-(-r.input_length // bt)})"
                )
            if r.arrival_s < prev:
                raise TraceError(f"request {r.index}: arrival {r.arrival_s} before the previous one ({prev})")
            prev = r.arrival_s

    def stats(self) -> TraceStats:
        n = len(self.requests)
        if n == 0:
            return TraceStats(0, 0.0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0)
        inp = np.array([r.input_length for r in self.requests], dtype=np.float64)
        out = np.array([r.output_length for r in self.requests], dtype=np.float64)
        seen: set[int] = set()
        total = hit = 0
        hit_tokens = 0
        bt = self.block_tokens
        for r in self.requests:
            for j, h in enumerate(r.hash_ids):
                total += 1
                if h in seen:
                    hit += 1
                    hit_tokens += min(bt, r.input_length - j * bt)
                else:
                    seen.add(h)
        span = self.span_s
        return TraceStats(
            requests=n,
            span_s=span,
            rate_rps=(n / span) if span > 0 else float("inf"),
            input_p50=float(np.percentile(inp, 50)),
            input_p90=float(np.percentile(inp, 90)),
            input_p99=float(np.percentile(inp, 99)),
            input_mean=float(inp.mean()),
            output_p50=float(np.percentile(out, 50)),
            output_mean=float(out.mean()),
            blocks_total=total,
            blocks_unique=len(seen),
            ideal_block_reuse=hit / total if total else 0.0,
            ideal_token_reuse=hit_tokens / float(inp.sum()),
        )
