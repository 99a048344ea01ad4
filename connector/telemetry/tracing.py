"""OpenTelemetry set-up and span emission for the push worker.

Set-up follows vLLM: an already-installed SDK tracer provider (vLLM's worker tracer
or the user's) is reused; otherwise `--otlp-traces-endpoint` or the standard
`OTEL_EXPORTER_OTLP_*` variables select an OTLP exporter (gRPC by default,
`http/protobuf` on request) behind a `BatchSpanProcessor`, so exporting happens on
the processor's own thread and never blocks the writer or handshake threads. With
no endpoint, or `OTEL_SDK_DISABLED=true`, tracing is off and every call here is a
cheap no-op. No function here raises: a telemetry fault is logged and dropped.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID, Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from connector.telemetry import errors
from connector.telemetry.lean_span import LeanTracer, lean_spans_wanted, new_span_context
from connector.telemetry.record import HandshakeRecord
from connector.vocabulary import (
    MAX_PEER_STRING,
    SPAN_HANDSHAKE,
    TRACE_HEADER_KEYS,
    TRACER_NAME,
    Attr,
    Outcome,
    TelemetryError,
    phase_span_name,
)

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_setup_lock = threading.Lock()
_own_provider: Any = None
_own_processor: Any = None


def _env_endpoint() -> str | None:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )


def _protocol() -> str:
    return (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    )


def make_span_exporter(endpoint: str) -> Any:
    """OTLP exporter for `endpoint` with the protocol the environment asks for."""
    protocol = _protocol()
    if protocol == "grpc":
        from connector.telemetry.otlp_export import WireGrpcSpanExporter

        return WireGrpcSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        if not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return OTLPSpanExporter(endpoint=endpoint)
    raise ValueError(
        f"Unsupported OTLP protocol {protocol!r}: use 'grpc' or 'http/protobuf' "
        "(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)"
    )


class PrivateRandomIdGenerator(IdGenerator):
    """Trace and span ids from a generator of this process's own, seeded from the OS's
    entropy, not from Python's shared `random`.

    The SDK's default generator draws from the `random` module, which vLLM seeds with
    the same value (0 unless `--seed` says otherwise) in every worker process: every
    engine then produced the same sequence of span ids, and P's and D's spans of one
    request collided (parent cycles in Jaeger, repeated trace ids across restarts).
    A private `random.Random` seeded from `os.urandom` is out of vLLM's reach and costs
    no system call per id (reading `os.urandom` per id cost ~0.4 us, several times
    that inside a busy engine); a forked child seeds its copy afresh.
    """

    def generate_span_id(self) -> int:
        while True:
            value = _ids.getrandbits(64)
            if value != INVALID_SPAN_ID:
                return value

    def generate_trace_id(self) -> int:
        while True:
            value = _ids.getrandbits(128)
            if value != INVALID_TRACE_ID:
                return value


_ids = random.Random(os.urandom(32))
# A forked child would otherwise repeat its parent's ids.
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


def use_os_entropy(provider: Any) -> None:
    """Give an already-installed SDK provider (vLLM's, or a user's) our id generator.

    Only when it still has the SDK's default (seeded-`random`) generator: a user's own
    generator is left alone. Tracers created afterwards use it.
    """
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    if isinstance(getattr(provider, "id_generator", None), RandomIdGenerator):
        provider.id_generator = PrivateRandomIdGenerator()


def resolve_tracer(otlp_traces_endpoint: str | None = None) -> trace.Tracer | None:
    """The tracer our spans go to, or None when tracing is off."""
    global _own_provider
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return None
    from opentelemetry.sdk.trace import TracerProvider

    installed = trace.get_tracer_provider()
    if installed is _own_provider and installed is not None:
        return own_tracer(_own_provider, _own_processor)
    if isinstance(installed, TracerProvider):
        use_os_entropy(installed)
        return installed.get_tracer(TRACER_NAME)
    endpoint = otlp_traces_endpoint or _env_endpoint()
    if not endpoint:
        return None
    with _setup_lock:
        if _own_provider is None:
            install_provider(make_span_exporter(endpoint))
        return own_tracer(_own_provider, _own_processor)


def own_tracer(provider: Any, processor: Any) -> Any:
    """Lean spans on the provider we installed while our batch processor is its only
    one (`lean_span.py`); the SDK's tracer otherwise."""
    if processor is not None and lean_spans_wanted():
        tracer = LeanTracer(provider, processor, TRACER_NAME)
        if tracer.is_current():
            return tracer
    return provider.get_tracer(TRACER_NAME)


def install_provider(exporter: Any) -> Any:
    """Install our SDK provider: `exporter` behind a batch processor, losses counted.

    Export runs on the processor's thread; a full queue drops (counted as
    `spans_dropped`), a failing or raising exporter is counted per span
    (`span_export_failed`); neither ever reaches the thread that ended the span.
    """
    global _own_provider, _own_processor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from connector.telemetry.export_guard import CountingBatchSpanProcessor, CountingExporter

    resource = Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME", "vllm"),
         "vllm.process_id": str(os.getpid())}
    )
    provider = TracerProvider(resource=resource, id_generator=PrivateRandomIdGenerator())
    processor = CountingBatchSpanProcessor(CountingExporter(exporter))
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _own_provider = trace.get_tracer_provider()
    if not isinstance(_own_provider, TracerProvider):  # someone else won
        _own_provider = provider
    _own_processor = processor if _own_provider is provider else None
    return _own_provider


# A version-00 `traceparent` as we and vLLM write it (lower-case hex): one C match.
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def _traceparent(span_context: Any) -> str:
    """W3C `traceparent` (version 00) of a span context."""
    return (f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
            f"{int(span_context.trace_flags):02x}")


def _parse_traceparent(value: str) -> Any:
    """A remote span context from a version-00 `traceparent`, else None (the SDK's
    propagator then parses it, and rejects what is malformed)."""
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    trace_hex, span_hex, flags_hex = match.groups()
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if trace_id == INVALID_TRACE_ID or span_id == INVALID_SPAN_ID:
        return None
    flags = _FLAGS.get(flags_hex)
    if flags is None:
        flags = trace.TraceFlags(int(flags_hex, 16))
    return new_span_context(trace_id, span_id, True, flags)


# The flags nearly every traceparent carries (dropped, sampled), made once.
_FLAGS = {"00": trace.TraceFlags(0), "01": trace.TraceFlags(1)}


def inject_context(span: Any) -> dict[str, str]:
    """W3C trace-context carrier for `span` (empty for none or an invalid one).

    A span the sampler dropped is carried too (flags without the sampled bit): the
    peer then drops its spans of this request instead of deciding afresh, and skips
    creating them.
    """
    carrier: dict[str, str] = {}
    if span is None:
        return carrier
    try:
        span_context = span.get_span_context()
        if not span_context.is_valid:
            return carrier
        if not span_context.trace_state:
            carrier["traceparent"] = _traceparent(span_context)  # the common case, without a Context
            return carrier
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    except Exception as exc:
        errors.note(TelemetryError.SPAN, exc)
    return carrier


def extract_span(carrier: Any) -> Any:
    """The remote span a carrier dict names, as a non-recording span (a parent or a link
    for ours: no OTel context is built around it); None for a missing or malformed
    carrier."""
    if not carrier or (type(carrier) is not dict and not isinstance(carrier, Mapping)):
        return None  # (a plain dict, what msgpack gives, skips the ABC check)
    if len(carrier) > 8:
        errors.note(TelemetryError.TRACE_CONTEXT, f"{len(carrier)} keys", exc_info=False)
        return None
    try:
        if len(carrier) == 1:  # the common case: a traceparent alone, as we send it
            value = carrier.get("traceparent")
            if type(value) is str and len(value) <= 64:
                span_context = _parse_traceparent(value)
                if span_context is not None:
                    return trace.NonRecordingSpan(span_context)
        # A peer controls this: keep only the W3C keys, at their real sizes.
        clean = {k: v for k, v in carrier.items()
                 if k in ("traceparent", "tracestate") and isinstance(v, str)
                 and len(v) <= (64 if k == "traceparent" else 512)}
        if "traceparent" not in clean:
            errors.note(TelemetryError.TRACE_CONTEXT, "no usable traceparent", exc_info=False)
            return None
        if "tracestate" not in clean:
            span_context = _parse_traceparent(clean["traceparent"])
            if span_context is not None:  # the common case, without the propagator's regex
                return trace.NonRecordingSpan(span_context)
        span = trace.get_current_span(_PROPAGATOR.extract(clean))
        if span.get_span_context().is_valid:
            return span
        errors.note(TelemetryError.TRACE_CONTEXT, "invalid traceparent", exc_info=False)
    except Exception as exc:
        errors.note(TelemetryError.TRACE_CONTEXT, exc, exc_info=False)
    return None


def trace_carrier(headers: Any) -> dict[str, str] | None:
    """The W3C trace-context part of request headers (vLLM's `Request.trace_headers`).

    Header names are matched case-insensitively; None when there is no traceparent.
    Pure data handling, no OTel call: it runs in vLLM's scheduler process.
    """
    if not headers:
        return None
    try:
        carrier = {str(k).lower(): str(v) for k, v in headers.items()
                   if str(k).lower() in TRACE_HEADER_KEYS}
    except Exception:
        logger.debug("unreadable trace headers", exc_info=True)
        return None
    return carrier if carrier.get("traceparent") else None


def span_ids(span: Any) -> tuple[str, str] | None:
    """(trace id, span id) of a recording span as lower-case hex, else None."""
    if span is None:
        return None
    try:
        ctx = span.get_span_context()
        if not ctx.is_valid or not span.is_recording():
            return None
        return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
    except Exception as exc:
        errors.note(TelemetryError.SPAN, exc)
        return None


def span_link(span: Any, attributes: Mapping[str, Any] | None = None) -> Link | None:
    """A span link to a span (one from `extract_span`), or None."""
    if span is None:
        return None
    try:
        span_context = span.get_span_context()
        if span_context.is_valid:
            return Link(span_context, dict(attributes or {}))
    except Exception as exc:
        errors.note(TelemetryError.SPAN, exc)
    return None


def peer_str(value: Any) -> str:
    """A peer-sent value as a bounded span attribute (peers are unauthenticated)."""
    text = value if isinstance(value, str) else str(value)
    return text[:MAX_PEER_STRING]


class SpanEmitter:
    """Builds our spans; every method is a no-op when `tracer` is None."""

    def __init__(self, tracer: trace.Tracer | None):
        self.tracer = tracer
        # A plain attribute, not a property: the push path tests it per request and step.
        self.enabled = tracer is not None
        # Ours takes a parent span as it is (no OTel context built per span).
        self._under = tracer.start_under if isinstance(tracer, LeanTracer) else None

    def start(self, name: str, parent: Any = None,
              attributes: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
              kind: SpanKind = SpanKind.INTERNAL, links: list[Link] | None = None) -> Any:
        """Start a span as a child of `parent` (a span: ours, or a remote one from
        `extract_span`).

        A None parent makes a root span (never the thread's current span). A parent
        the sampler dropped gives a non-recording span at no SDK cost; `attributes`
        may be a function, called only when the SDK is asked.
        """
        if self.tracer is None:
            return None
        try:
            under = self._under
            if parent is None:
                if under is not None:
                    return under(name, None, kind, attributes, links)
                parent = otel_context.Context()
            else:
                span_context = parent.get_span_context()
                if span_context.is_valid and not span_context.trace_flags.sampled:
                    # The sampler dropped the parent, so it drops this child (every SDK
                    # sampler decides per trace or follows the parent): skip the SDK.
                    return trace.NonRecordingSpan(span_context)
                if under is not None:
                    return under(name, parent, kind, attributes, links)
                parent = trace.set_span_in_context(parent)
            if callable(attributes):
                if getattr(self.tracer, "decides_before_attributes", False):
                    # The lean tracer asks the sampler first and builds them only for a
                    # span it keeps (a dropped root request builds none).
                    return self.tracer.start_span(name, context=parent, kind=kind,
                                                  attributes=attributes, links=links)
                attributes = attributes()
            return self.tracer.start_span(name, context=parent, kind=kind,
                                          attributes=dict(attributes or {}), links=links)
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)
            return None

    @staticmethod
    def end(span: Any, error_type: str | None = None, message: str = "",
            attributes: Mapping[str, Any] | None = None) -> None:
        if span is None:
            return
        try:
            if span.is_recording():
                if attributes:
                    span.set_attributes(dict(attributes))
                if error_type is not None:
                    span.set_attribute(Attr.ERROR_TYPE, error_type)
                    span.set_status(Status(StatusCode.ERROR, message[:300] or error_type))
            span.end()
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)

    def emit_handshake(self, record: HandshakeRecord) -> None:
        """One handshake span plus one child per phase segment, with real times."""
        if self.tracer is None:
            return
        try:
            self._emit_handshake(record)
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)

    def _emit_handshake(self, record: HandshakeRecord) -> None:
        assert self.tracer is not None
        failed = record.outcome is Outcome.FAILURE
        attrs = {
            Attr.NOTIF_AGENTS_ONLY: record.notif_only,
            Attr.DIRECTION: record.direction.value,
            Attr.TRIGGER: record.trigger.value,
            Attr.OUTCOME: (record.outcome or Outcome.FAILURE).value,
            Attr.UPGRADE: record.upgrade,
            Attr.ATTEMPT: record.attempt,
            # A P->D handshake's engine id and host come from the peer's PUSH_REG.
            Attr.REMOTE_ENGINE_ID: peer_str(record.remote_engine_id),
            Attr.LOCAL_ENGINE_ID: record.local_engine_id,
            Attr.SERVER_ADDRESS: peer_str(record.host),
            Attr.SERVER_PORT: record.port,
            Attr.REMOTE_TP_SIZE: record.remote_tp_size,
            Attr.REMOTE_PP_SIZE: record.remote_pp_size,
            Attr.LOCAL_TP_RANK: record.local_tp_rank,
            Attr.DESCRIPTOR_REGISTRATIONS: sum(record.registrations.values()),
            Attr.DESCRIPTORS_REGISTERED: sum(record.descriptors.values()),
            Attr.DESCRIPTOR_REGISTRATIONS_SAVED: record.saved_registrations,
            Attr.DESCRIPTORS_SAVED: record.saved_descriptors,
        }
        if failed and record.error_type is not None:
            attrs[Attr.ERROR_TYPE] = record.error_type.value
        span = self.tracer.start_span(
            SPAN_HANDSHAKE, context=record.parent_context, kind=SpanKind.CLIENT,
            start_time=record.submitted_ns, attributes=attrs,
        )
        ids = span_ids(span)
        if ids is not None:
            record.trace_id, record.span_id = ids
        parent = trace.set_span_in_context(span)
        last = len(record.segments) - 1
        for i, seg in enumerate(record.segments):
            seg_attrs: dict[str, Any] = {
                Attr.NOTIF_AGENTS_ONLY: record.notif_only,
                Attr.PHASE: seg.phase.value,
            }
            if seg.remote_tp_rank is not None:
                seg_attrs[Attr.REMOTE_TP_RANK] = seg.remote_tp_rank
            if seg.remote_pp_rank is not None:
                seg_attrs[Attr.REMOTE_PP_RANK] = seg.remote_pp_rank
            child = self.tracer.start_span(
                phase_span_name(seg.phase), context=parent, start_time=seg.start_ns,
                attributes=seg_attrs,
            )
            child_ids = span_ids(child)
            if child_ids is not None:
                # The exemplar of a phase observation points at its first segment.
                record.phase_span_ids.setdefault(seg.phase.value, child_ids[1])
            if failed and i == last and record.error_type is not None:
                child.set_attribute(Attr.ERROR_TYPE, record.error_type.value)
                child.set_status(Status(StatusCode.ERROR, record.error_message[:300]))
            child.end(end_time=max(seg.end_ns, seg.start_ns))
        if failed:
            span.add_event("exception", {"exception.message": record.error_message[:500]})
            span.set_status(Status(StatusCode.ERROR, record.error_message[:300]))
        span.end(end_time=max(record.ended_ns, record.submitted_ns))
