"""An SGLang worker's load, read from its Prometheus `/metrics` (it has no `/load`).

SGLang exports its scheduler's gauges when started with `--enable-metrics`:
`sglang:num_queue_reqs` (waiting), `sglang:num_running_reqs`, `sglang:token_usage` (the
share of its KV token pool in use, 0..1) and `sglang:num_used_tokens`, each labelled with
`model_name` and the scheduler's ranks. The tensor-parallel ranks of one scheduler report
the same figures, so within one data-parallel rank (label `dp_rank`, or `dp` in some
builds) the largest sample is taken, and the ranks are summed; `rank` keeps one rank's.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvwire import BlockCounts, LoadReport

from .vllm_load import _label, _samples

_WAITING = "sglang:num_queue_reqs"
_RUNNING = "sglang:num_running_reqs"
_USAGE = "sglang:token_usage"
_USED = "sglang:num_used_tokens"
_RANK_LABELS = ("dp_rank", "dp")


@dataclass(slots=True)
class SglangLoad:
    waiting_requests: int
    running_requests: int
    token_usage: float | None  # 0..1, None when not exported
    pool_tokens: int | None = None  # its KV token pool (used / usage), None when unknown


def _rank_of(labels: str) -> str:
    for key in _RANK_LABELS:
        v = _label(labels, key)
        if v:
            return v
    return ""


def parse_sglang_metrics(text: str, rank: str | None = None) -> SglangLoad:
    """Raises ValueError when the text lacks the queue gauges. `rank`: only that
    data-parallel rank's samples where the server labels them so, else the server's."""
    per: dict[str, dict[str, float]] = {}  # gauge -> rank -> value
    for name in (_WAITING, _RUNNING, _USAGE, _USED):
        by_rank: dict[str, float] = {}
        for labels, value in _samples(text, name):
            r = _rank_of(labels)
            by_rank[r] = max(value, by_rank.get(r, value))
        if by_rank:
            per[name] = by_rank
    if _WAITING not in per or _RUNNING not in per:
        raise ValueError(f"no {_WAITING} / {_RUNNING} gauges in /metrics (is SGLang started with --enable-metrics?)")
    if rank is not None and rank not in per[_WAITING]:
        rank = None

    def total(name: str) -> float | None:
        vals = per.get(name)
        if not vals:
            return None
        if rank is not None:
            return vals.get(rank)
        return sum(vals.values())

    usage: float | None = None
    pool: int | None = None
    used = total(_USED)
    if _USAGE in per:
        ranks = [rank] if rank is not None else list(per[_USAGE])
        us = [per[_USAGE][r] for r in ranks if r in per[_USAGE]]
        if us:
            usage = min(1.0, max(0.0, sum(us) / len(us)))
    if usage and used:
        pool = int(round(used / usage))
    return SglangLoad(int(total(_WAITING) or 0), int(total(_RUNNING) or 0), usage, pool)


def sglang_report(v: SglangLoad, page_size: int) -> LoadReport:
    """An SGLang server's load as a `/load` report, its KV pool in pages of `page_size`
    tokens (the worker's block size); without the pool's size, on a per-10k scale."""
    blocks: dict[str, BlockCounts] = {}
    if v.token_usage is not None:
        cap = v.pool_tokens // max(1, page_size) if v.pool_tokens else 10_000
        free = int(round((1.0 - v.token_usage) * cap))
        blocks["GPU"] = BlockCounts(cap - free, free, cap)
    return LoadReport(waiting_requests=v.waiting_requests, running_requests=v.running_requests, blocks=blocks)
