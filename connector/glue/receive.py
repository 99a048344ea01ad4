"""D-side flow: the registration handed to the worker, PUSH_REG to P.

Wrappers at the boundary of vLLM's push worker: they time the whole receive, open
the request's receive span (child of the request's own trace context, which our
scheduler puts into the registration) and register span, carry the W3C trace
context in the PUSH_REG payload, tag the handshakes a registration starts, and
count PUSH_REG notifications. (Receives start, and heartbeats are tagged, in the
worker's per-step `start_load_kv`, see worker.py.)
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry.trace import SpanKind

from connector.telemetry import errors
from connector.telemetry.tracing import (
    SpanEmitter,
    extract_span,
    inject_context,
    peer_str,
)
from connector.vocabulary import (
    CAP_PUSH_FAIL,
    PUSH_REG_CAPS_KEY,
    PUSH_REG_TRACE_KEY,
    REGISTRATION_TRACE_KEY,
    SPAN_PUSH_RECEIVE,
    SPAN_PUSH_REGISTER,
    Attr,
    TelemetryError,
    Trigger,
)

logger = logging.getLogger(__name__)
# (A tuple, not `list | tuple`: that builds a union object at every call.)
SEQUENCE_TYPES = (list, tuple)
_CAPS = (CAP_PUSH_FAIL,)  # (read only: msgpack sends it as a list)


class ReceiveFlow:
    """Mixin for `NixlPushConnectorWorker`: the decode side of a push."""

    def _start_receives(self, registrations: dict[str, dict[str, Any]]) -> None:
        """Time every receive (histogram); open its span when tracing is on. (Called
        from the worker's `start_load_kv` with the registrations vLLM hands over.)"""
        self._receive_clock.start_all(registrations)
        if self._spans.enabled:
            try:
                self._open_receive_spans(registrations)
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)

    def _open_receive_spans(self, registrations: dict[str, dict[str, Any]]) -> None:
        for req_id, reg in registrations.items():
            self._receive_spans.put(req_id, self._spans.start(
                # The request's own trace (from our scheduler) or, without one, a root.
                SPAN_PUSH_RECEIVE, parent=extract_span(reg.get(REGISTRATION_TRACE_KEY)),
                kind=SpanKind.CONSUMER,
                attributes=lambda req_id=req_id, reg=reg: {  # only for a span that may be kept
                    Attr.REQUEST_ID: req_id,
                    Attr.LOCAL_ENGINE_ID: self.engine_id,
                    Attr.REMOTE_ENGINE_ID: peer_str(reg.get("remote_engine_id", "")),
                    Attr.NUM_BLOCKS: count_blocks(reg.get("local_block_ids"))}))

    def _send_registration_to_p(self, req_id: str, reg_data: dict[str, Any]) -> None:
        # Tell P we understand PUSH_FAIL (push_fail.py); a stock P ignores the key. The
        # copy is ours from here on (vLLM re-queues this very dict after a handshake, the
        # key already in it), so the register span's context goes into it in place.
        if PUSH_REG_CAPS_KEY not in reg_data:
            reg_data = {**reg_data, PUSH_REG_CAPS_KEY: _CAPS}
        span = None
        if self._spans.enabled:
            try:
                span = self._open_register_span(req_id, reg_data)
            except Exception as exc:
                errors.note(TelemetryError.SPAN, exc)
        # A handshake this starts is tagged PUSH_REG and parented on the register span
        # (without a span, D's writer thread tags it already).
        if span is None and self._writer_trigger is Trigger.PUSH_REG:
            super()._send_registration_to_p(req_id, reg_data)
        else:
            self._in_scope(Trigger.PUSH_REG, span, super()._send_registration_to_p, req_id, reg_data)

    def _open_register_span(self, req_id: str, reg_data: dict[str, Any]) -> Any:
        """The register span (reused when re-queued after a handshake); its trace context
        is added to the PUSH_REG payload `reg_data` (our copy, see above)."""
        span = self._register_spans.get(req_id)
        if span is None:
            port = reg_data.get("remote_port", 0)
            span = self._spans.start(
                SPAN_PUSH_REGISTER, parent=self._receive_spans.get(req_id),
                kind=SpanKind.PRODUCER,
                attributes=lambda: {  # built only for a span the sampler may keep
                    Attr.REQUEST_ID: req_id,
                    Attr.REMOTE_ENGINE_ID: peer_str(reg_data.get("remote_engine_id", "")),
                    Attr.SERVER_ADDRESS: peer_str(reg_data.get("remote_host", "")),
                    Attr.SERVER_PORT: port if type(port) is int else 0})
            if span is not None and span.is_recording():
                # (A dropped request's span is its receive span's context: nothing to
                # end, and a re-queued PUSH_REG derives the same one again.)
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
        # the table hides an engine only from the handshake thread's own lookups; this
        # is the writer thread, so the plain lookup is the same.)
        num_agents = len(dict.get(self._remote_agents, reg_data.get("remote_engine_id")) or ())
        self._trigger_local.reg_failures = 0
        super()._do_send_reg_notif(req_id, reg_data)
        failed = self._trigger_local.reg_failures if num_agents else 1
        try:
            if num_agents:
                if num_agents > failed:
                    self.xfer_stats.record_push_reg_notif(sent=True, count=num_agents - failed)
            else:
                self.xfer_stats.record_push_reg_notif(sent=False)
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



def count_blocks(block_ids: Any) -> int:
    """Blocks in a flat or per-group block id list (for a span attribute)."""
    if not block_ids:
        return 0
    first = block_ids[0]
    if isinstance(first, SEQUENCE_TYPES):
        return sum(map(len, block_ids))
    return len(block_ids)
