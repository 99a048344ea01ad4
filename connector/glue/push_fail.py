"""PUSH_FAIL: a prefill tells a decoder that its request's KV will never be pushed.

Upstream a decoder learns nothing when its push is dead: a PUSH_REG that reaches P
after P's KV lease for the request ended waits in P's pending registrations for
ever, and D's request waits until its registration watchdog
(`push_registration_timeout`, by default the 480 s block TTL). Seen on a busy
machine: the router's D leg reached D's scheduler after P's 30 s lease, and the
request hung.

The fork closes the cases where P knows and can reach D:
- P side: a PUSH_REG for a request whose lease already ended (matched by base
  request id, as vLLM matches PUSH_REGs) is not stored; it is counted
  (`vllm:nixl_push_reg_rejected_total{reason="after_lease_expired"}`), logged, and
  P sends D a PUSH_FAIL notification over NIXL (connecting to D first if needed);
  the same when a WRITE deferred behind a slow handshake finds the lease gone.
- D side: a PUSH_FAIL for a request D still waits on fails that KV load at once,
  with the reason in D's log; vLLM then handles it like any failed load (recompute
  or fail, per `kv_load_failure_policy`).
Only a decoder that lists `push_fail` in its PUSH_REG (`nixl_observed_caps`) gets the
notification: a stock decoder would misread an unknown notification.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.glue.receive import SEQUENCE_TYPES
from connector.telemetry.span_table import BoundedIdSet
from connector.telemetry.tracing import peer_str
from connector.vocabulary import (
    CAP_PUSH_FAIL,
    MAX_PUSH_FAIL_BYTES,
    PUSH_FAIL_NOTIF_PREFIX,
    PUSH_REG_CAPS_KEY,
    PushFailReason,
    PushRegRejection,
    Trigger,
)

logger = logging.getLogger(__name__)


def encode_push_fail(request_id: str, reason: PushFailReason) -> bytes:
    return PUSH_FAIL_NOTIF_PREFIX + msgspec.msgpack.encode({"request_id": request_id,
                                                            "reason": reason.value})


def decode_push_fail(notif: bytes) -> tuple[str, PushFailReason] | None:
    """(D's request id, reason) of a well-formed PUSH_FAIL, else None."""
    body = notif[len(PUSH_FAIL_NOTIF_PREFIX):]
    if len(body) > MAX_PUSH_FAIL_BYTES:
        return None
    try:
        msg = msgspec.msgpack.decode(body)
        return str(msg["request_id"]), PushFailReason(msg["reason"])
    except Exception:
        return None


def wants_push_fail(reg: dict[str, Any]) -> bool:
    caps = reg.get(PUSH_REG_CAPS_KEY)
    return isinstance(caps, SEQUENCE_TYPES) and CAP_PUSH_FAIL in caps


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


class PushFailFlow:
    """Mixin for `NixlPushConnectorWorker`: both ends of the PUSH_FAIL notification."""

    def _init_push_fail(self) -> None:
        """Called at the end of the worker's `__init__`, before vLLM starts the writer
        thread (`register_kv_caches`), so nothing was queued in the inbox replaced here."""
        self._lease_expired_bases = BoundedIdSet()  # P: base ids of leases that ended unpushed
        inbox = NotifInbox()
        old = self._pending_completion_notifs
        while not old.empty():  # (defensive: carry over anything already queued)
            inbox.put(old.get_nowait())
        self._pending_completion_notifs = inbox

    # ------------------------------------------------------------------ P side
    def _note_lease_expired(self, request_id: str) -> None:
        """P: the request's lease ended without a WRITE (caller holds `_push_lock`)."""
        self._lease_expired_bases.add(get_base_request_id(request_id))

    def _registration_is_late(self, reg: dict[str, Any]) -> bool:
        """P: this PUSH_REG names a request whose lease already ended (one-shot)."""
        base = get_base_request_id(reg["request_id"])
        with self._push_lock:
            late = base in self._lease_expired_bases
            if late:
                self._lease_expired_bases.discard(base)
        return late

    def _reject_late_registration(self, reg: dict[str, Any], notif: bytes) -> None:
        self._reject_push_reg(PushRegRejection.AFTER_LEASE,
                              f"request {peer_str(reg['request_id'])}: this prefill's KV lease for it "
                              "ended before the PUSH_REG arrived (decoder too slow, or lease too short: "
                              "VLLM_NIXL_ABORT_REQUEST_TIMEOUT)", notif)
        self._tell_decoder(reg, PushFailReason.LEASE_EXPIRED)

    def _tell_decoder(self, reg: dict[str, Any], reason: PushFailReason) -> None:
        """P: send PUSH_FAIL to the decoder of `reg`, connecting first when needed."""
        d_id, eid = peer_str(reg.get("request_id", "")), reg.get("decode_engine_id")
        if not wants_push_fail(reg):
            logger.warning("Decoder %s cannot be told that request %s gets no KV (it does not "
                           "understand PUSH_FAIL); it waits for its registration timeout",
                           peer_str(eid), d_id)
            return
        try:
            with self._triggered_by(Trigger.PUSH_REG_EARLY):
                fut = self._ensure_handshake(eid, reg["decode_host"], reg["decode_port"],
                                             reg["decode_tp_size"])
        except Exception:
            logger.warning("Could not reach decoder %s to fail request %s", peer_str(eid), d_id,
                           exc_info=True)
            return
        notif = encode_push_fail(reg["request_id"], reason)
        if fut is None:
            self._send_push_fail(eid, d_id, notif)
        else:
            fut.add_done_callback(lambda f: f.exception() is None and self._send_push_fail(eid, d_id, notif))

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

    # ------------------------------------------------------------------ D side
    def _take_push_fail_notifs(self) -> None:
        """D (main thread): act on the PUSH_FAILs the writer set aside (see `NotifInbox`).
        The worker's `get_transfer_results` calls it when the deque is not empty, before
        vLLM's, which then fails the receives named here."""
        pending = self._pending_completion_notifs.push_fails
        while pending:
            self._on_push_fail(pending.popleft())

    def _on_push_fail(self, notif: bytes) -> None:
        parsed = decode_push_fail(notif)
        if parsed is None:
            logger.warning("Dropped a malformed PUSH_FAIL notification (%d bytes)", len(notif))
            return
        req_id, reason = parsed
        if req_id not in self._recving_metadata:
            logger.debug("PUSH_FAIL for request %s, which is not waiting here", peer_str(req_id))
            return
        logger.warning("Request %s: its prefill reports the KV will never be pushed (%s: the "
                       "prefill's KV lease ended first); failing the KV load now instead of "
                       "waiting for push_registration_timeout", peer_str(req_id), reason.value)
        self._failed_recv_reqs.put(req_id)
