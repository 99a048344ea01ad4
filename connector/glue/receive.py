"""D side: a receive from the registration vLLM hands the worker until the KV landed.

- The PUSH_REG leaves from vLLM's writer thread through `_send_registration_to_p` and
  `_do_send_reg_notif`, both in our words: vLLM fails a receive at once when it knows
  no agent of P at the moment it sends (the case right after the dead connection to a
  restarted P was dropped), and does not say which agents a PUSH_REG reached. Here the
  receive ledger decides (connector/state/receives.py): a PUSH_REG that reached no
  agent is UNDELIVERED and goes again once the connection is replaced (the connection
  table parks it), whatever `kv_load_failure_policy` says; a handshake that fails for
  good fails the receive only if no PUSH_REG of it ever reached P, else it is given up
  and fails at its safe point.
- PUSH_FAIL (a fork P: "the KV of your request will never come") and each P rank's
  completion notification reach the receive ledger from the notification router
  (writer thread). A receive fails at once only when no WRITE into its blocks can still
  come; vLLM then recomputes or fails it, per `kv_load_failure_policy`.
- Telemetry: the receive span (a child of the request's own trace context, which our
  scheduler puts into the registration) and the register span, the W3C context and our
  capabilities in the PUSH_REG payload, PUSH_REG notifications counted.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import msgspec
from opentelemetry.trace import SpanKind

from connector.glue.flow import Flow, ParkedRegistration
from connector.glue.wire import OUR_CAPS, PUSH_REG_PREFIX, count_blocks, decode_push_fail
from connector.state import agent_name
from connector.telemetry import errors
from connector.telemetry.tracing import SpanEmitter, extract_span, inject_context, peer_str
from connector.vocabulary import (
    PUSH_REG_CAPS_KEY,
    PUSH_REG_SENT_AT_KEY,
    PUSH_REG_TRACE_KEY,
    REGISTRATION_ARRIVAL_KEY,
    REGISTRATION_TRACE_KEY,
    REGISTRATION_VERIFY_KEY,
    SPAN_PUSH_RECEIVE,
    SPAN_PUSH_REGISTER,
    Attr,
    InternalStep,
    LeaseFate,
    PeerReset,
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


class ReceiveFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: the decode side of a push."""

    def _start_receives(self, registrations: dict[str, dict[str, Any]]) -> None:
        self._receives.start(registrations, time.perf_counter())
        try:
            self._receive_clock.start_all(registrations)
            self._receive_clock.note_arrivals(registrations)
            if self._spans.enabled:
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
        """vLLM's writer (its only caller): connect to P notification-only (the
        handshake runs on the pool; the PUSH_REG goes again once it is done), then send.
        In our words: see the module docstring for what vLLM's does differently."""
        send = self._receives.begin_send(req_id)
        if not send:
            return  # given up or failed here meanwhile: nothing to send
        # Tell P we understand PUSH_FAIL; a stock P ignores the key. The copy is ours
        # from here on (it is queued again as it is), so the register span's context
        # goes into it in place.
        if PUSH_REG_CAPS_KEY not in reg_data:
            reg_data = {**reg_data, PUSH_REG_CAPS_KEY: OUR_CAPS}
            reg_data.pop(REGISTRATION_ARRIVAL_KEY, None)  # (D's own: P has no use for it)
            reg_data.pop(REGISTRATION_VERIFY_KEY, None)
        span = None
        if self._spans.enabled and send == 1:  # (a PUSH_REG sent again opens no new span)
            try:
                span = self._open_register_span(req_id, reg_data)
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)
        future = self._connect(
            Trigger.PUSH_REG, span, reg_data["remote_engine_id"], reg_data["remote_host"],
            reg_data["remote_port"], reg_data["remote_tp_size"],
            {"pp_size": reg_data.get("remote_pp_size", 1), "notif_agents_only": True})
        if future is None:
            self._do_send_reg_notif(req_id, reg_data)
        else:
            future.add_done_callback(partial(self._registration_connected, req_id, reg_data))

    def _registration_connected(self, req_id: str, reg_data: dict[str, Any], future: Any) -> None:
        """The handshake a PUSH_REG waited for is over (pool thread): send it (on the
        writer), or decide the receive (see `ReceiveLedger.handshake_failed`)."""
        exc = future.exception()
        if exc is None:
            self._reg_send_inbox.put((req_id, reg_data))
            self._push_writer_wake.set()
            return
        action = self._receives.handshake_failed(req_id, time.perf_counter())
        if action == "fail":
            self._failed_recv_reqs.put(req_id)
        self._log_failure(failure_type="push_reg_handshake_failed", req_id=req_id, error=exc)
        try:
            if action == "fail":
                self._end_receive_spans(req_id, "push_reg_handshake_failed", str(exc))
            elif action == "held":
                self.xfer_stats.record_receive_abandoned(ReceiveAbandon.PEER_UNREACHABLE.value)
        except Exception as exc_:
            errors.note(TelemetryError.STATS, exc_)

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
        """Writer: the PUSH_REG to every agent of P's connection, and what became of it
        in the receive ledger. In our words (see the module docstring)."""
        engine_id = reg_data["remote_engine_id"]
        targets = self._connections.targets(engine_id)
        reached: set[str] = set()
        failed = 0
        if targets.agents:
            # When this decoder last asked for the KV (its clock): a fork P posts no WRITE
            # more than a lease after it (connector/state/receives.py). Our copy of the dict.
            reg_data[PUSH_REG_SENT_AT_KEY] = time.perf_counter()
            message = PUSH_REG_PREFIX + msgspec.msgpack.encode(reg_data)
            for rank, agent in targets.agents.items():
                try:
                    self.nixl_wrapper.send_notif(agent, notif_msg=message)
                except Exception as exc:
                    failed += 1
                    self._connections.failed_agent(agent, PeerReset.NOTIFICATION_FAILED)
                    self._log_failure(failure_type="push_reg_notif_failed", req_id=req_id, error=exc,
                                      remote_rank=rank)
                    self.xfer_stats.record_failed_notification()  # (as vLLM counts it)
                else:
                    reached.add(agent_name(agent))
        try:
            fail_now = self._receives.sent(req_id, reg_data, frozenset(reached), time.perf_counter())
            if fail_now:  # given up meanwhile, and P never got it: nothing can land
                self._failed_recv_reqs.put(req_id)
            elif not reached:
                self._registration_undelivered(req_id, reg_data, engine_id, targets)
        except Exception:
            self._internal_error(InternalStep.REGISTRATION,
                                 f"noting where request {req_id}'s PUSH_REG went (it is given up)")
            self._give_up_receive(req_id, ReceiveAbandon.INTERNAL_ERROR)
        try:
            self._count_registration(req_id, len(targets.agents), failed)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    def _registration_undelivered(self, req_id: str, reg_data: dict[str, Any], engine_id: str,
                                  targets: Any) -> None:
        """A PUSH_REG that reached no agent goes again with the next connection: parked
        until the one it tried is dropped (it is dead or being dropped), or now when
        there was none (it handshakes) or it was replaced meanwhile."""
        logger.warning("PUSH_REG of request %s reached no agent of %s (%s); it is sent again "
                       "with the next connection", req_id, peer_str(engine_id),
                       "connection being dropped" if targets.dropping
                       else "no connection" if not targets.agents else "every send failed")
        parked = bool(targets.agents or targets.dropping) and self._connections.park(
            engine_id, targets.epoch, ParkedRegistration(req_id, reg_data))
        if not parked:
            self._reg_send_inbox.put((req_id, reg_data))
            self._push_writer_wake.set()

    def _count_registration(self, req_id: str, num_agents: int, failed: int) -> None:
        """One PUSH_REG notification counted per agent it went to (sent or failed); one
        failed when there was no agent to send it to."""
        if not num_agents:
            self.xfer_stats.record_push_reg_notif(sent=False)
        if failed:
            self.xfer_stats.record_push_reg_notif(sent=False, count=failed)
        if num_agents > failed:
            self.xfer_stats.record_push_reg_notif(sent=True, count=num_agents - failed)
        if not self._spans.enabled:
            return
        span = self._register_spans.pop(req_id)
        if failed >= max(num_agents, 1):
            SpanEmitter.end(span, error_type="push_reg_notif_failed",
                            message=f"PUSH_REG reached none of {num_agents} agents")
        else:
            SpanEmitter.end(span)

    # --------------------------------------------------- from the router (writer)
    def _write_landed_from(self, agent: Any, message: bytes) -> None:
        """A P agent's completion notification ("<D request id>:<P TP>"): that rank
        writes no more into the request's blocks."""
        req_id = message.rpartition(b":")[0].decode("utf-8", "replace")
        if req_id and self._receives.agent_done(req_id, agent):
            self._failed_recv_reqs.put(req_id)

    def _push_fail_from(self, agent: Any, notif: bytes) -> None:
        """A P agent (rank) says this request's KV will never come from it. The receive
        fails once every rank its PUSH_REG reached has settled; until then another rank
        may still WRITE into its blocks."""
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
        if action == "fail":
            self._failed_recv_reqs.put(req_id)
            logger.warning("Request %s: its prefill reports the KV will never be pushed (%s); "
                           "failing the KV load now instead of waiting for push_registration_timeout",
                           peer_str(req_id), reason.value)
        else:
            logger.warning("Request %s: a prefill rank reports its KV will never be pushed (%s); "
                           "it fails once every rank's WRITE into its blocks has settled",
                           peer_str(req_id), reason.value)
        if reason is PushFailReason.LEASE_EXPIRED and self._spans.enabled:
            try:
                span = self._receive_spans.get(req_id)
                if span is not None and span.is_recording():
                    span.add_event(SpanEvent.LEASE_EXPIRED, {Attr.LEASE_FATE: LeaseFate.REGISTERED.value})
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)

    def _push_fail_lost(self, notif: bytes) -> None:
        """Handling a PUSH_FAIL raised: its receive is given up (it fails at its safe
        point: a rank of P may still WRITE)."""
        parsed = decode_push_fail(notif)
        if parsed is not None:
            self._give_up_receive(parsed[0], ReceiveAbandon.INTERNAL_ERROR)

    # ------------------------------------------------------- decided failures
    def _fail_receive(self, req_id: str, reason: ReceiveFailure) -> None:
        if self._receives.fail(req_id, reason):
            self._failed_recv_reqs.put(req_id)

    def _give_up_receive(self, req_id: str, why: ReceiveAbandon) -> None:
        outcome = self._receives.give_up(req_id, why, time.perf_counter())
        if outcome == "fail":
            self._failed_recv_reqs.put(req_id)  # its PUSH_REG never left: nothing can land
        if outcome:
            try:
                self.xfer_stats.record_receive_abandoned(why.value)
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)
