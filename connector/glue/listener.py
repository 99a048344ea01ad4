"""Supervision of vLLM's side-channel listener (the scheduler's metadata server).

vLLM serves each engine's handshake metadata from one thread
(`_nixl_handshake_listener`), and two things there turn a peer's or an operator's
mistake into a silent outage:
- a request it cannot decode (wrong frame count, not msgpack, not a 3-tuple) or that
  asks for a rank this engine does not have raises inside the thread; the thread
  ends, the port closes, and from then on no engine can handshake with this one;
- a port it cannot bind raises in the thread before it signals "ready", and the
  scheduler waits for that signal forever: the engine never starts and says nothing.

`supervise` runs vLLM's listener unchanged and handles both: a request that kills
it is counted (by reason, process-wide, drained into the connector's stats and
exported as `vllm:nixl_side_channel_rejected_total{reason}`), logged (the first of
each reason at WARNING) and the listener is started again on the same port at once;
a port that cannot be bound releases the scheduler's wait and is raised there as a
`SideChannelBindError` naming the port and the setting.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from connector.vocabulary import SideChannelRejection

logger = logging.getLogger(__name__)

# Back-off between attempts to re-bind after the listener died (port briefly busy).
REBIND_BACKOFF_S = (0.05, 0.2, 1.0)

_lock = threading.Lock()
_rejected: Counter[str] = Counter()
# Read-only alias for the scheduler's per-step check (cleared in place, never rebound).
pending_rejections = _rejected
_warned: set[str] = set()
_bind_errors: dict[int, BaseException] = {}


class SideChannelBindError(RuntimeError):
    """The side-channel port could not be bound at start-up."""


class _RelayEvent(threading.Event):
    """A per-attempt 'ready' event that also sets the scheduler's own event."""

    def __init__(self, outer: threading.Event):
        super().__init__()
        self._outer = outer

    def set(self) -> None:
        super().set()
        self._outer.set()


def classify(exc: BaseException) -> SideChannelRejection:
    """The closed reason for an exception raised while serving one request."""
    return SideChannelRejection.UNKNOWN_RANK if isinstance(exc, KeyError) else SideChannelRejection.MALFORMED


def note_rejected(reason: SideChannelRejection, exc: BaseException, port: int) -> None:
    with _lock:
        _rejected[reason.value] += 1
        first = reason.value not in _warned
        _warned.add(reason.value)
    log = logger.warning if first else logger.debug
    log("NIXL side channel on port %d dropped a %s request (%s: %.200s) and keeps serving; "
        "counted in vllm:nixl_side_channel_rejected_total{reason=%r}%s", port, reason.value,
        type(exc).__name__, exc, reason.value, "" if not first else " (further ones at DEBUG)")


def drain_rejected() -> dict[str, int]:
    """{reason: count} since the last drain (the scheduler's stats interval)."""
    if not _rejected:  # the scheduler asks every step: no lock on the common path
        return {}
    with _lock:
        out = dict(_rejected)
        _rejected.clear()
    return out


def take_bind_error(port: int) -> BaseException | None:
    with _lock:
        return _bind_errors.pop(port, None)


def supervise(serve: Callable[..., Any], encoded_data: Any, ready_event: threading.Event,
              stop_event: threading.Event, host: str, port: int) -> None:
    """Run vLLM's listener `serve`; restart it after a request that kills it (thread target)."""
    bound_once = False
    failures = 0
    while not stop_event.is_set():
        attempt_ready = _RelayEvent(ready_event)
        try:
            serve(encoded_data, attempt_ready, stop_event, host, port)
            return  # vLLM's listener returns only when stop_event is set
        except Exception as exc:
            if not attempt_ready.is_set():  # the socket was never bound
                if not bound_once:
                    with _lock:
                        _bind_errors[port] = exc
                    ready_event.set()  # release the scheduler's wait; it raises from there
                    return
                delay = REBIND_BACKOFF_S[min(failures, len(REBIND_BACKOFF_S) - 1)]
                failures += 1
                logger.error("NIXL side channel could not re-bind %s:%d (%s); retrying in %.2fs",
                             host, port, exc, delay)
                stop_event.wait(delay)
                continue
            bound_once, failures = True, 0
            if stop_event.is_set():
                return
            note_rejected(classify(exc), exc, port)
