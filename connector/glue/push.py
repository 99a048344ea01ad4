"""P side: a PUSH_REG from D until the WRITE completed, observed and hardened.

Every decision about a lease goes through the lease ledger (connector/state/leases.py),
the one owner of P's push state; this module is what vLLM's writer thread does with
those decisions:
- every PUSH_REG is checked (`wire.parse_push_reg`) and handled on its own: a bad one
  is counted by reason, logged and dropped; the rest of the batch goes on (upstream,
  one bad PUSH_REG raising in the writer's batch loop dropped the rest);
- a PUSH_REG is matched to P's finished blocks only when the match is certain: a
  duplicate is dropped, one whose request id two live requests share (a router that
  reused a client's id) or whose prompt digest differs is refused, and one whose lease
  already ended is answered as late; each refusal is a PUSH_FAIL to the decoder;
- a match claims the lease: vLLM's reaper does not release it until its WRITEs settle;
- right before the WRITEs are posted the ledger checks the claim still stands, the
  decoder's connection is not being dropped, and the decoder asked for the KV less
  than a lease ago; the handles posted are published even if vLLM's posting raises;
- PUSH_FAILs owed (every rank's WRITE settled first) leave from this thread;
- the P->D handshake starts when D's PUSH_REG arrives, not only at the WRITE;
- the write span opens under the trace context the PUSH_REG carried, linked to the
  context P's own request arrived with (our scheduler passes it in the step metadata).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from typing import Any

from opentelemetry.trace import SpanKind
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.glue.flow import Flow
from connector.glue.wire import (
    count_blocks,
    encode_push_fail,
    parse_push_reg,
    push_reg_digest,
    push_reg_sent_at,
    wants_push_fail,
)
from connector.state.leases import Refusal
from connector.telemetry import errors
from connector.telemetry.span_table import MAX_TRACKED_REQUESTS
from connector.telemetry.tracing import SpanEmitter, extract_span, peer_str, span_link
from connector.vocabulary import (
    METADATA_TRACE_ATTR,
    PUSH_REG_TRACE_KEY,
    REGISTRATION_TRACE_KEY,
    SPAN_PUSH_WRITE,
    Attr,
    LeaseState,
    LinkRole,
    PushFailOutcome,
    PushFailReason,
    PushRegRejection,
    StatKey,
    TelemetryError,
    Trigger,
)

logger = logging.getLogger(__name__)

_PREFILL_REQUEST_LINK = {Attr.LINK_ROLE: LinkRole.PREFILL_REQUEST.value}
_XFER_BLOCKS_SIG = inspect.signature(NixlPushConnectorWorker._xfer_blocks)


def _decoder_context(reg: dict[str, Any]) -> Any:
    """The trace context D's PUSH_REG carries: its register span's, else the request's
    own context from D's scheduler; None without either."""
    return (extract_span(reg.get(PUSH_REG_TRACE_KEY))
            or extract_span(reg.get(REGISTRATION_TRACE_KEY)))


def write_span_links(own_carrier: dict[str, str] | None) -> list[Any]:
    """The write span's link to P's own request context (none for a bad carrier)."""
    link = span_link(extract_span(own_carrier), _PREFILL_REQUEST_LINK)
    return [link] if link is not None else []


class PushFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: the prefill side of a push."""

    def _init_push(self) -> None:
        extra = self.kv_transfer_config.get_from_extra_config
        # P: start the P->D handshake when D's PUSH_REG arrives (see below).
        self._early_p_to_d = str(extra("early_p_to_d_handshake", True)).lower() not in ("false", "0")
        self._write_deferred_at: dict[str, float] = {}
        # Writer-owned: D request id -> when its PUSH_REG was stored unmatched.
        self._pending_since: dict[str, float] = {}
        self._unmatched_after_s = float(extra("unmatched_push_reg_timeout_s",
                                              extra("kv_lease_duration", 30)))
        # Writer: the push being posted now (its arguments, and the handles it got).
        self._posting = threading.local()

    def _keep_request_contexts(self, metadata: NixlConnectorMetadata) -> None:
        contexts = getattr(metadata, METADATA_TRACE_ATTR, None)
        if contexts:
            try:
                for req_id, carrier in contexts.items():
                    self._request_contexts.put(req_id, carrier)
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)

    def _write_span_placement(self, request_id: str,
                              registration_data: dict[str, Any]) -> tuple[Any, dict[str, str] | None]:
        """Parent of a write span, and the carrier of the context it links to.

        Parent: the D register span the PUSH_REG names (one tree from D's receive
        down to P's write and the handshakes it starts); else D's request context
        (a D that does not trace but got one from its scheduler); else P's own
        request context; else a root. Link: P's own request context, when it is
        not already the parent (`write_span_links` makes it, for a span that records).
        """
        own = self._request_contexts.pop(request_id)
        parent = _decoder_context(registration_data)
        if parent is None:
            return extract_span(own), None
        return parent, own or None

    # --------------------------------------------------------- PUSH_REG intake
    def _handle_push_reg_notif(self, notif: bytes) -> None:
        """vLLM's intake, in our words (vLLM's decodes the PUSH_REG a second time,
        raises on a bad one, and matches by base id whatever else holds it): the
        WRITE starts now when P's blocks are ready, else the registration waits."""
        reg, problem = parse_push_reg(notif)
        if problem is not None:
            self._reject_push_reg(problem[0], problem[1], notif)
            return
        d_id = reg["request_id"]
        refusal = self._leases.intake(d_id)
        if refusal is not None:
            self._refuse(reg, refusal, notif)
            return
        match = None
        try:
            match = self._finished_blocks_for(d_id)
            if match is None:
                self._pending_d_registrations[d_id] = reg
                self._pending_since[d_id] = time.monotonic()
            else:
                refusal = self._claim(match, reg)
                if refusal is not None:
                    self._refuse(reg, refusal, notif)
                    return
                self._do_start_push_kv(match, self._push_finished_blocks.pop(match), reg)
        except Exception as exc:
            if match is not None:
                self._leases.fail(match, PushFailReason.PUSH_FAILED)
            self._reject_push_reg(PushRegRejection.FAILED, f"{type(exc).__name__}: {exc}", notif,
                                  exc_info=True)
            return
        if match is None and self._early_p_to_d:
            self._start_early_handshake(reg)

    def _finished_blocks_for(self, d_request_id: str) -> str | None:
        """P's finished request a PUSH_REG names (vLLM matches by base id), not popped."""
        if d_request_id in self._push_finished_blocks:
            return d_request_id
        base = get_base_request_id(d_request_id)
        for p_id in self._push_finished_blocks:
            if get_base_request_id(p_id) == base:
                return p_id
        return None

    def _pop_matching_registration(self, request_id: str) -> dict[str, Any] | None:
        """vLLM's writer found P's blocks of `request_id` ready: the PUSH_REG waiting for
        them, claimed, or None (the blocks wait). In our words: vLLM's takes the first
        registration of the same base id and lets no one refuse it."""
        pending = self._pending_d_registrations
        d_id = request_id if request_id in pending else None
        if d_id is None:
            base = get_base_request_id(request_id)
            d_id = next((r for r in pending if get_base_request_id(r) == base), None)
        if d_id is None:
            return None
        reg = pending.pop(d_id)
        self._pending_since.pop(d_id, None)
        refusal = self._claim(request_id, reg)
        if refusal is not None:
            self._refuse(reg, refusal, b"")
            return None
        return reg

    def _claim(self, p_request_id: str, reg: dict[str, Any]) -> Refusal | None:
        return self._leases.claim(p_request_id, reg, push_reg_digest(reg), push_reg_sent_at(reg),
                                  time.perf_counter())

    def _refuse(self, reg: dict[str, Any], refusal: Refusal, notif: bytes) -> None:
        """A PUSH_REG P will not WRITE for: counted, logged, and its decoder told
        (unless it repeats one being handled or done)."""
        if refusal.rejection is not None:
            self._reject_push_reg(refusal.rejection,
                                  f"request {peer_str(reg.get('request_id', ''))}: {refusal.detail}",
                                  notif)
        if refusal.answer:
            self._leases.owe(reg, refusal.reason)

    def _start_early_handshake(self, reg: dict[str, Any]) -> None:
        """Start the P->D handshake now, while the prefill still runs.

        Upstream the full handshake to a new D only starts at the WRITE, so the first
        request from every new D paid prefill + handshake + WRITE in series. Started
        here (on the handshake pool, the writer never waits), the WRITE later finds
        the connection ready or joins this very handshake; if this one fails, the
        WRITE path tries again as it always did.
        """
        eid = reg.get("decode_engine_id")
        if eid in self._remote_agents and eid not in self._notif_only_engines:
            return  # (the usual case: connected already)
        try:
            # Its span sits in the request's trace, under D's register span.
            parent = _decoder_context(reg) if self._spans.enabled else None
            self._run_triggered(Trigger.PUSH_REG_EARLY, parent, self._ensure_handshake,
                                reg["decode_engine_id"], reg["decode_host"], reg["decode_port"],
                                reg["decode_tp_size"])
        except Exception:
            logger.warning("early P->D handshake to %s could not start; the WRITE will start it",
                           peer_str(reg.get("decode_engine_id")), exc_info=True)

    def _reject_push_reg(self, reason: PushRegRejection, detail: str, notif: bytes,
                         exc_info: bool = False) -> None:
        logger.warning("Dropped a PUSH_REG notification (%s: %s; %d bytes, starts %r); other "
                       "requests are unaffected", reason.value, detail[:200], len(notif),
                       notif[:64], exc_info=exc_info)
        try:
            self.xfer_stats.record_push_reg_rejected(reason.value)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    # ---------------------------------------------------- writer's own work
    def _answer_unmatched(self, now: float) -> None:
        """PUSH_REGs no request of P matched in time get PUSH_FAIL (no_prefill)."""
        pending = self._pending_d_registrations
        for d_id, since in list(self._pending_since.items()):
            if d_id not in pending:
                del self._pending_since[d_id]  # matched (or evicted) meanwhile
                continue
            if now - since < self._unmatched_after_s:
                continue
            del self._pending_since[d_id]
            reg = pending.pop(d_id)
            self._leases.unmatched(d_id)
            self._reject_push_reg(PushRegRejection.UNMATCHED,
                                  f"request {peer_str(d_id)}: no prefill request matched it within "
                                  f"{self._unmatched_after_s:.0f} s (unmatched_push_reg_timeout_s)",
                                  b"")
            self._leases.owe(reg, PushFailReason.NO_PREFILL)

    def _send_owed_push_fails(self) -> None:
        for reg, reason in self._leases.take_owed():
            try:
                self._tell_decoder(reg, reason)
            except Exception:
                logger.warning("PUSH_FAIL to %s failed", peer_str(reg.get("decode_engine_id")),
                               exc_info=True)
                self._count_push_fail(reason, PushFailOutcome.UNDELIVERABLE)

    def _tell_decoder(self, reg: dict[str, Any], reason: PushFailReason) -> None:
        """Writer: PUSH_FAIL to the decoder of `reg`; connects first if needed (the send
        then happens on a later writer pass)."""
        d_id, eid = peer_str(reg.get("request_id", "")), reg.get("decode_engine_id")
        if not wants_push_fail(reg):
            logger.warning("Decoder %s cannot be told that request %s gets no KV (%s; it does "
                           "not understand PUSH_FAIL); it waits for its registration timeout",
                           peer_str(eid), d_id, reason.value)
            self._count_push_fail(reason, PushFailOutcome.UNDELIVERABLE)
            return
        fut = self._run_triggered(Trigger.PUSH_REG_EARLY, None, self._ensure_handshake, eid,
                                  reg["decode_host"], reg["decode_port"], reg["decode_tp_size"])
        if fut is None:
            if not self._send_push_fail(eid, d_id, reason, encode_push_fail(reg["request_id"], reason)):
                self._leases.owe_after_reset(eid, reg, reason)  # its agent is dead: after the drop
            return

        def connected(f: Any) -> None:  # (handshake pool thread: hand it back to the writer)
            if f.exception() is None:
                self._leases.owe(reg, reason)
                self._push_writer_wake.set()
            else:
                logger.warning("Could not reach decoder %s to fail request %s (%s)", peer_str(eid),
                               d_id, reason.value)
                self._count_push_fail(reason, PushFailOutcome.UNDELIVERABLE)

        fut.add_done_callback(connected)

    def _send_push_fail(self, engine_id: str, d_id: str, reason: PushFailReason,
                        notif: bytes) -> bool:
        """False when it reached no agent of a connected decoder (sent again after the
        dead connection is dropped)."""
        with self._handshake_lock:
            agents = list((self._remote_agents.get(engine_id) or {}).values())
        sent = 0
        for agent in agents:
            try:
                self.nixl_wrapper.send_notif(agent, notif_msg=notif)
                sent += 1
            except Exception:
                logger.warning("PUSH_FAIL for request %s to %s failed", d_id, peer_str(engine_id),
                               exc_info=True)
        if sent:
            logger.warning("Told decoder %s that request %s gets no KV from this prefill (%s)",
                           peer_str(engine_id), d_id, reason.value)
            self._count_push_fail(reason, PushFailOutcome.SENT)
            return True
        if not agents:
            self._count_push_fail(reason, PushFailOutcome.UNDELIVERABLE)
            return True
        return False

    def _count_push_fail(self, reason: PushFailReason, outcome: PushFailOutcome) -> None:
        try:
            self.xfer_stats.record_push_fail(reason.value, outcome.value)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    # ------------------------------------------------------------ the push
    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        # vLLM calls this with a claimed lease (our match) or again once its P->D
        # handshake is done; a claim that ended meanwhile (timed out) posts nothing.
        if self._leases.state_of(request_id) is not LeaseState.CLAIMED:
            return
        span, kept = (self._open_write_span(request_id, local_block_ids, registration_data)
                      if self._spans.enabled else (None, True))
        local = self._trigger_local
        local.deferred = False
        if (span is not None and kept) or self._write_deferred_at:
            # Before the WRITE is posted: once it is, P's main thread may end the span.
            self._note_handshake_wait(request_id, span)
        self._posting.args = (request_id, local_block_ids, registration_data)
        try:
            # The handshake this WRITE may start is tagged with its trigger and parented
            # on its span (without a span, P's writer thread tags it already).
            if span is None and self._writer_trigger is Trigger.PUSH_WRITE:
                super()._do_start_push_kv(request_id, local_block_ids, registration_data)
            else:
                self._run_triggered(Trigger.PUSH_WRITE, span, super()._do_start_push_kv,
                                    request_id, local_block_ids, registration_data)
        except Exception as exc:
            # Upstream this escapes into the writer's batch loop and drops the rest of
            # the batch. It costs this request only (it fails; its decoder is told).
            self._log_failure(failure_type="transfer_setup_failed", req_id=request_id,
                              msg="push could not start", error=exc)
        finally:
            self._posting.args = None
        if local.deferred:
            if not kept:  # (so that its retry continues the same dropped trace)
                self._write_spans.put(request_id, span)
            self._note_deferred(request_id)

    def _open_write_span(self, request_id: str, local_block_ids: Any,
                         registration_data: dict[str, Any]) -> tuple[Any, bool]:
        """The write span (reused when vLLM calls again after a handshake), and whether
        it is kept in `_write_spans` for P's main thread to end (a dropped request's
        is not: nothing ends it)."""
        span = self._write_spans.get(request_id)
        if span is not None:
            return span, True
        parent, own = self._write_span_placement(request_id, registration_data)
        engine_id = self.engine_id
        span = self._spans.start(
            SPAN_PUSH_WRITE, parent=parent, kind=SpanKind.CONSUMER,
            links=None if own is None else lambda: write_span_links(own),
            attributes=lambda: {
                Attr.REQUEST_ID: request_id,
                Attr.REMOTE_REQUEST_ID: peer_str(registration_data.get("request_id", "")),
                Attr.REMOTE_ENGINE_ID: peer_str(registration_data.get("decode_engine_id", "")),
                Attr.LOCAL_ENGINE_ID: engine_id,
                Attr.NUM_BLOCKS: count_blocks(local_block_ids)})
        if span is not None and span.is_recording():
            self._write_spans.put(request_id, span)
            return span, True
        return span, span is None

    def _xfer_blocks_for_req(self, req_id: str, meta: Any) -> None:
        """vLLM posts the request's WRITEs here, once its P->D connection is ready: ask
        the ledger first, and publish whatever was posted even if vLLM's posting raises
        (its handles would otherwise be invisible to every in-flight check)."""
        engine_id = meta.remote.engine_id
        with self._handshake_lock:
            offset = self._engine_clock_offset.get(engine_id)
        verdict = self._leases.begin_post(req_id, offset, time.perf_counter())
        if verdict == "retry":  # its connection is being dropped: after the drop, again
            args = getattr(self._posting, "args", None)
            if args is not None:
                self._deferred_push_inbox.put(args)
                self._push_writer_wake.set()
            return
        if isinstance(verdict, Refusal):
            logger.warning("Not pushing request %s: %s (its decoder is told)", req_id, verdict.detail)
            self._mark_push_failed(req_id, verdict.reason.value, verdict.detail)
            return
        handles: list[int] = []
        self._posting.handles = handles
        raised = True
        try:
            super()._xfer_blocks_for_req(req_id, meta)
            raised = False
        finally:
            self._posting.handles = None
            if raised and handles:
                with self._sending_transfers_lock:
                    known = set(self._sending_transfers.get(req_id, ()))
                    self._sending_transfers[req_id].extend(h for h in handles if h not in known)
                    self._send_failures.add(req_id)
            self._leases.posted(req_id, len(handles))

    def _note_handshake_wait(self, request_id: str, span: Any) -> None:
        """How long this WRITE waited for its P->D handshake (writer thread only).

        vLLM defers a WRITE whose handshake is pending and calls `_do_start_push_kv`
        again when it is done: the time between the two calls is the wait.
        """
        try:
            started = self._write_deferred_at.pop(request_id, None)
            waited = 0.0 if started is None else time.monotonic() - started
            if span is not None and span.is_recording():
                span.set_attribute(Attr.HANDSHAKE_WAIT, waited)
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)

    def _note_deferred(self, request_id: str) -> None:
        try:
            self._write_deferred_at.setdefault(request_id, time.monotonic())
            while len(self._write_deferred_at) > MAX_TRACKED_REQUESTS:
                self._write_deferred_at.pop(next(iter(self._write_deferred_at)))
        except Exception as exc:
            errors.note(TelemetryError.SPAN, exc)

    def _xfer_blocks(self, *args: Any, **kwargs: Any) -> int | None:
        handle = super()._xfer_blocks(*args, **kwargs)
        # Kept here, before vLLM publishes the handle: once published, the main thread
        # may see the WRITE done at any moment. Never raises (the handle must reach
        # the caller, or the request waits for its lease).
        if handle is not None:
            posted = getattr(self._posting, "handles", None)
            if posted is not None:
                posted.append(handle)
            try:
                req_id = kwargs.get("request_id")
                if req_id is None:
                    req_id = _XFER_BLOCKS_SIG.bind(self, *args, **kwargs).arguments["request_id"]
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)
            else:
                self._count_push_once(self._pushing, req_id, StatKey.PUSHES_STARTED)
        return handle

    def _count_push_once(self, seen: Any, req_id: str, key: str) -> None:
        """Count a push event the first time `req_id` enters `seen` (a request's several
        WRITEs are one push); never raises into the push flow."""
        try:
            with self._push_lock:
                first = seen.add(req_id)
            if first:
                self.xfer_stats.record_push(key)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    def _mark_push_failed(self, req_id: str, failure_type: str, message: str) -> None:
        self._count_push_once(self._push_failed, req_id, StatKey.PUSHES_FAILED)
        SpanEmitter.end(self._write_spans.pop(req_id), error_type=failure_type, message=message)
