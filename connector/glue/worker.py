"""The fork's push worker: vLLM's `NixlPushConnectorWorker`, observed and fixed.

The class is vLLM's worker plus one mixin per flow (see connector/glue/flow.py, the
interface between them). This module holds the state they share, the per-step entry
points vLLM calls on the engine's main thread (`start_load_kv`,
`get_transfer_results`, `get_kv_connector_stats`: one call each per step, handing
work to the flows only when there is some), and the outcomes both sides see: vLLM's
failure log and the transfer results.
Telemetry never raises into the push flow and never blocks the writer thread.
"""

from __future__ import annotations

import logging
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

from connector.glue.compat import RemoteAgentTable
from connector.glue.cpu_affinity import EXTRA_CONFIG_KEY as AFFINITY_KEY
from connector.glue.guard import check_worker
from connector.glue.handshakes import HandshakeFlow
from connector.glue.host_settings import HostSettings
from connector.glue.leases import LeaseFlow
from connector.glue.nixl_probe import NixlAgentProbe
from connector.glue.nixl_progress import EXTRA_CONFIG_KEY as PROGRESS_DELAY_KEY
from connector.glue.peers import PeerFlow
from connector.glue.push import PushFlow
from connector.glue.receive import ReceiveFlow
from connector.glue.retry import RetryPolicy
from connector.glue.wire import prompt_digest
from connector.state.leases import LeaseLedger
from connector.state.peers import PeerTable
from connector.state.receives import ReceiveLedger
from connector.telemetry import errors
from connector.telemetry.in_flight import InFlight
from connector.telemetry.receives import ReceiveClock
from connector.telemetry.span_table import BoundedIdSet, SpanTable
from connector.telemetry.stats import ObservedNixlStats
from connector.telemetry.tracing import SpanEmitter, resolve_tracer, span_ids
from connector.vocabulary import (
    METADATA_GIVEN_UP_ATTR,
    METADATA_TRACE_ATTR,
    Attr,
    PushFailReason,
    ReceiveAbandon,
    ReceiveFailure,
    ReceiveOutcome,
    TelemetryError,
    Trigger,
    WriteAbort,
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
# vLLM's default for the D-side registration watchdog (`push_registration_timeout`,
# itself defaulting to `decoder_kv_blocks_ttl`).
DEFAULT_REGISTRATION_TIMEOUT_S = 480.0
# A WRITE that has not settled this long after its PUSH_REG matched is aborted.
DEFAULT_WRITE_TIMEOUT_S = 30.0
# Slack for clock offsets and engine steps in the lease arithmetic (s).
DEFAULT_LEASE_MARGIN_S = 2.0
# A dropped peer silent this long is forgotten.
DEFAULT_FORGET_AFTER_S = 600.0
__all__ = ["ObservedPushWorker", "prompt_digest"]
# (Plain strings: an enum's `.value` is a Python-level property, read per request.)
_SUCCESS, _FAILURE, _EXPIRED = (o.value for o in (ReceiveOutcome.SUCCESS, ReceiveOutcome.FAILURE,
                                                  ReceiveOutcome.EXPIRED))


class ObservedPushWorker(HandshakeFlow, ReceiveFlow, PushFlow, LeaseFlow, PeerFlow,
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
        # What an untagged handshake on vLLM's writer thread is for (handshakes.py).
        self._writer_trigger = {"kv_producer": Trigger.PUSH_WRITE,
                                "kv_consumer": Trigger.PUSH_REG}.get(self._kv_role)
        obs = getattr(vllm_config, "observability_config", None)
        self._init_state(extra, resolve_tracer(getattr(obs, "otlp_traces_endpoint", None)))
        self.nixl_wrapper = NixlAgentProbe(self.nixl_wrapper, on_notif=self._notif_sent,
                                           on_receive=self._notifs_received)
        self._remote_agents = RemoteAgentTable(self._remote_agents)
        # Engines connected notification-only, and the pending handshake job per engine
        # (its flavor, and whether a WRITE waits on it).
        self._notif_only_engines: set[str] = set()
        self._pending_jobs: dict[str, Any] = {}
        self._trigger_local = threading.local()
        self._retry_policy = RetryPolicy.from_extra_config(extra)
        self._init_receive()
        self._init_push()
        self._init_leases()
        self._init_peers()

    def _init_state(self, extra: Any, tracer: Any) -> None:
        """The push state's owners and the per-request telemetry the flows keep: all the
        worker holds beyond vLLM's own (benchmarks/telemetry_cost.py builds a worker
        without vLLM's engine with this too). Needs vLLM's `_lease_extension`."""
        self.xfer_stats = ObservedNixlStats()
        # The push state's owners (connector/state; docs/architecture.md "Push state").
        lease_s = float(extra("kv_lease_duration", 30))
        write_timeout_s = float(extra("push_write_timeout_s", DEFAULT_WRITE_TIMEOUT_S))
        margin_s = float(extra("push_lease_margin_s", DEFAULT_LEASE_MARGIN_S))
        self._leases = LeaseLedger(lease_s=lease_s, extension_s=float(self._lease_extension),
                                   write_timeout_s=write_timeout_s, margin_s=margin_s,
                                   base_of=get_base_request_id)
        self._receives = ReceiveLedger(hold_s=lease_s + write_timeout_s + 2 * margin_s)
        self._peers = PeerTable(forget_after_s=float(extra("peer_forget_after_s",
                                                           DEFAULT_FORGET_AFTER_S)))
        self._spans = SpanEmitter(tracer)
        self._receive_spans = SpanTable()  # D: registration until KV landed
        self._register_spans = SpanTable()  # D: registration until PUSH_REG sent
        self._write_spans = SpanTable()  # P: PUSH_REG matched until WRITE done
        # P: request id -> the W3C context P's own request arrived with (span link).
        self._request_contexts = SpanTable(spans=False)
        # D: registration handed over until KV landed, failed or expired (histogram), and
        # the request's arrival (its whole wait for KV).
        self._receive_clock = ReceiveClock(float(extra(
            "push_registration_timeout",
            extra("decoder_kv_blocks_ttl", DEFAULT_REGISTRATION_TIMEOUT_S))))
        self._push_lock = threading.Lock()
        self._pushing = BoundedIdSet()  # P: WRITEs posted, not yet reported done
        self._push_failed = BoundedIdSet()
        self._in_flight = InFlight()

    # ------------------------------------------------------------- every step
    # vLLM calls these on the engine's main thread every step, mostly with nothing
    # for us to do: each idle step costs attribute tests, not calls into the flows.
    def start_load_kv(self, metadata: NixlConnectorMetadata) -> None:
        """Before vLLM's step: D starts (and traces) the receives handed over and gives
        up those whose client went away; P grants the step's leases in the ledger (the
        writer may see their blocks the moment vLLM queues them). Then vLLM's step, its
        heartbeats tagged; then P takes vLLM's exact lease deadlines."""
        if getattr(self, "pcp_rank", 0) > 0 and not getattr(self, "pcp_dcp_sharded", False):
            return super().start_load_kv(metadata)  # (vLLM skips the whole step on these ranks)
        if metadata.push_registrations:
            self._start_receives(metadata.push_registrations)
        given_up = getattr(metadata, METADATA_GIVEN_UP_ATTR, None)
        if given_up:
            for req_id in given_up:
                self._give_up_receive(req_id, ReceiveAbandon.CLIENT_GONE)
        granted = (self._grant_ahead(metadata)
                   if metadata.reqs_to_send or metadata.reqs_in_batch or metadata.reqs_not_processed
                   else None)
        if self._spans.enabled and getattr(metadata, METADATA_TRACE_ATTR, None):
            self._keep_request_contexts(metadata)
        if not metadata.heartbeat_by_engine and not self._owed_heartbeats:  # most steps
            super().start_load_kv(metadata)
        else:
            # vLLM sends the step's heartbeats (`_send_heartbeats`) at the end of this
            # call, the only place in it that may start a handshake: tag those as the
            # heartbeat's (roots of their own traces).
            self._run_triggered(Trigger.HEARTBEAT, None, super().start_load_kv, metadata)
        if granted:
            self._note_leases_granted(granted)
        return None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """vLLM's per-step stats, plus the in-flight handshakes, the leases held and
        telemetry faults."""
        if self._in_flight.to_report or errors.pending or len(self._leases) or \
                self._leases_report_owed:
            try:
                snapshot = self._in_flight.snapshot()
                if snapshot is not None:
                    self.xfer_stats.set_in_flight(snapshot)
                if len(self._leases) or self._leases_report_owed:
                    self._report_leases()
                lost = errors.drain()
                if lost:
                    self.xfer_stats.record_telemetry_errors(lost)
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)
        return super().get_kv_connector_stats()

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """The step's defined point for the push state (engine main thread), in order:
        PUSH_FAILs received and peers tended (receives that fail now are queued for
        vLLM's step); vLLM's step, whose reaper releases what the lease ledger released
        and which polls the WRITEs; then WRITEs settled, overdue ones aborted, and the
        results accounted."""
        if self._pending_completion_notifs.push_fails:  # rare: D was told a push will not come
            self._take_push_fail_notifs()  # before vLLM drains its failed receives
        if self._peers.need_tending or self._receives.abandoned or self._receives or \
                time.perf_counter() - self._tended_at >= 1.0:
            self._tend_peers()  # before vLLM reports the receives it fails
        clock = self._receive_clock
        expired = clock.waiting and time.monotonic() >= clock.next_expiry
        if expired:
            for req_id, _ in clock.overdue():
                self._give_up_receive(req_id, ReceiveAbandon.TIMED_OUT)
        results = super().get_transfer_results()
        if self._leases.writing or results.finished_sending:
            # Read and judged in one critical section with the writer's publish: the
            # writer publishes a WRITE's handles under this lock and only then marks its
            # lease posted, so a lease `settle` finds WRITING has its open handles in
            # this read. (Read first and judged after, a WRITE published and marked
            # posted in between looked settled without success: a landed push failed.)
            with self._sending_transfers_lock:
                open_writes = {r for r, handles in self._sending_transfers.items() if handles}
                settled_now = self._leases.settle(results.finished_sending, open_writes,
                                                  time.perf_counter())
            for settled in settled_now:
                if settled.pushed:
                    try:
                        self._record_push_stages(settled)
                    except Exception as exc:
                        errors.note(TelemetryError.STATS, exc)
                else:
                    self._mark_push_failed(settled.req_id, "push_failed",
                                           (settled.failure or PushFailReason.PUSH_FAILED).value)
        if len(self._leases):
            # After vLLM polled this step's WRITEs: a handle still open is not done.
            self._abort_overdue_writes()
        if results.finished_sending or results.finished_recving or expired:
            try:
                self._account_results(results)
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)
        return results

    def _abort_overdue_writes(self) -> None:
        """Claims past push_write_timeout_s: an unposted one fails in the ledger; posted
        WRITEs are aborted here (NIXL releases their handles: no byte moves after)."""
        for req_id in self._leases.overdue(time.perf_counter()):
            with self._sending_transfers_lock:
                handles = list(self._sending_transfers.get(req_id, ()))
                kept = []
                for handle in handles:
                    try:
                        self.nixl_wrapper.release_xfer_handle(handle)
                    except Exception:
                        kept.append(handle)
                if kept:
                    self._sending_transfers[req_id] = kept
                else:
                    self._sending_transfers.pop(req_id, None)
            outcome = WriteAbort.ABORT_FAILED if kept else WriteAbort.ABORTED
            logger.warning("WRITE of request %s did not settle within push_write_timeout_s: %s",
                           req_id, "NIXL kept it; trying again next step" if kept else "aborted")
            try:
                self.xfer_stats.record_write_abort(outcome.value)
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)
            if not kept:
                self._leases.aborted(req_id)
                self._mark_push_failed(req_id, "write_timeout",
                                       "the WRITE did not settle within push_write_timeout_s")

    # ------------------------------------------------------------- failures
    def _log_failure(self, failure_type: str, req_id: str | None, msg: str = "",
                     error: BaseException | None = None, meta: ReqMeta | None = None,
                     **extra_context: Any) -> None:
        """vLLM's structured failure line, then our accounting.

        Written here rather than calling vLLM's: its line uses `stacklevel=2` to name
        the code that failed, and a wrapper around it would make every failure line
        point at this file instead. Same logger, message and context keys as vLLM's.
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
        try:
            self._account_failure(failure_type, req_id, error or msg)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    def _account_failure(self, failure_type: str, req_id: str | None, why: Any) -> None:
        if failure_type == "push_reg_notif_failed":
            self._trigger_local.reg_failures = getattr(self._trigger_local, "reg_failures", 0) + 1
            self.xfer_stats.record_push_reg_notif(sent=False)
            return
        if req_id is None:
            return
        if failure_type in _PUSH_FAILURES and self._kv_role != "kv_consumer":
            if failure_type != "push_handshake_failed":  # (the WRITE itself failed)
                self._push_broke(req_id, why)
            # A claim that posted nothing fails now; posted WRITEs fail once all settle.
            self._leases.fail(req_id, PushFailReason.PUSH_FAILED)
            self._mark_push_failed(req_id, failure_type, str(why))
        elif failure_type in _RECEIVE_FAILURES and not self._receives.reached_prefill(req_id):
            # (Once a PUSH_REG reached P, vLLM's failure is turned into a give-up.)
            self._receives.note_failure(req_id, ReceiveFailure.HANDSHAKE_FAILED)
            self._end_receive_spans(req_id, failure_type, str(why))

    def _account_results(self, results: KVConnectorTransferResults) -> None:
        tracing = self._spans.enabled  # (without it the span tables stay empty: no lookups)
        if results.finished_sending:
            self._leases_ended(results.finished_sending)
        for req_id in results.finished_sending:
            with self._push_lock:
                pushed = req_id in self._pushing
                failed = req_id in self._push_failed
                self._pushing.pop(req_id, None)
                self._push_failed.pop(req_id, None)
            if pushed and not failed:
                self.xfer_stats.record_push_completed()
            if tracing:
                span = self._write_spans.pop(req_id)
                self._request_contexts.pop(req_id)
                if span is not None:
                    self._lease_events(req_id, span)
                if pushed and not failed:
                    SpanEmitter.end(span)
                elif span is not None:
                    SpanEmitter.end(span, error_type="lease_expired",
                                    message="KV lease ended before the WRITE completed")
            self._leases.forget(req_id)
        clock = self._receive_clock
        record = self.xfer_stats.record_receive
        for req_id in results.finished_recving:
            failed = req_id in results.failed_recving
            why = self._receives.over(req_id)
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
