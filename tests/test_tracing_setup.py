"""Tracer set-up follows vLLM and the OTEL_* variables; off means no spans and no cost."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

from connector.telemetry import tracing
from connector.telemetry.record import HandshakeRecord
from connector.telemetry.tracing import SpanEmitter, extract_context, inject_context, make_span_exporter
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
    assert extract_context(None) is None
    assert extract_context("traceparent") is None
    assert extract_context({"traceparent": "garbage"}) is None
    assert extract_context({}) is None


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
