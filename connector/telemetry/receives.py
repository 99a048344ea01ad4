"""When each D-side receive started, so its whole duration can be observed.

A receive starts when vLLM hands the registration to the worker (`start_load_kv`,
engine main thread) and ends when the worker reports the request received or
failed (`get_transfer_results`, same thread), or when nothing landed within the
registration timeout (expired). Entries are kept in start order, so finding the
expired ones costs one look at the oldest entry, and only once a step reaches the
time the oldest could expire.

Single-threaded by contract: every call comes from the engine's main thread (the
worker's `start_load_kv` and `get_transfer_results`), so there is no lock.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable

from connector.telemetry.span_table import MAX_TRACKED_REQUESTS


class ReceiveClock:
    """Request id -> monotonic start time, bounded, oldest first."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        # Public for the per-step check without a call: `waiting` (truthy while any
        # receive is open) and `next_expiry` (no receive can expire before it: the
        # oldest start + timeout, or earlier when the oldest was stopped meanwhile).
        self.waiting: OrderedDict[str, float] = OrderedDict()
        self.next_expiry = float("inf")

    def start(self, req_id: str, now: float | None = None) -> None:
        self.start_all((req_id,), now)

    def start_all(self, req_ids: Iterable[str], now: float | None = None) -> None:
        """Start the receives of one step (one clock read for all of them); a
        re-sent registration keeps its first start."""
        started = time.monotonic() if now is None else now
        waiting = self.waiting
        for req_id in req_ids:
            if req_id not in waiting:
                waiting[req_id] = started
        if started + self.timeout_s < self.next_expiry:
            self.next_expiry = started + self.timeout_s
        while len(waiting) > MAX_TRACKED_REQUESTS:
            waiting.popitem(last=False)

    def stop(self, req_id: str, now: float | None = None) -> float | None:
        """Seconds since the receive started; None for a receive we never saw start."""
        started = self.waiting.pop(req_id, None)
        if started is None:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - started)

    def overdue(self, now: float | None = None) -> list[tuple[str, float]]:
        """Receives older than the timeout (not removed), with their age in seconds."""
        if not self.waiting:
            return []
        now = time.monotonic() if now is None else now
        if now < self.next_expiry:
            return []
        out = []
        for req_id, started in self.waiting.items():
            if now - started < self.timeout_s:
                break
            out.append((req_id, now - started))
        return out

    def pop_expired(self, now: float | None = None) -> list[tuple[str, float]]:
        """Receives older than the timeout, removed, with their age in seconds."""
        if not self.waiting:  # no receive open: no lock, no clock read
            return []
        now = time.monotonic() if now is None else now
        if now < self.next_expiry:  # nothing old enough yet: no lock
            return []
        out: list[tuple[str, float]] = []
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
