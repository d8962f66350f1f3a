"""Optional OpenTelemetry traces: one span per completion request, its routing decision
(worker, policy, reason, predicted TTFT, cached tokens) as attributes.

Off unless `observability.otel.enabled`; then the OpenTelemetry SDK must be installed
(`pip install 'kvroute[otel]'`), else a warning says so and the gateway runs without
traces. With `endpoint` set, spans go to that OTLP/HTTP collector; without it they go
to the process's global tracer provider, which the operator configures (for example
with `opentelemetry-instrument` and the standard OTEL_* environment). The span is
written when the request ends, with its real start time: nothing is added to the
request's path before then.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from ..config import OtelConfig

log = logging.getLogger("kvroute.tracing")


class RequestTracer:
    """Writes finished requests as spans."""

    def __init__(self, tracer: Any, status: Any) -> None:
        self.tracer = tracer
        self.status = status  # opentelemetry.trace.Status / StatusCode, imported once

    @classmethod
    def build(cls, cfg: OtelConfig) -> RequestTracer | None:
        if not cfg.enabled:
            return None
        try:
            from opentelemetry import trace
            from opentelemetry.trace import Status, StatusCode
        except ImportError:
            log.warning("observability.otel.enabled, but the OpenTelemetry SDK is not installed "
                        "(pip install 'kvroute[otel]'): no traces")
            return None
        provider = _otlp_provider(cfg) if cfg.endpoint else trace.get_tracer_provider()
        if provider is None:
            return None
        return cls(provider.get_tracer("kvroute.gateway"), (Status, StatusCode))

    def request(self, t_start: float, ok: bool, attrs: Mapping[str, Any]) -> None:
        """One span from `t_start` (time.monotonic) to now; None-valued attributes left out."""
        now_ns, mono = time.time_ns(), time.monotonic()
        start_ns = now_ns - int((mono - t_start) * 1e9)
        span = self.tracer.start_span("kvroute.request", start_time=start_ns, attributes={
            f"kvroute.{k}": v for k, v in attrs.items() if v is not None})
        status_cls, code = self.status
        span.set_status(status_cls(code.OK if ok else code.ERROR))
        span.end(end_time=now_ns)


def _otlp_provider(cfg: OtelConfig) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("observability.otel.endpoint is set, but the OTLP exporter is not installed "
                    "(pip install 'kvroute[otel]'): no traces")
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.endpoint)))
    return provider
