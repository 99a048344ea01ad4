"""An engine core: vLLM's real scheduler driving harness rank processes.

Like vLLM's `EngineCore` with a multiprocess executor: in this (the parent) process, a
thread per engine runs vLLM's `Scheduler`, which builds the scheduler-role connector
itself (our `ObservedPushScheduler`: its side-channel listener, leases, heartbeats,
registrations, aborts), and each step hands the `SchedulerOutput` to every rank process
(`harness.engine` in driven mode: the real fork worker, real NIXL, real KV caches,
and `harness.model` writing and checking KV bytes), aggregates their outputs with
vLLM's `KVOutputAggregator`, and feeds them back with `update_from_output`. Blocks,
preemption, leases and the abort of a request waiting for KV are vLLM's own.

The engine steps only while vLLM's scheduler has requests (or pending push work), as
vLLM's busy loop does. A step can be held back on command: the engine's main thread
stalled (the way a starved host stalls it).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from harness.config import EngineSpec, build_kv_cache_config, build_vllm_config
from harness.runner import EngineError, EngineHandle

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005
START_TIMEOUT_S = 300.0


@dataclass
class Finished:
    """A request vLLM's scheduler reported finished, with what it produced."""

    req_id: str
    tokens: list[int]
    reason: str
    at: float


@dataclass
class CoreState:
    """What the core thread recorded (read by the campaign after a run)."""

    finished: dict[str, Finished] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    failed_recving: set[str] = field(default_factory=set)  # as the scheduler saw them (any rank failed)
    # Rank 0's own: its telemetry describes its view (another rank can fail a receive
    # rank 0 landed, e.g. by its KV check of its heads).
    failed_on_rank0: set[str] = field(default_factory=set)
    finished_recving: dict[str, float] = field(default_factory=dict)
    finished_sending: dict[str, float] = field(default_factory=dict)
    checks: list[Any] = field(default_factory=list)
    # What each rank and the scheduler reported of each receive, by step (a wrong byte's lead).
    kv_events: dict[str, list[str]] = field(default_factory=dict)
    receivers: dict[int, list[str]] = field(default_factory=dict)  # block -> receives into it
    stats: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    steps: int = 0


class EngineCore:
    """One engine: a scheduler thread here, its ranks in their own processes."""

    def __init__(self, spec: EngineSpec, ctx: Any):
        self.spec = replace(spec, driven=True)
        self.state = CoreState()
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._stall_until = 0.0
        self._thread: threading.Thread | None = None
        self.scheduler: Any = None
        work = Path(spec.workdir)
        work.mkdir(parents=True, exist_ok=True)
        init_file = str(work / f"dist-{spec.engine_id}-{os.getpid()}-{time.monotonic_ns()}")
        self.rank_specs = [
            replace(self.spec, name=f"{spec.name}.r{r}", rank=r, dist_init_file=init_file,
                    log_file=str(work / f"{spec.name}.rank{r}.log"))
            for r in range(spec.world_size)]
        self.ranks = [EngineHandle(s, ctx) for s in self.rank_specs]
        self._on_finished: Callable[[Finished], None] | None = None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> EngineCore:
        """Wait for the ranks, build the scheduler (its connector serves the ranks'
        metadata on the side channel), start stepping."""
        try:
            for handle in self.ranks:
                handle.wait_ready(START_TIMEOUT_S)
            payloads = {(rs.pp_rank, rs.tp_rank): h.call("handshake_payload")
                        for h, rs in zip(self.ranks, self.rank_specs)}
            self.scheduler = build_scheduler(self.spec)
            connector = self.scheduler.connector
            connector.set_xfer_handshake_metadata_pp_aware(payloads)
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._loop, name=f"core-{self.spec.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        for handle in self.ranks:
            handle.request_stop()
        for handle in self.ranks:
            handle.finish_stop()
        self._shutdown_scheduler()

    def kill(self) -> None:
        """The engine dies at once (its processes killed, its listener closed)."""
        self._stop.set()
        for handle in self.ranks:
            if handle.process.is_alive():
                handle.process.kill()
        for handle in self.ranks:
            handle.process.join(10)
        if self._thread is not None:
            self._thread.join(30)
            self._thread = None
        self._shutdown_scheduler()

    def _shutdown_scheduler(self) -> None:
        if self.scheduler is not None:
            try:
                self.scheduler.shutdown()
            except Exception:
                logger.debug("scheduler shutdown", exc_info=True)
            self.scheduler = None

    @property
    def address(self) -> dict[str, Any]:
        return {"engine_id": self.spec.engine_id, "host": "127.0.0.1",
                "port": self.spec.side_channel_port, "tp_size": self.spec.tp_size,
                "pp_size": self.spec.pp_size}

    # ------------------------------------------------------------- commands
    def add_request(self, request: Any) -> None:
        self._commands.put(("add", request))

    def abort(self, req_id: str) -> None:
        self._commands.put(("abort", req_id))

    def stall(self, seconds: float) -> None:
        """Hold the engine's main thread back for `seconds` (its next steps wait)."""
        self._commands.put(("stall", seconds))

    def on_finished(self, callback: Callable[[Finished], None]) -> None:
        self._on_finished = callback

    def query(self, fn: Callable[[Any], Any], timeout_s: float = 60.0) -> Any:
        """Run `fn(scheduler)` on the core thread (vLLM's scheduler is single-threaded)."""
        if self._stop.is_set() or self._thread is None:
            raise EngineError(f"engine {self.spec.name} is not running")
        box: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self._commands.put(("query", (fn, box)))
        try:
            ok, value = box.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineError(f"engine {self.spec.name} did not answer within {timeout_s:.0f} s") from None
        if not ok:
            raise EngineError(value)
        return value

    def rank_call(self, name: str, *args: Any, rank: int | None = None) -> list[Any]:
        """A command to one rank or all (between steps: through the core thread)."""
        targets = self.ranks if rank is None else [self.ranks[rank]]
        return self.query(lambda _s: [h.call(name, *args) for h in targets])

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.v1.request import RequestStatus

        aggregator = KVOutputAggregator(expected_finished_count=len(self.ranks))
        while not self._stop.is_set():
            try:
                idle = not self.scheduler.has_requests()
                self._drain_commands(block=idle, aborted=RequestStatus.FINISHED_ABORTED)
                if time.monotonic() < self._stall_until:
                    time.sleep(min(0.01, max(0.0, self._stall_until - time.monotonic())))
                    continue
                if not self.scheduler.has_requests():
                    continue
                self._step(aggregator)
            except Exception as exc:  # an engine exception: recorded, the engine goes on
                self.state.errors.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                if isinstance(exc, EngineError):
                    return  # a rank died: this engine is gone
                time.sleep(0.01)

    def _drain_commands(self, block: bool, aborted: Any) -> None:
        try:
            name, arg = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if name == "add":
                self.scheduler.add_request(arg)
            elif name == "abort":
                self.scheduler.finish_requests(arg, aborted)
            elif name == "stall":
                self._stall_until = max(self._stall_until, time.monotonic() + arg)
            elif name == "query":
                fn, box = arg
                try:
                    box.put((True, fn(self.scheduler)))
                except Exception as exc:
                    box.put((False, f"{type(exc).__name__}: {exc}"))
            try:
                name, arg = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self, aggregator: Any) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        recv = getattr(so.kv_connector_metadata, "reqs_to_recv", None) or {}
        for r, m in recv.items():
            blocks = list(m.local_block_ids[0]) if m.local_block_ids else []
            self.state.kv_events.setdefault(r, []).append(f"{self.state.steps}: receives into {blocks}")
            for b in blocks:
                self.state.receivers.setdefault(b, []).append(r)
        for handle in self.ranks:  # every rank at once, as the executor broadcasts
            handle._conn.send(("model_step", (so,)))
        outs = [handle._receive(120.0) for handle in self.ranks]
        now = time.monotonic()
        runner_outputs = []
        for rank, out in enumerate(outs):
            req_ids = list(so.num_scheduled_tokens)
            sampled = out["sampled"]
            # (vLLM 0.34 dropped req_id_to_index: the order of req_ids is the index.)
            index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} \
                if "req_id_to_index" in _fields(ModelRunnerOutput) else {}
            runner_outputs.append(ModelRunnerOutput(
                req_ids=req_ids, **index,
                sampled_token_ids=[sampled.get(r, []) for r in req_ids],
                kv_connector_output=KVConnectorOutput(
                    finished_sending=out["finished_sending"] or None,
                    finished_recving=out["finished_recving"] or None,
                    failed_recving=out["failed_recving"], invalid_block_ids=out["invalid"],
                    kv_connector_stats=out["stats"])))
            self.state.checks.extend(out["checks"])
            step = self.state.steps
            for r in out["finished_recving"]:
                failed = " failed" if r in out["failed_recving"] else ""
                self.state.kv_events.setdefault(r, []).append(f"{step}: rank {rank} finished{failed}")
            if out["invalid"]:
                for r in out["failed_recving"]:
                    self.state.kv_events.setdefault(r, []).append(
                        f"{step}: rank {rank} invalid blocks {sorted(out['invalid'])}")
            # (each rank counts its own work: rank 0's counts are per request; a copy: the
            # aggregator extends rank 0's in place)
            if rank == 0:
                self.state.failed_on_rank0 |= out["failed_recving"]
                if out["stats"] is not None:
                    self.state.stats.append(copy.deepcopy(out["stats"].to_dict()))
        merged = aggregator.aggregate(runner_outputs)
        kv = merged.kv_connector_output
        if kv is not None:
            # (what the scheduler sees: a receive one rank failed, e.g. its KV check, failed)
            self.state.failed_recving |= kv.failed_recving or set()
            for r in kv.finished_recving or ():
                self.state.finished_recving[r] = now
                failed = " failed" if r in (kv.failed_recving or ()) else ""
                self.state.kv_events.setdefault(r, []).append(
                    f"{self.state.steps}: scheduler finished{failed}")
            for r in kv.finished_sending or ():
                self.state.finished_sending[r] = now
        engine_outputs = self.scheduler.update_from_output(so, merged)
        self.state.steps += 1
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                self.state.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finish_reason is not None:
                    done = Finished(out.request_id, self.state.tokens.get(out.request_id, []),
                                    str(out.finish_reason), now)
                    self.state.finished[out.request_id] = done
                    if self._on_finished is not None:
                        self._on_finished(done)


@functools.cache
def _fields(cls: type) -> frozenset[str]:
    """The dataclass fields of one of vLLM's output classes (they change between minors)."""
    return frozenset(f.name for f in fields(cls))


def build_scheduler(spec: EngineSpec) -> Any:
    """vLLM's scheduler for `spec` (its connector listens on the spec's side channel)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    # (The scheduler-role connector reads its side-channel address from the environment
    # when it is built; engines are built one at a time.)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    config = build_vllm_config(replace(spec, rank=0))
    kv_cache_config = build_kv_cache_config(replace(spec, rank=0, tp_size=1, pp_size=1))
    with set_current_vllm_config(config):
        return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config,
                         structured_output_manager=StructuredOutputManager(config),
                         block_size=spec.block_size, log_stats=True)


def make_request(req_id: str, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any],
                 arrival: float | None = None) -> Any:
    """A vLLM request as its engine builds it from an API call (token ids, no tokenizer)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    params.extra_args = {"kv_transfer_params": dict(kv_transfer_params)}
    request = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params,
                      pooling_params=None, arrival_time=arrival)
    request.kv_transfer_params = dict(kv_transfer_params)
    return request
