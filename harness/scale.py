"""Engine commands that load an engine with held state and time its steps (benchmarks).

`python -m benchmarks scale` asks a P engine to hold many KV leases, a D engine to wait
on many receives, and either to know many remote engines, then times the engine's own
per-step calls (what vLLM's model runner calls on the engine's main thread each step:
`start_load_kv`, `get_transfer_results`, `get_kv_connector_stats`) on that thread's CPU
clock, with how long vLLM's `_sending_transfers_lock` was held meanwhile. The same
commands serve the fork and stock vLLM, side by side. Mixed into `harness.engine.Engine`.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import threading
import time
import tracemalloc
from typing import Any


class HoldTimer:
    """Stands in for vLLM's `_sending_transfers_lock`: the same lock, and how long it
    was held (ns, every acquisition on any thread) since the last `take()`."""

    def __init__(self, lock: Any):
        self._lock = lock
        self._since = 0
        self.held_ns = 0
        self._sum_lock = threading.Lock()

    def __enter__(self) -> Any:
        self._lock.acquire()
        self._since = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        held = time.perf_counter_ns() - self._since
        self._lock.release()
        with self._sum_lock:
            self.held_ns += held

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        got = self._lock.acquire(*args, **kwargs)
        if got:
            self._since = time.perf_counter_ns()
        return got

    def release(self) -> None:
        self.__exit__()

    def take(self) -> int:
        with self._sum_lock:
            held, self.held_ns = self.held_ns, 0
        return held


class ScaleCommands:
    """`cmd_*` for the scale benchmark; the engine provides the worker and its steps."""

    worker: Any
    pending_meta: Any
    heartbeats: dict[str, Any]
    step: Any
    _track_heartbeat: Any

    def cmd_hold_leases(self, n: int, lease_s: float = 3600.0) -> int:
        """P: `n` more finished prefills whose leases are held (no decoder asks for them):
        granted in the next step. Returns the leases vLLM holds now."""
        meta = self.pending_meta
        base = len(self.worker._reqs_to_send)
        deadline = time.perf_counter() + lease_s
        for i in range(base, base + n):
            req_id = f"cmpl-scale{i:08d}-0-{i:08x}"
            meta.reqs_in_batch.add(req_id)
            meta.push_finished_blocks[req_id] = ([0],)
            meta.reqs_to_send[req_id] = deadline
        self.step()
        return len(self.worker._reqs_to_send)

    def cmd_wait_receives(self, n: int, prefill: dict[str, Any]) -> int:
        """D: `n` more requests waiting for KV from `prefill` (which has no such request:
        they wait, heartbeated, until the benchmark stops). Registered in the next step."""
        base = len(self.worker._recving_metadata)
        for i in range(base, base + n):
            req_id = f"cmpl-wait{i:08d}-0-{i:08x}"
            self.cmd_register(req_id, [0], prefill, f"cmpl-wait{i:08d}-0", True)
        self.step()
        return len(self.worker._recving_metadata)

    def cmd_add_peers(self, n: int) -> int:
        """`n` more remote engines this worker is connected to (their agents are names
        NIXL does not know: nothing is sent to them). Returns the engines known."""
        w = self.worker
        known = len(w._remote_agents)
        now = time.perf_counter()
        for i in range(known, known + n):
            engine_id, ranks = f"scale-peer-{i}", {(0, 0): f"scale-agent-{i}"}
            connections = getattr(w, "_connections", None)
            if connections is not None:  # the fork: through its connection table
                decision = connections.ensure(engine_id, notif_only=True, for_write=False)
                connections.connected(engine_id, decision.pending, ranks, 0.0, now)
            else:  # stock: vLLM's own maps, as its handshake's done-callback fills them
                with w._handshake_lock:
                    w._remote_agents[engine_id] = ranks
                    w._engine_clock_offset[engine_id] = 0.0
                    w._engine_last_active[engine_id] = now
        return len(w._remote_agents)

    def cmd_time_steps(self, steps: int) -> dict[str, Any]:
        """`steps` engine steps on this (the engine's main) thread: per step, its CPU
        (thread clock) and how long `_sending_transfers_lock` was held."""
        w = self.worker
        timer = w._sending_transfers_lock
        if not isinstance(timer, HoldTimer):
            timer = w._sending_transfers_lock = HoldTimer(timer)
        cpu, held = [], []
        for _ in range(steps):
            timer.take()
            start = time.thread_time_ns()
            self.step()
            cpu.append(time.thread_time_ns() - start)
            held.append(timer.take())
        return {"cpu_us": statistics.median(cpu) / 1000, "cpu_mean_us": statistics.fmean(cpu) / 1000,
                "lock_held_us": statistics.median(held) / 1000,
                "lock_held_mean_us": statistics.fmean(held) / 1000}

    def cmd_time_heartbeat(self, ids: list[str], repeats: int = 5) -> float:
        """CPU (us, median) of applying one heartbeat naming `ids`: the fork's writer
        applies it as it reads it (the router's heartbeat owner); stock vLLM on its main
        thread (`_handle_heartbeat`)."""
        w = self.worker
        message = ("HB:" + ",".join(ids)).encode()
        samples = []
        for _ in range(repeats):
            start = time.thread_time_ns()
            if hasattr(w, "_renew_from"):
                w._renew_from(None, message)
            else:
                w._handle_heartbeat(message[3:].decode())
            samples.append(time.thread_time_ns() - start)
        return statistics.median(samples) / 1000

    def cmd_held_ids(self) -> list[str]:
        return list(self.worker._reqs_to_send)

    def cmd_traced_memory(self, start: bool) -> int:
        """Python heap bytes allocated since `start` (tracemalloc)."""
        if start:
            tracemalloc.start()
            return 0
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return current

    def cmd_profile_steps(self, steps: int, top: int = 25) -> str:
        """The `top` functions by own time over `steps` engine steps (cProfile), as text."""
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(steps):
            self.step()
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
        return out.getvalue()

    def cmd_pid(self) -> int:
        return os.getpid()
