"""Engine commands that time what a benchmark asks about (benchmarks only).

A D->P handshake started the way a heartbeat starts it, timed inside the engine
process: one at a time (`timed_handshake`: wall time, descriptors NIXL was asked to
prepare, RSS growth), or several at once (`timed_handshakes`: when each finished, and
how long each waited on the worker's handshake executor before it ran). Mixed into
`harness.engine.Engine`, whose command loop dispatches `cmd_<name>`.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, as_completed
from typing import Any

from harness.poll import wait_until

# Futures resolve just before their done-callbacks record the new agent: how long to
# wait for the worker's tables to show it.
SETTLE_TIMEOUT_S = 10.0
# Where a worker runs its handshakes: the fork's pool (`handshake_concurrency` threads),
# else vLLM's one-thread executor.
HANDSHAKE_EXECUTORS = ("_handshake_pool", "_handshake_initiation_executor")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _heartbeat_handshake(worker: Any, prefill: dict[str, Any]) -> Any:
    """The D->P handshake a heartbeat asks for: through the fork's declared seam (tagged
    heartbeat-triggered), or vLLM's own `_ensure_handshake` on stock (full for PP=1)."""
    from connector.vocabulary import Trigger

    if hasattr(worker, "observed_connect"):
        return worker.observed_connect(Trigger.HEARTBEAT, prefill["engine_id"], prefill["host"],
                                       prefill["port"], 1, dcp_size=1, pp_size=1)
    return worker._ensure_handshake(prefill["engine_id"], prefill["host"], prefill["port"], 1, 1, 1,
                                    False)


class ExecutorClock:
    """While installed, times every job submitted to the worker's handshake executor:
    how long it queued, how long it ran, and how many ran at once.

    Measured from outside the connector, so a stock and a fork worker are timed alike
    (the fork also records `queue_wait` itself; stock has no record). It wraps the
    `submit` of the first of `HANDSHAKE_EXECUTORS` the worker has; a worker that runs
    handshakes elsewhere shows no jobs.
    """

    def __init__(self, worker: Any):
        self._executor = next((getattr(worker, name) for name in HANDSHAKE_EXECUTORS
                               if getattr(worker, name, None) is not None), None)
        self._lock = threading.Lock()
        self.jobs: list[tuple[float, float, float]] = []  # (queued, started, ended), perf_counter
        self.running = 0
        self.max_running = 0

    def __enter__(self) -> ExecutorClock:
        if self._executor is not None:
            submit = self._executor.submit
            self._executor.submit = lambda fn, *a, **kw: submit(self._timed(fn), *a, **kw)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._executor is not None:
            del self._executor.submit  # (the class's method shows through again)

    def _timed(self, fn: Any) -> Any:
        queued = time.perf_counter()

        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            with self._lock:
                self.running += 1
                self.max_running = max(self.max_running, self.running)
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.running -= 1
                    self.jobs.append((queued, started, time.perf_counter()))
        return run


class InstrumentCommands:
    """`cmd_*` benchmark instrumentation; the engine provides the worker and its NIXL log."""

    worker: Any
    nixl_log: Any

    def _handshake(self, prefill: dict[str, Any]) -> Future | None:
        return _heartbeat_handshake(self.worker, prefill)

    def _settled(self, engine_ids: list[str]) -> None:
        agents = self.worker._remote_agents
        wait_until(lambda: all(e in agents for e in engine_ids),
                   f"remote agents of {engine_ids}", SETTLE_TIMEOUT_S, interval_s=0.0005)

    def cmd_timed_handshake(self, prefill: dict[str, Any]) -> dict[str, Any]:
        """Time one heartbeat-style D->P handshake in this process.

        The fork makes it notification-only; the stock connector does a full one for a
        PP=1 producer. `descriptors`: what the worker asked NIXL to prepare meanwhile
        (counted by the harness's NIXL call log, not by the connector); memory is the
        process RSS before and after.
        """
        calls = len(self.nixl_log.calls)
        rss0 = _rss_bytes()
        t0 = time.perf_counter()
        fut = self._handshake(prefill)
        if fut is not None:
            fut.result(timeout=300)
        seconds = time.perf_counter() - t0
        self._settled([prefill["engine_id"]])
        new = self.nixl_log.calls[calls:]
        return {"seconds": seconds, "rss_delta": _rss_bytes() - rss0,
                "descriptors": sum(n for name, _, n in new if name == "prep_xfer_dlist"),
                "dst_handles": len(self.worker.dst_xfer_side_handles.get(prefill["engine_id"], {}))}

    def cmd_timed_handshakes(self, prefills: list[dict[str, Any]]) -> dict[str, Any]:
        """Heartbeat-style D->P handshakes to several producers, all submitted at once.

        `seconds`: until the last is done; `done_s`: when each was done (from the
        submission); `executor`: each job's queue wait and run time on the worker's
        handshake executor, and how many ran at once (`ExecutorClock`).
        """
        done: list[float] = [0.0] * len(prefills)
        with ExecutorClock(self.worker) as clock:
            t0 = time.perf_counter()
            index = {fut: i for i, fut in enumerate(self._handshake(p) for p in prefills)
                     if fut is not None}
            for fut in as_completed(index, timeout=600):
                done[index[fut]] = time.perf_counter() - t0
                fut.result()  # (raises a failed handshake's error)
            seconds = time.perf_counter() - t0
            self._settled([p["engine_id"] for p in prefills])
        return {"seconds": seconds, "done_s": done,
                "executor": {"waits_s": [s - q for q, s, _ in clock.jobs],
                             "runs_s": [e - s for _, s, e in clock.jobs],
                             "max_running": clock.max_running}}
