"""In-memory span capture, the way opentelemetry-python-contrib's TestBase does it."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_exporter: InMemorySpanExporter | None = None


def install_memory_tracer(service_name: str = "vllm") -> InMemorySpanExporter:
    """Install a global SDK provider that keeps finished spans in memory."""
    global _exporter
    from connector.telemetry.tracing import PrivateRandomIdGenerator

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              id_generator=PrivateRandomIdGenerator())
    _exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(_exporter))
    trace.set_tracer_provider(provider)
    return _exporter


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    """A picklable view of a finished span (ids as hex, like Jaeger shows them)."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "kind": span.kind.name,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
        "status_description": span.status.description or "",
        "start": span.start_time,
        "end": span.end_time,
        "service": (span.resource.attributes or {}).get("service.name"),
        "events": [e.name for e in span.events],
        "event_times": {e.name: e.timestamp for e in reversed(span.events)},
        "links": [{"trace_id": format(link.context.trace_id, "032x"),
                   "span_id": format(link.context.span_id, "016x"),
                   "attributes": dict(link.attributes or {})} for link in span.links],
    }


def flush_and_collect() -> list[dict[str, Any]]:
    """Finished spans so far (memory mode); in OTLP mode, flush and return none."""
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)
    if flush is not None:
        flush()
    if _exporter is None:
        return []
    return [span_to_dict(s) for s in _exporter.get_finished_spans()]
