"""When each D-side receive started, so its whole duration can be observed, and when
its request arrived at D (the start of its whole wait for KV, a TTFT stage).

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
from collections.abc import Iterable, Mapping
from typing import Any

from connector.telemetry.span_table import MAX_TRACKED_REQUESTS
from connector.vocabulary import REGISTRATION_ARRIVAL_KEY


class ReceiveClock:
    """Request id -> monotonic start time, bounded, oldest first."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        # Public for the per-step check without a call: `waiting` (truthy while any
        # receive is open) and `next_expiry` (no receive can expire before it: the
        # oldest start + timeout, or earlier when the oldest was stopped meanwhile).
        self.waiting: OrderedDict[str, float] = OrderedDict()
        self.next_expiry = float("inf")
        # Request id -> its arrival at D (wall clock, vLLM's `arrival_time`), while open.
        self._arrivals: dict[str, float] = {}

    def note_arrivals(self, registrations: Mapping[str, Mapping[str, Any]]) -> None:
        """Keep each registration's arrival time (our scheduler puts it in); the first
        one of a request stands."""
        arrivals = self._arrivals
        for req_id, reg in registrations.items():
            at = reg.get(REGISTRATION_ARRIVAL_KEY)
            if type(at) is float and req_id not in arrivals:
                arrivals[req_id] = at
        while len(arrivals) > MAX_TRACKED_REQUESTS:
            del arrivals[next(iter(arrivals))]

    def since_arrival(self, req_id: str, now_wall: float | None = None) -> float | None:
        """Seconds since the request arrived at D, forgetting it; None when not known."""
        at = self._arrivals.pop(req_id, None)
        if at is None:
            return None
        return max(0.0, (time.time() if now_wall is None else now_wall) - at)

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
