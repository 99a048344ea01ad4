"""Parent side of the harness: start engine processes, drive pushes, verify bytes."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config import FORK, EngineSpec
from harness.engine import engine_main
from harness.logs import LOG_DIR_ENV
from harness.poll import wait_until
from harness.ports import free_port

# When set, every engine whose spec names no log file writes its output to a file here.
# Engine start-up on a loaded 2-core machine can take minutes; raise it there.
START_TIMEOUT_S = float(os.environ.get("HARNESS_START_TIMEOUT_S", "180"))


class EngineError(RuntimeError):
    """An engine process reported an error or died."""


class EngineHandle:
    """A running engine process and the command pipe to it."""

    def __init__(self, spec: EngineSpec, ctx: Any = None):
        ctx = ctx or mp.get_context("spawn")
        if spec.log_file is None and os.environ.get(LOG_DIR_ENV):  # quiet parent (benchmarks)
            spec = dataclasses.replace(spec, log_file=str(
                Path(os.environ[LOG_DIR_ENV]) / f"{spec.name}-{spec.engine_id}.log"))
        self.spec = spec
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=engine_main, args=(spec, child),
                                   name=f"harness-{spec.name}", daemon=True)
        self.process.start()
        child.close()
        self.info: dict[str, Any] = {}
        self._next_block = 0

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict[str, Any]:
        self.info = self._receive(timeout)
        return self.info

    def _receive(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise EngineError(f"engine {self.spec.name} did not answer within {timeout:.0f}s")
        try:
            status, value = self._conn.recv()
        except EOFError as exc:
            raise EngineError(f"engine {self.spec.name} exited "
                              f"(code {self.process.exitcode})") from exc
        if status != "ok":
            raise EngineError(f"engine {self.spec.name}: {value}")
        return value

    def call(self, name: str, *args: Any, timeout: float = 60.0) -> Any:
        self._conn.send((name, args))
        return self._receive(timeout)

    def call_all(self, calls: list[tuple[str, tuple[Any, ...]]], bulk: bool = False) -> list[Any]:
        """`calls` ((command, args) each) one round trip each, or all in one (`bulk`)."""
        if bulk:
            return self.call("batch", calls)
        return [self.call(name, *args) for name, args in calls]

    @property
    def address(self) -> dict[str, Any]:
        return {"engine_id": self.info["engine_id"], "host": self.info["host"],
                "port": self.info["port"]}

    def allocate(self, n: int) -> list[int]:
        """Distinct block ids for one request (block 0 is never handed out)."""
        total = self.spec.num_blocks - 1
        if self._next_block + n > total:
            raise EngineError(f"engine {self.spec.name} ran out of blocks "
                              f"({total} usable); raise num_blocks")
        ids = list(range(1 + self._next_block, 1 + self._next_block + n))
        self._next_block += n
        return ids

    def stop(self) -> None:
        self.request_stop()
        self.finish_stop()

    def request_stop(self) -> None:
        """Ask the engine to shut down (returns at once; see `finish_stop`)."""
        self._stop_sent = False
        if self.process.is_alive():
            with contextlib.suppress(Exception):
                self._conn.send(("stop", ()))
                self._stop_sent = True

    def finish_stop(self) -> None:
        """Wait for the shutdown asked for, then make sure the process is gone."""
        if getattr(self, "_stop_sent", False):
            with contextlib.suppress(Exception):
                self._receive(10.0)
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@dataclass
class PushReport:
    """What happened to a batch of pushes."""

    requests: list[str]
    latencies_s: dict[str, float]
    verified: int
    mismatched: list[str]
    failed: list[str]
    dirty_blocks: list[int]
    pairs: list[tuple[str, str]] = field(default_factory=list)

    @property
    def median_latency_s(self) -> float:
        return statistics.median(self.latencies_s.values()) if self.latencies_s else float("nan")

    @property
    def ok(self) -> bool:
        return (not self.mismatched and not self.failed and not self.dirty_blocks
                and self.verified == len(self.requests))


class PushHarness:
    """A set of engine processes plus the driver for the push flow.

    Typical use: `with PushHarness.pd() as h: report = h.push(20)`.
    """

    def __init__(self, specs: list[EngineSpec], ctx: Any = None):
        """`ctx`: the multiprocessing context engines start from (default: spawn; many
        engines start much faster from `harness.cluster.rank_context()`)."""
        self.specs = {s.name: s for s in specs}
        self._ctx = ctx
        self.engines: dict[str, EngineHandle] = {}
        self._seed = 0
        self._written: dict[str, list[int]] = {}
        self.scratch: str | None = None  # a work directory made for this harness, removed on stop

    @classmethod
    def pd(cls, *, connector: str = FORK, prefill_connector: str | None = None,
           decode_connector: str | None = None, num_layers: int = 2, num_blocks: int = 128,
           block_size: int = 32, extra_config: dict[str, Any] | None = None,
           tracing: Any = None, prefill_tracing: Any = None, decode_tracing: Any = None,
           workdir: str | None = None,
           roles: tuple[str, str] = ("kv_producer", "kv_consumer"), ctx: Any = None) -> PushHarness:
        """One prefill engine `P` and one decode engine `D`.

        `tracing` applies to both engines unless `prefill_tracing`/`decode_tracing`
        override it: None (off), "memory", or {"endpoint": ..., "protocol": ...}.
        `ctx`: the multiprocessing context the engines start from (see `__init__`).
        """
        work = workdir or tempfile.mkdtemp(prefix="push-harness-")
        common = dict(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                      extra_config=dict(extra_config or {}), workdir=work)
        run = secrets.token_hex(3)
        harness = cls([
            EngineSpec(name="P", engine_id=f"prefill-{run}", kv_role=roles[0],
                       side_channel_port=free_port(), connector=prefill_connector or connector,
                       tracing=prefill_tracing or tracing, **common),
            EngineSpec(name="D", engine_id=f"decode-{run}", kv_role=roles[1],
                       side_channel_port=free_port(), connector=decode_connector or connector,
                       tracing=decode_tracing or tracing, **common),
        ], ctx)
        harness.scratch = None if workdir else work
        return harness

    # ------------------------------------------------------------- lifecycle
    def start(self) -> PushHarness:
        Path(next(iter(self.specs.values())).workdir).mkdir(parents=True, exist_ok=True)
        for name, spec in self.specs.items():
            self.engines[name] = EngineHandle(spec, self._ctx)
        try:
            for handle in self.engines.values():
                handle.wait_ready()
        except Exception:
            self.stop()
            raise
        return self

    def add(self, specs: list[EngineSpec]) -> None:
        """Start more engines into a running harness (load tests bring decoders in waves)."""
        handles = {s.name: EngineHandle(s, self._ctx) for s in specs}
        self.specs.update({s.name: s for s in specs})
        self.engines.update(handles)
        for handle in handles.values():
            handle.wait_ready()

    def remove(self, names: list[str]) -> None:
        """Stop some engines (in parallel) and forget them."""
        handles = [self.engines.pop(n) for n in names]
        for handle in handles:
            handle.request_stop()
        for handle in handles:
            handle.finish_stop()
        for n in names:
            del self.specs[n]
            self._written.pop(n, None)

    def stop(self) -> None:
        # Decode engines first, so nobody notifies an engine that is gone; each group
        # shuts down in parallel (an engine's shutdown waits on its threads for a while).
        self.resume()  # (a frozen engine cannot take the stop command)
        handles = list(self.engines.values())
        for group in ([h for h in handles if h.spec.kv_role == "kv_consumer"],
                      [h for h in handles if h.spec.kv_role != "kv_consumer"]):
            for handle in group:
                handle.request_stop()
            for handle in group:
                handle.finish_stop()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self) -> PushHarness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __getitem__(self, name: str) -> EngineHandle:
        return self.engines[name]

    def pause(self) -> None:
        """Freeze every engine process (SIGSTOP): a benchmark measuring one harness at a
        time keeps the others' loops and NIXL progress threads off the cores meanwhile."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        for handle in self.engines.values():
            if handle.process.pid is not None and handle.process.is_alive():
                os.kill(handle.process.pid, sig)

    # ---------------------------------------------------------------- pushes
    def reuse_blocks(self, *names: str) -> None:
        """Allocate from block 0 again on these engines and forget what was written.

        Long runs push batch after batch into the same blocks, so the caches stay
        small; the untouched-block check then covers only what follows.
        """
        self._written.clear()
        for name in names:
            self.engines[name]._next_block = 0

    def push(self, n_requests: int, *, prefill: str = "P", decode: str = "D",
             blocks_per_request: int = 2, heartbeat: bool = True, lease_s: float = 30.0,
             timeout_s: float = 60.0, verify: bool = True, bulk: bool = False,
             trace_headers: list[tuple[dict[str, str] | None, dict[str, str] | None]] | None = None,
             ) -> PushReport:
        """Drive `n_requests` through the real push flow and verify D's bytes.

        Per request, the way vLLM's schedulers would: D allocates blocks and hands
        the worker the registration (and heartbeats P for it, as vLLM's D scheduler
        does: one per interval for all waiting requests); P finishes the prefill and
        hands over the blocks. Both are sent together, so PUSH_REG and finished blocks
        meet in either order.
        `trace_headers`, one (D headers, P headers) pair per request, are the W3C
        headers each leg's request arrived with (None: no trace context). `bulk`: all
        requests in one command per engine (one D step registers them all, one P step
        finishes them all), as under load, instead of one round trip each.
        """
        if trace_headers is not None and len(trace_headers) != n_requests:
            raise ValueError("trace_headers needs one (D, P) pair per request")
        p, d = self.engines[prefill], self.engines[decode]
        pairs: list[tuple[str, str, list[int], list[int]]] = []
        fills = []
        for _ in range(n_requests):
            base = f"cmpl-{secrets.token_hex(6)}"
            p_id, d_id = f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"
            p_blocks, d_blocks = p.allocate(blocks_per_request), d.allocate(blocks_per_request)
            self._seed += 1
            fills.append(("fill", (p_blocks, self._seed)))
            pairs.append((p_id, d_id, p_blocks, d_blocks))
        p.call_all(fills, bulk)
        headers = trace_headers or [(None, None)] * n_requests
        registers = [("register", (d_id, d_blocks, p.address, p_id, heartbeat, d_headers))
                     for (p_id, d_id, _, d_blocks), (d_headers, _) in zip(pairs, headers)]
        finishes = [("finish", (p_id, p_blocks, lease_s, p_headers))
                    for (p_id, _, p_blocks, _), (_, p_headers) in zip(pairs, headers)]
        started: dict[str, float] = {}
        if bulk:  # all registrations in one D step, all finished prefills in one P step
            started = dict.fromkeys((pair[1] for pair in pairs), d.call("now"))
            d.call_all(registers, bulk)
            p.call_all(finishes, bulk)
        else:  # request by request, D's registration and P's finished blocks in turn
            for (_, d_id, _, _), (register, d_args), (finish, p_args) in zip(pairs, registers, finishes):
                started[d_id] = d.call("now")
                d.call(register, *d_args)
                p.call(finish, *p_args)
        d_ids = {pair[1] for pair in pairs}
        results = d.call("await_results", sorted(d_ids), timeout_s, timeout=timeout_s + 30)
        finished = results.get("finished_recving", {})
        failed = sorted((d_ids - set(finished)) | (d_ids & set(results.get("failed_recving", []))))
        latencies = {d_id: finished[d_id] - started[d_id] for d_id in d_ids
                     if d_id in finished and d_id not in failed}
        mismatched: list[str] = []
        verified = 0
        dirty: list[int] = []
        if verify:
            for _, d_id, p_blocks, d_blocks in pairs:
                if d_id in failed:
                    continue
                if p.call("digest", p_blocks) == d.call("digest", d_blocks):
                    verified += 1
                else:
                    mismatched.append(d_id)
            written = self._written.setdefault(decode, [])
            written.extend(b for pair in pairs for b in pair[3])
            dirty = d.call("untouched", written)
        return PushReport(requests=[pair[1] for pair in pairs], latencies_s=latencies,
                          verified=verified, mismatched=mismatched, failed=failed,
                          dirty_blocks=dirty, pairs=[(pair[0], pair[1]) for pair in pairs])

    def wait_for(self, engine: str, predicate: Any, command: str = "connections",
                 timeout_s: float = 30.0) -> Any:
        """Poll `command` on an engine until `predicate(result)` holds; that result."""
        seen: list[Any] = [None]

        def holds() -> tuple[Any] | None:
            seen[0] = self.engines[engine].call(command)
            return (seen[0],) if predicate(seen[0]) else None

        return wait_until(holds, f"{engine}: {command} to satisfy the condition", timeout_s,
                          interval_s=0.01, last=lambda: seen[0])[0]

    def frontend(self, engine: str) -> Any:
        """A vLLM-API-server-like metrics front end for one engine (see harness.frontend)."""
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        from harness.config import connector_settings
        from harness.frontend import Frontend

        spec = self.specs[engine]
        name, module_path = connector_settings(spec)
        kv = KVTransferConfig(kv_connector=name, kv_connector_module_path=module_path,
                              kv_role=spec.kv_role, engine_id=spec.engine_id)
        return Frontend(KVConnectorFactory.get_connector_class(kv), kv)

    def stats(self, engine: str) -> list[dict[str, Any]]:
        """Connector stats dicts the engine's worker produced since the last call."""
        return self.engines[engine].call("stats")
