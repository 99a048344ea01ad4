"""Exporter-thread cost per span: the SDK's OTLP encoder vs ours (`otlp_wire`).

Spans shaped like ours (a per-request write span: five attributes, two of them request
ids; a handshake span: seventeen attributes) are made by a real SDK tracer, then a
batch of 512 is turned into an `ExportTraceServiceRequest` both ways, alternating, for
`--repeats` rounds: the SDK's `encode_spans`, and ours plus the parse the gRPC exporter
needs to hand the request to its stub. Prints medians and their ratio.

    python -m benchmarks.otlp_encode [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from opentelemetry import context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from connector.telemetry.otlp_wire import encode_request
from connector.vocabulary import SPAN_HANDSHAKE, SPAN_PUSH_WRITE, Attr

BATCH = 512


def _spans(kind: str) -> list[Any]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "vllm-prefill"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("connector")
    for i in range(BATCH):
        if kind == "write":
            rid = f"cmpl-{i:08x}-0"
            attrs: dict[str, Any] = {Attr.REQUEST_ID: rid, Attr.REMOTE_REQUEST_ID: rid,
                                     Attr.REMOTE_ENGINE_ID: "6f1c-decode",
                                     Attr.LOCAL_ENGINE_ID: "91ab-prefill", Attr.NUM_BLOCKS: 4}
            name = SPAN_PUSH_WRITE
        else:
            attrs = {f"{Attr.PHASE}.{j}": (j if j % 2 else f"value-{j}") for j in range(16)}
            attrs[Attr.NOTIF_AGENTS_ONLY] = True
            name = SPAN_HANDSHAKE
        tracer.start_span(name, context=context.Context(), attributes=attrs).end()
    return list(exporter.get_finished_spans())


def _per_span_us(fn: Any, spans: list[Any], loops: int = 5) -> float:
    t0 = time.perf_counter()
    for _ in range(loops):
        fn(spans)
    return (time.perf_counter() - t0) / loops / len(spans) * 1e6


def otlp_encode_bench(repeats: int) -> dict[str, dict[str, float]]:
    ours = lambda s: ExportTraceServiceRequest.FromString(encode_request(s))  # noqa: E731
    out: dict[str, dict[str, float]] = {}
    print(f"== OTLP encoding per span, batches of {BATCH}, {repeats} alternating rounds, medians")
    for kind in ("write", "handshake"):
        spans = _spans(kind)
        assert ours(spans) == encode_spans(spans)  # the same request, or the figure means nothing
        sdk_us, our_us = [], []
        for _ in range(repeats):
            sdk_us.append(_per_span_us(encode_spans, spans))
            our_us.append(_per_span_us(ours, spans))
        s, o = statistics.median(sdk_us), statistics.median(our_us)
        out[kind] = {"sdk_us": s, "ours_us": o, "ratio": s / o}
        print(f"  {kind:>9} span: SDK {s:5.1f} us [{min(sdk_us):.1f}-{max(sdk_us):.1f}], "
              f"ours {o:5.1f} us [{min(our_us):.1f}-{max(our_us):.1f}]: {s / o:.2f}x less")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    otlp_encode_bench(ap.parse_args(argv).repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
