"""Count the spans a trace back-end loses, without ever waiting on it.

The OTel SDK's `BatchSpanProcessor` already keeps exporting off the writer and
handshake threads and bounds memory: its queue holds at most `OTEL_BSP_MAX_QUEUE_SIZE`
spans and drops the oldest past that. But the drop is only a log line, and an
exporter that fails (endpoint down, HTTP 503, gRPC UNAVAILABLE after its retries) or
raises loses a whole batch quietly. These two thin wrappers count both into
`connector.telemetry.errors`, so they reach `/metrics` as
`vllm:nixl_telemetry_errors_total{reason="spans_dropped"|"span_export_failed"}`.

They are installed only on the tracer provider we create ourselves; a provider vLLM
or the user installed is left as it is. `ledger()` is the per-process ground truth
the tests reconcile against.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from connector.telemetry import errors
from connector.vocabulary import TelemetryError

logger = logging.getLogger(__name__)
_lock = threading.Lock()
_ledger = {"ended": 0, "dropped": 0, "handed_to_exporter": 0, "exported": 0, "export_failed": 0}


def _add(**counts: int) -> None:
    with _lock:
        for key, n in counts.items():
            _ledger[key] += n


def ledger() -> dict[str, int]:
    """Spans ended, dropped at the queue, handed to, exported by and failed in the exporter."""
    with _lock:
        return dict(_ledger)


class CountingExporter(SpanExporter):
    """Wraps the real exporter: a failed or raising export is counted per span."""

    def __init__(self, inner: SpanExporter):
        self.inner = inner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        n = len(spans)
        _add(handed_to_exporter=n)
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
        try:
            self.inner.shutdown()
        except Exception:  # nothing is lost by a failed shutdown; never raise at exit
            logger.debug("span exporter shutdown failed", exc_info=True)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return bool(self.inner.force_flush(timeout_millis))
        except Exception:
            return False


class _CountingQueue(collections.deque):
    """The batch processor's bounded deque, counting the spans it pushes out.

    `appendleft` on a full deque drops the oldest span. Checking "full" before the
    append would race with the export thread's `pop`, so both take a small lock: two
    O(1) deque operations, never an export, so the ending thread never waits on the
    back-end.
    """

    def __init__(self, items: Any, maxlen: int | None):
        super().__init__(items, maxlen)
        self._guard = threading.Lock()

    def appendleft(self, item: Any) -> None:
        with self._guard:
            full = self.maxlen is not None and len(self) >= self.maxlen
            super().appendleft(item)
        _add(ended=1, dropped=int(full))
        if full:
            errors.note(TelemetryError.SPANS_DROPPED, "span queue full (exporter slow or down)",
                        exc_info=False)

    def pop(self) -> Any:
        with self._guard:
            return super().pop()


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """`BatchSpanProcessor` that counts each span its full queue drops, exactly.

    The SDK (1.45, pinned in the lock) keeps spans in a bounded deque
    (`_batch_processor._queue`) and only logs a drop; we swap in a counting deque of
    the same bound. Should a future SDK lay this out differently, drops are simply not
    counted (export failures still are).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        try:
            inner: Any = self._batch_processor
            queue = inner._queue
            if isinstance(queue, collections.deque):
                inner._queue = _CountingQueue(queue, queue.maxlen)
        except Exception as exc:  # pragma: no cover - SDK internals changed shape
            logger.info("span drops will not be counted: %s", exc)
