"""Request id -> open span, for spans that outlive the call that started them.

The D-side receive and register spans and the P-side write span start on one thread
(main or writer) and end on another, when vLLM reports the transfer done. The table
is bounded: past its limit the oldest entries are ended (`error.type=abandoned`),
dropped and counted. A request id registered again ends the span it replaces
(`error.type=superseded`) instead of leaking it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from connector.telemetry import errors
from connector.telemetry.tracing import SpanEmitter
from connector.vocabulary import TelemetryError

# Bound on per-request telemetry state; beyond it the oldest entries are dropped.
MAX_TRACKED_REQUESTS = 65536


class SpanTable:
    """Request id -> open span, bounded and thread-safe (main + writer threads).

    With `spans=False` it holds plain values (trace-context carriers): overflow
    just drops them (counted as a full table).
    """

    def __init__(self, limit: int = MAX_TRACKED_REQUESTS, spans: bool = True) -> None:
        self._lock = threading.Lock()
        self._spans: OrderedDict[str, Any] = OrderedDict()
        self._limit = limit
        self._holds_spans = spans

    def put(self, req_id: str, span: Any) -> None:
        if span is None:
            return
        spans = self._spans
        with self._lock:
            replaced = spans.pop(req_id, None)
            spans[req_id] = span
            # (The comprehension only past the bound: it is a call of its own.)
            dropped = ([spans.popitem(last=False)[1] for _ in range(len(spans) - self._limit)]
                       if len(spans) > self._limit else ())
        if replaced is None and not dropped:  # the usual put
            return
        if not self._holds_spans:
            if dropped:
                errors.note(TelemetryError.TABLE_FULL, "request trace contexts", exc_info=False)
            return
        if replaced is not None and replaced is not span:
            SpanEmitter.end(replaced, error_type="superseded",
                            message="request registered again before this span ended")
        for old in dropped:
            errors.note(TelemetryError.TABLE_FULL, "open request spans", exc_info=False)
            SpanEmitter.end(old, error_type="abandoned", message="telemetry table full")

    def get(self, req_id: str) -> Any:
        if not self._spans:  # tracing off: always empty, no lock per request
            return None
        with self._lock:
            return self._spans.get(req_id)

    def pop(self, req_id: str) -> Any:
        if not self._spans:
            return None
        with self._lock:
            return self._spans.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._spans)


class BoundedIdSet(OrderedDict):
    """Insertion-ordered set of request ids; past its limit the OLDEST is dropped.

    An `OrderedDict` of id -> None, so membership, size and `pop(id, None)` are the
    dict's own C calls: the push path asks them for every request.
    """

    def __init__(self, limit: int = MAX_TRACKED_REQUESTS) -> None:
        super().__init__()
        self._limit = limit

    def add(self, req_id: str) -> bool:
        """Add; True when it was not there. Caller holds its own lock."""
        if req_id in self:
            return False
        self[req_id] = None
        while len(self) > self._limit:
            self.popitem(last=False)
            errors.note(TelemetryError.TABLE_FULL, "tracked push ids", exc_info=False)
        return True

    def discard(self, req_id: str) -> None:
        self.pop(req_id, None)
