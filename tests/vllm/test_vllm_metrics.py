"""The gateway reads a vLLM server's load by name from its `/metrics` text (router/fleet/vllm_load.py).

The reference is prometheus_client's full parser over a real server's exposition
(tests/data/vllm/metrics-0.32.0.txt) and over made-up texts with the details a reader
by name can trip on: longer names sharing a prefix, several engines, timestamps, label
values with spaces and braces, comments naming the metric.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.fleet.vllm_load import VllmLoad, parse_vllm_metrics

DATA = Path(__file__).parents[1] / "data" / "vllm" / "metrics-0.32.0.txt"


def _reference(text: str) -> VllmLoad:
    """The same quantities through prometheus_client's full parser."""
    sums: dict[str, float] = {}
    blocks = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
            elif s.name == "vllm:cache_config_info" and s.labels.get("num_gpu_blocks", "").isdigit():
                blocks = (blocks or 0) + int(s.labels["num_gpu_blocks"])
    return VllmLoad(int(sums["vllm:num_requests_waiting"]), int(sums["vllm:num_requests_running"]),
                    sums.get("vllm:kv_cache_usage_perc"), blocks)


def test_real_server_text_reads_as_the_full_parser_reads_it() -> None:
    text = DATA.read_text()
    got = parse_vllm_metrics(text)
    assert got == _reference(text)
    assert got.gpu_blocks == 4096 and got.waiting_requests == 0 and got.kv_usage == 0.0


TRICKY = """\
# HELP vllm:num_requests_waiting Number of requests waiting. vllm:num_requests_waiting{x="1"} 99
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="a b {c}"} 3.0
vllm:num_requests_waiting{engine="1",model_name="a b {c}"} 2.0 1700000000000
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 40.0
vllm:num_requests_running{engine="0",model_name="m"} 4
vllm:num_requests_running{engine="1",model_name="m"} 1e0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100",xnum_gpu_blocks="7"} 1.0
vllm:cache_config_info{block_size="32",engine="1",num_gpu_blocks="None"} 1.0
"""


def test_prefixed_names_engines_timestamps_and_odd_labels() -> None:
    got = parse_vllm_metrics(TRICKY)
    assert got == VllmLoad(5, 5, 0.75, 100)
    assert got == _reference(TRICKY)


def test_usage_is_clamped_and_missing_gauges_refused() -> None:
    text = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:gpu_cache_usage_perc 1.7\n"
    assert parse_vllm_metrics(text).kv_usage == 1.0
    with pytest.raises(ValueError, match="num_requests_running"):
        parse_vllm_metrics("vllm:num_requests_waiting 1\n")
    with pytest.raises(ValueError):
        parse_vllm_metrics("vllm:num_requests_waitingx 1\nvllm:num_requests_runningy 1\n")
