"""The gateway's Prometheus metrics, on a registry of its own (no process-global state).

Hot-path counters are resolved to their labelled children once and cached, so a
request pays a dict lookup and an increment, not `labels()` parsing. Gauges that
describe state (worker health, index size, ingestion) are computed at scrape time by
a collector that reads the live objects, so nothing updates them per request.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FAST = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1)
_RATIO = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("kvroute_requests", "Requests by route, status and model", ["route", "status", "model"], registry=r)
        self.ttft = Histogram("kvroute_ttft_seconds", "Time to first token seen by the gateway", ["model"], buckets=_LAT, registry=r)
        self.tpot = Histogram("kvroute_tpot_seconds", "Time per output token after the first", ["model"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5), registry=r)
        self.e2e = Histogram("kvroute_e2e_seconds", "Request latency end to end", ["model"], buckets=_LAT, registry=r)
        self.decision = Histogram("kvroute_decision_seconds", "Routing decision time (keys+lookup+policy)", ["policy"], buckets=_FAST, registry=r)
        self.tokenize = Histogram("kvroute_tokenize_seconds", "Prompt tokenization time", ["model"], buckets=_FAST, registry=r)
        self.choices = Counter("kvroute_route_choices", "Routing choices by policy and reason", ["policy", "reason"], registry=r)
        self.ttft_ratio = Histogram("kvroute_ttft_actual_over_predicted", "Measured / predicted TTFT", ["worker"], buckets=_RATIO, registry=r)
        self.ttft_abs_err = Histogram("kvroute_ttft_prediction_abs_error_seconds", "|measured - predicted| TTFT", ["worker"], buckets=_LAT, registry=r)
        self.matched_tokens = Counter("kvroute_matched_tokens", "Prompt tokens the chosen worker held, by tier", ["tier"], registry=r)
        self.prompt_tokens = Counter("kvroute_prompt_tokens", "Prompt tokens routed", ["model"], registry=r)
        self.cached_tokens = Counter("kvroute_cached_tokens", "Prompt tokens workers reported as cached", ["model"], registry=r)
        self.prefetch_sent = Counter("kvroute_prefetch_sent", "Prefetch requests sent", registry=r)
        self.prefetch_failed = Counter("kvroute_prefetch_failed", "Prefetch requests refused or failed", registry=r)
        self.prefetch_cancelled = Counter("kvroute_prefetch_cancelled", "Prefetches cancelled (request cancelled or rerouted)", registry=r)
        self.prefetch_requested_tokens = Counter("kvroute_prefetch_requested_tokens", "Tokens asked to be raised toward GPU", registry=r)
        self.prefetch_used_tokens = Counter("kvroute_prefetch_used_tokens", "Prefetched tokens the worker reported using", registry=r)
        self.prefetch_wasted_tokens = Counter("kvroute_prefetch_wasted_tokens", "Requested minus used prefetch tokens", registry=r)
        self.prefetch_wasted_bytes = Counter("kvroute_prefetch_wasted_bytes", "Wasted prefetch tokens times KV bytes per token", registry=r)
        self.retries = Counter("kvroute_retries", "Requests retried on the next-best worker", ["reason"], registry=r)
        self.shed = Counter("kvroute_shed", "Requests shed with 429/503", ["reason"], registry=r)
        self.upstream_errors = Counter("kvroute_upstream_errors", "Worker failures seen by the proxy", ["worker", "phase"], registry=r)
        self.worker_refused = Counter("kvroute_worker_refused", "Worker registrations refused", ["worker", "reason"], registry=r)
        self.worker_transitions = Counter("kvroute_worker_transitions", "Worker state changes", ["worker", "state"], registry=r)
        self.internal_errors = Counter("kvroute_internal_errors", "Unexpected exceptions turned into 500s", registry=r)
        self.disconnects = Counter("kvroute_client_disconnects", "Clients that went away mid-request", registry=r)
        self.inflight = Gauge("kvroute_inflight_requests", "Requests in flight at the gateway", registry=r)
        self._req_children: dict[tuple[str, int, str], Any] = {}
        self._per_model: dict[tuple[int, str], Any] = {}

    def count_request(self, route: str, status: int, model: str) -> None:
        key = (route, status, model)
        c = self._req_children.get(key)
        if c is None:
            if len(self._req_children) > 10_000:  # bounded: unknown model names are client-chosen
                key = (route, status, "other")
                c = self._req_children.get(key)
            if c is None:
                c = self._req_children[key] = self.requests.labels(route, str(status), key[2])
        c.inc()

    def child(self, metric: Any, *labels: str) -> Any:
        """A cached labelled child (labels must be bounded: model ids, worker ids, tiers)."""
        key = (id(metric), *labels)
        c = self._per_model.get(key)  # type: ignore[arg-type]
        if c is None:
            c = self._per_model[key] = metric.labels(*labels)  # type: ignore[index]
        return c

    def add_state_collector(self, fn: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self.registry.register(_FnCollector(fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterable[GaugeMetricFamily]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return self._fn()

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []
