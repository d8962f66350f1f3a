"""`ideal`: the physical limit of a trace on a fleet, shown beside every simulated run.

Each request alone on an idle worker, with every block it could ever reuse already on
GPU: its TTFT is the prefill of its uncached tokens only, in the engine's own chunks
(`max_num_batched_tokens` per step, the profile's prefill formula per chunk), with no
queue, no load, no decode sharing the steps, no transport. A block "could be reused"
when another request issued no later than this one holds it (the leading run of the
request's fleet block keys found among them; blocks are prefix-chained, so that run is
exactly its reusable prefix), capped at the blocks an engine may take from cache (the
last prompt token is always computed).

It is a real lower bound for every policy on the simulated engines: a request's
chunks are at least that many and each costs at least that much (overheads, linear
and attention terms only add; other requests in the same step, decode steps, queueing,
loads and transport add time), and no engine can hold a block no request issued before
it (or with it) computed. Per-request slowdown = TTFT / ideal TTFT (>= 1).

Requests every engine refuses as too large (`SimProfile.refusal`: over the model's
context or the whole GPU pool) end failed here too, with the engine's 400 and message,
and hold no blocks for later ones: ideal and the policies' percentiles then cover the
same requests (a refused prompt is among the longest, and counting it put the ideal's
p99 above what the policies served).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import groupby

from router.planner.terms.cut import usable_blocks
from workers.errors import RequestTooLarge
from workers.sim import SimProfile

from .results import RequestResult, Run, RunMeta
from .trace import Trace, TraceRequest

IDEAL = "ideal"
KeysOf = Callable[[TraceRequest], Sequence[bytes]]


def reusable_blocks(requests: Iterable[TraceRequest], keys_of: KeysOf) -> list[int]:
    """Per request (in `requests` order, which must be arrival order): the leading blocks
    some other request issued no later than it holds. `keys_of(req)` gives its fleet keys."""
    seen: set[bytes] = set()
    out: list[int] = []
    for _t, grp in groupby(requests, key=lambda r: r.arrival_s):
        group = list(grp)
        keys = [keys_of(r) for r in group]
        count: dict[bytes, int] = {}
        for ks in keys:
            for k in set(ks):
                count[k] = count.get(k, 0) + 1
        for ks in keys:
            n = 0
            for k in ks:
                if k in seen or count[k] >= 2:
                    n += 1
                else:
                    break
            out.append(n)
        for ks in keys:
            seen.update(ks)
    return out


def ideal_prefill_s(profile: SimProfile, prompt_tokens: int, cached_blocks: int) -> float:
    """Prefill of a lone request after `cached_blocks` leading blocks on GPU, chunk by chunk."""
    bs = profile.block_size
    c = profile.compute
    budget = profile.scheduler.max_num_batched_tokens
    cached = usable_blocks(prompt_tokens, cached_blocks, bs) * bs
    left = prompt_tokens - cached
    t = 0.0
    while left > 0:
        n = min(left, budget)
        t += c.prefill_s(n, cached)
        cached += n
        left -= n
    return t


def ideal_ttfts(trace: Trace, profile: SimProfile, keys_of: KeysOf) -> list[float | None]:
    """Ideal TTFT (seconds) of each request of `trace`, in trace order; None for one the
    engines refuse (`SimProfile.refusal`), which no later request can reuse either."""
    reqs = sorted((r for r in trace.requests if _refusal(profile, r) is None), key=lambda r: (r.arrival_s, r.index))
    reuse = reusable_blocks(reqs, keys_of)
    by_index = {r.index: ideal_prefill_s(profile, r.input_length, n) for r, n in zip(reqs, reuse, strict=True)}
    return [by_index.get(r.index) for r in trace.requests]


def _refusal(profile: SimProfile, r: TraceRequest) -> tuple[str, str] | None:
    """The engines' refusal of `r` as the simulator sends it (its output length as max_tokens)."""
    return profile.refusal(r.input_length, r.output_length)


def ideal_run(trace: Trace, profile: SimProfile, keys_of: KeysOf, *, speed: float = 1.0, workers: int | None = None,
              tiers: str = "all", label: str = IDEAL) -> Run:
    """The ideal as a run of its own (mode "ideal"): reports put it beside the simulated
    runs of the same trace, profile and block size, and divide their TTFTs by it."""
    ttfts = ideal_ttfts(trace, profile, keys_of)
    results = [_ideal_result(profile, r, t, speed, label) for r, t in zip(trace.requests, ttfts, strict=True)]
    meta = RunMeta(run=label, mode=IDEAL, policy=IDEAL, trace=trace.name, speed=speed, workers=workers,
                   profile=profile.name, tiers=tiers, params={"block_size": profile.block_size})
    return Run(meta, results)


def _ideal_result(profile: SimProfile, r: TraceRequest, ttft: float | None, speed: float, label: str) -> RequestResult:
    """One request alone: its ideal TTFT and batch-1 decode, or the engines' refusal."""
    at = r.arrival_s / speed
    if ttft is None:
        refused = _refusal(profile, r)
        return RequestResult(run=label, index=r.index, arrival_s=at, start_s=at, prompt_tokens=r.input_length,
                             status=RequestTooLarge.status, error=refused[1] if refused else "refused")
    step = profile.compute.decode_step_s(1, r.input_length)
    out = max(r.output_length, 1)
    return RequestResult(
        run=label, index=r.index, arrival_s=at, start_s=at, ttft_s=ttft, tpot_s=step if out > 1 else None,
        e2e_s=ttft + (out - 1) * step, prompt_tokens=r.input_length, output_tokens=out, worker="alone",
    )
