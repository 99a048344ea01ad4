"""The one poll-with-deadline helper of the tests, the harness, the demo, the
benchmarks and the dashboard tools: wait for a condition, never for a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class PollTimeout(TimeoutError):
    """The condition did not hold before the deadline; the message says what was awaited
    and the last value seen."""


def wait_until(condition: Callable[[], T], what: str, timeout_s: float = 30.0,
               interval_s: float = 0.02, last: Callable[[], object] | None = None) -> T:
    """Call `condition` until it returns something truthy and return that value.

    Raises `PollTimeout` naming `what` (and `last()`, or the last value returned,
    when given) once `timeout_s` has passed. `interval_s` is only how often it asks,
    never a synchronisation.
    """
    deadline = time.monotonic() + timeout_s
    value: T = condition()
    while not value:
        if time.monotonic() >= deadline:
            seen = last() if last is not None else value
            raise PollTimeout(f"timed out after {timeout_s:g} s waiting for {what}; last seen: "
                              f"{str(seen)[:500]}")
        time.sleep(interval_s)
        value = condition()
    return value
