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
        # Public for the per-step check without a call: `waiting` (truthy while any
        # receive is open) and `next_expiry` (no receive can expire before it: the
        # oldest start + timeout, or earlier when the oldest was stopped meanwhile).
        self.waiting: OrderedDict[str, float] = OrderedDict()
        self.next_expiry = float("inf")

    def start(self, req_id: str, now: float | None = None) -> None:
        started = time.monotonic() if now is None else now
        waiting = self.waiting
        with self._lock:
            if req_id in waiting:  # a re-sent registration keeps its first start
                return
            waiting[req_id] = started
            if started + self.timeout_s < self.next_expiry:
                self.next_expiry = started + self.timeout_s
            if len(waiting) > MAX_TRACKED_REQUESTS:
                waiting.popitem(last=False)

    def stop(self, req_id: str, now: float | None = None) -> float | None:
        """Seconds since the receive started; None for a receive we never saw start."""
        with self._lock:
            started = self.waiting.pop(req_id, None)
        if started is None:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - started)

    def pop_expired(self, now: float | None = None) -> list[tuple[str, float]]:
        """Receives older than the timeout, removed, with their age in seconds."""
        if not self.waiting:  # no receive open: no lock, no clock read
            return []
        now = time.monotonic() if now is None else now
        if now < self.next_expiry:  # nothing old enough yet: no lock
            return []
        out: list[tuple[str, float]] = []
        with self._lock:
            self.next_expiry = float("inf")
            while self.waiting:
                req_id, started = next(iter(self.waiting.items()))
                if now - started < self.timeout_s:
                    self.next_expiry = started + self.timeout_s
                    break
                self.waiting.popitem(last=False)
                out.append((req_id, now - started))
        return out

    def __len__(self) -> int:
        return len(self.waiting)
