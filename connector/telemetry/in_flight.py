"""Handshakes submitted and not finished yet, for the in-flight gauges.

`vllm:nixl_handshakes` counts a handshake when it ends, so a hung one would be
invisible until its timeout. The worker keeps the unfinished records here and puts a
snapshot (count per direction and flavor, age of the oldest) into its stats each
interval while any are open, and once more when the last one closes (so the gauge
returns to 0).
"""

from __future__ import annotations

import threading
import time

from connector.telemetry.record import HandshakeRecord
from connector.vocabulary import bool_label


def in_flight_key(direction: str, notif_only: bool) -> str:
    return f"{direction}|{bool_label(notif_only)}"


class InFlight:
    """Open handshake records; `to_report` is read by the per-step caller without a
    call (an idle step then costs one attribute test)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, HandshakeRecord] = {}
        self._reported_open = False
        self.to_report = False  # something open, or a last snapshot (back to 0) owed

    def _update(self) -> None:  # (lock held)
        self.to_report = bool(self._open) or self._reported_open

    def add(self, record: HandshakeRecord) -> None:
        with self._lock:
            self._open[id(record)] = record
            self._update()

    def discard(self, record: HandshakeRecord) -> None:
        with self._lock:
            self._open.pop(id(record), None)
            self._update()

    def __len__(self) -> int:
        return len(self._open)

    def snapshot(self) -> dict[str, list[float]] | None:
        """{"d_to_p|true": [count, oldest_age_s], ...}; None when nothing changed to report."""
        if not self._open and not self._reported_open:
            return None  # the common idle step: no lock, no clock read
        now = time.time_ns()
        with self._lock:
            records = list(self._open.values())
            if not records and not self._reported_open:
                return None
            self._reported_open = bool(records)
            self._update()
        out: dict[str, list[float]] = {}
        for rec in records:
            entry = out.setdefault(in_flight_key(rec.direction.value, rec.notif_only), [0, 0.0])
            entry[0] += 1
            entry[1] = max(entry[1], max(0, now - rec.submitted_ns) / 1e9)
        return out
