"""D side: a receive from the registration vLLM hands the worker until the KV landed.

Wrappers at the boundary of vLLM's push worker: they time the whole receive, open the
request's receive span (a child of the request's own trace context, which our
scheduler puts into the registration) and register span, carry the W3C trace context
and our capabilities in the PUSH_REG payload, tag the handshakes a registration
starts, count PUSH_REG notifications, and act on PUSH_FAIL: a notification from P that
the KV will never come, which fails that receive at once (vLLM then recomputes or
fails the request, per `kv_load_failure_policy`) instead of after
`push_registration_timeout`.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from typing import Any

from opentelemetry.trace import SpanKind

from connector.glue.flow import Flow
from connector.glue.wire import OUR_CAPS, count_blocks, decode_push_fail
from connector.telemetry import errors
from connector.telemetry.tracing import SpanEmitter, extract_span, inject_context, peer_str
from connector.vocabulary import (
    PUSH_FAIL_NOTIF_PREFIX,
    PUSH_REG_CAPS_KEY,
    PUSH_REG_SENT_AT_KEY,
    PUSH_REG_TRACE_KEY,
    REGISTRATION_ARRIVAL_KEY,
    REGISTRATION_TRACE_KEY,
    SPAN_PUSH_RECEIVE,
    SPAN_PUSH_REGISTER,
    Attr,
    LeaseFate,
    PushFailReason,
    ReceiveAbandon,
    ReceiveFailure,
    SpanEvent,
    TelemetryError,
    Trigger,
)

logger = logging.getLogger(__name__)


def _register_attributes(req_id: str, reg_data: dict[str, Any]) -> dict[str, Any]:
    port = reg_data.get("remote_port", 0)
    return {Attr.REQUEST_ID: req_id,
            Attr.REMOTE_ENGINE_ID: peer_str(reg_data.get("remote_engine_id", "")),
            Attr.SERVER_ADDRESS: peer_str(reg_data.get("remote_host", "")),
            Attr.SERVER_PORT: port if type(port) is int else 0}


class NotifInbox(queue.Queue):
    """vLLM's writer -> main thread notification queue, with PUSH_FAILs set aside.

    The writer thread forwards every NIXL notification that is not a PUSH_REG into
    this queue; a PUSH_FAIL goes to `push_fails` instead (a deque: appends and pops
    are atomic), so the main thread checks one deque per step and never takes other
    notifications out and puts them back.
    """

    def __init__(self) -> None:
        super().__init__()
        self.push_fails: deque[bytes] = deque()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, bytes) and item.startswith(PUSH_FAIL_NOTIF_PREFIX):
            self.push_fails.append(item)
            return
        super().put(item, block, timeout)


class FailedReceives(queue.Queue):
    """vLLM's queue of receives to fail (drained on the main thread), with a gate on
    vLLM's own puts: vLLM fails a receive at once when a handshake for its PUSH_REG
    fails or P has no agent left, which is right for a first PUSH_REG that never left,
    and wrong for one sent again after the first reached P (P may still WRITE into the
    blocks). `gate(req_id)` says whether vLLM's put may stand (the caller gives the
    receive up instead when not); the fork's own decided failures use `decided`."""

    def __init__(self, gate: Any) -> None:
        super().__init__()
        self._gate = gate

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        try:
            allowed = self._gate(item)
        except Exception as exc:  # (a fault here must not lose the failure)
            errors.note(TelemetryError.STATS, exc)
            allowed = True
        if allowed:
            super().put(item, block, timeout)

    def decided(self, item: Any) -> None:
        super().put(item)


class ReceiveFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: the decode side of a push."""

    def _init_receive(self) -> None:
        """Called at the end of the worker's `__init__`, before vLLM starts the writer
        thread (`register_kv_caches`), so nothing queued is lost by the swap."""
        inbox = NotifInbox()
        old = self._pending_completion_notifs
        while not old.empty():  # (defensive: carry over anything already queued)
            inbox.put(old.get_nowait())
        self._pending_completion_notifs = inbox
        failed = FailedReceives(self._vllm_may_fail)
        old_failed = self._failed_recv_reqs
        while not old_failed.empty():
            failed.decided(old_failed.get_nowait())
        self._failed_recv_reqs = failed

    def _vllm_may_fail(self, req_id: str) -> bool:
        """vLLM fails this receive now: fine unless its PUSH_REG reached P before (a
        resend's handshake failed); then it is given up, to fail at its safe point."""
        if not self._receives.reached_prefill(req_id):
            return True
        self._give_up_receive(req_id, ReceiveAbandon.PEER_UNREACHABLE)
        return False

    def _start_receives(self, registrations: dict[str, dict[str, Any]]) -> None:
        self._receives.start(registrations, time.perf_counter())
        self._receive_clock.start_all(registrations)
        self._receive_clock.note_arrivals(registrations)
        if self._spans.enabled:
            try:
                self._open_receive_spans(registrations)
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)

    def _open_receive_spans(self, registrations: dict[str, dict[str, Any]]) -> None:
        engine_id = self.engine_id
        for req_id, reg in registrations.items():
            self._receive_spans.put(req_id, self._spans.start(
                # The request's own trace (from our scheduler) or, without one, a root.
                SPAN_PUSH_RECEIVE, parent=extract_span(reg.get(REGISTRATION_TRACE_KEY)),
                kind=SpanKind.CONSUMER,
                attributes=lambda req_id=req_id, reg=reg: {
                    Attr.REQUEST_ID: req_id,
                    Attr.LOCAL_ENGINE_ID: engine_id,
                    Attr.REMOTE_ENGINE_ID: peer_str(reg.get("remote_engine_id", "")),
                    Attr.NUM_BLOCKS: count_blocks(reg.get("local_block_ids"))}))

    def _end_receive_spans(self, req_id: str, error_type: str, message: str) -> None:
        SpanEmitter.end(self._register_spans.pop(req_id), error_type=error_type, message=message)
        SpanEmitter.end(self._receive_spans.pop(req_id), error_type=error_type, message=message)

    # ------------------------------------------------------------- PUSH_REG out
    def _send_registration_to_p(self, req_id: str, reg_data: dict[str, Any]) -> None:
        send = self._receives.begin_send(req_id)
        if not send:
            return  # given up or failed here meanwhile: nothing to send
        # Tell P we understand PUSH_FAIL; a stock P ignores the key. The copy is ours
        # from here on (vLLM re-queues this very dict after a handshake, the key
        # already in it), so the register span's context goes into it in place.
        if PUSH_REG_CAPS_KEY not in reg_data:
            reg_data = {**reg_data, PUSH_REG_CAPS_KEY: OUR_CAPS}
            reg_data.pop(REGISTRATION_ARRIVAL_KEY, None)  # (D's own: P has no use for it)
        span = None
        if self._spans.enabled and send == 1:  # (a PUSH_REG sent again opens no new span)
            try:
                span = self._open_register_span(req_id, reg_data)
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)
        # A handshake this starts is tagged PUSH_REG and parented on the register span
        # (without a span, D's writer thread tags it already).
        if span is None and self._writer_trigger is Trigger.PUSH_REG:
            super()._send_registration_to_p(req_id, reg_data)
        else:
            self._run_triggered(Trigger.PUSH_REG, span, super()._send_registration_to_p,
                                req_id, reg_data)

    def _open_register_span(self, req_id: str, reg_data: dict[str, Any]) -> Any:
        """The register span (reused when re-queued after a handshake); its trace context
        goes into the PUSH_REG payload `reg_data` (our copy, see above)."""
        span = self._register_spans.get(req_id)
        if span is None:
            span = self._spans.start(
                SPAN_PUSH_REGISTER, parent=self._receive_spans.get(req_id), kind=SpanKind.PRODUCER,
                attributes=lambda: _register_attributes(req_id, reg_data))
            if span is not None and span.is_recording():
                self._register_spans.put(req_id, span)
        if PUSH_REG_TRACE_KEY not in reg_data:
            carrier = inject_context(span)
            if carrier:
                # P parents its write on our register span; the request's own context
                # (already our receive span's parent) need not travel.
                reg_data.pop(REGISTRATION_TRACE_KEY, None)
                reg_data[PUSH_REG_TRACE_KEY] = carrier
        return span

    def _do_send_reg_notif(self, req_id: str, reg_data: dict[str, Any]) -> None:
        # (No lock: one dict lookup and a len() are atomic under the GIL. `dict.get`:
        # the table hides an engine only from the handshake thread's own lookups.)
        agents = dict(dict.get(self._remote_agents, reg_data.get("remote_engine_id")) or {})
        num_agents = len(agents)
        self._trigger_local.reg_failures = 0
        self._trigger_local.reg_failed_agents = set()
        # When this decoder last asked for the KV (its clock): a fork P posts no WRITE
        # more than a lease after it (connector/state/receives.py). Our copy of the dict.
        reg_data[PUSH_REG_SENT_AT_KEY] = time.perf_counter()
        super()._do_send_reg_notif(req_id, reg_data)
        failed = self._trigger_local.reg_failures if num_agents else 1
        try:
            self._registration_sent(req_id, reg_data, agents, failed)
            # (A failure to reach an agent is counted where vLLM logs it, `_log_failure`.)
            if not num_agents:
                self.xfer_stats.record_push_reg_notif(sent=False)
            elif num_agents > failed:
                self.xfer_stats.record_push_reg_notif(sent=True, count=num_agents - failed)
            if not self._spans.enabled:
                return
            span = self._register_spans.pop(req_id)
            if failed >= max(num_agents, 1):
                SpanEmitter.end(span, error_type="push_reg_notif_failed",
                                message=f"PUSH_REG reached none of {num_agents} agents")
            else:
                SpanEmitter.end(span)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    # -------------------------------------------------------------- PUSH_FAIL in
    def _take_push_fail_notifs(self) -> None:
        """Main: PUSH_FAILs that reached vLLM's queue instead of the writer's pass (it
        failed): which agent sent them is not known, so each is taken as one P rank's."""
        pending = self._pending_completion_notifs.push_fails
        while pending:
            self._push_fail_from(None, pending.popleft())

    def _push_fail_from(self, agent: Any, notif: bytes) -> None:
        """A P agent (rank) says this request's KV will never come from it (writer, or
        main for one without its agent). The receive fails once every rank its PUSH_REG
        reached has settled; until then another rank may still WRITE into its blocks."""
        parsed = decode_push_fail(notif)
        if parsed is None:
            logger.warning("Dropped a malformed PUSH_FAIL notification (%d bytes)", len(notif))
            return
        req_id, reason = parsed
        action = self._receives.agent_failed(req_id, agent, ReceiveFailure(reason.value),
                                             time.perf_counter())
        if action == "ignore":
            logger.debug("PUSH_FAIL for request %s, which is not waiting here", peer_str(req_id))
            return
        if reason is PushFailReason.LEASE_EXPIRED and self._spans.enabled:
            try:
                span = self._receive_spans.get(req_id)
                if span is not None and span.is_recording():
                    span.add_event(SpanEvent.LEASE_EXPIRED, {Attr.LEASE_FATE: LeaseFate.REGISTERED.value})
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)
        if action == "fail":
            logger.warning("Request %s: its prefill reports the KV will never be pushed (%s); "
                           "failing the KV load now instead of waiting for push_registration_timeout",
                           peer_str(req_id), reason.value)
            self._failed_recv_reqs.decided(req_id)
        else:
            logger.warning("Request %s: a prefill rank reports its KV will never be pushed (%s); "
                           "it fails once every rank's WRITE into its blocks has settled",
                           peer_str(req_id), reason.value)
