"""A known amount of CPU work per request, added to a running engine (benchmarks only).

Why: the whole-CPU measure (`benchmarks.cpu_ab`) prices the fork's own work with what
it costs the rest of the engines too: on shared cores, work on the push's critical
path makes a batch last longer, and every thread that polls (engine loops stepping at
1 kHz, NIXL's progress threads, vLLM's writer) spends more while it lasts. How much
more is a property of the harness and the machine, not of the fork. Burning a known
number of microseconds per request in vLLM's stock code paths, where the fork's own
work sits, measures that rate: the whole-CPU microseconds one microsecond of own work
costs. A ratio goal then reads as a budget of own work.

The sites, one per thread the fork works on for each request:
- each engine's main thread, in `start_load_kv`, per request its metadata carries
  (D: receives to track; P: finished blocks to hand to the writer);
- D's push writer, per registration it sends (`_send_registration_to_p`);
- P's push writer, per PUSH_REG it takes in (`_handle_push_reg_notif`).

The work is a busy loop on the thread's own CPU clock, holding the GIL as the fork's
Python code does. It wraps the worker's methods on the instance (vLLM looks them up on
`self` at every call, its writer thread included), so the class, stock or fork, is
untouched, and removing the wrappers restores the methods exactly.
"""

from __future__ import annotations

import time
from typing import Any

# Worker methods wrapped, and how many requests one call stands for.
_PER_CALL = ("_send_registration_to_p", "_handle_push_reg_notif")
_PER_REQUEST = "start_load_kv"


def burn(us: float) -> None:
    """Spend `us` microseconds of this thread's CPU (not wall time) in Python."""
    end = time.thread_time_ns() + int(us * 1000)
    while time.thread_time_ns() < end:
        pass


def _requests_in(metadata: Any) -> int:
    """Requests a step's metadata hands the worker: D's receives plus P's finished blocks."""
    if metadata is None:
        return 0
    return len(getattr(metadata, "reqs_to_recv", ()) or ()) + len(
        getattr(metadata, "push_finished_blocks", ()) or ())


def _per_call(method: Any, us: float) -> Any:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        burn(us)
        return method(*args, **kwargs)
    return wrapped


def _per_request(method: Any, us: float) -> Any:
    def wrapped(metadata: Any, *args: Any, **kwargs: Any) -> Any:
        n = _requests_in(metadata)
        if n:
            burn(us * n)
        return method(metadata, *args, **kwargs)
    return wrapped


def set_known_work(worker: Any, us: float) -> list[str]:
    """Burn `us` microseconds at each site (0: none, the methods as they were); returns
    the methods the instance now overrides (read back, so a caller can check them)."""
    for name in (*_PER_CALL, _PER_REQUEST):
        worker.__dict__.pop(name, None)  # (the class's method shows through again)
    if us > 0:
        for name in _PER_CALL:
            setattr(worker, name, _per_call(getattr(worker, name), us))
        setattr(worker, _PER_REQUEST, _per_request(getattr(worker, _PER_REQUEST), us))
    return sorted(name for name in (*_PER_CALL, _PER_REQUEST) if name in worker.__dict__)
