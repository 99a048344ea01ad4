"""What the worker's flows share: the one interface between them.

`ObservedPushWorker` (worker.py) is vLLM's push worker plus one mixin per flow, each
in a module of its own:
- handshakes.py `HandshakeFlow`: flavor, dedup, upgrade, retries, phases;
- receive.py `ReceiveFlow` (D): registration, PUSH_REG, PUSH_FAIL received;
- push.py `PushFlow` (P): PUSH_REG intake until the WRITE is done, PUSH_FAIL sent;
- leases.py `LeaseFlow`: P's KV leases (renewal, expiry) and D's heartbeats;
- peers.py `PeerFlow`: peers that stop working (dropped, re-handshaken, their requests
  failed instead of left waiting).
The push state itself (leases, WRITEs, receives, peers) lives in the owner objects of
connector/state, each behind its own lock; the flows change it only through them.
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
    from connector.state.leases import LeaseLedger
    from connector.state.peers import PeerTable
    from connector.state.receives import ReceiveLedger
    from connector.telemetry.in_flight import InFlight
    from connector.telemetry.receives import ReceiveClock
    from connector.telemetry.span_table import BoundedIdSet, SpanTable
    from connector.telemetry.stats import ObservedNixlStats
    from connector.telemetry.tracing import SpanEmitter
    from connector.vocabulary import ReceiveAbandon, Trigger


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
    # The push state's owners (connector/state): P's leases and WRITEs, D's receives,
    # the remote engines. Every thread goes through their methods.
    _leases: LeaseLedger
    _receives: ReceiveLedger
    _peers: PeerTable
    # P: pushes counted started / failed (once per request; under _push_lock).
    _push_lock: threading.Lock
    _pushing: BoundedIdSet
    _push_failed: BoundedIdSet

    # ----------------------------------------------------------- HandshakeFlow offers
    # The pool handshakes (and D's liveness probes) run on; the lock every NIXL and
    # vLLM registration call of a remote engine takes (re-entrant).
    _handshake_pool: Any
    _registration_lock: Any

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
        """D (main thread): PUSH_FAILs that reached vLLM's queue (no agent known)."""
        raise NotImplementedError

    def _push_fail_from(self, agent: Any, notif: bytes) -> None:
        """D: a P agent's PUSH_FAIL (writer, or main for one with no agent known)."""
        raise NotImplementedError

    def _end_receive_spans(self, req_id: str, error_type: str, message: str) -> None:
        """D: end a receive's register and receive spans as failed."""
        raise NotImplementedError

    # --------------------------------------------------------------- PushFlow offers
    _pending_since: dict[str, float]  # P (writer): unmatched PUSH_REGs, by D request id

    def _keep_request_contexts(self, metadata: Any) -> None:
        """P: keep the trace contexts of requests whose blocks ship this step."""
        raise NotImplementedError

    def _mark_push_failed(self, req_id: str, failure_type: str, message: str) -> None:
        """P: count the push failed (once) and end its write span."""
        raise NotImplementedError

    def _send_owed_push_fails(self) -> None:
        """P (writer): send the PUSH_FAILs the lease ledger owes decoders."""
        raise NotImplementedError

    def _count_push_fail(self, reason: Any, outcome: Any) -> None:
        """P: one PUSH_FAIL sent, or undeliverable."""
        raise NotImplementedError

    def _answer_unmatched(self, now: float) -> None:
        """P (writer): PUSH_REGs no request matched in time are answered no_prefill."""
        raise NotImplementedError

    # -------------------------------------------------------------- LeaseFlow offers
    _leases_report_owed: bool

    def _grant_ahead(self, metadata: Any) -> list[str]:
        """P (main, before vLLM's `start_load_kv`): the leases this step starts, granted
        in the ledger before vLLM hands the writer their blocks."""
        raise NotImplementedError

    def _note_leases_granted(self, granted: list[str]) -> None:
        """P (main thread, after vLLM's `start_load_kv`): vLLM's exact deadlines."""
        raise NotImplementedError

    def _renew_from(self, agent: Any, message: bytes) -> None:
        """P (writer): a heartbeat notification arrived from a decoder's agent."""
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

    def _count_heartbeat(self, ok: bool) -> None:
        """D: one heartbeat notification sent, or failed."""
        raise NotImplementedError

    # --------------------------------------------------------------- PeerFlow offers

    def _release_kept_transfer_info(self, engine_id: str) -> None:
        """Pool thread, under the registration lock, before a handshake registers the
        engine with vLLM: drop what was kept of it since its connection was dropped."""
        raise NotImplementedError

    def _notif_sent(self, notif: Any, ok: bool, agent: Any = None) -> None:
        """Every NIXL notification this worker sent, or failed to send (the probe's hook)."""
        raise NotImplementedError

    def _notifs_received(self, notifs: dict[Any, list[bytes]]) -> dict[Any, list[bytes]]:
        """Writer, each pass (vLLM's `get_new_notifs`, through the probe): contact,
        heartbeats and the writer's own due work; returns what vLLM's loop handles."""
        raise NotImplementedError

    def _note_peer_agents(self, engine_id: str, agents: dict[Any, str]) -> bool:
        """A handshake ended with these agents; True when the peer restarted."""
        raise NotImplementedError

    def _after_reset(self, engine_id: str) -> str:
        """Why the connection a handshake now replaces was dropped ("" if none)."""
        raise NotImplementedError

    def _registration_sent(self, req_id: str, reg_data: dict[str, Any], agents: dict[Any, str],
                           failed: int) -> None:
        """D (writer): which agents a PUSH_REG reached (`failed` of them did not)."""
        raise NotImplementedError

    def _fail_receive(self, req_id: str, reason: Any) -> None:
        """D: fail a receive now (vLLM recomputes or fails the request): only when no
        WRITE into its blocks can come (see connector/state/receives.py)."""
        raise NotImplementedError

    def _give_up_receive(self, req_id: str, why: ReceiveAbandon) -> None:
        """D (main): stop waiting for a receive; it fails once no WRITE can reach it."""
        raise NotImplementedError

    def _push_broke(self, request_id: str, why: Any = None) -> None:
        """P: a WRITE of the request failed (`why`: the error, if any)."""
        raise NotImplementedError

    def _tend_peers(self) -> None:
        """Main thread, each step while a peer is suspect, dropped or waited on."""
        raise NotImplementedError
