"""P-side flow: a PUSH_REG from D until the WRITE completed, observed and hardened.

Wrappers at the boundary of vLLM's push worker:
- every PUSH_REG is checked (size, msgpack, a map, the fields P acts on with their
  types) before vLLM acts on it, and handled on its own: a bad one is counted by
  reason, logged and dropped, and the other notifications of the same batch (other
  PUSH_REGs, completion notifications) go on as usual (upstream, one bad PUSH_REG
  raising in the writer's batch loop dropped the rest of the batch);
- the write span opens under the trace context the PUSH_REG carried, linked to the
  context P's own request arrived with (our scheduler passes it in the step metadata);
- the P->D handshake a WRITE starts is tagged, pushes started/failed are counted.
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Annotated, Any

import msgspec
from opentelemetry.trace import SpanKind
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
    NixlPushConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.glue.receive import SEQUENCE_TYPES, count_blocks
from connector.telemetry import errors
from connector.telemetry.span_table import MAX_TRACKED_REQUESTS
from connector.telemetry.tracing import (
    SpanEmitter,
    extract_span,
    peer_str,
    span_link,
)
from connector.vocabulary import (
    MAX_PUSH_REG_BYTES,
    METADATA_TRACE_ATTR,
    PUSH_REG_FIELDS,
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

_PUSH_REG_PREFIX = b"PUSH_REG:"
_PREFILL_REQUEST_LINK = {Attr.LINK_ROLE: LinkRole.PREFILL_REQUEST.value}  # (copied per link)
_XFER_BLOCKS_SIG = inspect.signature(NixlPushConnectorWorker._xfer_blocks)
# Where `request_id` sits among the positional arguments after self, for a caller that
# passes it positionally (binding the whole signature per WRITE cost ~5 us).
_XFER_REQ_ID_POS = list(_XFER_BLOCKS_SIG.parameters).index("request_id") - 1
_XFER_BLOCKS_PARAMS = tuple(_XFER_BLOCKS_SIG.parameters)[1:]
# vLLM 0.32's and 0.33's: with it, the wrapper names the arguments (see `_xfer_blocks`).
_XFER_BLOCKS_EXPECTED = ("read_spec", "dst_engine_id", "request_id", "remote_request_id",
                         "local_xfer_side_handle", "remote_xfer_side_handle")


def parse_push_reg(notif: bytes) -> tuple[dict[str, Any] | None, tuple[PushRegRejection, str] | None]:
    """The decoded PUSH_REG, or why P must not act on it."""
    body = notif[len(_PUSH_REG_PREFIX):]
    if len(body) > MAX_PUSH_REG_BYTES:
        return None, (PushRegRejection.OVERSIZED, f"{len(body)} bytes > {MAX_PUSH_REG_BYTES}")
    try:
        reg = msgspec.msgpack.decode(body)
    except Exception as exc:
        return None, (PushRegRejection.UNDECODABLE, f"{type(exc).__name__}: {str(exc)[:100]}")
    try:  # the usual PUSH_REG (grouped block ids) passes one check in C (~0.3 us) ...
        msgspec.convert(reg, _UsualPushReg)
        return reg, None
    except msgspec.ValidationError:
        return _checked_field_by_field(reg)  # ... anything else is looked at closely


def _checked_field_by_field(reg: Any) -> tuple[dict[str, Any] | None,
                                               tuple[PushRegRejection, str] | None]:
    """The same rules, one field at a time: accepts flat block ids too, and names
    what is wrong with a PUSH_REG that breaks them."""
    if not isinstance(reg, dict):
        return None, (PushRegRejection.NOT_A_MAP, f"a {type(reg).__name__}")
    for name, types in PUSH_REG_FIELDS.items():
        if name not in reg:
            return None, (PushRegRejection.MISSING_FIELD, name)
        value = reg[name]
        if not isinstance(value, types) or isinstance(value, bool):
            return None, (PushRegRejection.WRONG_TYPE, f"{name} is a {type(value).__name__}")
    if not _valid_block_ids(reg["local_block_ids"]):
        return None, (PushRegRejection.WRONG_TYPE, "local_block_ids are not (lists of) block ids")
    return reg, None


def push_reg_problem(notif: bytes) -> tuple[PushRegRejection, str] | None:
    """Why P must not act on this PUSH_REG notification (None: it is well-formed)."""
    return parse_push_reg(notif)[1]


# A block id as PUSH_REG must carry it: an int (not a bool), not negative. Checked by
# msgspec in C: a PUSH_REG of a long prompt names thousands of blocks, and a Python
# loop over them cost ~58 us per 2,000 ids on the writer thread (now ~13 us).
_BLOCK_ID = Annotated[int, msgspec.Meta(ge=0)]
_FLAT_IDS = list[_BLOCK_ID]
_GROUPED_IDS = list[list[_BLOCK_ID]]


# The fields P acts on, typed as `PUSH_REG_FIELDS` says (its first type each; msgspec's
# int refuses a bool, as the field-by-field check does), with block ids grouped (what
# vLLM sends); other keys are ignored. A PUSH_REG that fits needs no further look; one
# that does not goes through `_checked_field_by_field`.
_UsualPushReg = msgspec.defstruct("_UsualPushReg", [
    (name, _GROUPED_IDS if name == "local_block_ids" else types[0])
    for name, types in PUSH_REG_FIELDS.items()])


def _valid_block_ids(block_ids: Any) -> bool:
    if not block_ids:
        return True
    try:
        msgspec.convert(block_ids, _GROUPED_IDS if isinstance(block_ids[0], SEQUENCE_TYPES) else _FLAT_IDS)
    except msgspec.ValidationError:
        return False
    return True


def _decoder_context(reg: dict[str, Any]) -> Any:
    """The trace context D's PUSH_REG carries: its register span's, else the request's
    own context from D's scheduler; None without either."""
    return (extract_span(reg.get(PUSH_REG_TRACE_KEY))
            or extract_span(reg.get(REGISTRATION_TRACE_KEY)))


class PushFlow:
    """Mixin for `NixlPushConnectorWorker`: the prefill side of a push."""

    def _keep_request_contexts(self, metadata: NixlConnectorMetadata) -> None:
        """The contexts P's own requests arrived with (our scheduler ships them in the
        step metadata), kept until their write spans link to them (tracing on)."""
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
        reg, problem = parse_push_reg(notif)
        if problem is not None:
            self._reject_push_reg(problem[0], problem[1], notif)
            return
        request_id = reg["request_id"]
        # Only after a lease ended unpushed can a PUSH_REG be late (the common case
        # skips both checks, each a regex per request id).
        if (self._lease_expired_bases and not self._has_finished_blocks_for(request_id)
                and self._registration_is_late(reg)):
            self._reject_late_registration(reg, notif)  # upstream: pending for ever
            return
        # vLLM's intake, in our words, on the PUSH_REG decoded and checked above (vLLM's
        # own `_handle_push_reg_notif` would decode it a second time: ~1 us a request on
        # the writer thread, which every push waits for): the WRITE starts now when P's
        # blocks are ready, else the registration waits for them.
        try:
            match = self._pop_matching_finished_blocks(request_id)
            if match is None:
                self._pending_d_registrations[request_id] = reg
            else:
                self._do_start_push_kv(match[0], match[1], reg)
        except Exception as exc:
            # Already counted as a push failure where it was known; keep the batch going.
            self._reject_push_reg(PushRegRejection.FAILED, f"{type(exc).__name__}: {exc}", notif,
                                  exc_info=True)
            return
        if match is None and self._early_p_to_d:
            self._start_early_handshake(reg)

    def _has_finished_blocks_for(self, d_request_id: str) -> bool:
        """P: finished blocks wait for this PUSH_REG (vLLM matches by base request id)."""
        if d_request_id in self._push_finished_blocks:
            return True
        base = get_base_request_id(d_request_id)
        return any(get_base_request_id(rid) == base for rid in list(self._push_finished_blocks))

    def _start_early_handshake(self, reg: dict[str, Any]) -> None:
        """Start the P->D handshake now, while the prefill still runs.

        The PUSH_REG usually arrives long before P's blocks are ready; upstream the
        full handshake to a new D only starts at the WRITE, so the first request from
        every new D paid prefill + handshake + WRITE in series. Started here (on vLLM's
        handshake executor, the writer never waits), the WRITE path later finds the
        connection ready or joins this very handshake; if this one fails, the WRITE
        path tries again as it always did, so no request fails because of it.
        """
        eid = reg.get("decode_engine_id")
        if eid in self._remote_agents and eid not in self._notif_only_engines:
            return  # (the usual case: connected already; plain dict lookups)
        try:
            # Its span sits in the request's trace, under D's register span.
            parent = _decoder_context(reg) if self._spans.enabled else None
            with self._triggered_by(Trigger.PUSH_REG_EARLY, parent):
                self._ensure_handshake(reg["decode_engine_id"], reg["decode_host"],
                                       reg["decode_port"], reg["decode_tp_size"])
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

    # ------------------------------------------------------------ the push
    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        if self._lease_expired and self._lease_gone(request_id):  # (empty: no lease ended unpushed)
            self._tell_decoder(registration_data, PushFailReason.LEASE_EXPIRED)
            return
        span = None
        kept = True  # the span is in `_write_spans` (or there is none)
        if self._spans.enabled:
            span = self._write_spans.get(request_id)
            if span is None:
                parent, links = self._write_span_placement(request_id, registration_data)
                span = self._spans.start(
                    SPAN_PUSH_WRITE, parent=parent, links=links,
                    kind=SpanKind.CONSUMER,
                    attributes=lambda: {  # built only for a span the sampler may keep
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
        if (span is not None and kept) or self._write_deferred_at:  # else: nothing to note
            # Before the WRITE is posted: once it is, P's main thread may end the span.
            self._note_handshake_wait(request_id, span)
        try:
            # The handshake this WRITE may start is tagged with its trigger and parented
            # on its span (without a span, P's writer thread tags it already).
            if span is None and self._writer_trigger is Trigger.PUSH_WRITE:
                super()._do_start_push_kv(request_id, local_block_ids, registration_data)
            else:
                self._in_scope(Trigger.PUSH_WRITE, span, super()._do_start_push_kv,
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
        again when it is done: the time between the two calls is the wait. A first
        call sets 0; if it is then deferred, the second call sets the real wait.
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
        with self._push_lock:
            gone = request_id in self._lease_expired
        if gone:
            logger.warning("Not pushing request %s: its KV lease expired before the WRITE "
                           "could start (its blocks may already hold another request)", request_id)
            self._mark_push_failed(request_id, "lease_expired",
                                   "KV lease ended before the WRITE could start")
        return gone

    # vLLM passes every argument by keyword: a `*args, **kwargs` pass-through rebuilds
    # them as a dict and calls through CPython's slow path (the wrapper's own cost per
    # WRITE 0.91 us, against 0.46 named), so with the signature we know it names them.
    def _xfer_blocks_named(self, read_spec: Any, dst_engine_id: str, request_id: str,
                           remote_request_id: str, local_xfer_side_handle: int,
                           remote_xfer_side_handle: int) -> int | None:
        handle = super()._xfer_blocks(read_spec, dst_engine_id, request_id, remote_request_id,
                                      local_xfer_side_handle, remote_xfer_side_handle)
        # Counted here, before the caller publishes the handle: once published, the main
        # thread may see the WRITE done at any moment. Never raises (the handle must reach
        # the caller, or the request waits for its lease).
        if handle is not None:
            self._count_push_once(self._pushing, request_id, StatKey.PUSHES_STARTED)
        return handle

    def _xfer_blocks_passing(self, *args: Any, **kwargs: Any) -> int | None:
        """For another vLLM's signature: whatever arrives is passed on."""
        handle = super()._xfer_blocks(*args, **kwargs)
        if handle is not None:
            try:
                if "request_id" in kwargs:
                    req_id = kwargs["request_id"]
                elif len(args) > _XFER_REQ_ID_POS:
                    req_id = args[_XFER_REQ_ID_POS]
                else:
                    req_id = _XFER_BLOCKS_SIG.bind(self, *args, **kwargs).arguments["request_id"]
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)
            else:
                self._count_push_once(self._pushing, req_id, StatKey.PUSHES_STARTED)
        return handle

    _xfer_blocks = (_xfer_blocks_named if _XFER_BLOCKS_PARAMS == _XFER_BLOCKS_EXPECTED
                    else _xfer_blocks_passing)

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
