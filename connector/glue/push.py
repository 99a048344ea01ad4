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
- `_do_start_push_kv`, in our words: the P->D handshake a WRITE needs is asked for with
  what it is for and its span (vLLM's asks without either), and a WRITE whose
  connection is being dropped waits for the next one (the connection table parks it);
- right before the WRITEs are posted the ledger checks the claim still stands and the
  decoder asked for the KV less than a lease ago, and the connection table that it is
  not being dropped (in that order: see docs/architecture.md, "Dropping a
  connection"); the handles posted are published even if vLLM's posting raises;
- after vLLM's step the main thread settles the WRITEs (done, failed, or aborted past
  `push_write_timeout_s`); PUSH_FAILs owed (every rank's WRITE settled first) leave
  from the writer;
- the P->D handshake starts when D's PUSH_REG arrives, not only at the WRITE;
- the write span opens under the trace context the PUSH_REG carried, linked to the
  context P's own request arrived with (our scheduler passes it in the step metadata).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from opentelemetry.trace import SpanKind
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    RemoteMeta,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector import settings
from connector.glue.flow import Flow, ParkedPush, ParkedPushFail
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
    PeerReset,
    PushFailOutcome,
    PushFailReason,
    PushRegRejection,
    StatKey,
    TelemetryError,
    Trigger,
    WriteAbort,
)

logger = logging.getLogger(__name__)

_PREFILL_REQUEST_LINK = {Attr.LINK_ROLE: LinkRole.PREFILL_REQUEST.value}
# vLLM warns when posting one request's WRITEs took this long (ms): we keep its line.
SLOW_SUBMISSION_MS = 200.0


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

    def _init_push(self, extra: Any) -> None:
        # P: start the P->D handshake when D's PUSH_REG arrives (see below).
        self._early_p_to_d = str(settings.read(extra, settings.EARLY_P_TO_D_HANDSHAKE)).lower() not in (
            "false", "0")
        self._write_deferred_at: dict[str, float] = {}
        # Writer-owned: D request id -> when its PUSH_REG was stored unmatched.
        self._pending_since: dict[str, float] = {}
        self._unmatched_after_s = settings.unmatched_push_reg_timeout_s(extra)
        # Writer-owned: request id -> the WRITE handles vLLM's `_xfer_blocks_for_req`
        # got so far (`_xfer_blocks` is called per rank inside it, on the writer only).
        self._posted_handles: dict[str, list[int]] = {}

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
                self._pending_since.pop(d_id, None)  # (kept in arrival order)
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
        """P's finished request a PUSH_REG names (vLLM matches by base id), not popped.
        Looked up through the lease ledger's index of ids by base id (vLLM scans every
        finished request for each PUSH_REG)."""
        finished = self._push_finished_blocks
        if d_request_id in finished:
            return d_request_id
        for p_id in self._leases.ids_known_by(get_base_request_id(d_request_id)):
            if p_id in finished:
                return p_id
        return None

    def _pop_matching_registration(self, request_id: str) -> dict[str, Any] | None:
        """vLLM's writer found P's blocks of `request_id` ready: the PUSH_REG waiting for
        them, claimed, or None (the blocks wait). In our words: vLLM's takes the first
        registration of the same base id and lets no one refuse it."""
        pending = self._pending_d_registrations
        d_id = request_id if request_id in pending else None
        if d_id is None:  # (through the ledger's index: vLLM scans every pending one)
            d_id = self._leases.registration_waiting(get_base_request_id(request_id))
        if d_id is None or d_id not in pending:
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
        if self._connections.is_connected(eid, full=True):
            return  # (the usual case: connected already)
        try:
            # Its span sits in the request's trace, under D's register span.
            parent = _decoder_context(reg) if self._spans.enabled else None
            self._connect(Trigger.PUSH_REG_EARLY, parent, eid, reg["decode_host"], reg["decode_port"],
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
    def _writer_due_work(self) -> None:
        """After every read of the notifications (the router's `after_pass`): the
        PUSH_FAILs owed, and PUSH_REGs no request matched in time."""
        if self._leases.owes:
            self._send_owed_push_fails()
        if self._pending_since:
            self._answer_unmatched(time.monotonic())

    def _answer_unmatched(self, now: float) -> None:
        """PUSH_REGs no request of P matched in time get PUSH_FAIL (no_prefill). They are
        kept in arrival order: only those due, and those matched meanwhile ahead of them,
        are looked at (a pass costs what is due, not what waits)."""
        pending, since_of = self._pending_d_registrations, self._pending_since
        while since_of:
            d_id, since = next(iter(since_of.items()))
            if d_id not in pending:
                del since_of[d_id]  # matched (or evicted) meanwhile
                continue
            if now - since < self._unmatched_after_s:
                break
            del since_of[d_id]
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
                logger.error("PUSH_FAIL to %s could not be sent", peer_str(reg.get("decode_engine_id")),
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
        future = self._connect(Trigger.PUSH_REG_EARLY, None, eid, reg["decode_host"],
                               reg["decode_port"], reg["decode_tp_size"])
        if future is None:
            self._send_push_fail(eid, reg, reason)
        else:
            future.add_done_callback(partial(self._decoder_connected, reg, reason))

    def _decoder_connected(self, reg: dict[str, Any], reason: PushFailReason, future: Any) -> None:
        """Pool thread: the handshake a PUSH_FAIL waited for is over: the writer sends it."""
        if future.exception() is None:
            self._leases.owe_again(reg, reason)
            self._push_writer_wake.set()
        else:
            logger.warning("Could not reach decoder %s to fail request %s (%s)",
                           peer_str(reg.get("decode_engine_id")), peer_str(reg.get("request_id", "")),
                           reason.value)
            self._count_push_fail(reason, PushFailOutcome.UNDELIVERABLE)

    def _send_push_fail(self, engine_id: str, reg: dict[str, Any], reason: PushFailReason) -> None:
        """Writer: PUSH_FAIL to every agent of the decoder's connection; one that reached
        none goes again with the next connection (parked until this one is replaced)."""
        d_id = peer_str(reg.get("request_id", ""))
        targets = self._connections.targets(engine_id)
        notif = encode_push_fail(reg["request_id"], reason)
        sent = 0
        for agent in targets.agents.values():
            try:
                self.nixl_wrapper.send_notif(agent, notif_msg=notif)
                sent += 1
            except Exception:
                self._connections.failed_agent(agent, PeerReset.NOTIFICATION_FAILED)
                logger.warning("PUSH_FAIL for request %s to %s failed", d_id, peer_str(engine_id),
                               exc_info=True)
        if sent:
            logger.warning("Told decoder %s that request %s gets no KV from this prefill (%s)",
                           peer_str(engine_id), d_id, reason.value)
            self._count_push_fail(reason, PushFailOutcome.SENT)
            return
        if not self._connections.park(engine_id, targets.epoch, ParkedPushFail(reg, reason)):
            self._leases.owe_again(reg, reason)  # (replaced meanwhile: the next pass connects)

    def _count_push_fail(self, reason: PushFailReason, outcome: PushFailOutcome) -> None:
        try:
            self.xfer_stats.record_push_fail(reason.value, outcome.value)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    # ------------------------------------------------------------ the push
    def _do_start_push_kv(self, request_id: str, local_block_ids: Any,
                          registration_data: dict[str, Any]) -> None:
        """Writer: connect to the decoder (full: the WRITE needs its descriptors) and post
        the request's WRITEs. vLLM calls this with a claimed lease (our match), and again
        from `_deferred_push_inbox` once the handshake is done. In our words (see the
        module docstring). Whatever raises costs this request only: it fails, its
        decoder is told (upstream it escaped into the writer's batch loop and dropped
        the rest of the batch)."""
        try:
            self._start_push(request_id, local_block_ids, registration_data)
        except Exception as exc:
            self._log_failure(failure_type="transfer_setup_failed", req_id=request_id,
                              msg="push could not start", error=exc)

    def _start_push(self, request_id: str, local_block_ids: Any, reg: dict[str, Any]) -> None:
        if self._leases.state_of(request_id) is not LeaseState.CLAIMED:
            return  # (a claim that ended meanwhile, timed out: nothing to post)
        if not local_block_ids:
            logger.warning("No local blocks to push for request %s", request_id)
            self._push_failed(request_id, "transfer_setup_failed", "no local blocks to push")
            return
        span, kept = (self._open_write_span(request_id, local_block_ids, reg)
                      if self._spans.enabled else (None, True))
        future = self._connect(Trigger.PUSH_WRITE, span, reg["decode_engine_id"], reg["decode_host"],
                               reg["decode_port"], reg["decode_tp_size"])
        if future is not None:
            if not kept:  # (so that its retry continues the same dropped trace)
                self._write_spans.put(request_id, span)
            self._note_deferred(request_id)
            future.add_done_callback(partial(self._write_connected, request_id, local_block_ids, reg))
            return
        if (span is not None and kept) or self._write_deferred_at:
            # Before the WRITE is posted: once it is, P's main thread may end the span.
            self._note_handshake_wait(request_id, span)
        self._post_writes(request_id, local_block_ids, reg)

    def _write_connected(self, request_id: str, blocks: Any, reg: dict[str, Any], future: Any) -> None:
        """Pool thread: the handshake a WRITE waited for is over: the writer posts it,
        or the push fails (its decoder is told)."""
        exc = future.exception()
        if exc is not None:
            self._log_failure(failure_type="push_handshake_failed", req_id=request_id, error=exc)
            return
        self._deferred_push_inbox.put((request_id, blocks, reg))
        self._push_writer_wake.set()

    def _post_writes(self, request_id: str, local_block_ids: Any, reg: dict[str, Any]) -> None:
        """Writer: the lease becomes POSTING, then (checked in that order, against a drop
        on the main thread) its connection must still stand; vLLM posts one WRITE per
        rank and publishes their handles; the ledger learns how many were posted."""
        engine_id = reg["decode_engine_id"]
        connection = self._connections.for_write(engine_id)
        if connection is None:  # being dropped (or gone meanwhile): with the next connection
            self._push_waits_for_connection(request_id, local_block_ids, reg)
            return
        epoch, clock_offset = connection
        now = time.perf_counter()
        refusal = self._leases.begin_post(request_id, clock_offset, now)
        if refusal is not None:
            logger.warning("Not pushing request %s: %s (its decoder is told)", request_id, refusal.detail)
            self._push_failed(request_id, refusal.reason.value, refusal.detail)
            return
        if not self._connections.writable(engine_id, epoch):
            self._leases.unpost(request_id)
            self._push_waits_for_connection(request_id, local_block_ids, reg)
            return
        self._connections.touch(engine_id, now)  # (vLLM's idle clock: it is in use)
        grouped_local = self._as_grouped_block_ids(local_block_ids)
        meta = ReqMeta(
            local_block_ids=grouped_local,
            local_physical_block_ids=self._logical_to_kernel_block_ids(
                grouped_local, self._physical_blocks_per_logical_kv_block),
            tp_size=self.world_size,
            remote=RemoteMeta(block_ids=self._as_grouped_block_ids(reg["local_block_ids"]), host="",
                              port=0, engine_id=engine_id, request_id=reg["request_id"]))
        handles = self._posted_handles[request_id] = []
        asked = self._digest_asked(reg)
        if asked is not None:
            self._digest_wanted[request_id] = asked  # (each WRITE's digest goes ahead of it)
        raised = True
        try:
            self._xfer_blocks_for_req(req_id=request_id, meta=meta)
            raised = False
        finally:
            self._posted_handles.pop(request_id, None)
            self._digest_wanted.pop(request_id, None)
            if raised and handles:
                # vLLM publishes a request's handles at the end of its posting call: any
                # posted before it raised would be invisible to every in-flight check.
                with self._sending_transfers_lock:
                    known = set(self._sending_transfers.get(request_id, ()))
                    self._sending_transfers[request_id].extend(h for h in handles if h not in known)
                    self._send_failures.add(request_id)
            self._leases.posted(request_id, len(handles))
        elapsed_ms = (time.perf_counter() - now) * 1000.0
        if elapsed_ms > SLOW_SUBMISSION_MS:
            logger.warning("Posting the WRITEs of request %s took %.1f ms (slow NIXL submission)",
                           request_id, elapsed_ms)

    def _push_waits_for_connection(self, request_id: str, blocks: Any, reg: dict[str, Any]) -> None:
        """The decoder's connection is being dropped (or went meanwhile): the WRITE goes
        with the next one (parked; or now, which connects first)."""
        engine_id = reg["decode_engine_id"]
        targets = self._connections.targets(engine_id)
        if not (targets.dropping and self._connections.park(
                engine_id, targets.epoch, ParkedPush(request_id, blocks, reg))):
            self._deferred_push_inbox.put((request_id, blocks, reg))
            self._push_writer_wake.set()

    def _xfer_blocks(self, *args: Any, **kwargs: Any) -> int | None:
        version = self._digest_wanted.get(kwargs.get("request_id")) if self._digest_wanted else None
        if version is not None:
            # KV integrity: this WRITE's digest, to its D rank, before the WRITE is posted.
            self._send_kv_digest(kwargs["read_spec"], kwargs["dst_engine_id"],
                                 kwargs["remote_request_id"], version)
        handle = super()._xfer_blocks(*args, **kwargs)
        # Kept here, before vLLM publishes the handle: once published, the main thread
        # may see the WRITE done at any moment. (vLLM passes `request_id` by keyword; the
        # guard checks its position for a caller that does not.)
        if handle is not None:
            req_id = kwargs["request_id"] if "request_id" in kwargs else args[2] if len(args) > 2 else None
            handles = self._posted_handles.get(req_id)
            if handles is not None:
                handles.append(handle)
            if self._leases.wrote(req_id):  # (its first WRITE: the push started)
                self._count_push(StatKey.PUSHES_STARTED)
        return handle

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

    def _note_handshake_wait(self, request_id: str, span: Any) -> None:
        """How long this WRITE waited for its P->D handshake (writer thread only): the
        time between the deferral and the call from `_deferred_push_inbox`."""
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

    # ------------------------------------------------- settled (main thread)
    def _settle_writes(self, results: KVConnectorTransferResults) -> None:
        """After vLLM's step: the WRITEs done, and those settled without success. Read
        and judged in one critical section with the writer's publish: the writer
        publishes a WRITE's handles under vLLM's `_sending_transfers_lock` and only then
        marks its lease posted, so a lease `settle` finds WRITING has its open handles in
        this read. (Read first and judged after, a WRITE published and marked posted in
        between looked settled without success: a landed push failed.)"""
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
            if not kept:
                self._leases.aborted(req_id)
                self._mark_push_failed(req_id, "write_timeout",
                                       "the WRITE did not settle within push_write_timeout_s")
            try:
                self.xfer_stats.record_write_abort(outcome.value)
            except Exception as exc:
                errors.note(TelemetryError.STATS, exc)

    # ------------------------------------------------------------ failures
    def _push_failed(self, req_id: str, failure_type: str, message: str) -> None:
        """P: the push of `req_id` failed before any WRITE of it settled: the claim
        fails in the ledger (posted WRITEs fail once all settle; the decoder is told
        once no handle is open), and the failure is counted."""
        self._leases.fail(req_id, PushFailReason.PUSH_FAILED)
        self._mark_push_failed(req_id, failure_type, message)

    def _mark_push_failed(self, req_id: str, failure_type: str, message: str) -> None:
        """Count the push failed (once) and end its write span (telemetry only)."""
        try:
            if self._leases.push_failed(req_id):
                self.xfer_stats.record_push(StatKey.PUSHES_FAILED)
            SpanEmitter.end(self._write_spans.pop(req_id), error_type=failure_type, message=message)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)

    def _count_push(self, key: str) -> None:
        try:
            self.xfer_stats.record_push(key)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)
