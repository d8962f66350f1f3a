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
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_FAST = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1)
_RATIO = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)


_TOKENS = (0, 1, 16, 64, 256, 1024, 4096, 16384)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, list(labels), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(name, doc, list(labels), buckets=buckets, registry=r)

        self.requests = counter("kvroute_requests", "Requests by route, status and model", "route", "status", "model")
        self.ttft = histogram("kvroute_ttft_seconds", "Time to first token seen by the gateway", _LAT, "model")
        self.tpot = histogram("kvroute_tpot_seconds", "Time per output token after the first",
                              (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5), "model")
        self.e2e = histogram("kvroute_e2e_seconds", "Request latency end to end", _LAT, "model")
        self.decision = histogram("kvroute_decision_seconds",
                                  "Routing work per request: block keys, index lookup and scoring", _FAST, "policy")
        self.tokenize = histogram("kvroute_tokenize_seconds", "Prompt tokenization time", _FAST, "model")
        self.choices = counter("kvroute_route_choices", "Routing choices by policy and reason", "policy", "reason")
        self.ttft_ratio = histogram("kvroute_ttft_actual_over_predicted", "Measured / predicted TTFT", _RATIO, "worker")
        self.ttft_abs_err = histogram("kvroute_ttft_prediction_abs_error_seconds", "|measured - predicted| TTFT",
                                      _LAT, "worker")
        self.matched_tokens = counter("kvroute_matched_tokens", "Prompt tokens the chosen worker held, by tier", "tier")
        self.prompt_tokens = counter("kvroute_prompt_tokens", "Prompt tokens routed", "model")
        self.cached_tokens = counter("kvroute_cached_tokens", "Prompt tokens workers reported as cached", "model")
        self.prefetch_sent = counter("kvroute_prefetch_sent", "Prefetch requests sent")
        self.prefetch_failed = counter("kvroute_prefetch_failed", "Prefetch requests refused or failed")
        self.prefetch_cancelled = counter("kvroute_prefetch_cancelled",
                                          "Prefetches cancelled (request cancelled or rerouted)")
        self.prefetch_requested_tokens = counter("kvroute_prefetch_requested_tokens",
                                                 "Tokens asked to be raised toward GPU")
        self.prefetch_used_tokens = counter("kvroute_prefetch_used_tokens",
                                            "Prefetched tokens the worker reported using")
        self.prefetch_wasted_tokens = counter("kvroute_prefetch_wasted_tokens", "Requested minus used prefetch tokens")
        self.prefetch_wasted_bytes = counter("kvroute_prefetch_wasted_bytes",
                                             "Wasted prefetch tokens times KV bytes per token")
        self.retries = counter("kvroute_retries", "Requests retried on the next-best worker", "reason")
        self.pd_served = counter("kvroute_pd_requests", "Requests of a pair policy by the option that served them "
                                 "(single, pair, bypass)", "option")
        self.shed = counter("kvroute_shed", "Requests shed with 429/503", "reason")
        self.upstream_errors = counter("kvroute_upstream_errors", "Worker failures seen by the proxy", "worker",
                                       "phase")
        self.worker_refused = counter("kvroute_worker_refused", "Worker registrations refused", "worker", "reason")
        self.worker_transitions = counter("kvroute_worker_transitions", "Worker state changes", "worker", "state")
        self.internal_errors = counter("kvroute_internal_errors", "Unexpected exceptions turned into 500s")
        self.key_prompt_mismatch = counter("kvroute_key_prompt_mismatch",
                                           "Answers whose usage.prompt_tokens differ from the gateway's count",
                                           "worker")
        self.key_cached_drift = histogram("kvroute_key_cached_drift_tokens",
                                          "|reported - predicted| cached prompt tokens (vLLM workers)", _TOKENS,
                                          "worker")
        self.disconnects = counter("kvroute_client_disconnects", "Clients that went away mid-request")
        self.held = Gauge("kvroute_gateway_held_requests", "Requests held in the gateway's queue (late binding)",
                          ["model"], registry=r)
        self.hold = histogram("kvroute_gateway_hold_seconds", "Time requests were held in the gateway's queue",
                              _LAT, "model")
        self.hold_overflow = counter("kvroute_gateway_queue_full",
                                     "Requests routed on arrival because the gateway's queue was full", "model")
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

    def add_state_collector(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.registry.register(_FnCollector(fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        return self._fn()

    def describe(self) -> Iterable[Metric]:
        return []
