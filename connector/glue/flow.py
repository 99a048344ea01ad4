"""What the worker's flows share: the one interface between them.

`ObservedPushWorker` (worker.py) is vLLM's push worker plus one mixin per flow, each
in a module of its own:
- handshakes.py `HandshakeFlow`: flavor, dedup, upgrade, retries, phases;
- receive.py `ReceiveFlow` (D): registration, PUSH_REG, PUSH_FAIL received;
- push.py `PushFlow` (P): PUSH_REG intake until the WRITE is done, PUSH_FAIL sent;
- leases.py `LeaseFlow`: P's KV leases (renewal, expiry) and D's heartbeats.
Every flow subclasses `Flow`. A flow uses its own methods, vLLM's, and only what
`Flow` declares here of the others: the state the worker's `__init__` sets, and the
methods one flow offers the rest. It never imports a sibling flow module
(tests/test_seams.py checks both).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.glue.retry import RetryPolicy
    from connector.telemetry.in_flight import InFlight
    from connector.telemetry.receives import ReceiveClock
    from connector.telemetry.span_table import BoundedIdSet, SpanTable
    from connector.telemetry.stats import ObservedNixlStats
    from connector.telemetry.tracing import SpanEmitter
    from connector.vocabulary import PushFailReason, Trigger


class Flow:
    """Declarations only; each method is implemented by the flow named above it."""

    # ---------------------------------------------- state set by the worker's __init__
    xfer_stats: ObservedNixlStats
    _spans: SpanEmitter
    _kv_role: str
    # Per-thread handshake scope: `trigger`, `parent` (see HandshakeFlow), `deferred`.
    _trigger_local: threading.local
    # What an untagged handshake on vLLM's writer thread is for (by role).
    _writer_trigger: Trigger | None
    _retry_policy: RetryPolicy
    _handshake_timeout_ms: int
    _notif_only_engines: set[str]
    _pending_jobs: dict[str, Any]
    _in_flight: InFlight
    # D: registration handed to the worker until the KV landed, failed or expired.
    _receive_clock: ReceiveClock
    _receive_spans: SpanTable
    _register_spans: SpanTable
    # P: PUSH_REG matched until the WRITE is done; P's own request trace contexts.
    _write_spans: SpanTable
    _request_contexts: SpanTable
    # P: pushes posted / failed, leases that ended without a WRITE (under _push_lock).
    _push_lock: threading.Lock
    _pushing: BoundedIdSet
    _push_failed: BoundedIdSet
    _lease_expired: BoundedIdSet

    # ----------------------------------------------------------- HandshakeFlow offers
    def _run_triggered(self, trigger: Trigger, parent: Any, call: Callable[..., Any],
                       *args: Any) -> Any:
        """`call(*args)` with the handshakes it starts tagged `trigger`, parented on
        `parent` (a span, or None)."""
        raise NotImplementedError

    # ------------------------------------------------------------ ReceiveFlow offers
    def _start_receives(self, registrations: dict[str, dict[str, Any]]) -> None:
        """D: time (and trace) the receives vLLM hands over this step."""
        raise NotImplementedError

    def _take_push_fail_notifs(self) -> None:
        """D (main thread): fail the receives P said will never get their KV."""
        raise NotImplementedError

    def _end_receive_spans(self, req_id: str, error_type: str, message: str) -> None:
        """D: end a receive's register and receive spans as failed."""
        raise NotImplementedError

    # --------------------------------------------------------------- PushFlow offers
    def _keep_request_contexts(self, metadata: Any) -> None:
        """P: keep the trace contexts of requests whose blocks ship this step."""
        raise NotImplementedError

    def _mark_push_failed(self, req_id: str, failure_type: str, message: str) -> None:
        """P: count the push failed (once) and end its write span."""
        raise NotImplementedError

    def _note_lease_ended_unpushed(self, req_id: str) -> None:
        """P: the request's lease ended without a WRITE (caller holds `_push_lock`)."""
        raise NotImplementedError

    def _tell_decoder(self, reg: dict[str, Any], reason: PushFailReason) -> None:
        """P: send PUSH_FAIL to the decoder of a PUSH_REG, connecting first if needed."""
        raise NotImplementedError

    # -------------------------------------------------------------- LeaseFlow offers
    _lease_granted: dict[str, float]  # P: request id -> when its lease was granted
    _leases_report_owed: bool

    def _note_leases_granted(self, reqs_to_send: dict[str, float]) -> None:
        """P (main thread, after vLLM's `start_load_kv`): the leases started this step."""
        raise NotImplementedError

    def _note_lease_registered(self, p_request_id: str) -> None:
        """P (writer thread): a decoder's PUSH_REG matched this request."""
        raise NotImplementedError

    def _lease_events(self, req_id: str, span: Any) -> None:
        """P: put the request's renewals and expiry on its write span before it ends."""
        raise NotImplementedError

    def _leases_ended(self, req_ids: Any) -> None:
        """P (main thread): these requests were pushed or released this step."""
        raise NotImplementedError

    def _report_leases(self) -> None:
        """P: refresh the lease gauges (throttled)."""
        raise NotImplementedError

    def _notif_sent(self, notif: Any, ok: bool) -> None:
        """Every NIXL notification this worker sent, or failed to send."""
        raise NotImplementedError
