"""P side: a PUSH_REG from D until the WRITE completed, observed and hardened.

Wrappers at the boundary of vLLM's push worker:
- every PUSH_REG is checked (`wire.parse_push_reg`) before vLLM acts on it, and
  handled on its own: a bad one is counted by reason, logged and dropped, and the
  other notifications of the same batch go on (upstream, one bad PUSH_REG raising in
  the writer's batch loop dropped the rest of the batch);
- a PUSH_REG for a request whose KV lease already ended is not stored (upstream it
  waits in P's pending registrations for ever, and D until its registration
  watchdog): it is counted, and P tells the decoder with a PUSH_FAIL notification,
  connecting to it first when needed; the same when a WRITE deferred behind a slow
  handshake finds the lease gone (upstream it WRITEs blocks P already released);
- the P->D handshake starts when D's PUSH_REG arrives, not only at the WRITE;
- the write span opens under the trace context the PUSH_REG carried, linked to the
  context P's own request arrived with (our scheduler passes it in the step metadata);
- the handshakes a WRITE starts are tagged, pushes started/failed are counted.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any

from opentelemetry.trace import SpanKind
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.glue.flow import Flow
from connector.glue.wire import count_blocks, encode_push_fail, parse_push_reg, wants_push_fail
from connector.telemetry import errors
from connector.telemetry.span_table import MAX_TRACKED_REQUESTS, BoundedIdSet
from connector.telemetry.tracing import SpanEmitter, extract_span, peer_str, span_link
from connector.vocabulary import (
    METADATA_TRACE_ATTR,
    PUSH_REG_TRACE_KEY,
    REGISTRATION_TRACE_KEY,
    SPAN_PUSH_WRITE,
    Attr,
    LinkRole,
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


class PushFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: the prefill side of a push."""

    def _init_push(self) -> None:
        # Base ids of leases that ended unpushed: a PUSH_REG naming one is late.
        self._lease_expired_bases = BoundedIdSet()
        # P: start the P->D handshake when D's PUSH_REG arrives (see below).
        extra = self.kv_transfer_config.get_from_extra_config
        self._early_p_to_d = str(extra("early_p_to_d_handshake", True)).lower() not in ("false", "0")
        self._write_deferred_at: dict[str, float] = {}

    def _keep_request_contexts(self, metadata: NixlConnectorMetadata) -> None:
        contexts = getattr(metadata, METADATA_TRACE_ATTR, None)
        if contexts:
            try:
                for req_id, carrier in contexts.items():
                    self._request_contexts.put(req_id, carrier)
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)

    def _write_span_placement(self, request_id: str,
                              registration_data: dict[str, Any]) -> tuple[Any, list[Any] | None]:
        """Parent and links of a write span.

        Parent: the D register span the PUSH_REG names (one tree from D's receive
        down to P's write and the handshakes it starts); else D's request context
        (a D that does not trace but got one from its scheduler); else P's own
        request context; else a root. Link: P's own request context, when it is
        not already the parent.
        """
        own = extract_span(self._request_contexts.pop(request_id))
        parent = _decoder_context(registration_data)
        if parent is None:
            return own, None
        link = span_link(own, _PREFILL_REQUEST_LINK)
        return parent, [link] if link is not None else None

    # --------------------------------------------------------- PUSH_REG intake
    def _handle_push_reg_notif(self, notif: bytes) -> None:
        """vLLM's intake, in our words (vLLM's would decode the PUSH_REG a second time
        and raise on a bad one): the WRITE starts now when P's blocks are ready, else
        the registration waits for them."""
        reg, problem = parse_push_reg(notif)
        if problem is not None:
            self._reject_push_reg(problem[0], problem[1], notif)
            return
        request_id = reg["request_id"]
        # Only after a lease ended unpushed can a PUSH_REG be late.
        if (self._lease_expired_bases and not self._has_finished_blocks_for(request_id)
                and self._registration_is_late(reg)):
            self._reject_push_reg(
                PushRegRejection.AFTER_LEASE,
                f"request {peer_str(request_id)}: this prefill's KV lease for it ended before the "
                "PUSH_REG arrived (decoder too slow, or lease too short: kv_lease_duration)", notif)
            self._tell_decoder(reg, PushFailReason.LEASE_EXPIRED)
            return
        try:
            match = self._pop_matching_finished_blocks(request_id)
            if match is None:
                self._pending_d_registrations[request_id] = reg
                self._registration_pending(request_id)
            else:
                self._hold_lease_for_write(match[0])
                self._do_start_push_kv(match[0], match[1], reg)
        except Exception as exc:
            # Already counted as a push failure where it was known; keep the batch going.
            self._reject_push_reg(PushRegRejection.FAILED, f"{type(exc).__name__}: {exc}", notif,
                                  exc_info=True)
            return
        if match is None and self._early_p_to_d:
            self._start_early_handshake(reg)

    def _hold_lease_for_write(self, req_id: str) -> None:
        """A PUSH_REG that finds the lease alive extends it as a heartbeat would.

        D stops heartbeating a request once it registered it, and the WRITE it asks for
        can start later than the last heartbeat covered (behind a P->D handshake, or on
        a prefill whose threads are busy); `_lease_gone` would then refuse a WRITE whose
        decoder did everything in time. (Writer thread, beside the main thread's reaper:
        only a lease a second or more from its deadline is touched, so the reaper cannot
        be releasing it meanwhile, and one released all the same is not brought back.)
        """
        deadline = self._reqs_to_send.get(req_id)
        now = time.perf_counter()
        if deadline is None or deadline - now < 1.0:
            return
        self._reqs_to_send[req_id] = max(deadline, now + float(self._lease_extension))
        if req_id not in self._reqs_to_process:
            self._reqs_to_send.pop(req_id, None)

    def _has_finished_blocks_for(self, d_request_id: str) -> bool:
        """P: finished blocks wait for this PUSH_REG (vLLM matches by base request id)."""
        if d_request_id in self._push_finished_blocks:
            return True
        base = get_base_request_id(d_request_id)
        return any(get_base_request_id(rid) == base for rid in list(self._push_finished_blocks))

    def _registration_is_late(self, reg: dict[str, Any]) -> bool:
        """P: this PUSH_REG names a request whose lease already ended (one-shot)."""
        base = get_base_request_id(reg["request_id"])
        with self._push_lock:
            late = base in self._lease_expired_bases
            if late:
                self._lease_expired_bases.discard(base)
        return late

    def _note_lease_ended_unpushed(self, req_id: str) -> None:
        self._lease_expired.add(req_id)
        self._lease_expired_bases.add(get_base_request_id(req_id))

    def _start_early_handshake(self, reg: dict[str, Any]) -> None:
        """Start the P->D handshake now, while the prefill still runs.

        Upstream the full handshake to a new D only starts at the WRITE, so the first
        request from every new D paid prefill + handshake + WRITE in series. Started
        here (on vLLM's handshake executor, the writer never waits), the WRITE later
        finds the connection ready or joins this very handshake; if this one fails,
        the WRITE path tries again as it always did.
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

    # ------------------------------------------------------------ PUSH_FAIL out
    def _tell_decoder(self, reg: dict[str, Any], reason: PushFailReason) -> None:
        d_id, eid = peer_str(reg.get("request_id", "")), reg.get("decode_engine_id")
        if not wants_push_fail(reg):
            logger.warning("Decoder %s cannot be told that request %s gets no KV (it does not "
                           "understand PUSH_FAIL); it waits for its registration timeout",
                           peer_str(eid), d_id)
            return
        try:
            fut = self._run_triggered(Trigger.PUSH_REG_EARLY, None, self._ensure_handshake, eid,
                                      reg["decode_host"], reg["decode_port"], reg["decode_tp_size"])
        except Exception:
            logger.warning("Could not reach decoder %s to fail request %s", peer_str(eid), d_id,
                           exc_info=True)
            return
        notif = encode_push_fail(reg["request_id"], reason)
        if fut is None:
            self._send_push_fail(eid, d_id, notif)
        else:
            fut.add_done_callback(
                lambda f: f.exception() is None and self._send_push_fail(eid, d_id, notif))

    def _send_push_fail(self, engine_id: str, d_id: str, notif: bytes) -> None:
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
            logger.warning("Told decoder %s that request %s gets no KV from this prefill",
                           peer_str(engine_id), d_id)

    # ------------------------------------------------------------ the push
    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        if self._unmatched_rejected and self._registration_refused(registration_data.get("request_id")):
            return  # answered no_prefill already: D may have freed the blocks
        if self._lease_gone(request_id):
            self._tell_decoder(registration_data, PushFailReason.LEASE_EXPIRED)
            return
        self._note_lease_registered(request_id)
        self._push_started(request_id, registration_data)
        span = None
        kept = True  # the span is in `_write_spans` (or there is none)
        if self._spans.enabled:
            span = self._write_spans.get(request_id)
            if span is None:
                parent, links = self._write_span_placement(request_id, registration_data)
                span = self._spans.start(
                    SPAN_PUSH_WRITE, parent=parent, links=links, kind=SpanKind.CONSUMER,
                    attributes={
                        Attr.REQUEST_ID: request_id,
                        Attr.REMOTE_REQUEST_ID: peer_str(registration_data.get("request_id", "")),
                        Attr.REMOTE_ENGINE_ID: peer_str(registration_data.get("decode_engine_id", "")),
                        Attr.LOCAL_ENGINE_ID: self.engine_id,
                        Attr.NUM_BLOCKS: count_blocks(local_block_ids)})
                if span is not None and span.is_recording():
                    self._write_spans.put(request_id, span)
                else:  # a dropped request's: P's main thread has nothing to end
                    kept = span is None
        local = self._trigger_local
        local.deferred = False
        if (span is not None and kept) or self._write_deferred_at:
            # Before the WRITE is posted: once it is, P's main thread may end the span.
            self._note_handshake_wait(request_id, span)
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
            # the batch. It costs this request only (its lease reclaims the blocks).
            self._log_failure(failure_type="transfer_setup_failed", req_id=request_id,
                              msg="push could not start", error=exc)
        if local.deferred:
            if not kept:  # (so that its retry continues the same dropped trace)
                self._write_spans.put(request_id, span)
            self._note_deferred(request_id)

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

    def _lease_gone(self, request_id: str) -> bool:
        """True (and the push counted failed) when the request's KV lease already ended.

        A push deferred behind a slow P->D handshake comes back here after the
        handshake; by then vLLM may have reported the lease expired and freed the
        blocks for another request. Upstream still WRITEs them: D would then get
        another request's KV and decode from it without any error.
        """
        # Reported expired, or past its deadline and not reaped yet (P's reaper runs on
        # P's engine steps): either way D may no longer hold the blocks for it.
        deadline = self._reqs_to_send.get(request_id)
        gone = deadline is not None and time.perf_counter() >= deadline
        if not gone and self._lease_expired:
            with self._push_lock:
                gone = request_id in self._lease_expired
        if gone:
            logger.warning("Not pushing request %s: its KV lease expired before the WRITE "
                           "could start (its blocks may already hold another request)", request_id)
            self._mark_push_failed(request_id, "lease_expired",
                                   "KV lease ended before the WRITE could start")
        return gone

    def _xfer_blocks(self, *args: Any, **kwargs: Any) -> int | None:
        handle = super()._xfer_blocks(*args, **kwargs)
        # Counted here, before the caller publishes the handle: once published, the main
        # thread may see the WRITE done at any moment. Never raises (the handle must
        # reach the caller, or the request waits for its lease).
        if handle is not None:
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
