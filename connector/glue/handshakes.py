"""Handshake control: which flavor a handshake gets, and the handshake itself, observed.

- `_ensure_handshake` (re-implemented in our words; no seam for flavor or timing):
  every handshake a D starts (PUSH_REG or heartbeat) is notification-only, P->D
  handshakes before a WRITE are full, and a notification-only connection is
  upgraded to a full one when a WRITE needs it (kv_both).
- `_observed_handshake` (our words for vLLM's `_nixl_handshake`): the same
  side-channel exchange and checks, cut into the vocabulary's phases.
- Handshakes to different remote engines run at once on a pool of our own
  (`handshake_concurrency` threads), not on vLLM's one-thread executor, where the
  M-th of M new producers waited for all the others. One remote engine still gets
  one handshake at a time (an upgrade runs after the notification-only one it
  follows). The side-channel exchange and decoding run in parallel; every NIXL and
  vLLM registration call (agent load, transfer plan, descriptor lists) runs one
  handshake at a time under `_registration_lock`, because vLLM builds its NIXL
  agent without thread synchronisation (`NIXL_THREAD_SYNC_NONE`); time spent waiting
  for it is its own phase, `registration_wait`.
- Thin overrides of the methods vLLM's full `add_remote_agent` calls mark where one
  phase ends and the next begins; the business logic stays vLLM's.
The handshake thread fills a plain record; spans and stats are built from it when
the handshake is over.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec
from opentelemetry import context as otel_context
from opentelemetry import trace
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
    NixlBaseConnectorWorker as _BASE,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlAgentMetadata,
    NixlHandshakePayload,
)
from vllm.platforms import current_platform

from connector import settings
from connector.glue.compat import accepted, bind_handshake_tail
from connector.glue.flow import Flow
from connector.glue.side_channel import SideChannelClient
from connector.state.connections import Pending
from connector.telemetry import errors
from connector.telemetry.record import (
    ActiveRecord,
    HandshakeError,
    HandshakeRecord,
    PhaseSegment,
)
from connector.telemetry.savings import LocalLayout, LocalListLedger, shape_aware_saving
from connector.telemetry.tracing import peer_str
from connector.trust.secret import load_secret
from connector.vocabulary import (
    Attr,
    Direction,
    ErrorType,
    InternalStep,
    Phase,
    SpanEvent,
    TelemetryError,
    Trigger,
)

logger = logging.getLogger(__name__)



@dataclass
class _HandshakeJob:
    """One logical handshake: what every attempt of it needs. Its future (every caller
    waits on it), flavor and upgrade flag are the connection table's `Pending`."""

    pending: Pending
    engine_id: str
    host: str
    port: int
    tp_size: int
    tail: dict[str, Any]
    direction: Direction
    trigger: Trigger
    parent_context: Any
    deadline: float
    attempt: int = 0


# Triggers that decide a handshake's direction and flavor whatever the caller asked:
# D only ever sends notifications to P in push mode; P writes into D's blocks, so it
# needs D's descriptors.
_FLAVOR_BY_TRIGGER: dict[Trigger, tuple[Direction, bool]] = {
    Trigger.PUSH_REG: (Direction.D_TO_P, True),
    Trigger.HEARTBEAT: (Direction.D_TO_P, True),
    Trigger.PUSH_WRITE: (Direction.P_TO_D, False),
    Trigger.PUSH_REG_EARLY: (Direction.P_TO_D, False),
}


class HandshakeFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: handshake flavor, dedup, upgrade and phases."""

    def _init_handshakes(self) -> None:
        extra = self.kv_transfer_config.get_from_extra_config
        self._handshake_timeout_ms = int(settings.read(extra, settings.HANDSHAKE_TIMEOUT_MS))
        # The deployment's secret (connector/trust), or None: vLLM's unauthenticated exchange.
        self._peer_secret = load_secret(extra)
        concurrency = int(settings.read(extra, settings.HANDSHAKE_CONCURRENCY))
        if concurrency < 1:
            raise ValueError(f"handshake_concurrency must be >= 1, got {concurrency}")
        self._handshake_pool = ThreadPoolExecutor(concurrency, thread_name_prefix="nixl-handshake")
        # (Re-entrant: a peer drop holds it across vLLM's cleanup, which takes it too.)
        self._registration_lock = threading.RLock()

    def shutdown(self) -> None:
        pool = getattr(self, "_handshake_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        super().shutdown()

    # --------------------------------------------------------- handshake control
    def _ensure_handshake(self, engine_id: str, host: str, port: int, tp_size: int,
                          *args: Any, **kwargs: Any) -> Future | None:
        """vLLM's entry point, for a caller of vLLM's own (the fork's callers use
        `_connect`, which says what the handshake is for): a notification-only request
        is a D->P one, anything else P->D."""
        tail = bind_handshake_tail(args, kwargs)
        return self._connect(Trigger.OTHER, None, engine_id, host, port, tp_size, tail)

    def _connect(self, trigger: Trigger, parent: Any, engine_id: str, host: str, port: int,
                 tp_size: int, tail: dict[str, Any] | None = None) -> Future | None:
        """A connection to `engine_id` for what `trigger` needs: None when the one there
        is serves, else the future of the handshake that makes it (joined, or started
        here on the handshake pool, its spans parented on `parent`)."""
        flavor = _FLAVOR_BY_TRIGGER.get(trigger)
        if flavor is None:
            flavor = self._flavor_for(trigger, bool(tail and tail.get("notif_agents_only", False)))
        direction, notif_only = flavor
        decision = self._connections.ensure(engine_id, notif_only=notif_only,
                                            for_write=trigger is Trigger.PUSH_WRITE)
        if decision.future is None:
            return None
        if decision.pending is None:  # (joined the handshake under way)
            if parent is not None and self._spans.enabled:
                self._note_joined_handshake(parent, engine_id, decision.joined_notif_only)
            return decision.future
        job = _HandshakeJob(
            pending=decision.pending, engine_id=engine_id, host=host, port=int(port),
            tp_size=int(tp_size), tail=dict(tail or {}), direction=direction, trigger=trigger,
            parent_context=self._parent_context(parent) if self._spans.enabled else None,
            deadline=time.monotonic() + self._retry_policy.budget_s)
        self._start_attempt(job)
        return decision.future

    @staticmethod
    def _parent_context(parent: Any) -> Any:
        """The OTel context a handshake starting now is parented on: `parent`'s span,
        else the thread's current context."""
        if parent is None:
            return otel_context.get_current()
        return trace.set_span_in_context(parent)

    def _flavor_for(self, trigger: Trigger, requested_notif_only: bool) -> tuple[Direction, bool]:
        """Direction and flavor of a handshake from what started it."""
        flavor = _FLAVOR_BY_TRIGGER.get(trigger)
        if flavor is not None:
            return flavor
        if self._kv_role == "kv_consumer" or requested_notif_only:
            return Direction.D_TO_P, requested_notif_only
        return Direction.P_TO_D, requested_notif_only

    def _note_joined_handshake(self, parent: Any, engine_id: str, notif_only: bool) -> None:
        """Mark on the caller's span that it waits for a handshake someone else started.

        (One handshake per engine: a PUSH_REG often waits on the one a heartbeat
        started, which lives in its own trace.)
        """
        try:
            if parent.is_recording():
                parent.add_event(SpanEvent.HANDSHAKE_JOINED, {Attr.REMOTE_ENGINE_ID: engine_id,
                                                            Attr.NOTIF_AGENTS_ONLY: notif_only})
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)

    def _start_attempt(self, job: _HandshakeJob) -> None:
        """An attempt of `job` (the first, or a retry from its timer thread): it runs
        now unless another handshake to the same engine runs (then after it)."""
        job.attempt += 1
        pending = job.pending
        record = HandshakeRecord(
            direction=job.direction, trigger=job.trigger, notif_only=pending.notif_only,
            remote_engine_id=job.engine_id, host=job.host, port=job.port,
            remote_tp_size=job.tp_size, remote_pp_size=int(job.tail.get("pp_size", 1) or 1),
            local_tp_rank=self.tp_rank, local_engine_id=self.engine_id, upgrade=pending.upgrade,
            parent_context=job.parent_context, attempt=job.attempt, after_reset=pending.after_reset,
        )
        self._in_flight.add(record)
        if self._connections.attempt_begins(job.engine_id, (job, record)):
            self._submit_attempt(job, record)

    def _submit_attempt(self, job: _HandshakeJob, record: HandshakeRecord) -> None:
        try:
            inner = self._handshake_pool.submit(self._run_handshake, record,
                                                int(job.tail.get("dcp_size", 1) or 1))
        except RuntimeError as exc:  # pool shut down (engine stopping)
            record.finish(exc)
            self._in_flight.discard(record)
            self._finish_job(job, record, None, exc)
            self._next_attempt(job.engine_id)
            return
        inner.add_done_callback(partial(self._on_attempt_done, job, record))

    def _next_attempt(self, engine_id: str) -> None:
        """The engine's handshake attempt is over: start the one waiting behind it."""
        waiting = self._connections.attempt_over(engine_id)
        if waiting is not None:
            self._submit_attempt(*waiting)

    def _on_attempt_done(self, job: _HandshakeJob, record: HandshakeRecord, inner: Future) -> None:
        try:
            self._attempt_done(job, record, inner)
        finally:
            # After the connection state is updated: an upgrade waiting behind a
            # notification-only handshake must find it in place.
            self._next_attempt(job.engine_id)

    def _attempt_done(self, job: _HandshakeJob, record: HandshakeRecord, inner: Future) -> None:
        self._in_flight.discard(record)
        exc = inner.exception()
        if exc is not None:
            # An early P->D handshake is an optimisation started by whatever a peer wrote in
            # its PUSH_REG: it is not retried on its own, so unreachable decoders named in
            # PUSH_REGs cannot pile retries on the executor. Once a WRITE has joined it, a
            # request waits on it, and it is retried like the WRITE's own would be (else
            # the early start would cost that request its retries).
            delay = (None if job.trigger is Trigger.PUSH_REG_EARLY and not job.pending.write_waits
                     else self._retry_policy.delay(job.attempt, record.error_type, job.deadline))
            if delay is not None:
                logger.warning(
                    "NIXL handshake to %s (%s:%s, %s) failed transiently (%s); retry %d in %.2f s",
                    peer_str(job.engine_id), peer_str(job.host), job.port, job.direction.value,
                    record.error_type.value if record.error_type else "error", job.attempt, delay)
                # An attempt, not a handshake: the handshake is counted once, with its
                # final outcome (`_finish_job`); this one's spans and phase failure stay.
                record.retried = True
                self._publish_handshake(record)
                self._safe_stats(self.xfer_stats.record_retry, job.direction.value)
                # (A timer thread of its own starts the retry: `nixl-handshake-retry`.)
                timer = threading.Timer(delay, self._start_attempt, args=(job,))
                timer.name = "nixl-handshake-retry"
                timer.daemon = True
                timer.start()
                return
        self._finish_job(job, record, None if exc is not None else inner.result(), exc)

    def _finish_job(self, job: _HandshakeJob, record: HandshakeRecord, result: Any,
                    exc: BaseException | None) -> None:
        """The connection table learns the outcome (and the peer's restart, whose
        receives fail now); the work parked for a new connection goes again; then
        everyone waiting on the handshake is released."""
        eid = job.engine_id
        if exc is not None:
            self._connections.connect_failed(eid, job.pending)
            self._log_failure(failure_type="handshake_setup_failed", req_id=None,
                              error=exc, remote_engine_id=peer_str(eid))
            self.xfer_stats.record_failed_handshake()
        else:
            ranks, clock_offset = result
            outcome = self._connections.connected(eid, job.pending, ranks, clock_offset,
                                                  time.perf_counter())
            if outcome.restarted:
                record.peer_restarted = True
                try:
                    self._peer_restarted(eid, outcome.old_agents)
                except Exception:
                    self._internal_error(InternalStep.PEER_RESTART,
                                         f"failing the receives of restarted engine {peer_str(eid)} "
                                         "(they are given up)")
                    self._peer_restart_failsafe(eid)
            self._release_parked(outcome.parked)
        self._publish_handshake(record)
        # Last: the callbacks on this future (vLLM's and ours) use the connection.
        if exc is not None:
            job.pending.future.set_exception(exc)
        else:
            job.pending.future.set_result(result)

    def _publish_handshake(self, record: HandshakeRecord) -> None:
        try:
            # Spans first (never raises): the stats record carries their ids (exemplars).
            self._spans.emit_handshake(record)
            self.xfer_stats.record_handshake(record)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    def _safe_stats(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

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
        with SideChannelClient(record.host, record.port, self._handshake_timeout_ms,
                               secret=self._peer_secret) as channel:
            for pp_rank, tp_rank in itertools.product(range(record.remote_pp_size), target_ranks):
                record.set_rank(pp_rank, tp_rank)
                record.enter(Phase.METADATA_FETCH)
                reply = channel.fetch(pp_rank, tp_rank)
                record.authenticated = reply.authenticated
                if reply.rtt < best_rtt:
                    best_rtt, best_offset = reply.rtt, reply.clock_offset
                record.enter(Phase.METADATA_DECODE)
                meta = self._decode_and_check(reply.payload, record.remote_engine_id, channel.path)
                with self._registering(record):
                    self._release_kept_transfer_info(record.remote_engine_id)
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

    @contextmanager
    def _registering(self, record: HandshakeRecord) -> Iterator[None]:
        """One handshake at a time past this point (NIXL and vLLM's tables); waiting
        for the others is the `registration_wait` phase (only when there was a wait)."""
        lock = self._registration_lock
        if not lock.acquire(blocking=False):
            record.enter(Phase.REGISTRATION_WAIT)
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

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
                meta, LocalLayout.of_worker(self), local_tp_size=self.world_size,
                remote_tp_size=record.remote_tp_size, remote_pp_size=record.remote_pp_size,
                registered_block_sizes=set(self.src_xfer_handles_by_block_size),
                registered_tp_splits=set(self.src_xfer_handles_by_tp_ratio),
                ledger=ledger, splits_local=not self.use_mla)
        except Exception as exc:
            errors.note(TelemetryError.SAVINGS, exc)
            return
        record.saved_registrations += saving.registrations
        record.saved_descriptors += saving.descriptors
        if saving.none_because and not record.nothing_saved_because:
            record.nothing_saved_because = saving.none_because
            logger.info("notification-only handshake to %s saves no descriptors (%s): a full one "
                        "would prepare none either", peer_str(record.remote_engine_id),
                        saving.none_because)

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
