"""When each D-side receive started, so its whole duration can be observed.

A receive starts when vLLM hands the registration to the worker (`start_load_kv`,
engine main thread) and ends when the worker reports the request received or
failed (`get_transfer_results`, same thread), or when nothing landed within the
registration timeout (expired). Entries are kept in start order, so finding the
expired ones costs one look at the oldest entry, and only once a step reaches the
time the oldest could expire.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from connector.telemetry.span_table import MAX_TRACKED_REQUESTS


class ReceiveClock:
    """Request id -> monotonic start time, bounded, oldest first."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._started: OrderedDict[str, float] = OrderedDict()
        # No receive can expire before this (the oldest start + timeout, or earlier when
        # the oldest was stopped meanwhile): steps before it skip the lock.
        self._next_expiry = float("inf")

    def start(self, req_id: str, now: float | None = None) -> None:
        with self._lock:
            if req_id in self._started:  # a re-sent registration keeps its first start
                return
            started = self._started[req_id] = time.monotonic() if now is None else now
            self._next_expiry = min(self._next_expiry, started + self.timeout_s)
            while len(self._started) > MAX_TRACKED_REQUESTS:
                self._started.popitem(last=False)

    def stop(self, req_id: str, now: float | None = None) -> float | None:
        """Seconds since the receive started; None for a receive we never saw start."""
        with self._lock:
            started = self._started.pop(req_id, None)
        if started is None:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - started)

    def pop_expired(self, now: float | None = None) -> list[tuple[str, float]]:
        """Receives older than the timeout, removed, with their age in seconds."""
        if not self._started:  # no receive open: no lock, no clock read
            return []
        now = time.monotonic() if now is None else now
        if now < self._next_expiry:  # nothing old enough yet: no lock
            return []
        out: list[tuple[str, float]] = []
        with self._lock:
            self._next_expiry = float("inf")
            while self._started:
                req_id, started = next(iter(self._started.items()))
                if now - started < self.timeout_s:
                    self._next_expiry = started + self.timeout_s
                    break
                self._started.popitem(last=False)
                out.append((req_id, now - started))
        return out

    def __len__(self) -> int:
        return len(self._started)
