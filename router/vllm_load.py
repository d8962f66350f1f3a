"""A vLLM worker's load, read from its Prometheus `/metrics` (it has no `/load`).

Parsed with prometheus_client's own text parser (robust to label sets, comments and
exposition details across vLLM releases). Gauges carry labels (model_name, engine);
values of one name are summed (several engines behind one server add up).
"""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

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


def parse_vllm_metrics(text: str) -> VllmLoad:
    """Raises ValueError when the text is not Prometheus exposition or lacks the queue gauges."""
    sums: dict[str, float] = {}
    wanted = {_WAITING, _RUNNING, *_USAGE}
    blocks: int | None = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in wanted:
                sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
            elif s.name == _CACHE_INFO:
                n = s.labels.get("num_gpu_blocks", "")
                if n.isdigit() and int(n) > 0:  # "None" before the engine has profiled memory
                    blocks = (blocks or 0) + int(n)
    if _WAITING not in sums or _RUNNING not in sums:
        raise ValueError(f"no {_WAITING} / {_RUNNING} gauges in /metrics")
    usage = next((sums[n] for n in _USAGE if n in sums), None)
    if usage is not None:
        usage = min(1.0, max(0.0, usage))
    return VllmLoad(int(sums[_WAITING]), int(sums[_RUNNING]), usage, blocks)


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
