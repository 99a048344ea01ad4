"""Request id -> open span, for spans that outlive the call that started them.

The D-side receive and register spans and the P-side write span start on one thread
(main or writer) and end on another, when vLLM reports the transfer done. The table
is bounded: past `MAX_TRACKED_REQUESTS` the oldest entries are ended and dropped.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from connector.telemetry.tracing import SpanEmitter

# Bound on per-request telemetry state; beyond it the oldest entries are dropped.
MAX_TRACKED_REQUESTS = 65536


class SpanTable:
    """Request id -> open span, bounded and thread-safe (main + writer threads).

    With `spans=False` it holds plain values (trace-context carriers): overflow
    just drops them.
    """

    def __init__(self, spans: bool = True) -> None:
        self._lock = threading.Lock()
        self._spans: dict[str, Any] = {}
        self._end_dropped = spans

    def put(self, req_id: str, span: Any) -> None:
        if span is None:
            return
        with self._lock:
            self._spans[req_id] = span
            overflow = len(self._spans) - MAX_TRACKED_REQUESTS
            dropped = [self._spans.pop(k) for k in list(itertools.islice(self._spans, max(0, overflow)))]
        if self._end_dropped:
            for old in dropped:
                SpanEmitter.end(old, error_type="abandoned", message="telemetry table full")

    def get(self, req_id: str) -> Any:
        with self._lock:
            return self._spans.get(req_id)

    def pop(self, req_id: str) -> Any:
        with self._lock:
            return self._spans.pop(req_id, None)

