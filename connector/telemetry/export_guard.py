"""Count the spans a trace back-end loses, through the OpenTelemetry SDK's public API.

Only for the tracer provider we install ourselves (none of this runs on a provider
vLLM or the user installed). The SDK's `BatchSpanProcessor` already exports off the
writer and handshake threads and bounds its queue (`OTEL_BSP_MAX_QUEUE_SIZE`); what
it loses is only logged. Two public knobs make the losses countable:
- the exporter is wrapped (`CountingExporter`): a batch it fails or raises on is
  counted per span as `span_export_failed`;
- the processor reports its own metrics (`OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED`,
  `meter_provider=`) to an SDK `MeterProvider` of ours with an in-memory reader:
  spans it dropped at a full queue (`otel.sdk.processor.span.processed` with
  `error.type`) are read on the exporter's thread and counted as `spans_dropped`.
Both reach `/metrics` as `vllm:nixl_telemetry_errors_total{reason}`.
`ledger()` is the per-process ground truth the tests reconcile against.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.environment_variables import OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from connector.telemetry import errors
from connector.vocabulary import TelemetryError

logger = logging.getLogger(__name__)

# The SDK's self-observability metrics (OTel semantic conventions) and the attribute.
PROCESSED_METRIC = "otel.sdk.processor.span.processed"
QUEUE_SIZE_METRIC = "otel.sdk.processor.span.queue.size"
ERROR_TYPE = "error.type"

_lock = threading.Lock()
_ledger = {"ended": 0, "dropped": 0, "exports": 0, "handed_to_exporter": 0, "exported": 0,
           "export_failed": 0}
_counters: list[DropCounter] = []


def _add(**counts: int) -> None:
    with _lock:
        for key, n in counts.items():
            _ledger[key] += n


def ledger() -> dict[str, int]:
    """Spans ended (sampled), dropped at the queue, handed to, exported by and failed
    in the exporter (in `exports` calls), and queued now, in this process.

    The SDK counts a drop when it finds its queue full as a span arrives; if its
    export thread takes a batch out at that very moment, nothing was dropped after all.
    So `dropped + handed_to_exporter + queued` may exceed `ended` by at most one per
    export call, never fall short of it.
    """
    queued = 0
    for counter in list(_counters):
        counter.count_new()
        queued += counter.queued
    with _lock:
        return {**_ledger, "queued": queued}


class DropCounter:
    """Reads what the batch processor reported dropping and counts what is new."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.queued = 0  # spans in the processor's queue at the last read
        self._seen = 0
        self._lock = threading.Lock()
        _counters.append(self)

    def _read(self) -> tuple[int, int]:
        """(spans dropped so far, spans queued now), from the processor's own metrics."""
        dropped = queued = 0
        data = self.reader.get_metrics_data()
        for resource in getattr(data, "resource_metrics", None) or ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    points = metric.data.data_points
                    if metric.name == PROCESSED_METRIC:
                        dropped += sum(int(p.value) for p in points
                                       if (p.attributes or {}).get(ERROR_TYPE))
                    elif metric.name == QUEUE_SIZE_METRIC:
                        queued += sum(int(p.value) for p in points)
        return dropped, queued

    def count_new(self) -> None:
        """Count the drops since the last call (never raises)."""
        try:
            with self._lock:
                total, self.queued = self._read()
                new, self._seen = total - self._seen, max(self._seen, total)
            if new > 0:
                _add(dropped=new)
                errors.note(TelemetryError.SPANS_DROPPED, "span queue full (exporter slow or down)",
                            exc_info=False, count=new)
        except Exception as exc:
            logger.debug("could not read the span processor's drops: %s", exc)


class CountingExporter(SpanExporter):
    """Wraps the real exporter: a failed or raising export is counted per span, and
    the processor's drops are read at every export."""

    def __init__(self, inner: SpanExporter, drops: DropCounter | None = None):
        self.inner = inner
        self.drops = drops

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        n = len(spans)
        _add(handed_to_exporter=n, exports=1)
        if self.drops is not None:
            self.drops.count_new()
        try:
            result = self.inner.export(spans)
        except Exception as exc:
            _add(export_failed=n)
            errors.note(TelemetryError.SPAN_EXPORT_FAILED, exc, exc_info=False, count=n)
            return SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            _add(exported=n)
        else:
            _add(export_failed=n)
            errors.note(TelemetryError.SPAN_EXPORT_FAILED, f"exporter returned {result.name}",
                        exc_info=False, count=n)
        return result

    def shutdown(self) -> None:
        if self.drops is not None:
            self.drops.count_new()
        try:
            self.inner.shutdown()
        except Exception:  # nothing is lost by a failed shutdown; never raise at exit
            logger.debug("span exporter shutdown failed", exc_info=True)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        if self.drops is not None:
            self.drops.count_new()
        try:
            return bool(self.inner.force_flush(timeout_millis))
        except Exception:
            return False


class CountedBatchProcessor(SpanProcessor):
    """The SDK's `BatchSpanProcessor`, called through its public interface, counting
    the sampled spans handed to it (the ledger's `ended`)."""

    def __init__(self, batch: BatchSpanProcessor):
        self.batch = batch

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self.batch.on_start(span, parent_context)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:
            _add(ended=1)
        self.batch.on_end(span)

    def shutdown(self) -> None:
        self.batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)


_env_lock = threading.Lock()


def counting_batch_span_processor(exporter: SpanExporter, **batch_settings: Any) -> CountedBatchProcessor:
    """The SDK's `BatchSpanProcessor` around `exporter`, with its losses counted.

    `batch_settings` are the processor's own keyword arguments (the `OTEL_BSP_*`
    variables apply otherwise). The processor reads the internal-metrics switch
    when it is built: it is turned on for that moment only, so nothing else in the
    process starts reporting SDK metrics.
    """
    drops = DropCounter()
    with _env_lock:
        before = os.environ.get(OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED)
        os.environ[OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED] = "true"
        try:
            batch = BatchSpanProcessor(CountingExporter(exporter, drops),
                                       meter_provider=drops.meter_provider, **batch_settings)
        except TypeError:  # an SDK before its processor metrics: drops go uncounted
            logger.info("this OpenTelemetry SDK reports no span-processor metrics: spans its "
                        "batch queue drops are logged by the SDK but not counted")
            batch = BatchSpanProcessor(CountingExporter(exporter), **batch_settings)
        finally:
            if before is None:
                del os.environ[OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED]
            else:
                os.environ[OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED] = before
    return CountedBatchProcessor(batch)
