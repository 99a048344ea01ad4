"""Telemetry faults: counted by reason, the first of each reason logged at WARNING.

Telemetry code catches its own exceptions so the push flow never sees them; a fault
swallowed silently would leave a dashboard quietly wrong ("descriptors saved" stuck
at 0). So every swallowed fault is noted here. The counts are process-wide (one
worker per process in vLLM) and drained into the worker's stats each interval, so
they reach `/metrics` as `vllm:nixl_telemetry_errors_total{reason}`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from connector.vocabulary import TelemetryError

logger = logging.getLogger("connector.telemetry")

_lock = threading.Lock()
_counts: Counter[str] = Counter()
_warned: set[str] = set()
# Read-only view for the per-step check (`if errors.pending: errors.drain()`): the
# same object, cleared in place, so a truth test costs no call on the idle step.
pending = _counts


def note(reason: TelemetryError, detail: object = "", exc_info: bool = True, count: int = 1) -> None:
    """Count `count` lost pieces of telemetry (default one); never raises."""
    try:
        with _lock:
            _counts[reason.value] += count
            first = reason.value not in _warned
            _warned.add(reason.value)
        if first:
            logger.warning("NIXL push telemetry: %s (%s); later ones are only counted in "
                           "vllm:nixl_telemetry_errors_total{reason=%r}", reason.value,
                           str(detail)[:200], reason.value, exc_info=exc_info)
        else:
            logger.debug("NIXL push telemetry: %s (%s)", reason.value, str(detail)[:200],
                         exc_info=exc_info)
    except Exception:  # pragma: no cover - logging itself failed
        pass


def drain() -> dict[str, int]:
    """Counts since the last drain (the worker moves them into its stats)."""
    if not _counts:
        return {}  # every engine step asks: no lock on the common path
    with _lock:
        if not _counts:
            return {}
        out = dict(_counts)
        _counts.clear()
    return out
