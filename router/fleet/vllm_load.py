"""A vLLM worker's load, read from its Prometheus `/metrics` (it has no `/load`).

Only the few samples routing needs are read, by name, from the exposition text; gauges
carry labels (model_name, engine) and values of one name are summed (several engines
behind one server add up).
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from kvwire import BlockCounts, LoadReport

_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
# Renamed across releases: the newest first.
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
# An info gauge (value 1) whose labels carry the engine's cache layout, num_gpu_blocks among them.
_CACHE_INFO = "vllm:cache_config_info"


@dataclass(slots=True)
class VllmLoad:
    waiting_requests: int
    running_requests: int
    kv_usage: float | None  # 0..1, None when the server does not export it
    gpu_blocks: int | None = None  # KV blocks of all its engines, None when not exported


def parse_vllm_metrics(text: str, engine: str | None = None) -> VllmLoad:
    """Raises ValueError when the text lacks the queue gauges. `engine`: only that
    engine's samples (one data-parallel rank, label `engine`), where the server labels
    them so; where it does not, the whole server's (the ranks share one figure).

    Reads only the samples it needs, found by name in the text: a vLLM server's
    `/metrics` is ~50 KB of histograms, and prometheus_client's full parse took 8.7 ms per
    poll against 73 us for this, on the recorded text tests/vllm/test_vllm_metrics.py checks it
    against (the full parser stays the reference there)."""
    if engine is not None and not any(_label(lb, "engine") == engine for lb, _ in _samples(text, _WAITING)):
        engine = None

    def mine(labels: str) -> bool:
        return engine is None or _label(labels, "engine") == engine

    sums: dict[str, float] = {}
    for name in (_WAITING, _RUNNING, *_USAGE):
        for labels, value in _samples(text, name):
            if mine(labels):
                sums[name] = sums.get(name, 0.0) + value
    blocks: int | None = None
    for labels, _value in (s for s in _samples(text, _CACHE_INFO) if mine(s[0])):
        n = _label(labels, "num_gpu_blocks")
        if n.isdigit() and int(n) > 0:  # "None" before the engine has profiled memory
            blocks = (blocks or 0) + int(n)
    if _WAITING not in sums or _RUNNING not in sums:
        raise ValueError(f"no {_WAITING} / {_RUNNING} gauges in /metrics")
    usage = next((sums[n] for n in _USAGE if n in sums), None)
    if usage is not None:
        usage = min(1.0, max(0.0, usage))
    return VllmLoad(int(sums[_WAITING]), int(sums[_RUNNING]), usage, blocks)


def _samples(text: str, name: str) -> Iterator[tuple[str, float]]:
    """(label text, value) of every sample line of `name` (exposition format: `name{labels}
    value [timestamp]`, one per line); a line whose value does not parse is skipped."""
    start = 0
    while True:
        i = text.find(name, start)
        if i < 0:
            return
        start = i + len(name)
        if (i and text[i - 1] != "\n") or start >= len(text) or text[start] not in "{ ":
            continue  # a longer name, or the name inside another line
        end = text.find("\n", start)
        line = text[start:end if end >= 0 else len(text)]
        labels = ""
        if line.startswith("{"):
            close = line.rfind("}")
            if close < 0:
                continue
            labels, line = line[1:close], line[close + 1:]
        parts = line.split()
        try:
            v = float(parts[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(v):
            yield labels, v


def _label(labels: str, key: str) -> str:
    """The value of `key="..."` in a label text ("" when absent)."""
    i = labels.find(key + '="')
    while i > 0 and labels[i - 1] not in ", ":
        i = labels.find(key + '="', i + 1)
    if i < 0:
        return ""
    j = i + len(key) + 2
    return labels[j:labels.find('"', j)]


def vllm_report(v: VllmLoad) -> LoadReport:
    """A vLLM server's load as a `/load` report. Its block count comes from
    `cache_config_info`; without it, free blocks are on a per-10k scale (the policies
    then compare such workers by fraction only)."""
    blocks: dict[str, BlockCounts] = {}
    if v.kv_usage is not None:
        cap = v.gpu_blocks or 10_000
        free = int(round((1.0 - v.kv_usage) * cap))
        blocks["GPU"] = BlockCounts(cap - free, free, cap)
    return LoadReport(waiting_requests=v.waiting_requests, running_requests=v.running_requests, blocks=blocks)
