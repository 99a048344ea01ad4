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
import threading
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import INVALID_SPAN_ID, INVALID_TRACE_ID, Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from connector.telemetry import errors
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
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https"))
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
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return None
    from opentelemetry.sdk.trace import TracerProvider

    installed = trace.get_tracer_provider()
    if isinstance(installed, TracerProvider):  # vLLM's worker tracer, the user's, or ours
        use_os_entropy(installed)
        return installed.get_tracer(TRACER_NAME)
    endpoint = otlp_traces_endpoint or _env_endpoint()
    if not endpoint:
        return None
    with _setup_lock:
        if _own_provider is None:
            install_provider(make_span_exporter(endpoint))
        return trace.get_tracer_provider().get_tracer(TRACER_NAME)


def install_provider(exporter: Any) -> Any:
    """Install our SDK provider: `exporter` behind the SDK's batch processor.

    Only where nothing installed a provider before us (under `vllm serve` with an
    OTLP endpoint, vLLM installs its own in every engine process). Export runs on the
    processor's thread; what the back-end loses is counted (`export_guard`).
    """
    global _own_provider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    from connector.telemetry.export_guard import counting_batch_span_processor

    resource = Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME", "vllm"),
         "vllm.process_id": str(os.getpid())}
    )
    provider = TracerProvider(resource=resource, id_generator=PrivateRandomIdGenerator())
    provider.add_span_processor(counting_batch_span_processor(exporter))
    trace.set_tracer_provider(provider)
    _own_provider = trace.get_tracer_provider()
    return _own_provider


def inject_context(span: Any) -> dict[str, str]:
    """W3C trace-context carrier for `span` (empty for none or an invalid one).

    A span the sampler dropped is carried too (flags without the sampled bit): the
    peer's parent-based sampler then drops its spans of this request as well.
    """
    carrier: dict[str, str] = {}
    if span is None:
        return carrier
    try:
        if span.get_span_context().is_valid:
            _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    except Exception as exc:
        errors.note(TelemetryError.SPAN, exc)
    return carrier


# What a peer may send as trace context: the W3C keys only, at their real sizes.
_CARRIER_LIMITS = {"traceparent": 64, "tracestate": 512}
_MAX_CARRIER_KEYS = 8


def extract_span(carrier: Any) -> Any:
    """The remote span a carrier dict names (a non-recording span, to parent or link
    ours on); None for a missing or malformed carrier. A peer controls the carrier:
    only well-formed W3C keys are read, and a bad one is counted."""
    if not carrier or not isinstance(carrier, Mapping):
        return None
    if len(carrier) > _MAX_CARRIER_KEYS:
        errors.note(TelemetryError.TRACE_CONTEXT, f"{len(carrier)} keys", exc_info=False)
        return None
    try:
        clean = {k: v for k, v in carrier.items()
                 if k in _CARRIER_LIMITS and isinstance(v, str) and len(v) <= _CARRIER_LIMITS[k]}
        if "traceparent" not in clean:
            errors.note(TelemetryError.TRACE_CONTEXT, "no usable traceparent", exc_info=False)
            return None
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


def drops_unsampled_children(tracer: Any) -> bool:
    """Whether `tracer`'s sampler never records a child of an unsampled parent: the SDK's
    parent-based samplers as OTEL_TRACES_SAMPLER makes them (the default
    `parentbased_always_on`, `parentbased_always_off`, `parentbased_traceidratio`), whose
    delegates for unsampled parents are ALWAYS_OFF. Any other sampler decides per span."""
    from opentelemetry.sdk.trace import sampling

    sampler = getattr(tracer, "sampler", None)
    return (sampler is sampling.DEFAULT_ON or sampler is sampling.DEFAULT_OFF
            or type(sampler) is sampling.ParentBasedTraceIdRatio)


class SpanEmitter:
    """Builds our spans; every method is a no-op when `tracer` is None."""

    def __init__(self, tracer: trace.Tracer | None):
        self.tracer = tracer
        # A plain attribute, not a property: the push path tests it per request and step.
        self.enabled = tracer is not None
        self.drops_unsampled_children = drops_unsampled_children(tracer)

    def start(self, name: str, parent: Any = None,
              attributes: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
              kind: SpanKind = SpanKind.INTERNAL,
              links: list[Link] | Callable[[], list[Link]] | None = None) -> Any:
        """Start a span as a child of `parent` (a span: ours, or a remote one from
        `extract_span`); a None parent makes a root span, never the thread's current
        span. The provider's sampler decides as for any SDK span.

        `attributes` and `links` may be callables: the per-request spans pass them so,
        and they are built only for a span that records (most spans do not record when
        the sampler keeps a share of the traces; the sampler then decides without them,
        which the SDK's samplers never look at)."""
        if self.tracer is None:
            return None
        if parent is not None and self.drops_unsampled_children:
            # The sampler would make a non-recording child: the unsampled parent stands in
            # for it (ending it is a no-op; its context propagates the same decision), and
            # the SDK's span start, a third of a dropped request's tracing cost, is saved.
            try:
                parent_context = parent.get_span_context()
                if parent_context.is_valid and not parent_context.trace_flags.sampled:
                    return parent
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)
                return None
        try:
            context = (otel_context.Context() if parent is None
                       else trace.set_span_in_context(parent))
            lazy = callable(attributes) or callable(links)
            if not lazy:
                return self.tracer.start_span(name, context=context, kind=kind,
                                              attributes=attributes, links=links)
            span = self.tracer.start_span(name, context=context, kind=kind)
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)
            return None
        try:
            if span.is_recording():
                if attributes:
                    span.set_attributes(attributes() if callable(attributes) else attributes)
                for link in (links() if callable(links) else links) or ():
                    span.add_link(link.context, link.attributes)
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)
        return span

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
            Attr.PEER_AUTHENTICATED: record.authenticated,
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
        if record.nothing_saved_because:
            attrs[Attr.NOTHING_SAVED_BECAUSE] = record.nothing_saved_because
        if record.after_reset:
            attrs[Attr.AFTER_RESET] = record.after_reset
            attrs[Attr.PEER_RESTARTED] = record.peer_restarted
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
