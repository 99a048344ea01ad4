"""The fork's push worker: vLLM's `NixlPushConnectorWorker`, observed and fixed.

The class is vLLM's worker plus one mixin per flow (see connector/glue/flow.py, the
interface between them). This module holds the push state's owners and the telemetry
the flows share, the per-step entry points vLLM calls on the engine's main thread
(`start_load_kv`, `get_transfer_results`, `get_kv_connector_stats`: one call each per
step, handing work to the flows only when there is some), the notification router on
vLLM's writer thread, and vLLM's failure log.
In every method the data path comes first and in the open; telemetry follows, each
piece catching and counting its own faults (it never raises into the push flow and
never blocks the writer). A data-path step that raises never hides as a lost metric:
it fails its request through the failure path (`_log_failure`), logged at ERROR.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import logger as vllm_logger
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector import settings
from connector.glue.compat import RemoteAgentTable
from connector.glue.cpu_affinity import EXTRA_CONFIG_KEY as AFFINITY_KEY
from connector.glue.guard import check_worker
from connector.glue.handshakes import HandshakeFlow
from connector.glue.host_settings import HostSettings
from connector.glue.integrity import IntegrityFlow
from connector.glue.leases import LeaseFlow
from connector.glue.nixl_progress import EXTRA_CONFIG_KEY as PROGRESS_DELAY_KEY
from connector.glue.notifications import NotifAuth, NotificationRouter, Owners
from connector.glue.peers import PeerFlow
from connector.glue.push import PushFlow
from connector.glue.receive import ReceiveFlow
from connector.glue.retry import RetryPolicy
from connector.glue.wire import prompt_digest
from connector.state.connections import ConnectionTable
from connector.state.leases import LeaseLedger
from connector.state.receives import ReceiveLedger
from connector.telemetry import errors
from connector.telemetry.handshake_calls import HandshakeCallObserver
from connector.telemetry.in_flight import InFlight
from connector.telemetry.receives import ReceiveClock
from connector.telemetry.span_table import SpanTable
from connector.telemetry.stats import ObservedNixlStats
from connector.telemetry.tracing import SpanEmitter, resolve_tracer, span_ids
from connector.trust import refusals
from connector.vocabulary import (
    METADATA_GIVEN_UP_ATTR,
    METADATA_TRACE_ATTR,
    Attr,
    InternalStep,
    PeerReset,
    ReceiveAbandon,
    ReceiveFailure,
    ReceiveOutcome,
    TelemetryError,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

# vLLM failure types (the `failure_type` of `_log_failure`) that end a P-side push.
AGENT_NAMED_EVERY_S = 60.0
_PUSH_FAILURES = frozenset(
    {"push_handshake_failed", "transfer_setup_failed", "transfer_failed", "transfer_exception"}
)
__all__ = ["ObservedPushWorker", "prompt_digest"]
# (Plain strings: an enum's `.value` is a Python-level property, read per request.)
_SUCCESS, _FAILURE, _EXPIRED = (o.value for o in (ReceiveOutcome.SUCCESS, ReceiveOutcome.FAILURE,
                                                  ReceiveOutcome.EXPIRED))


class ObservedPushWorker(HandshakeFlow, ReceiveFlow, PushFlow, LeaseFlow, PeerFlow, IntegrityFlow,
                         NixlPushConnectorWorker):
    """See module docstring."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig):
        # vLLM builds its NIXL agent in here (with the poll delay asked for, if any) and,
        # on the CPU platform, pins this thread to a core (kept inside the engine's own).
        kv = getattr(vllm_config, "kv_transfer_config", None)  # (read before vLLM's checks run)
        host = HostSettings.from_extra_config(
            kv.get_from_extra_config if kv is not None else lambda _key, default=None: default)
        with host.applied() as (delayed, affinity):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        # (vLLM's NIXL logger: these lines show in `vllm serve` logs beside its own.)
        if delayed:
            vllm_logger.info("NIXL progress thread polls every %d us (%s)", host.progress_delay_us,
                             PROGRESS_DELAY_KEY)
        if affinity.kept:
            vllm_logger.info("Kept the NIXL worker on CPUs %s: vLLM pinned it to CPUs %s, outside "
                             "them (%s=contain)", sorted(affinity.before or ()),
                             sorted(affinity.pinned or ()), AFFINITY_KEY)
        check_worker(self)  # the vLLM surface we rely on (connector/glue/guard.py)
        extra = self.kv_transfer_config.get_from_extra_config
        self._init_handshakes()
        self._kv_role = self.kv_transfer_config.kv_role
        self._hb_handshake_notif_only = True
        # vLLM's map of remote agents, able to hide one engine from the thread upgrading
        # it (compat.py); written by the connection table only.
        self._remote_agents = RemoteAgentTable(self._remote_agents)
        obs = getattr(vllm_config, "observability_config", None)
        self._init_state(extra, resolve_tracer(getattr(obs, "otlp_traces_endpoint", None)))
        self._retry_policy = RetryPolicy.from_extra_config(extra)
        self._init_push(extra)
        self._init_integrity(extra)
        self._init_leases()
        self._init_peers(extra)
        self._start_idle_poll()
        # vLLM's writer reads NIXL notifications through this (connector/glue/notifications.py);
        # handshakes' NIXL calls are measured below it (telemetry/handshake_calls.py).
        auth = NotifAuth(self._peer_secret, str(engine_id).encode()) if self._peer_secret else None
        self.nixl_wrapper = NotificationRouter(HandshakeCallObserver(self.nixl_wrapper), Owners(
            contact=self._connections.heard_from, heartbeat=self._renew_from,
            push_fail=self._push_fail_from, push_fail_lost=self._push_fail_lost,
            kv_digest=self._kv_digest_from if self._kv_role != "kv_producer" else None,
            completion=self._write_landed_from if self._kv_role != "kv_producer" else None,
            after_pass=self._writer_due_work if self._kv_role != "kv_consumer" else _nothing,
            fault=self._internal_error), auth=auth)

    @classmethod
    def without_engine(cls, kv_role: str, *, extra: dict[str, Any] | None = None, tracer: Any = None,
                       engine_id: str = "engine-0", lease_extension: int = 20,
                       handshake_pool: Any = None) -> ObservedPushWorker:
        """A worker with the fork's state and no vLLM engine, NIXL agent or threads: the
        declared seam for unit tests and benchmarks of the flows (benchmarks/telemetry_cost.py).
        It holds what vLLM's constructor would set that the flows' state needs (the
        remote-engine maps and their lock, the lease extension), and nothing else of vLLM's."""
        get = (extra or {}).get
        worker = object.__new__(cls)
        worker._kv_role, worker.engine_id, worker.tp_rank = kv_role, engine_id, 0
        worker._lease_extension = lease_extension  # (vLLM's: two thirds of the lease)
        worker._handshake_lock = threading.RLock()
        worker._remote_agents = RemoteAgentTable()
        worker._handshake_futures, worker._engine_clock_offset, worker._engine_last_active = {}, {}, {}
        worker._failed_recv_reqs = queue.Queue()  # (vLLM's: the receives failed for its next step)
        worker._handshake_pool = handshake_pool
        worker._peer_secret = None
        worker._retry_policy = RetryPolicy.from_extra_config(lambda key, default=None: get(key, default))
        worker._init_state(lambda key, default=None: get(key, default), tracer)
        worker._init_push(lambda key, default=None: get(key, default))
        worker._init_integrity(lambda key, default=None: get(key, default))
        worker._init_leases()
        worker._init_peers(lambda key, default=None: get(key, default))
        return worker

    def _init_state(self, extra: Any, tracer: Any) -> None:
        """The push state's owners and the per-request telemetry the flows keep: all the
        worker holds beyond vLLM's own (a worker built without vLLM's engine, as
        benchmarks/telemetry_cost.py does, gets plain maps for vLLM's). Needs vLLM's
        `_lease_extension`."""
        self.xfer_stats = ObservedNixlStats()
        # The push state's owners (connector/state; docs/architecture.md "Push state").
        lease_s = settings.lease_s(extra)
        write_timeout_s = float(settings.read(extra, settings.PUSH_WRITE_TIMEOUT_S))
        margin_s = float(settings.read(extra, settings.PUSH_LEASE_MARGIN_S))
        registration_timeout_s = settings.registration_timeout_s(extra)
        self._leases = LeaseLedger(lease_s=lease_s, extension_s=float(self._lease_extension),
                                   write_timeout_s=write_timeout_s, margin_s=margin_s,
                                   base_of=get_base_request_id)
        self._receives = ReceiveLedger(hold_s=settings.hold_bound_s(lease_s, write_timeout_s, margin_s),
                                       timeout_s=registration_timeout_s)
        # The remote engines: vLLM's lock and maps of them are the table's (see there).
        self._connections = ConnectionTable(
            forget_after_s=float(settings.read(extra, settings.PEER_FORGET_AFTER_S)),
            lock=getattr(self, "_handshake_lock", None),
            remote_agents=getattr(self, "_remote_agents", None),
            futures=getattr(self, "_handshake_futures", None),
            clock_offsets=getattr(self, "_engine_clock_offset", None),
            last_active=getattr(self, "_engine_last_active", None))
        self._spans = SpanEmitter(tracer)
        self._receive_spans = SpanTable()  # D: registration until KV landed
        self._register_spans = SpanTable()  # D: registration until PUSH_REG sent
        self._write_spans = SpanTable()  # P: PUSH_REG matched until WRITE done
        # P: request id -> the W3C context P's own request arrived with (span link).
        self._request_contexts = SpanTable(spans=False)
        # D: registration handed over until KV landed, failed or expired (histogram), and
        # the request's arrival (its whole wait for KV).
        self._receive_clock = ReceiveClock(registration_timeout_s)
        self._in_flight = InFlight()
        # This worker's NIXL agent, named to the API server for the join of NIXL's own
        # exporter (vLLM names the agent with a random UUID; the harness has none).
        self._agent_name: str | None = getattr(getattr(self, "nixl_wrapper", None), "name", None)
        self._agent_named_at: float | None = None

    # -------------------------------------------------- declared seams (tools)
    # What the harness, benchmarks and tests use of a running worker beyond vLLM's own
    # interface and what `Flow` declares (tests/test_seams.py holds them to it).
    def observed_state(self) -> dict[str, Any]:
        """What the push state's owners hold (counts), and the per-request telemetry
        tables' sizes."""
        tables = {"write_spans": self._write_spans, "receive_spans": self._receive_spans,
                  "register_spans": self._register_spans, "request_contexts": self._request_contexts,
                  "receive_clock": self._receive_clock, "in_flight": self._in_flight,
                  "write_deferred_at": getattr(self, "_write_deferred_at", {})}
        return {"leases": self._leases.snapshot(), "receives": self._receives.snapshot(),
                "connections": self._connections.snapshot(),
                "telemetry_tables": {name: len(table) for name, table in tables.items()}}

    def observed_connect(self, trigger: Any, engine_id: str, host: str, port: int, tp_size: int,
                         **tail: Any) -> Any:
        """A connection for `trigger` (a `Trigger`), as the flows ask for one."""
        return self._connect(trigger, None, engine_id, host, port, tp_size, tail)

    def observed_suspect(self, engine_id: str) -> None:
        """Mark the connection to `engine_id` failed, as a failed notification does."""
        self._connections.failed(engine_id, PeerReset.NOTIFICATION_FAILED)

    def observed_interpose(self, factory: Any) -> Any:
        """Put `factory(agent)` below the fork's wrappers of the NIXL agent (a fault
        layer: the router then routes what it delivers); returns it."""
        return self.nixl_wrapper.interpose(factory)

    @property
    def observed_tracer(self) -> Any:
        """The tracer the worker's spans come from (None: tracing off)."""
        return self._spans.tracer if self._spans.enabled else None

    # ------------------------------------------------------------- every step
    # vLLM calls these on the engine's main thread every step, mostly with nothing
    # for us to do: each idle step costs attribute tests, not calls into the flows.
    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        """Before vLLM's step: D starts (and traces) the receives handed over and gives
        up those whose client went away; P grants the step's leases in the ledger (the
        writer may see their blocks the moment vLLM queues them). Then vLLM's step (its
        heartbeats are ours: LeaseFlow); then P takes vLLM's exact lease deadlines."""
        if getattr(self, "pcp_rank", 0) > 0 and not getattr(self, "pcp_dcp_sharded", False):
            return super().start_load_kv(metadata)  # (vLLM skips the whole step on these ranks)
        if metadata.push_registrations:
            self._start_receives(metadata.push_registrations)
            self._note_verify_wanted(metadata.push_registrations)
        given_up = getattr(metadata, METADATA_GIVEN_UP_ATTR, None)
        if given_up:
            for req_id in given_up:
                self._give_up_receive(req_id, ReceiveAbandon.CLIENT_GONE)
        granted = (self._grant_ahead(metadata)
                   if metadata.reqs_to_send or metadata.reqs_in_batch or metadata.reqs_not_processed
                   else None)
        if self._spans.enabled and getattr(metadata, METADATA_TRACE_ATTR, None):
            self._keep_request_contexts(metadata)
        super().start_load_kv(metadata)  # (it sends the heartbeats last: `_send_heartbeats`)
        if granted:
            self._note_leases_granted(granted)
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """vLLM's per-step stats, plus the in-flight handshakes, the leases held and
        telemetry faults."""
        if self._in_flight.to_report or errors.pending or len(self._leases) or \
                self._leases_report_owed or refusals.pending:
            try:
                snapshot = self._in_flight.snapshot()
                if snapshot is not None:
                    self.xfer_stats.set_in_flight(snapshot)
                if len(self._leases) or self._leases_report_owed:
                    self._report_leases()
                lost = errors.drain()
                if lost:
                    self.xfer_stats.record_telemetry_errors(lost)
                refused = refusals.drain()
                if refused:
                    self.xfer_stats.record_auth_refusals(refused)
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)
        if self._agent_name is not None and not self.xfer_stats.is_empty():
            self._name_agent()
        return super().get_kv_connector_stats()

    def _name_agent(self) -> None:
        """On an interval that ships anyway: this worker's NIXL agent, the first time and
        then once every AGENT_NAMED_EVERY_S (an API server that missed it, e.g. one of
        several, learns it within that)."""
        now = time.monotonic()
        if self._agent_named_at is not None and now - self._agent_named_at < AGENT_NAMED_EVERY_S:
            return
        self._agent_named_at = now
        try:
            self.xfer_stats.add_nixl_agent(int(self.tp_rank), str(self._agent_name))
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """The step's defined point for the push state (engine main thread), in order:
        peers tended and receives timed out (receives that fail now are queued for
        vLLM's step); vLLM's step, whose reaper releases what the lease ledger released
        and which polls the WRITEs; then WRITEs settled, overdue ones aborted, the
        ledgers told what ended; then the telemetry of it all."""
        try:
            if self._tend_due():
                self._tend_peers()  # before vLLM reports the receives it fails
            for req_id in self._receives.timed_out(time.perf_counter()):
                self._give_up_receive(req_id, ReceiveAbandon.TIMED_OUT)
        except Exception:
            self._internal_error(InternalStep.STEP, "tending peers and receives (tried again next step)")
        results = super().get_transfer_results()
        mismatched = {}
        if results.finished_recving and self._verify_wanted:
            # KV integrity: before the scheduler sees the KV landed (a mismatch fails it).
            mismatched = self._verify_landed(results)
        completed, failures = (), {}
        try:
            if self._leases.writing or results.finished_sending:
                self._settle_writes(results)
            if len(self._leases):
                # After vLLM polled this step's WRITEs: a handle still open is not done.
                self._abort_overdue_writes()
            if results.finished_sending:
                completed = self._leases_ended(results.finished_sending)
            failures = {req_id: self._receives.over(req_id) for req_id in results.finished_recving}
            failures.update(mismatched)
        except Exception:
            # (vLLM still gets every result: a request it reports is over whatever our books say.)
            self._internal_error(InternalStep.STEP, "the step's WRITEs and results in the ledgers")
        clock = self._receive_clock
        if results.finished_sending or failures or (clock.waiting and time.monotonic() >= clock.next_expiry):
            try:
                self._observe_results(results, completed, failures)
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)
        try:
            for req_id in results.finished_sending:
                self._leases.forget(req_id)  # (after its telemetry read the lease's history)
        except Exception:
            self._internal_error(InternalStep.STEP, "forgetting the step's ended leases")
        return results

    # ------------------------------------------------------------- failures
    def _log_failure(self, failure_type: str, req_id: str | None, msg: str = "",
                     error: BaseException | None = None, meta: ReqMeta | None = None,
                     **extra_context: Any) -> None:
        """vLLM's structured failure line, then what the failure means for the push.

        Written here rather than calling vLLM's: its line uses `stacklevel=2` to name
        the code that failed, and a wrapper around it would make every failure line
        point at this file instead. Same logger, message and context keys as vLLM's.
        It never raises into its caller (vLLM's code, mid-cleanup).
        """
        context: dict[str, Any] = {"failure_type": failure_type, "request_id": req_id,
                                   "engine_id": self.engine_id}
        if meta is None and req_id is not None:
            meta = self._recving_metadata.get(req_id)
        remote = getattr(meta, "remote", None)
        if remote is not None:
            context.update(remote_engine_id=remote.engine_id, remote_request_id=remote.request_id,
                           remote_host=remote.host, remote_port=remote.port,
                           num_local_blocks=sum(len(g) for g in meta.local_block_ids),
                           num_remote_blocks=sum(len(g) for g in remote.block_ids))
        context.update(extra_context)
        vllm_logger.error("NIXL transfer failure: %s | Context: %s",
                          f"{failure_type}. {msg}" if msg else failure_type, context,
                          exc_info=error is not None, stacklevel=2)
        if req_id is None or failure_type not in _PUSH_FAILURES or self._kv_role == "kv_consumer":
            return
        # P: the push failed. A claim that posted nothing fails now; posted WRITEs fail
        # once all settle; the decoder is told once no handle is open.
        why = error or msg
        try:
            if failure_type != "push_handshake_failed":  # (the WRITE itself failed)
                self._suspect_write_target(req_id, why)
        except Exception:
            self._internal_error(InternalStep.PUSH_FAILURE,
                                 f"suspecting the connection of request {req_id}'s failed WRITE (the push "
                                 "still fails)")
        try:
            self._push_failed(req_id, failure_type, str(why))
        except Exception:
            self._internal_error(InternalStep.PUSH_FAILURE,
                                 f"failing the push of request {req_id} (push_write_timeout_s ends it)")

    def _internal_error(self, step: InternalStep, what: str) -> None:
        logger.error("Internal error (%s): %s raised; the request ends by the failure path. This is "
                     "a defect of the connector: please report it with this traceback", step.value, what,
                     exc_info=True)
        try:
            self.xfer_stats.record_internal_error(step.value)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    # ------------------------------------------------------------- telemetry
    def _observe_results(self, results: KVConnectorTransferResults, completed: Any,
                         failures: dict[str, ReceiveFailure | None]) -> None:
        """The step's ended pushes and receives, counted and their spans ended."""
        tracing = self._spans.enabled  # (without it the span tables stay empty: no lookups)
        for _ in completed:
            self.xfer_stats.record_push_completed()
        if tracing:
            completed = set(completed)
            for req_id in results.finished_sending:
                span = self._write_spans.pop(req_id)
                self._request_contexts.pop(req_id)
                if span is None:
                    continue
                self._lease_events(req_id, span)
                if req_id in completed:
                    SpanEmitter.end(span)
                else:
                    SpanEmitter.end(span, error_type="lease_expired",
                                    message="KV lease ended before the WRITE completed")
        clock = self._receive_clock
        record = self.xfer_stats.record_receive
        for req_id, why in failures.items():
            failed = req_id in results.failed_recving
            if failed:
                self.xfer_stats.record_receive_failure((why or ReceiveFailure.OTHER).value)
            if not tracing:  # (`_record_receive` inlined: one call fewer per receive)
                seconds = clock.stop(req_id)
                kv_wait = clock.since_arrival(req_id)
                if seconds is not None:
                    record(_FAILURE if failed else _SUCCESS, seconds, None, kv_wait)
                continue
            SpanEmitter.end(self._register_spans.pop(req_id))
            span = self._receive_spans.pop(req_id)
            self._record_receive(_FAILURE if failed else _SUCCESS, clock.stop(req_id), span,
                                 clock.since_arrival(req_id))
            if span is None:
                continue
            if failed:
                SpanEmitter.end(span, error_type="receive_failed", message="KV receive failed")
            else:
                SpanEmitter.end(span)
        for req_id, seconds in clock.pop_expired():  # (no lock, no clock read while none can be)
            SpanEmitter.end(self._register_spans.pop(req_id))
            span = self._receive_spans.pop(req_id)
            self._record_receive(_EXPIRED, seconds, span, clock.since_arrival(req_id))
            SpanEmitter.end(span, error_type="expired",
                            message="no KV landed within the registration timeout")

    def _record_receive(self, outcome: str, seconds: float | None, span: Any,
                        kv_wait: float | None) -> None:
        if kv_wait is not None and span is not None and span.is_recording():
            span.set_attribute(Attr.KV_WAIT, kv_wait)
        if seconds is not None:
            self.xfer_stats.record_receive(outcome, seconds,
                                           None if span is None else span_ids(span), kv_wait)


def _nothing() -> None:
    """The writer's due work of a pure consumer: none."""
