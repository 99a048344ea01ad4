"""Recording-thread and exporter-thread cost of one write span: SDK spans vs lean spans.

One provider with our batch processor (as `install_provider` builds it, with an
exporter that only keeps the spans). Per round, `--spans` write spans are made the
way P's writer makes them (a remote parent from the PUSH_REG, a link to P's own
request, five attributes, one attribute set later, ended), alternately by the SDK's
tracer and by our `LeanTracer`; then each round's finished spans are encoded with our
OTLP encoder (the exporter thread's work). Then, per round, as many traced requests'
three spans are made by the push path's own methods on a stand-in worker (D's receive
span from the registration's context, its register span, P's write span placed under
the PUSH_REG's context and linked to P's request), through `SpanEmitter` over each
tracer. Prints medians over `--repeats` rounds and the ratios.

    python -m benchmarks.span_cost [--repeats 15] [--spans 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from connector.glue.push import PushFlow
from connector.glue.receive import ReceiveFlow
from connector.telemetry.export_guard import CountingBatchSpanProcessor, CountingExporter
from connector.telemetry.lean_span import LeanTracer
from connector.telemetry.otlp_wire import encode_request
from connector.telemetry.span_table import SpanTable
from connector.telemetry.tracing import (
    PrivateRandomIdGenerator,
    SpanEmitter,
    extract_span,
    span_link,
)
from connector.vocabulary import REGISTRATION_TRACE_KEY, SPAN_PUSH_WRITE, TRACER_NAME, Attr


class _Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[Any] = []

    def export(self, spans: Any) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def _make(tracer: Any, n: int) -> float:
    """Microseconds per write span on the recording thread."""
    parent = trace.set_span_in_context(
        extract_span({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}))
    own = extract_span({"traceparent": "00-1bf7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01"})
    t0 = time.perf_counter()
    for i in range(n):
        rid = f"cmpl-{i:08x}-0"
        span = tracer.start_span(
            SPAN_PUSH_WRITE, context=parent, kind=SpanKind.CONSUMER,
            links=[span_link(own, {Attr.LINK_ROLE: "prefill_request"})],
            attributes={Attr.REQUEST_ID: rid, Attr.REMOTE_REQUEST_ID: rid,
                        Attr.REMOTE_ENGINE_ID: "6f1c-decode", Attr.LOCAL_ENGINE_ID: "91ab-prefill",
                        Attr.NUM_BLOCKS: 4})
        span.set_attribute(Attr.HANDSHAKE_WAIT, 0.0)
        span.end()
    return (time.perf_counter() - t0) / n * 1e6


def _request(tracer: Any, n: int) -> float:
    """Microseconds per traced request for its three spans, by the push path's methods
    (D's and P's threads together; the ends included)."""
    worker = SimpleNamespace(_spans=SpanEmitter(tracer), _receive_spans=SpanTable(),
                             _register_spans=SpanTable(), _request_contexts=SpanTable(spans=False),
                             engine_id="6f1c-decode")
    t0 = time.perf_counter()
    for i in range(n):
        d_id, p_id = f"cmpl-{i:08x}-d", f"cmpl-{i:08x}-p"
        reg = {"request_id": d_id, "remote_engine_id": "91ab-prefill", "remote_host": "10.0.0.2",
               "remote_port": 5600, "local_block_ids": ([2 * i, 2 * i + 1],),
               REGISTRATION_TRACE_KEY: {"traceparent": f"00-{i + 1:032x}-{i + 1:016x}-01"}}
        ReceiveFlow._open_receive_spans(worker, {d_id: reg})  # D main
        register = ReceiveFlow._open_register_span(worker, d_id, reg)  # D writer
        SpanEmitter.end(worker._register_spans.pop(d_id))
        push_reg = dict(reg, decode_engine_id="6f1c-decode")  # (as P decodes it)
        worker._request_contexts.put(p_id, {"traceparent": f"00-{i + 7:032x}-{i + 7:016x}-01"})
        parent, links = PushFlow._write_span_placement(worker, p_id, push_reg)  # P writer
        write = worker._spans.start(
            SPAN_PUSH_WRITE, parent=parent, links=links, kind=SpanKind.CONSUMER,
            attributes=lambda p_id=p_id, d_id=d_id: {
                Attr.REQUEST_ID: p_id, Attr.REMOTE_REQUEST_ID: d_id, Attr.REMOTE_ENGINE_ID: "6f1c-decode",
                Attr.LOCAL_ENGINE_ID: "91ab-prefill", Attr.NUM_BLOCKS: 2})
        write.set_attribute(Attr.HANDSHAKE_WAIT, 0.0)
        SpanEmitter.end(write)  # P main
        SpanEmitter.end(worker._receive_spans.pop(d_id))  # D main
        assert register is not None
    return (time.perf_counter() - t0) / n * 1e6


def span_cost_bench(repeats: int, n: int) -> dict[str, float]:
    kept = _Keep()
    provider = TracerProvider(id_generator=PrivateRandomIdGenerator())
    processor = CountingBatchSpanProcessor(CountingExporter(kept), max_queue_size=max(4 * n, 512),
                                           max_export_batch_size=512, schedule_delay_millis=60_000)
    provider.add_span_processor(processor)
    tracers = {"sdk": provider.get_tracer(TRACER_NAME),
               "lean": LeanTracer(provider, processor, TRACER_NAME)}
    make: dict[str, list[float]] = {k: [] for k in tracers}
    encode: dict[str, list[float]] = {k: [] for k in tracers}
    request: dict[str, list[float]] = {k: [] for k in tracers}
    try:
        for _ in range(repeats):
            for name, tracer in tracers.items():
                make[name].append(_make(tracer, n))
                processor.force_flush()
                spans, kept.spans = kept.spans, []
                assert len(spans) == n, len(spans)
                t0 = time.perf_counter()
                encode_request(spans)
                encode[name].append((time.perf_counter() - t0) / n * 1e6)
            for name, tracer in tracers.items():
                request[name].append(_request(tracer, n))
                processor.force_flush()
                spans, kept.spans = kept.spans, []
                assert len(spans) == 3 * n, len(spans)
    finally:
        provider.shutdown()
    med = {f"{k}_{what}": statistics.median(v)
           for what, d in (("make_us", make), ("encode_us", encode), ("request_us", request))
           for k, v in d.items()}
    print(f"== one write span, {repeats} alternating rounds x {n} spans, medians [min-max]")
    for what, d in (("start + set + end (recording thread)", make),
                    ("OTLP encode (exporter thread)", encode),
                    ("a request's three spans, push path", request)):
        s, lean = statistics.median(d["sdk"]), statistics.median(d["lean"])
        print(f"  {what:<38} SDK span {s:5.1f} us [{min(d['sdk']):.1f}-{max(d['sdk']):.1f}], "
              f"lean span {lean:5.1f} us [{min(d['lean']):.1f}-{max(d['lean']):.1f}]: {s / lean:.2f}x less")
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--spans", type=int, default=2000)
    args = ap.parse_args(argv)
    span_cost_bench(args.repeats, args.spans)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
