"""Our OTLP wire encoder against the SDK's: the same ExportTraceServiceRequest."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from connector.telemetry import otlp_wire


def _provider(exporter: InMemorySpanExporter, resource: Resource) -> TracerProvider:
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _decoded(spans) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest.FromString(otlp_wire.encode_request(spans))


def _spans() -> list:
    exporter = InMemorySpanExporter()
    one = _provider(exporter, Resource.create({"service.name": "vllm-prefill", "n": 3, "ok": True}, "https://x/1"))
    two = _provider(exporter, Resource.create({"service.name": "vllm-decode", "f": 0.25}))
    remote = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True,
                         trace_flags=TraceFlags(1),
                         trace_state=TraceState([("vendor", "v1"), ("other", "x")]))
    plain = one.get_tracer("connector", "1.2", schema_url="https://s/1", attributes={"scope.a": "b"})
    bare = two.get_tracer("bare")
    attrs = {"s": "text", "empty": "", "unicode": "kv-\u00e9\u4e2d", "t": True, "f": False, "zero": 0,
             "neg": -5, "big": 2**62, "float": 1.5, "negf": -0.0, "strs": ["a", "b"], "ints": (1, -2, 3),
             "bools": [True, False], "floats": [0.5], "nothing": [], "raw": b"\x00\x01"}
    for kind in SpanKind:
        parent = trace.set_span_in_context(NonRecordingSpan(remote))
        span = plain.start_span(f"span.{kind.name}", context=parent, kind=kind, attributes=attrs,
                                links=[Link(remote, {"link.role": "prefill_request", "n": 1}), Link(remote)])
        span.add_event("first", {"e": 1}, timestamp=123)
        span.add_event("second")
        span.set_status(Status(StatusCode.ERROR, "it broke"))
        child = bare.start_span("child", context=trace.set_span_in_context(span), start_time=5)
        child.set_status(Status(StatusCode.OK))
        child.end(end_time=9)
        span.end()
    root = bare.start_span("root")  # no parent, no attributes, unset status
    root.end()
    return list(exporter.get_finished_spans())


def test_matches_the_sdk_encoder_field_for_field():
    spans = _spans()
    ours = _decoded(spans)
    assert ours == encode_spans(spans)
    assert len(ours.resource_spans) == 2
    assert sum(len(s.spans) for rs in ours.resource_spans for s in rs.scope_spans) == len(spans)


def test_matches_the_sdk_encoder_again_once_encodings_are_reused():
    spans = _spans()
    otlp_wire.encode_request(spans)
    assert _decoded(spans) == encode_spans(spans)


def test_a_value_that_cannot_be_encoded_is_left_out_and_reported():
    exporter = InMemorySpanExporter()
    tracer = _provider(exporter, Resource.create({})).get_tracer("x")
    tracer.start_span("s", attributes={"huge": 2**70, "fine": 1}).end()
    spans = exporter.get_finished_spans()
    skipped: list[str] = []
    request = ExportTraceServiceRequest.FromString(otlp_wire.encode_request(spans, skipped))
    assert skipped == ["huge"]
    (span,) = request.resource_spans[0].scope_spans[0].spans
    assert [kv.key for kv in span.attributes] == ["fine"]
    assert request == encode_spans(spans)  # the SDK drops it too


def test_reused_encodings_stay_bounded():
    exporter = InMemorySpanExporter()
    tracer = _provider(exporter, Resource.create({})).get_tracer("x")
    for i in range(otlp_wire._CACHE_MAX + 10):
        tracer.start_span("s", attributes={"vllm.request_id": f"req-{i}"}).end()
    spans = exporter.get_finished_spans()
    assert _decoded(spans) == encode_spans(spans)
    assert len(otlp_wire._kv_cache) <= otlp_wire._CACHE_MAX
    assert len(otlp_wire._text_cache) <= otlp_wire._CACHE_MAX
    assert len(otlp_wire._field_cache) <= otlp_wire._CACHE_MAX


def test_reused_encodings_keep_values_that_compare_equal_apart():
    # 0.0 == -0.0 and True == 1 == 1.0, but each encodes differently: a reused encoding
    # of one must never stand in for another under the same key.
    exporter = InMemorySpanExporter()
    tracer = _provider(exporter, Resource.create({})).get_tracer("x")
    for value in (0.0, -0.0, 1, True, 1.0, 0, False, -0.0, 0.0):
        tracer.start_span("s", attributes={"v": value}, links=[Link(
            SpanContext(1, 2, is_remote=True), {"v": value})]).end()
    spans = exporter.get_finished_spans()
    for _ in range(2):  # the second pass reads every encoding back from the caches
        assert _decoded(spans) == encode_spans(spans)


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 2**35, 2**63 - 1, -1, -(2**63)])
def test_integers_round_trip(value):
    exporter = InMemorySpanExporter()
    _provider(exporter, Resource.create({})).get_tracer("x").start_span("s", attributes={"v": value}).end()
    (span,) = _decoded(exporter.get_finished_spans()).resource_spans[0].scope_spans[0].spans
    assert span.attributes[0].value.int_value == value


# -- the exporter we install for OTLP/gRPC, against a real gRPC receiver --------------

def test_grpc_exporter_we_install_writes_our_encoding(monkeypatch):
    from connector.telemetry.otlp_export import WireGrpcSpanExporter
    from connector.telemetry.tracing import make_span_exporter

    for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        monkeypatch.delenv(var, raising=False)
    assert isinstance(make_span_exporter("http://127.0.0.1:4317"), WireGrpcSpanExporter)


def _export_through_grpc(spans):
    from opentelemetry.sdk.trace.export import SpanExportResult

    from connector.telemetry.otlp_export import WireGrpcSpanExporter
    from connector.testing.otlp import OtlpGrpcReceiver

    receiver = OtlpGrpcReceiver()
    exporter = WireGrpcSpanExporter(endpoint=receiver.endpoint, insecure=True)
    try:
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        return list(receiver.last_requests)
    finally:
        exporter.shutdown()
        receiver.close()


def test_a_real_grpc_receiver_gets_what_the_sdk_would_have_sent():
    spans = _spans()
    (request,) = _export_through_grpc(spans)
    assert request == encode_spans(spans)


def test_an_encoder_fault_falls_back_to_the_sdk_encoder_and_is_counted(monkeypatch):
    from connector.telemetry import errors, otlp_export
    from connector.vocabulary import TelemetryError

    def broken(spans, skipped=None):
        raise RuntimeError("encoder bug")

    errors.reset_for_tests()
    monkeypatch.setattr(otlp_export, "encode_request", broken)
    spans = _spans()
    (request,) = _export_through_grpc(spans)
    assert request == encode_spans(spans)  # nothing lost
    assert errors.drain().get(TelemetryError.SPAN.value) == 1
