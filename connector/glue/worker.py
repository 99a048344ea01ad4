"""The fork's push worker: vLLM's `NixlPushConnectorWorker`, observed and fixed.

What changes against stock, and where:
- `_ensure_handshake` (re-implemented in our words; no seam for flavor or timing):
  every handshake a D starts (PUSH_REG or heartbeat) is notification-only, P->D
  handshakes before a WRITE are full, and a notification-only connection is
  upgraded to a full one when a WRITE needs it (kv_both).
- `_observed_handshake` (our words for vLLM's `_nixl_handshake`): the same
  side-channel exchange and checks, cut into the vocabulary's phases.
- Thin wrappers at the boundary tag the trigger of a handshake, carry the W3C trace
  context through PUSH_REG, and count pushes; the business logic stays vLLM's.
Telemetry never raises into the push flow and never blocks the writer thread: the
handshake thread fills a plain record, spans are built from it when it is over and
exported by a batch processor.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker as _BASE,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlConnectorMetadata,
    NixlHandshakePayload,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)
from vllm.platforms import current_platform

from connector.glue.compat import RemoteAgentTable, accepted, bind_handshake_tail
from connector.glue.nixl_probe import NixlAgentProbe
from connector.glue.side_channel import SideChannelClient
from connector.telemetry.record import (
    ActiveRecord,
    HandshakeError,
    HandshakeRecord,
    PhaseSegment,
)
from connector.telemetry.savings import LocalListLedger, shape_aware_saving
from connector.telemetry.stats import ObservedNixlStats
from connector.telemetry.tracing import (
    SpanEmitter,
    activated,
    extract_context,
    inject_context,
    resolve_tracer,
)
from connector.vocabulary import (
    PUSH_REG_TRACE_KEY,
    SPAN_PUSH_RECEIVE,
    SPAN_PUSH_REGISTER,
    SPAN_PUSH_WRITE,
    Attr,
    Direction,
    ErrorType,
    Phase,
    StatKey,
    Trigger,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

# vLLM failure types (the `failure_type` of `_log_failure`) that end a P-side push.
_PUSH_FAILURES = frozenset(
    {"push_handshake_failed", "transfer_setup_failed", "transfer_failed", "transfer_exception"}
)
# ... and those that end a D-side receive before any WRITE can land.
_RECEIVE_FAILURES = frozenset({"push_reg_handshake_failed"})
# Bound on per-request telemetry state; beyond it the oldest entries are dropped.
_MAX_TRACKED_REQUESTS = 65536
DEFAULT_HANDSHAKE_TIMEOUT_MS = 5000


class _SpanTable:
    """Request id -> open span, bounded and thread-safe (main + writer threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: dict[str, Any] = {}

    def put(self, req_id: str, span: Any) -> None:
        if span is None:
            return
        with self._lock:
            self._spans[req_id] = span
            overflow = len(self._spans) - _MAX_TRACKED_REQUESTS
            dropped = [self._spans.pop(k) for k in list(itertools.islice(self._spans, max(0, overflow)))]
        for old in dropped:
            SpanEmitter.end(old, error_type="abandoned", message="telemetry table full")

    def get(self, req_id: str) -> Any:
        with self._lock:
            return self._spans.get(req_id)

    def pop(self, req_id: str) -> Any:
        with self._lock:
            return self._spans.pop(req_id, None)


class ObservedPushWorker(NixlPushConnectorWorker):
    """See module docstring."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        extra = self.kv_transfer_config.get_from_extra_config
        self._handshake_timeout_ms = int(extra("handshake_timeout_ms", DEFAULT_HANDSHAKE_TIMEOUT_MS))
        self._kv_role = self.kv_transfer_config.kv_role
        self._hb_handshake_notif_only = True
        self.xfer_stats = ObservedNixlStats()
        self.nixl_wrapper = NixlAgentProbe(self.nixl_wrapper)
        self._remote_agents = RemoteAgentTable(self._remote_agents)
        # Engines connected notification-only, and the flavor of pending handshakes.
        self._notif_only_engines: set[str] = set()
        self._pending_notif_only: dict[str, bool] = {}
        self._trigger_local = threading.local()
        obs = getattr(vllm_config, "observability_config", None)
        self._spans = SpanEmitter(resolve_tracer(getattr(obs, "otlp_traces_endpoint", None)))
        self._receive_spans = _SpanTable()  # D: registration until KV landed
        self._register_spans = _SpanTable()  # D: registration until PUSH_REG sent
        self._write_spans = _SpanTable()  # P: PUSH_REG matched until WRITE done
        self._push_lock = threading.Lock()
        self._pushing: set[str] = set()  # P: WRITEs posted, not yet reported done
        self._push_failed: set[str] = set()

    # ------------------------------------------------------------------ triggers
    @contextmanager
    def _triggered_by(self, trigger: Trigger) -> Iterator[None]:
        previous = getattr(self._trigger_local, "trigger", None)
        self._trigger_local.trigger = trigger
        try:
            yield
        finally:
            self._trigger_local.trigger = previous

    def _flavor_for(self, trigger: Trigger, requested_notif_only: bool) -> tuple[Direction, bool]:
        """Direction and flavor of a handshake from what started it."""
        if trigger in (Trigger.PUSH_REG, Trigger.HEARTBEAT):
            # D only ever sends notifications to P in push mode.
            return Direction.D_TO_P, True
        if trigger is Trigger.PUSH_WRITE:
            return Direction.P_TO_D, False
        if self._kv_role == "kv_consumer" or requested_notif_only:
            return Direction.D_TO_P, requested_notif_only
        return Direction.P_TO_D, requested_notif_only

    # --------------------------------------------------------- handshake control
    def _ensure_handshake(self, engine_id: str, host: str, port: int, tp_size: int,
                          *args: Any, **kwargs: Any) -> Future | None:
        """Start (or join) the handshake to `engine_id`; None when already usable."""
        tail = bind_handshake_tail(args, kwargs)
        trigger = getattr(self._trigger_local, "trigger", None) or Trigger.OTHER
        direction, notif_only = self._flavor_for(trigger, bool(tail.get("notif_agents_only", False)))
        self._evict_stale_engines()
        with self._handshake_lock:
            connected = engine_id in self._remote_agents
            if connected and (notif_only or engine_id not in self._notif_only_engines):
                return None
            pending = self._handshake_futures.get(engine_id)
            pending_notif_only = self._pending_notif_only.get(engine_id, True)
            if pending is not None and (notif_only or not pending_notif_only):
                self._note_joined_handshake(engine_id, pending_notif_only)
                return pending
            # What remains: no handshake yet, or a WRITE needs descriptors from a peer
            # reached (or being reached) notification-only. The one-thread executor
            # runs an upgrade after any queued notification-only handshake.
            upgrade = connected or pending is not None
            return self._submit_handshake(engine_id, host, port, tp_size, tail, direction, trigger,
                                          notif_only=notif_only and not upgrade, upgrade=upgrade)

    def _note_joined_handshake(self, engine_id: str, notif_only: bool) -> None:
        """Mark on the caller's span that it waits for a handshake someone else started.

        (vLLM dedups handshakes by engine id: a PUSH_REG often waits on the one a
        heartbeat started, which lives in its own trace.)
        """
        if not self._spans.enabled:
            return
        try:
            span = trace.get_current_span()
            if span.is_recording():
                span.add_event("nixl.handshake.joined", {Attr.REMOTE_ENGINE_ID: engine_id,
                                                          Attr.NOTIF_AGENTS_ONLY: notif_only})
        except Exception:
            logger.debug("span event dropped", exc_info=True)

    def _submit_handshake(self, engine_id: str, host: str, port: int, tp_size: int,
                          tail: dict[str, Any], direction: Direction, trigger: Trigger, *,
                          notif_only: bool, upgrade: bool) -> Future:
        """Queue one handshake on vLLM's one-thread executor (lock held by caller)."""
        record = HandshakeRecord(
            direction=direction, trigger=trigger, notif_only=notif_only,
            remote_engine_id=engine_id, host=host, port=int(port),
            remote_tp_size=int(tp_size), remote_pp_size=int(tail.get("pp_size", 1) or 1),
            local_tp_rank=self.tp_rank, local_engine_id=self.engine_id, upgrade=upgrade,
            parent_context=otel_context.get_current() if self._spans.enabled else None,
        )
        fut = self._handshake_initiation_executor.submit(
            self._run_handshake, record, int(tail.get("dcp_size", 1) or 1))
        self._handshake_futures[engine_id] = fut
        self._pending_notif_only[engine_id] = notif_only
        fut.add_done_callback(partial(self._on_handshake_done, record))
        return fut

    def _on_handshake_done(self, record: HandshakeRecord, fut: Future) -> None:
        eid = record.remote_engine_id
        with self._handshake_lock:
            if self._handshake_futures.get(eid) is fut:
                del self._handshake_futures[eid]
                self._pending_notif_only.pop(eid, None)
            try:
                remote_agents, clock_offset = fut.result()
            except Exception as exc:
                self._log_failure(failure_type="handshake_setup_failed", req_id=None,
                                  error=exc, remote_engine_id=eid)
                self.xfer_stats.record_failed_handshake()
            else:
                self._remote_agents[eid] = remote_agents
                if record.notif_only:
                    self._notif_only_engines.add(eid)
                else:
                    self._notif_only_engines.discard(eid)
                self._engine_clock_offset[eid] = clock_offset
                self._engine_last_active[eid] = time.perf_counter()
                track = getattr(self, "_track_remote_engine_replacement", None)
                if track is not None:
                    track(eid, record.host, record.port)
        self._publish_handshake(record)

    def _publish_handshake(self, record: HandshakeRecord) -> None:
        try:
            self.xfer_stats.record_handshake(record)
            self._spans.emit_handshake(record)
        except Exception:
            logger.debug("handshake telemetry dropped", exc_info=True)

    def _run_handshake(self, record: HandshakeRecord, remote_dcp_size: int) -> tuple[dict, float]:
        """Executor job: the handshake, with the record active on this thread."""
        started = time.time_ns()
        record.segments.append(PhaseSegment(Phase.QUEUE_WAIT, record.submitted_ns, started))
        ActiveRecord.set(record)
        if record.upgrade:
            self._remote_agents.hide_from_this_thread(record.remote_engine_id)
        try:
            result = self._observed_handshake(record, remote_dcp_size)
        except BaseException as exc:
            record.finish(exc)
            raise
        finally:
            ActiveRecord.set(None)
            self._remote_agents.hide_from_this_thread(None)
        record.finish()
        return result

    def _observed_handshake(self, record: HandshakeRecord,
                            remote_dcp_size: int) -> tuple[dict[tuple[int, int], str], float]:
        """vLLM's handshake sequence, in our words, one phase at a time."""
        if self._is_csa_linear:
            self._validate_csa_linear_tp_layout(record.remote_tp_size)
        if not self.use_host_buffer:
            # The executor thread needs the device context for UCX to use it.
            current_platform.set_device(self.device_id)
        assert self.transfer_topo is not None
        target_ranks = self.transfer_topo.handshake_target_ranks(record.remote_tp_size, remote_dcp_size)
        agents: dict[tuple[int, int], str] = {}
        best_rtt, best_offset = float("inf"), 0.0
        with SideChannelClient(record.host, record.port, self._handshake_timeout_ms) as channel:
            for pp_rank, tp_rank in itertools.product(range(record.remote_pp_size), target_ranks):
                record.set_rank(pp_rank, tp_rank)
                record.enter(Phase.METADATA_FETCH)
                reply = channel.fetch(pp_rank, tp_rank)
                if reply.rtt < best_rtt:
                    best_rtt, best_offset = reply.rtt, reply.clock_offset
                record.enter(Phase.METADATA_DECODE)
                meta = self._decode_and_check(reply.payload, record.remote_engine_id, channel.path)
                if record.notif_only:
                    self._count_saving(record, meta)
                    record.enter(Phase.AGENT_LOAD)
                    name = self._add_notif_only_remote_agent(meta, **accepted(
                        _BASE._add_notif_only_remote_agent, remote_tp_size=record.remote_tp_size,
                        remote_dcp_size=meta.dcp_size))
                else:
                    record.enter(Phase.TRANSFER_PLAN)
                    name = self.add_remote_agent(meta, **accepted(
                        _BASE.add_remote_agent, remote_tp_rank=tp_rank,
                        remote_tp_size=record.remote_tp_size, remote_dcp_size=meta.dcp_size))
                record.close_phase()
                agents[(pp_rank, tp_rank)] = name
        return agents, best_offset

    def _decode_and_check(self, payload_bytes: bytes, expected_engine_id: str,
                          path: str) -> NixlAgentMetadata:
        """Decode the payload and run vLLM's compatibility and identity checks."""
        try:
            payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(payload_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HandshakeError(
                ErrorType.DECODE_ERROR,
                f"Failed to decode NixlHandshakePayload from {path}: the peer runs an "
                f"incompatible connector version ({exc})",
            ) from exc
        assert self.compat_hash is not None
        if self.enforce_compat_hash and payload.compatibility_hash != self.compat_hash:
            raise HandshakeError(
                ErrorType.COMPAT_HASH_MISMATCH,
                f"NIXL compatibility hash mismatch with {path}: local {self.compat_hash}, "
                f"remote {payload.compatibility_hash}. Prefill and decode must run the same "
                "vLLM version, model, dtype, KV layout, attention backend and transfer mode "
                "(or set kv_connector_extra_config.enforce_handshake_compat=false).",
            )
        try:
            meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HandshakeError(ErrorType.DECODE_ERROR,
                                 f"Failed to decode NixlAgentMetadata from {path}: {exc}") from exc
        try:
            self._validate_remote_parallel_config(meta)
        except (ValueError, NotImplementedError, AssertionError, RuntimeError) as exc:
            raise HandshakeError(ErrorType.CONFIG_MISMATCH, str(exc)) from exc
        if meta.engine_id != expected_engine_id:
            raise HandshakeError(
                ErrorType.ENGINE_ID_MISMATCH,
                f"Remote NIXL agent engine id mismatch at {path}: expected "
                f"{expected_engine_id}, received {meta.engine_id}",
            )
        return meta

    def _count_saving(self, record: HandshakeRecord, meta: NixlAgentMetadata) -> None:
        try:
            # The ledger lives on the worker: local lists count once per worker, as in vLLM.
            ledger = self.__dict__.setdefault("_saving_ledger", LocalListLedger())
            saving = shape_aware_saving(
                meta, local_block_size=self.block_size, local_num_descs=self.num_descs,
                local_tp_size=self.world_size, remote_tp_size=record.remote_tp_size,
                remote_pp_size=record.remote_pp_size,
                registered_block_sizes=set(self.src_xfer_handles_by_block_size),
                registered_tp_splits=set(self.src_xfer_handles_by_tp_ratio),
                ledger=ledger, splits_local=not self.use_mla,
                local_regions=len(self.block_len_per_layer) if self.pp_size > 1 else None,
                local_region_offset=self._remote_region_offset,
            )
        except Exception:
            logger.debug("could not size the skipped descriptor work", exc_info=True)
            return
        record.saved_registrations += saving.registrations
        record.saved_descriptors += saving.descriptors

    # ------------------------------------------------- phase hooks inside vLLM
    @staticmethod
    def _enter_phase(phase: Phase) -> None:
        record = ActiveRecord.get()
        if record is not None:
            record.enter(phase)

    def add_remote_agent(self, nixl_agent_meta: NixlAgentMetadata, *args: Any, **kwargs: Any) -> str:
        self._enter_phase(Phase.TRANSFER_PLAN)
        return super().add_remote_agent(nixl_agent_meta, *args, **kwargs)

    def _validate_remote_agent_handshake(self, *args: Any, **kwargs: Any) -> Any:
        self._enter_phase(Phase.TRANSFER_PLAN)
        return super()._validate_remote_agent_handshake(*args, **kwargs)

    def register_local_xfer_handler(self, *args: Any, **kwargs: Any) -> Any:
        self._enter_phase(Phase.DESCRIPTOR_REGISTRATION)
        return super().register_local_xfer_handler(*args, **kwargs)

    def _build_local_splits_from_plan(self, *args: Any, **kwargs: Any) -> Any:
        self._enter_phase(Phase.DESCRIPTOR_REGISTRATION)
        return super()._build_local_splits_from_plan(*args, **kwargs)

    def _build_fa_remote(self, *args: Any, **kwargs: Any) -> Any:
        self._enter_phase(Phase.DESCRIPTOR_REGISTRATION)
        return super()._build_fa_remote(*args, **kwargs)

    def _build_mamba_remote(self, *args: Any, **kwargs: Any) -> Any:
        self._enter_phase(Phase.DESCRIPTOR_REGISTRATION)
        return super()._build_mamba_remote(*args, **kwargs)

    def _cleanup_remote_engine(self, engine_id: str, *args: Any, **kwargs: Any) -> None:
        super()._cleanup_remote_engine(engine_id, *args, **kwargs)
        with self._handshake_lock:
            self._notif_only_engines.discard(engine_id)

    # ------------------------------------------------------------ D-side flow
    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        if self._spans.enabled and metadata.push_registrations:
            for req_id, reg in metadata.push_registrations.items():
                self._receive_spans.put(req_id, self._spans.start(
                    SPAN_PUSH_RECEIVE, parent=None, kind=SpanKind.CONSUMER,
                    attributes={Attr.REQUEST_ID: req_id,
                                Attr.LOCAL_ENGINE_ID: self.engine_id,
                                Attr.REMOTE_ENGINE_ID: str(reg.get("remote_engine_id", "")),
                                Attr.NUM_BLOCKS: _count_blocks(reg.get("local_block_ids"))}))
        super().start_load_kv(metadata)

    def _send_heartbeats(self, metadata: NixlConnectorMetadata) -> None:
        with self._triggered_by(Trigger.HEARTBEAT):
            super()._send_heartbeats(metadata)

    def _send_registration_to_p(self, req_id: str, reg_data: dict[str, Any]) -> None:
        span = None
        if self._spans.enabled:
            span = self._register_spans.get(req_id)
            if span is None:
                span = self._spans.start(
                    SPAN_PUSH_REGISTER, parent=self._receive_spans.get(req_id),
                    kind=SpanKind.PRODUCER,
                    attributes={Attr.REQUEST_ID: req_id,
                                Attr.REMOTE_ENGINE_ID: str(reg_data.get("remote_engine_id", "")),
                                Attr.SERVER_ADDRESS: str(reg_data.get("remote_host", "")),
                                Attr.SERVER_PORT: int(reg_data.get("remote_port", 0) or 0)})
                self._register_spans.put(req_id, span)
            if PUSH_REG_TRACE_KEY not in reg_data:
                carrier = inject_context(span)
                if carrier:
                    reg_data = {**reg_data, PUSH_REG_TRACE_KEY: carrier}
        with activated(span), self._triggered_by(Trigger.PUSH_REG):
            super()._send_registration_to_p(req_id, reg_data)

    def _do_send_reg_notif(self, req_id: str, reg_data: dict[str, Any]) -> None:
        with self._handshake_lock:
            num_agents = len(self._remote_agents.get(reg_data.get("remote_engine_id")) or {})
        self._trigger_local.reg_failures = 0
        super()._do_send_reg_notif(req_id, reg_data)
        failed = self._trigger_local.reg_failures if num_agents else 1
        try:
            for _ in range(num_agents - failed if num_agents else 0):
                self.xfer_stats.record_push_reg_notif(sent=True)
            if not num_agents:
                self.xfer_stats.record_push_reg_notif(sent=False)
            span = self._register_spans.pop(req_id)
            if failed >= max(num_agents, 1):
                SpanEmitter.end(span, error_type="push_reg_notif_failed",
                                message=f"PUSH_REG reached none of {num_agents} agents")
            else:
                SpanEmitter.end(span)
        except Exception:
            logger.debug("PUSH_REG telemetry dropped", exc_info=True)

    # ------------------------------------------------------------ P-side flow
    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        span = None
        if self._spans.enabled:
            span = self._write_spans.get(request_id)
            if span is None:
                span = self._spans.start(
                    SPAN_PUSH_WRITE,
                    parent=extract_context(registration_data.get(PUSH_REG_TRACE_KEY)),
                    kind=SpanKind.CONSUMER,
                    attributes={Attr.REQUEST_ID: request_id,
                                Attr.REMOTE_REQUEST_ID: str(registration_data.get("request_id", "")),
                                Attr.REMOTE_ENGINE_ID: str(registration_data.get("decode_engine_id", "")),
                                Attr.LOCAL_ENGINE_ID: self.engine_id,
                                Attr.NUM_BLOCKS: _count_blocks(local_block_ids)})
                self._write_spans.put(request_id, span)
        with activated(span), self._triggered_by(Trigger.PUSH_WRITE):
            super()._do_start_push_kv(request_id, local_block_ids, registration_data)

    def _xfer_blocks_for_req(self, req_id: str, meta: ReqMeta) -> None:
        try:
            super()._xfer_blocks_for_req(req_id, meta)
        except Exception:
            self._mark_push_failed(req_id, "transfer_setup_failed", "WRITE could not be planned")
            raise

    def _xfer_blocks(self, *args: Any, **kwargs: Any) -> int | None:
        handle = super()._xfer_blocks(*args, **kwargs)
        # Count here, before the caller publishes the handle: once published, the
        # main thread may see the WRITE done at any moment.
        if handle is not None:
            req_id = kwargs["request_id"] if "request_id" in kwargs else args[2]
            with self._push_lock:
                first = req_id not in self._pushing
                self._pushing.add(req_id)
            if first:
                self.xfer_stats.record_push(StatKey.PUSHES_STARTED)
        return handle

    def _mark_push_failed(self, req_id: str, failure_type: str, message: str) -> None:
        with self._push_lock:
            first = req_id not in self._push_failed
            self._push_failed.add(req_id)
            if len(self._push_failed) > _MAX_TRACKED_REQUESTS:
                self._push_failed.pop()
        if first:
            self.xfer_stats.record_push(StatKey.PUSHES_FAILED)
        SpanEmitter.end(self._write_spans.pop(req_id), error_type=failure_type, message=message)

    # --------------------------------------------------------------- both sides
    def _log_failure(self, failure_type: str, req_id: str | None, msg: str = "",
                     error: BaseException | None = None, meta: ReqMeta | None = None,
                     **extra_context: Any) -> None:
        super()._log_failure(failure_type, req_id, msg, error, meta, **extra_context)
        try:
            self._account_failure(failure_type, req_id, error or msg)
        except Exception:
            logger.debug("failure telemetry dropped", exc_info=True)

    def _account_failure(self, failure_type: str, req_id: str | None, why: Any) -> None:
        if failure_type == "push_reg_notif_failed":
            self._trigger_local.reg_failures = getattr(self._trigger_local, "reg_failures", 0) + 1
            self.xfer_stats.record_push_reg_notif(sent=False)
            return
        if req_id is None:
            return
        if failure_type in _PUSH_FAILURES and self._kv_role != "kv_consumer":
            self._mark_push_failed(req_id, failure_type, str(why))
        elif failure_type in _RECEIVE_FAILURES:
            SpanEmitter.end(self._register_spans.pop(req_id), error_type=failure_type, message=str(why))
            SpanEmitter.end(self._receive_spans.pop(req_id), error_type=failure_type, message=str(why))

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = super().get_transfer_results()
        try:
            self._account_results(results)
        except Exception:
            logger.debug("transfer-result telemetry dropped", exc_info=True)
        return results

    def _account_results(self, results: KVConnectorTransferResults) -> None:
        for req_id in results.finished_sending:
            with self._push_lock:
                pushed = req_id in self._pushing
                failed = req_id in self._push_failed
                self._pushing.discard(req_id)
                self._push_failed.discard(req_id)
            span = self._write_spans.pop(req_id)
            if pushed and not failed:
                self.xfer_stats.record_push(StatKey.PUSHES_COMPLETED)
                SpanEmitter.end(span)
            elif span is not None:
                SpanEmitter.end(span, error_type="lease_expired",
                                message="KV lease ended before the WRITE completed")
        for req_id in results.finished_recving:
            SpanEmitter.end(self._register_spans.pop(req_id))
            span = self._receive_spans.pop(req_id)
            if req_id in results.failed_recving:
                SpanEmitter.end(span, error_type="receive_failed", message="KV receive failed")
            else:
                SpanEmitter.end(span)


def _count_blocks(block_ids: Any) -> int:
    """Blocks in a flat or per-group block id list (for a span attribute)."""
    if not block_ids:
        return 0
    first = block_ids[0]
    if isinstance(first, list | tuple):
        return sum(len(group) for group in block_ids)
    return len(block_ids)
