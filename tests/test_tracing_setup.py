"""Tracer set-up follows vLLM and the OTEL_* variables; off means no spans and no cost."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

from connector.telemetry import tracing
from connector.telemetry.record import HandshakeRecord
from connector.telemetry.tracing import (
    SpanEmitter,
    extract_span,
    inject_context,
    make_span_exporter,
    span_link,
)
from connector.vocabulary import Direction, Trigger


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(var, raising=False)


def test_grpc_is_the_default_protocol():
    assert isinstance(make_span_exporter("http://127.0.0.1:4317"), GrpcExporter)


def test_http_protobuf_on_request_appends_the_traces_path(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    exporter = make_span_exporter("http://127.0.0.1:4318")
    assert isinstance(exporter, HttpExporter)
    assert exporter._endpoint == "http://127.0.0.1:4318/v1/traces"


def test_unknown_protocol_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    with pytest.raises(ValueError, match="grpc' or 'http/protobuf'"):
        make_span_exporter("http://x")


def test_no_endpoint_means_tracing_off(monkeypatch):
    # This test process never installs a tracer provider (engines do, in their own processes).
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert tracing.resolve_tracer(None) is None


def test_sdk_disabled_wins_over_an_endpoint(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.resolve_tracer("http://127.0.0.1:4317") is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.resolve_tracer("http://127.0.0.1:4317") is None


def test_disabled_emitter_is_a_no_op():
    emitter = SpanEmitter(None)
    r = HandshakeRecord(direction=Direction.D_TO_P, trigger=Trigger.PUSH_REG, notif_only=True,
                        remote_engine_id="p", host="h", port=1, remote_tp_size=1, remote_pp_size=1,
                        local_tp_rank=0)
    r.finish()
    emitter.emit_handshake(r)
    assert emitter.start("x") is None
    SpanEmitter.end(None, error_type="x")  # must not raise
    assert inject_context(None) == {}


def test_bad_trace_carriers_are_ignored():
    assert extract_span(None) is None
    assert extract_span("traceparent") is None
    assert extract_span({"traceparent": "garbage"}) is None
    assert extract_span({}) is None


class ExplodingTracer:
    """A tracer whose every call fails: telemetry faults must stay inside telemetry."""

    def start_span(self, *args, **kwargs):
        raise RuntimeError("exporter on fire")


def test_a_failing_tracer_never_raises_into_the_caller():
    emitter = SpanEmitter(ExplodingTracer())
    r = HandshakeRecord(direction=Direction.P_TO_D, trigger=Trigger.PUSH_WRITE, notif_only=False,
                        remote_engine_id="d", host="h", port=1, remote_tp_size=1, remote_pp_size=1,
                        local_tp_rank=0)
    r.finish(RuntimeError("x"))
    emitter.emit_handshake(r)  # swallowed and logged at DEBUG
    assert emitter.start("nixl.push.write") is None


def _sampled_provider(ratio: float):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBasedTraceIdRatio(ratio))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _sampled_flag(carrier: dict[str, str]) -> int:
    return int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1


def test_a_dropped_request_travels_as_dropped_and_stays_dropped_on_both_sides():
    d_provider, d_spans = _sampled_provider(0.0)  # D's sampler drops every root
    p_provider, p_spans = _sampled_provider(1.0)  # P's would keep every root it decides on
    d, p = SpanEmitter(d_provider.get_tracer("d")), SpanEmitter(p_provider.get_tracer("p"))

    receive = d.start("nixl.push.receive")
    register = d.start("nixl.push.register", parent=receive)
    assert not receive.is_recording() and not register.is_recording()
    carrier = inject_context(register)
    assert _sampled_flag(carrier) == 0  # "not sampled" travels to P

    write = p.start("nixl.push.write", parent=extract_span(carrier))
    assert not write.is_recording()  # P's parent-based sampler follows D's decision
    assert write.get_span_context().trace_id == receive.get_span_context().trace_id
    SpanEmitter.end(write)
    SpanEmitter.end(register)
    SpanEmitter.end(receive)
    assert d_spans.get_finished_spans() == () and p_spans.get_finished_spans() == ()


def test_a_sampled_request_is_recorded_on_both_sides():
    d_provider, d_spans = _sampled_provider(1.0)
    p_provider, p_spans = _sampled_provider(0.0)  # P's own roots would be dropped
    d, p = SpanEmitter(d_provider.get_tracer("d")), SpanEmitter(p_provider.get_tracer("p"))
    receive = d.start("nixl.push.receive")
    register = d.start("nixl.push.register", parent=receive)
    carrier = inject_context(register)
    assert _sampled_flag(carrier) == 1
    write = p.start("nixl.push.write", parent=extract_span(carrier))
    assert write.is_recording()  # parent-based: D's decision wins
    for span in (write, register, receive):
        SpanEmitter.end(span)
    (written,) = p_spans.get_finished_spans()
    assert written.parent.span_id == register.get_span_context().span_id
    assert len(d_spans.get_finished_spans()) == 2


@pytest.mark.parametrize("traceparent", [
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-03",
    "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # upper case: the SDK's call
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",  # a later version
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # invalid ids
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b71692033zz-01",
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
])
def test_our_traceparent_reading_agrees_with_the_sdk_propagator(traceparent):
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ours = extract_span({"traceparent": traceparent})
    sdk = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    sdk_context = trace.get_current_span(sdk).get_span_context()
    if not sdk_context.is_valid:
        assert ours is None
        return
    got = ours.get_span_context()
    assert (got.trace_id, got.span_id, got.trace_flags, got.is_remote) == (
        sdk_context.trace_id, sdk_context.span_id, sdk_context.trace_flags, sdk_context.is_remote)




def test_lazy_attributes_and_links_are_built_only_for_a_span_that_records():
    built: list[str] = []

    def attributes():
        built.append("attributes")
        return {"nixl.request_id": "r1"}

    def links():
        built.append("links")
        return [span_link(extract_span(LINKED), {"link.role": "prefill_request"})]

    kept_provider, kept = _sampled_provider(1.0)
    dropped_provider, dropped = _sampled_provider(0.0)
    span = SpanEmitter(dropped_provider.get_tracer("d")).start("s", attributes=attributes, links=links)
    SpanEmitter.end(span)
    assert built == [] and dropped.get_finished_spans() == ()

    span = SpanEmitter(kept_provider.get_tracer("k")).start("s", attributes=attributes, links=links)
    SpanEmitter.end(span)
    (finished,) = kept.get_finished_spans()
    assert built == ["attributes", "links"]
    assert dict(finished.attributes) == {"nixl.request_id": "r1"}
    (link,) = finished.links
    assert format(link.context.span_id, "016x") == LINKED["traceparent"].split("-")[2]
    assert dict(link.attributes) == {"link.role": "prefill_request"}


LINKED = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


UNSAMPLED = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"}


def test_a_child_of_an_unsampled_parent_is_the_parent_under_a_parent_based_sampler():
    """No span is started where the sampler would only make a non-recording one: the parent
    stands in, and what propagates from it is the same trace and the same decision."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    provider, exporter = _sampled_provider(1.0)  # parent-based: the parent decides
    emitter = SpanEmitter(provider.get_tracer("p"))
    assert emitter.drops_unsampled_children
    parent = extract_span(UNSAMPLED)
    child = emitter.start("child", parent=parent, attributes=lambda: {"built": True})
    assert child is parent and not child.is_recording()
    grandchild = emitter.start("grandchild", parent=child)
    SpanEmitter.end(grandchild, error_type="x")
    SpanEmitter.end(child)
    carrier = inject_context(child)
    assert carrier["traceparent"] == UNSAMPLED["traceparent"]
    assert exporter.get_finished_spans() == ()
    # A sampled parent gets a real child.
    sampled = emitter.start("sampled", parent=extract_span(LINKED))
    assert sampled is not None and sampled.is_recording()
    # A sampler that decides per span (not parent-based) gets every child started.
    own = SpanEmitter(TracerProvider(sampler=ALWAYS_ON).get_tracer("o"))
    assert not own.drops_unsampled_children
    started = own.start("child", parent=extract_span(UNSAMPLED))
    assert started is not parent and started.is_recording()
