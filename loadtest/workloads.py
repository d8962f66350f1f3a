"""Synthetic workloads for the scenarios: seeded traces with a chosen prefix structure.

All of them are ordinary `Trace`s (64-token blocks, so they align with fleet blocks of
16 or 64 tokens) and can be saved in Mooncake format and replayed over HTTP like any
trace. Arrivals are Poisson at `rate_rps` unless said otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .trace import Trace, TraceRequest

BT = 64


class _Ids:
    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


def _blocks(tokens: int) -> int:
    return -(-tokens // BT)


@dataclass(frozen=True, slots=True)
class PrefixMix:
    """Prompts = one of `prefix_tokens` (Zipf-popular, with probability `prefix_prob`)
    followed by a unique suffix of `suffix_tokens` (uniform in [lo, hi])."""

    prefix_tokens: Sequence[int]
    prefix_prob: float = 1.0
    zipf: float = 1.0
    suffix_tokens: tuple[int, int] = (64, 512)
    output_tokens: tuple[int, int] = (32, 256)


def prefix_workload(name: str, n: int, rate_rps: float, mix: PrefixMix, seed: int = 0,
                    start_s: float = 0.0) -> Trace:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    # Prefix lengths are rounded to whole blocks so a prefix ends where a block ends.
    pools = [ids.take(max(1, round(L / BT))) for L in mix.prefix_tokens]
    w = np.arange(1, len(pools) + 1, dtype=np.float64) ** -mix.zipf if pools else np.zeros(0)
    p = w / w.sum() if pools else w
    t = start_s
    reqs: list[TraceRequest] = []
    for i in range(n):
        t += rng.exponential(1.0 / rate_rps)
        suffix = int(rng.integers(mix.suffix_tokens[0], mix.suffix_tokens[1] + 1))
        prefix: tuple[int, ...] = ()
        if pools and rng.random() < mix.prefix_prob:
            prefix = pools[int(rng.choice(len(pools), p=p))]
        total = len(prefix) * BT + suffix
        hid = prefix + ids.take(_blocks(total) - len(prefix))
        out = int(rng.integers(mix.output_tokens[0], mix.output_tokens[1] + 1))
        reqs.append(TraceRequest(i, t, total, out, hid))
    return Trace(name, BT, reqs, sharing=f"synthetic: {mix}")


def burst_workload(name: str, n: int, window_s: float, mix: PrefixMix, seed: int = 0) -> Trace:
    """`n` requests arriving uniformly within `window_s` seconds (a cold-start burst)."""
    tr = prefix_workload(name, n, 1.0, mix, seed)
    rng = np.random.default_rng(seed + 1)
    times = np.sort(rng.uniform(0.0, window_s, n))
    return tr.with_requests(
        [TraceRequest(r.index, float(t), r.input_length, r.output_length, r.hash_ids)
         for r, t in zip(tr.requests, times, strict=True)]
    )


@dataclass(frozen=True, slots=True)
class Sessions:
    """Multi-turn conversations; some of them pause for `sleep_s` before their last turns."""

    sessions: int = 40
    turns: int = 4
    first_tokens: tuple[int, int] = (2000, 6000)
    turn_tokens: tuple[int, int] = (200, 800)
    think_s: tuple[float, float] = (5.0, 30.0)
    sleepers: float = 0.5  # share of sessions that sleep once
    sleep_s: float = 900.0
    output_tokens: tuple[int, int] = (64, 256)


def session_workload(name: str, spec: Sessions, seed: int = 0, span_s: float = 120.0) -> Trace:
    """Sessions start uniformly over `span_s`; each turn's prompt is the previous prompt
    plus a new user turn. Sleepers pause `sleep_s` before their second half of turns.
    `TraceRequest.session` names the session and, for a resumed turn, ends with ":resumed"."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    items: list[tuple[float, int, int, tuple[int, ...], str]] = []
    for s in range(spec.sessions):
        t = float(rng.uniform(0.0, span_s))
        sleeper = rng.random() < spec.sleepers
        prompt_ids: tuple[int, ...] = ()
        length = 0
        for turn in range(spec.turns):
            add = int(rng.integers(*(spec.first_tokens if turn == 0 else spec.turn_tokens)))
            # The new turn completes the previous partial block, then adds blocks.
            length = len(prompt_ids) * BT + add
            prompt_ids = prompt_ids + ids.take(_blocks(length) - len(prompt_ids))
            resumed = sleeper and turn == spec.turns // 2
            if turn:
                t += float(rng.uniform(*spec.think_s)) + (spec.sleep_s if resumed else 0.0)
            out = int(rng.integers(*spec.output_tokens))
            items.append((t, length, out, prompt_ids, f"s{s}" + (":resumed" if resumed else "")))
    items.sort(key=lambda x: x[0])
    reqs = [TraceRequest(i, t, L, o, h, session=sess) for i, (t, L, o, h, sess) in enumerate(items)]
    return Trace(name, BT, reqs, sharing=f"synthetic sessions: {spec}")


def merge(name: str, *traces: Trace) -> Trace:
    """Interleave traces by arrival time; their block ids are kept apart by offsets."""
    reqs: list[TraceRequest] = []
    off = 0
    for tr in traces:
        if tr.block_tokens != BT:
            raise ValueError("merge needs traces built here (64-token blocks)")
        top = 0
        for r in tr.requests:
            reqs.append(TraceRequest(0, r.arrival_s, r.input_length, r.output_length,
                                     tuple(h + off for h in r.hash_ids), r.session, r.model, r.cache_salt, r.lora))
            top = max(top, max(r.hash_ids) + 1)
        off += top
    reqs.sort(key=lambda r: r.arrival_s)
    return Trace(name, BT, reqs).with_requests(reqs)
