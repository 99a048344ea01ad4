"""The OTLP/gRPC span exporter we install: the SDK's, with our wire encoder.

Everything about the connection (endpoint, TLS, headers, timeout, compression,
retries with backoff, the SDK's own export metrics) stays the SDK exporter's; only
turning a batch of finished spans into the request is ours (`otlp_wire`), about a
third of the exporter thread's CPU per span. If our encoder ever fails on a batch,
that batch is encoded by the SDK instead and the failure is counted, so no span is
lost to it. OTLP over HTTP keeps the SDK's encoder: its exporter has no seam for the
request bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from connector.telemetry import errors
from connector.telemetry.otlp_wire import encode_request
from connector.vocabulary import TelemetryError


class WireGrpcSpanExporter(OTLPSpanExporter):
    """`OTLPSpanExporter` (gRPC) whose request is written by `otlp_wire`."""

    def _translate_data(self, data: Sequence[Any]) -> ExportTraceServiceRequest:
        skipped: list[str] = []
        try:
            request = ExportTraceServiceRequest.FromString(encode_request(data, skipped))
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)
            return super()._translate_data(data)
        if skipped:
            # The SDK's encoder leaves such values out too; say which keys.
            errors.note(TelemetryError.SPAN, f"attribute values left out: {sorted(set(skipped))[:8]}",
                        exc_info=False)
        return request
