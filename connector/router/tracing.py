"""The router's own tracer: one SERVER span per request, one CLIENT span per leg.

The router keeps its own `TracerProvider` (service `router` unless OTEL_SERVICE_NAME
says otherwise) instead of the global one, so embedding it never changes another
component's tracing. Without an endpoint the router starts no spans and forwards the
caller's `traceparent`/`tracestate` to both legs unchanged.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry.trace import Tracer

from connector.telemetry.tracing import make_span_exporter
from connector.vocabulary import ROUTER_TRACER_NAME

TRACE_HEADERS = ("traceparent", "tracestate")


class RouterTracing:
    """Owns the provider so the router can flush it on shutdown."""

    def __init__(self, endpoint: str | None = None, exporter: Any = None):
        self.provider: Any = None
        self.tracer: Tracer | None = None
        if exporter is None and endpoint:
            exporter = make_span_exporter(endpoint)
        if exporter is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "router")})
        from connector.telemetry.tracing import PrivateRandomIdGenerator

        self.provider = TracerProvider(resource=resource, id_generator=PrivateRandomIdGenerator())
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer(ROUTER_TRACER_NAME)

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
