"""Prometheus metrics of one worker (its own registry: many workers share a process).

Request-level series are recorded by the HTTP app from each request's usage (the same
numbers the router calibrates on); engine state (queue, blocks per tier) and engine
counters are read from the engine at scrape time, so nothing is updated per token.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from workers.api import Engine
from workers.usage import LOAD_TIERS, Usage

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load = self.engine.load()
        for name, doc in (
            ("waiting_requests", "Requests waiting to be scheduled"),
            ("running_requests", "Requests scheduled (loading, prefilling or decoding)"),
            ("waiting_prefill_tokens", "Prompt tokens of waiting requests"),
            ("est_queue_s", "Estimated wait before a new request starts prefill (s)"),
            ("prefetch_queue", "Prefetches in flight"),
        ):
            metric = "est_queue_seconds" if name == "est_queue_s" else name
            g = GaugeMetricFamily(f"kvroute_worker_{metric}", doc)
            g.add_metric([], float(getattr(load, name)))
            yield g
        used = GaugeMetricFamily("kvroute_worker_blocks_used", "KV blocks held per tier", labels=["tier"])
        cap = GaugeMetricFamily("kvroute_worker_blocks_capacity", "KV block capacity per tier", labels=["tier"])
        for tier, b in load.blocks.items():
            used.add_metric([tier], float(b.used))
            cap.add_metric([tier], float(b.total))
        yield used
        yield cap
        pinned = getattr(self.engine, "pd_pinned_blocks", None)
        if pinned is not None:  # the real engine: prompt blocks kept for remote decodes to pull
            g = GaugeMetricFamily("kvroute_worker_pd_pinned_blocks",
                                  "Device KV blocks pinned by prefills for a remote decode, until pulled or expired")
            g.add_metric([], float(pinned()))
            yield g
        for name, values in self.engine.counters().items():
            labelled = any(values)
            labels = ["tier"] if labelled else None
            c = CounterMetricFamily(f"kvroute_worker_{name}", name.replace("_", " "), labels=labels)
            for label, v in values.items():
                c.add_metric([label] if labelled else [], float(v))
            yield c


class WorkerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "kvroute_worker_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram("kvroute_worker_ttft_seconds", "Time to first token", buckets=_TTFT_BUCKETS, registry=r)
        self.queue = Histogram(
            "kvroute_worker_queue_seconds", "Time waiting before scheduling", buckets=_TTFT_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("kvroute_worker_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("kvroute_worker_completion_tokens", "Generated tokens", registry=r)
        self.loaded_tokens = Counter(
            "kvroute_worker_cached_tokens", "Prompt tokens served from cache, by tier", ["tier"], registry=r
        )
        self.recomputed_tokens = Counter("kvroute_worker_recomputed_tokens", "Prompt tokens prefilled", registry=r)
        self.prefetched_tokens = Counter(
            "kvroute_worker_prefetched_tokens", "Prompt tokens a prefetch raised", registry=r
        )
        self._tier_children = {t: self.loaded_tokens.labels(t) for t in LOAD_TIERS}
        r.register(_EngineCollector(engine))

    def observe(self, u: Usage) -> None:
        self.ttft.observe(u.ttft_ms / 1000.0)
        self.queue.observe(u.queue_ms / 1000.0)
        self.prompt_tokens.inc(u.prompt_tokens)
        self.completion_tokens.inc(u.completion_tokens)
        for t, n in u.loaded_tokens.items():
            if n:
                self._tier_children[t].inc(n)
        self.recomputed_tokens.inc(u.recomputed_tokens)
        if u.prefetched_tokens:
            self.prefetched_tokens.inc(u.prefetched_tokens)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
