"""One harness engine, run in its own OS process.

It holds what a vLLM engine holds for push mode: the scheduler-role connector (its
side-channel listener serves our NIXL metadata), one worker-role connector with a
real KV cache in CPU memory, and an engine loop that, like vLLM's engine core, feeds
the worker a `NixlConnectorMetadata` each step and collects transfer results and
connector stats. The parent drives it with commands over a pipe.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import sys
import tempfile
import time
import traceback
import zlib
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from harness.config import EngineSpec, build_kv_cache_config, build_vllm_config, engine_env
from harness.faults import FaultCommands
from harness.instruments import InstrumentCommands
from harness.scale import ScaleCommands

STEP_INTERVAL_S = 0.001
# Like vLLM's engine core, which blocks when it has no work, an engine with nothing
# happening for a while steps less often, so idle engines do not starve busy ones.
ACTIVE_WINDOW_S = 2.0
IDLE_INTERVAL_S = 0.02
# vLLM's scheduler sends heartbeats every kv_lease_duration // 6 s (30 s lease -> 5 s).
HEARTBEAT_INTERVAL_S = 5.0
SENTINEL = 7.0  # value of every KV element no push wrote


class NixlCallLog:
    """Records what the worker asked its NIXL agent to do (wraps whatever agent it has),
    and when each registration call ran (`times`: (call, agent, start, end), this
    process's perf_counter), measured here, not by the connector under test."""

    def __init__(self, agent: Any):
        object.__setattr__(self, "_agent", agent)
        object.__setattr__(self, "calls", [])
        object.__setattr__(self, "times", [])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def add_remote_agent(self, metadata: bytes) -> Any:
        start = time.perf_counter()
        name = self._agent.add_remote_agent(metadata)
        self.times.append(("add_remote_agent", _text(name), start, time.perf_counter()))
        self.calls.append(("add_remote_agent", _text(name), 0))
        return name

    def prep_xfer_dlist(self, agent_name: Any, descs: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        handle = self._agent.prep_xfer_dlist(agent_name, descs, *args, **kwargs)
        self.times.append(("prep_xfer_dlist", _text(agent_name), start, time.perf_counter()))
        self.calls.append(("prep_xfer_dlist", _text(agent_name), _descriptor_count(descs)))
        return handle


def _descriptor_count(descs: Any) -> int:
    """Descriptors NIXL was asked to prepare, counted here independently of the connector.

    vLLM 0.32 hands NIXL a descriptor list; 0.33 and 0.34 an Nx5 array of strided rows
    (address, length, device id, stride, count) where each row is `count` descriptors.
    """
    if hasattr(descs, "descCount"):
        return int(descs.descCount())
    rows = np.asarray(descs)
    return int(rows[:, 4].sum()) if rows.ndim == 2 and rows.shape[1] == 5 else len(rows)


def install_fault_agent(worker: Any, seed: int) -> Any:
    """Put the harness's fault layer between the worker and its NIXL agent (under the
    fork's notification router, so it routes what the 'network' delivers)."""
    from harness.fault_agent import FaultyAgent

    if hasattr(worker, "observed_interpose"):  # the fork: below its router (its declared seam)
        return worker.observed_interpose(lambda agent: FaultyAgent(agent, seed))
    worker.nixl_wrapper = faulty = FaultyAgent(worker.nixl_wrapper, seed)  # stock: vLLM's agent
    return faulty


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Engine(FaultCommands, InstrumentCommands, ScaleCommands):
    """The engine emulation: vLLM's per-step connector calls, and the commands that drive
    and read the push flow. Fault injection (`harness.faults`) and benchmark timing
    (`harness.instruments`) are mixed in; every `cmd_<name>` is a command."""

    def __init__(self, spec: EngineSpec):
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        self.spec = spec
        self.torch = torch
        self.vllm_config = build_vllm_config(spec)
        self.kv_cache_config = build_kv_cache_config(spec)
        self._config_ctx = set_current_vllm_config(self.vllm_config)
        self._config_ctx.__enter__()
        init_file = spec.dist_init_file or tempfile.mktemp(prefix="harness-dist-", dir=spec.workdir)
        # vLLM's CPU worker names the ranks' shared-memory group after the init file.
        os.environ["VLLM_DIST_IDENT"] = os.path.basename(init_file)
        init_distributed_environment(world_size=spec.world_size, rank=spec.rank,
                                     local_rank=spec.rank, backend="gloo",
                                     distributed_init_method=f"file://{init_file}")
        initialize_model_parallel(spec.tp_size, spec.pp_size)

        cls = KVConnectorFactory.get_connector_class(self.vllm_config.kv_transfer_config)
        affinity = os.sched_getaffinity(0)
        try:
            self.worker_connector = cls(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        finally:
            # vLLM's CPU worker pins the whole process to one core: undo it.
            os.sched_setaffinity(0, affinity)
        # Like vLLM, only one scheduler (here: rank 0's process) hosts the side channel;
        # a driven engine's scheduler (with its connector) lives in harness.core.
        self.scheduler_connector = (cls(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)
                                    if spec.rank == 0 and not spec.driven else None)
        self.worker = self.worker_connector.connector_worker
        self.fault_agent = None
        if spec.faults_seed is not None:
            self.fault_agent = install_fault_agent(self.worker, spec.faults_seed + spec.rank)
        self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        for cache in self.caches.values():
            cache.fill_(SENTINEL)
        self.worker_connector.register_kv_caches(self.caches)
        self.nixl_log = NixlCallLog(self.worker.nixl_wrapper)
        self.worker.nixl_wrapper = self.nixl_log
        self.handshake_payload = self.worker_connector.get_handshake_metadata()
        if spec.world_size == 1 and not spec.driven:
            self.cmd_serve_metadata({(0, 0): self.handshake_payload})
        self.model = None
        if spec.driven:
            from harness.model import ModelRunner

            self.model = ModelRunner(self.caches, block_size=spec.block_size,
                                     total_heads=spec.num_kv_heads, tp_rank=spec.tp_rank,
                                     layer_offset=spec.layer_range()[0], role=spec.kv_role,
                                     initial_fill=SENTINEL)

        self.pending_meta = self._new_meta()
        self.stats: list[dict[str, Any]] = []
        self.finished_recving: dict[str, float] = {}
        self.failed_recving: set[str] = set()
        self.finished_sending: dict[str, float] = {}
        self.heartbeats: dict[str, Any] = {}
        # D request id -> (prefill engine id, remote request id) while it waits for KV:
        # like vLLM's scheduler, heartbeats name only requests still waiting.
        self._awaiting_kv: dict[str, tuple[str, str]] = {}
        self.last_heartbeat = 0.0

    # ------------------------------------------------------------------ steps
    def _new_meta(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata

        return NixlConnectorMetadata()

    def step(self) -> bool:
        """One engine iteration; True when transfers finished or stats were produced."""
        meta = self.pending_meta
        self.pending_meta = self._new_meta()
        meta.scheduler_clock = time.perf_counter()
        now = time.perf_counter()
        if self.heartbeats and now - self.last_heartbeat >= HEARTBEAT_INTERVAL_S:
            meta.heartbeat_by_engine = dict(self.heartbeats)
        if meta.heartbeat_by_engine:
            self.last_heartbeat = now
        self.worker_connector.bind_connector_metadata(meta)
        self.worker_connector.start_load_kv(None)
        self.worker_connector.clear_connector_metadata()
        results = self.worker_connector.get_transfer_results(set())
        now = time.perf_counter()
        for req_id in results.finished_recving:
            self.finished_recving[req_id] = now
            self._stop_awaiting(req_id)
        self.failed_recving |= set(results.failed_recving)
        for req_id in results.finished_sending:
            self.finished_sending[req_id] = now
        stats = self.worker_connector.get_kv_connector_stats()
        if self.scheduler_connector is not None:  # like vLLM's scheduler: add its own stats
            sched = self.scheduler_connector.get_kv_connector_stats()
            if sched is not None and not sched.is_empty():
                stats = sched if stats is None else stats.aggregate(sched)
        if stats is not None:
            self.stats.append(stats.to_dict())
        return bool(stats is not None or results.finished_recving or results.finished_sending)

    def cmd_model_step(self, so: Any) -> dict[str, Any]:
        """One step of a driven engine, in vLLM's model-runner order: check what finished,
        bind the metadata, run the model, start the step's loads, collect the results."""
        conn, model = self.worker_connector, self.model
        assert model is not None, "not a driven engine"
        model.before(so)
        conn.bind_connector_metadata(so.kv_connector_metadata)
        sampled = model.run(so)
        conn.start_load_kv(None)
        conn.wait_for_save()
        results = conn.get_transfer_results(so.finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        stats = conn.get_kv_connector_stats()
        conn.clear_connector_metadata()
        return {"sampled": sampled, "finished_sending": set(results.finished_sending),
                "finished_recving": set(results.finished_recving),
                "failed_recving": set(results.failed_recving), "invalid": set(invalid or ()),
                "stats": stats, "checks": model.take_checks()}

    def cmd_push_state(self) -> dict[str, Any]:
        """What the worker still holds: the push-state owners' counts and vLLM's maps."""
        w = self.worker
        out: dict[str, Any] = {name: len(getattr(w, name)) for name in (
            "_reqs_to_send", "_reqs_to_process", "_recving_metadata", "_push_finished_blocks",
            "_pending_d_registrations", "_sending_transfers") if hasattr(w, name)}
        if hasattr(w, "observed_state"):  # the fork's owners (its declared seam)
            state = w.observed_state()
            out.update((owner, state[owner]) for owner in ("leases", "receives", "connections"))
        return out

    def cmd_faults(self, notif_faults: dict[str, dict[str, Any]]) -> None:
        from harness.fault_agent import NotifFaults

        assert self.fault_agent is not None, "engine started without faults_seed"
        self.fault_agent.set_notif_faults({k: NotifFaults(**v) for k, v in notif_faults.items()})

    def cmd_partition(self, seconds: float, deliver_fraction: float = 0.5) -> None:
        assert self.fault_agent is not None, "engine started without faults_seed"
        self.fault_agent.partition(seconds, deliver_fraction)

    def cmd_slow_writes(self, window_s: float, delay_s: float) -> None:
        assert self.fault_agent is not None, "engine started without faults_seed"
        self.fault_agent.slow_writes(window_s, delay_s)

    def cmd_corrupt_landed(self, rate: float) -> None:
        assert self.fault_agent is not None, "engine started without faults_seed"
        self.fault_agent.corrupt_landed(rate, self._corrupt)

    def cmd_corrupted_ids(self) -> list[str]:
        return list(self.fault_agent.corrupted_ids) if self.fault_agent is not None else []

    def _corrupt(self, req_id: str, kind: str) -> bool:
        """Change the landed KV of `req_id` (`kind`: one bit flipped, a block replaced by
        another block's content, two blocks swapped); whether its bytes changed. The
        fault agent calls it on vLLM's writer thread, before vLLM's main thread hears the
        KV landed. The blocks are read from vLLM's receive metadata: a fault injector's
        liberty, one dict read; the product never does this."""
        meta = self.worker._recving_metadata.get(req_id)
        groups = getattr(meta, "local_physical_block_ids", None)
        if not groups or not groups[0]:
            return False
        blocks = list(groups[0])
        pick = zlib.crc32(req_id.encode())
        block = blocks[pick % len(blocks)]
        layer = list(self.caches.values())[pick % len(self.caches)]
        before = layer[blocks].clone()
        if kind == "swap" and len(blocks) > 1:
            other = blocks[(pick + 1) % len(blocks)]
            layer[block], layer[other] = layer[other].clone(), layer[block].clone()
        elif kind == "other_block":
            source = (block + 1 + pick % (layer.shape[0] - 1)) % layer.shape[0]
            layer[block].copy_(layer[source])
        else:
            bits = layer[block].view(self.torch.int32 if layer.element_size() == 4 else self.torch.int16)
            bits.view(-1)[pick % bits.numel()] ^= 1
        return not self.torch.equal(before, layer[blocks])

    def cmd_stall_writer(self, seconds: float) -> None:
        assert self.fault_agent is not None, "engine started without faults_seed"
        self.fault_agent.stall_writer(seconds)

    def cmd_fault_counts(self) -> dict[str, Any]:
        import dataclasses

        return dataclasses.asdict(self.fault_agent.counts) if self.fault_agent is not None else {}

    # ---------------------------------------------------------------- commands
    def cmd_info(self) -> dict[str, Any]:
        return {"engine_id": self.spec.engine_id, "host": "127.0.0.1",
                "port": self.spec.side_channel_port, "pid": os.getpid(),
                "num_blocks": self.spec.num_blocks, "num_layers": self.spec.num_layers,
                "affinity": sorted(os.sched_getaffinity(0)),
                "tp_size": self.spec.tp_size, "pp_size": self.spec.pp_size, "rank": self.spec.rank}

    def cmd_handshake_payload(self) -> Any:
        """This rank's encoded handshake payload (gathered by the parent for rank 0)."""
        return self.handshake_payload

    def cmd_serve_metadata(self, payloads: dict[tuple[int, int], Any]) -> None:
        """Rank 0: serve every rank's payload, keyed (pp_rank, tp_rank), on the side channel."""
        assert self.scheduler_connector is not None, "only rank 0 hosts the side channel"
        self.scheduler_connector.set_xfer_handshake_metadata_pp_aware(payloads)

    def cmd_blocks(self, block_ids: list[int]) -> dict[str, Any]:
        """Raw contents of blocks, per layer (for head/layer-aware verification)."""
        return {name: cache[block_ids].contiguous().numpy().copy() for name, cache in self.caches.items()}

    def cmd_fill(self, block_ids: list[int], seed: int) -> None:
        """Write deterministic data into blocks (what a prefill would have computed)."""
        gen = self.torch.Generator().manual_seed(seed)
        for cache in self.caches.values():
            for b in block_ids:
                cache[b].copy_(self.torch.randn(cache[b].shape, generator=gen))

    def cmd_digest(self, block_ids: list[int]) -> list[str]:
        """One hash per block over every layer's bytes of that block."""
        out = []
        for b in block_ids:
            h = hashlib.sha256()
            for name in sorted(self.caches):
                h.update(self.caches[name][b].contiguous().numpy().tobytes())
            out.append(h.hexdigest())
        return out

    def cmd_untouched(self, exclude: list[int]) -> list[int]:
        """Blocks outside `exclude` whose contents are no longer the sentinel."""
        skip = set(exclude)
        dirty = []
        for b in range(self.spec.num_blocks):
            if b in skip:
                continue
            if any(bool((cache[b] != SENTINEL).any()) for cache in self.caches.values()):
                dirty.append(b)
        return dirty

    def cmd_register(self, req_id: str, block_ids: list[int], prefill: dict[str, Any],
                     remote_request_id: str, with_heartbeat: bool,
                     trace_headers: dict[str, str] | None = None) -> None:
        """D side: what the push scheduler hands the worker after allocating blocks.

        `trace_headers` are the request's W3C headers (vLLM's `Request.trace_headers`);
        they go into the registration the way our scheduler puts them there.
        """
        from connector.glue.scheduler import stage_trace_context
        from connector.vocabulary import REGISTRATION_ARRIVAL_KEY

        reg = {
            "request_id": req_id, "decode_engine_id": self.spec.engine_id,
            "decode_host": "127.0.0.1", "decode_port": self.spec.side_channel_port,
            "decode_tp_size": self.spec.tp_size, "local_block_ids": (list(block_ids),),
            "remote_engine_id": prefill["engine_id"], "remote_host": prefill["host"],
            "remote_port": prefill["port"], "remote_tp_size": prefill.get("tp_size", 1),
            "remote_pp_size": prefill.get("pp_size", 1),
        }
        params = {"remote_block_ids": (), "remote_engine_id": prefill["engine_id"],
                  "remote_request_id": remote_request_id, "remote_host": prefill["host"],
                  "remote_port": prefill["port"], "tp_size": prefill.get("tp_size", 1),
                  "pp_size": prefill.get("pp_size", 1)}
        if trace_headers:
            stage_trace_context(reg, trace_headers)
        # The request arrived now, as far as this D knows (vLLM's `arrival_time`, which our
        # scheduler puts into the registration): the start of its wait for KV.
        reg[REGISTRATION_ARRIVAL_KEY] = time.time()
        self.pending_meta.push_registrations[req_id] = reg
        self.pending_meta.add_new_req_to_recv(req_id, (list(block_ids),), params)
        if with_heartbeat:
            self._track_heartbeat(prefill, remote_request_id)
            self._awaiting_kv[req_id] = (prefill["engine_id"], remote_request_id)

    def _stop_awaiting(self, req_id: str) -> None:
        """The request has its KV (or failed): heartbeats stop naming it."""
        engine_id, remote_request_id = self._awaiting_kv.pop(req_id, (None, None))
        info = self.heartbeats.get(engine_id)
        if info is not None:
            info.req_ids.discard(remote_request_id)
            if not info.req_ids:
                del self.heartbeats[engine_id]

    def _track_heartbeat(self, prefill: dict[str, Any], remote_request_id: str,
                         now: bool = False) -> None:
        """Heartbeat P for this request from now on. Sent as vLLM's D scheduler sends
        them: every HEARTBEAT_INTERVAL_S for all waiting requests, the first one at once
        (`now`: on this request's first step anyway, an explicit heartbeat)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo

        info = self.heartbeats.get(prefill["engine_id"])
        if info is None:
            info = HeartbeatInfo(req_ids=set(), host=prefill["host"], port=prefill["port"],
                                 tp_size=prefill.get("tp_size", 1), pp_size=prefill.get("pp_size", 1))
            self.heartbeats[prefill["engine_id"]] = info
        info.req_ids.add(remote_request_id)
        # vLLM throttles heartbeats to one per interval for all requests, from a last
        # send time of 0: the first request's go out on its first step, later ones with
        # the next interval's (not one per request on its first step, which would add a
        # NIXL notification from D's main thread as D's writer sends the PUSH_REG).
        if now or not self.last_heartbeat:
            self.pending_meta.heartbeat_by_engine = dict(self.heartbeats)

    def cmd_heartbeat(self, prefill: dict[str, Any], remote_request_id: str) -> None:
        """Heartbeat P for this request, the first one on the next step."""
        self._track_heartbeat(prefill, remote_request_id, now=True)

    def cmd_stop_heartbeats(self, engine_id: str | None = None) -> None:
        """Stop heartbeating every prefill engine, or only `engine_id`."""
        if engine_id is None:
            self.heartbeats.clear()
        else:
            self.heartbeats.pop(engine_id, None)

    def cmd_finish(self, req_id: str, block_ids: list[int], lease_s: float,
                   trace_headers: dict[str, str] | None = None) -> None:
        """P side: a finished prefill whose blocks wait for D's registration.

        `trace_headers` (P's own request's W3C headers) ride in the step metadata the
        way our scheduler ships them with the finished blocks.
        """
        from connector.glue.scheduler import attach_request_contexts
        from connector.telemetry.tracing import trace_carrier
        from connector.vocabulary import METADATA_TRACE_ATTR

        meta = self.pending_meta
        meta.reqs_in_batch.add(req_id)
        meta.push_finished_blocks[req_id] = (list(block_ids),)
        meta.reqs_to_send[req_id] = time.perf_counter() + lease_s
        carrier = trace_carrier(trace_headers)
        if carrier:
            contexts = dict(getattr(meta, METADATA_TRACE_ATTR, None) or {})
            contexts[req_id] = carrier
            attach_request_contexts(meta, contexts)

    def cmd_results(self, req_ids: list[str] | None = None) -> dict[str, Any]:
        """Finished and failed transfers; with `req_ids`, the receives of those requests
        only (what `push` polls: the full tables grow with every request of a run, and
        answering them every 10 ms cost more CPU per request the longer a run lasted)."""
        if req_ids is not None:
            return {"finished_recving": {r: self.finished_recving[r] for r in req_ids
                                         if r in self.finished_recving},
                    "failed_recving": [r for r in req_ids if r in self.failed_recving]}
        return {"finished_recving": dict(self.finished_recving),
                "failed_recving": sorted(self.failed_recving),
                "finished_sending": dict(self.finished_sending)}

    def cmd_await_results(self, req_ids: list[str], timeout_s: float) -> dict[str, Any]:
        """`cmd_results(req_ids)` once all of them have finished (or `timeout_s` passed),
        stepping at the engine loop's pace meanwhile. The driver waits for the answer,
        so no command is missed; it learns of the last receive within a step instead
        of a 10 ms poll (which made a batch's wall time, and the CPU the engines spend
        while it lasts, jump in 10 ms steps)."""
        wanted = set(req_ids)
        deadline = time.monotonic() + timeout_s
        while not wanted <= self.finished_recving.keys() and time.monotonic() < deadline:
            self.step()
            time.sleep(STEP_INTERVAL_S)
        return self.cmd_results(req_ids)

    def cmd_stats(self) -> list[dict[str, Any]]:
        out, self.stats = self.stats, []
        return out

    def cmd_nixl_calls(self) -> list[tuple[str, str, int]]:
        return list(self.nixl_log.calls)

    def cmd_nixl_call_times(self) -> list[tuple[str, str, float, float]]:
        return list(self.nixl_log.times)

    def cmd_connections(self) -> dict[str, Any]:
        w = self.worker
        return {
            "remote_agents": {eid: len(a) for eid, a in dict(w._remote_agents).items()},
            "dst_handles": {eid: len(h) for eid, h in dict(w.dst_xfer_side_handles).items()},
            "notif_only": (w.observed_state()["connections"]["notif_only"]
                           if hasattr(w, "observed_state") else []),
        }

    def cmd_spans(self) -> list[dict[str, Any]]:
        from harness.spans import flush_and_collect

        return flush_and_collect()

    def cmd_tracing_enabled(self) -> bool:
        return getattr(self.worker, "observed_tracer", None) is not None

    def cmd_tracer_kind(self) -> str | None:
        """The class of the tracer our spans come from."""
        tracer = getattr(self.worker, "observed_tracer", None)
        return None if tracer is None else type(tracer).__name__

    def cmd_forget(self, engine_id: str) -> None:
        """Drop a remote engine (vLLM's TTL eviction path) so it can be re-measured."""
        self.worker._cleanup_remote_engine(engine_id)

    def cmd_batch(self, commands: list[tuple[str, tuple]]) -> list[Any]:
        """Run several commands in one round trip, before the next step (what one vLLM
        scheduler step hands its worker under load: many requests at once)."""
        return [getattr(self, f"cmd_{name}")(*args) for name, args in commands]

    def cmd_span_ledger(self) -> dict[str, int]:
        """Spans ended / dropped / exported / failed in this process (export_guard)."""
        from connector.telemetry.export_guard import ledger

        return ledger()

    def cmd_state_sizes(self, upstream: bool = False) -> dict[str, int]:
        """Entries in the fork worker's per-request telemetry state (empty for stock);
        with `upstream`, vLLM's own per-request tables instead (stock and fork)."""
        w = self.worker
        if not upstream:
            return w.observed_state()["telemetry_tables"] if hasattr(w, "observed_state") else {}
        tables = ("_recving_transfers", "_recving_metadata", "_reqs_to_send", "_reqs_to_process",
                  "consumer_notification_counts_by_req", "_push_finished_blocks",
                  "_pending_d_registrations", "_engine_last_active", "_sending_transfers")
        return {name: len(getattr(w, name)) for name in tables if hasattr(w, name)}

    def cmd_now(self) -> float:
        return time.perf_counter()

    def shutdown(self) -> None:
        for conn in (self.worker_connector, self.scheduler_connector):
            if conn is None:
                continue
            with contextlib.suppress(Exception):
                conn.shutdown()
        # Drop the worker now, while modules are alive: vLLM's __del__ shuts down
        # again and fails noisily if it only runs at interpreter teardown.
        self.worker_connector.connector_worker = None
        self.worker = None
        self.nixl_log = None
        gc.collect()


def engine_main(spec: EngineSpec, conn: Connection) -> None:
    """Process entry point: set up, then serve commands while stepping."""
    os.environ.update(engine_env(spec))
    if spec.log_file:  # quiet parent: this process's stdout/stderr (vLLM, NIXL, UCX) go to a file
        fd = os.open(spec.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)
    try:
        if spec.mutant:
            from harness.mutants import apply

            apply(spec.mutant)
        if spec.tracing == "memory":
            from harness.spans import install_memory_tracer

            install_memory_tracer(service_name=f"vllm-{spec.name}")
        elif isinstance(spec.tracing, dict) and spec.tracing.get("exporter") == "raising":
            from connector.telemetry.tracing import install_provider
            from harness.otlp_receiver import RaisingExporter

            install_provider(RaisingExporter())
        # Stock and fork engines alike: NIXL's progress thread sleeps between polls
        # (the fork's `nixl_progress_delay_us` seam, applied around the whole start-up).
        from connector.glue.nixl_progress import progress_delay

        with progress_delay(spec.nixl_progress_delay_us):
            engine = Engine(spec)
        # Like vLLM's engine core after start-up: the start-up heap (torch, vLLM, NIXL)
        # is frozen, so a full collection does not walk it. Without this every full
        # collection stalled a thread for ~300 ms, about once per 1,000 requests.
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
    except BaseException as exc:  # report why, instead of a silent dead child
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ok", engine.cmd_info()))
    last_activity = time.perf_counter()
    try:
        while True:
            idle = time.perf_counter() - last_activity > ACTIVE_WINDOW_S
            if conn.poll(IDLE_INTERVAL_S if idle else STEP_INTERVAL_S):
                last_activity = time.perf_counter()
                name, args = conn.recv()
                if name == "stop":
                    break
                try:
                    conn.send(("ok", getattr(engine, f"cmd_{name}")(*args)))
                except Exception as exc:
                    conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            if not spec.driven and engine.step():
                last_activity = time.perf_counter()
    finally:
        engine.shutdown()
        _flush_spans()
        conn.send(("ok", None))
    # Interpreter teardown (native destructors of torch, UCX, NIXL) takes 5-15 s and
    # does nothing a test or benchmark needs once the connector is shut down and the
    # spans are flushed: leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _flush_spans() -> None:
    """Export what the batch span processor still holds (OTLP engines)."""
    with contextlib.suppress(Exception):
        from opentelemetry import trace

        flush = getattr(trace.get_tracer_provider(), "force_flush", None)
        if flush is not None:
            flush(5000)
