"""What the worker's flows share: the one interface between them.

`ObservedPushWorker` (worker.py) is vLLM's push worker plus one mixin per flow, each
in a module of its own:
- handshakes.py `HandshakeFlow`: flavor, dedup, upgrade, retries, phases;
- receive.py `ReceiveFlow` (D): registration, PUSH_REG out, PUSH_FAIL and completions in;
- push.py `PushFlow` (P): PUSH_REG intake until the WRITE settled, PUSH_FAIL sent;
- leases.py `LeaseFlow`: P's KV leases (renewal, expiry) and D's heartbeats;
- peers.py `PeerFlow`: peers that stop working (dropped, re-handshaken, their requests
  failed instead of left waiting);
- integrity.py `IntegrityFlow`: the KV digest P sends ahead of each WRITE, D's check.
The push state itself (connections, leases, WRITEs, receives) lives in the owner
objects of connector/state, each behind its own lock; the flows change it only through
them. Every flow subclasses `Flow`. A flow uses its own methods, vLLM's, and only what
`Flow` declares here of the others: the state the worker's `__init__` sets, and the
methods one flow offers the rest. It never imports a sibling flow module
(tests/test_seams.py checks both, for the flows and for worker.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    from connector.glue.retry import RetryPolicy
    from connector.state.connections import ConnectionTable
    from connector.state.digests import DigestInbox
    from connector.state.leases import LeaseLedger
    from connector.state.receives import ReceiveLedger
    from connector.telemetry.in_flight import InFlight
    from connector.telemetry.receives import ReceiveClock
    from connector.telemetry.span_table import SpanTable
    from connector.telemetry.stats import ObservedNixlStats
    from connector.telemetry.tracing import SpanEmitter
    from connector.trust.secret import PeerSecret
    from connector.vocabulary import (
        InternalStep,
        PushFailOutcome,
        PushFailReason,
        ReceiveAbandon,
        ReceiveFailure,
        Trigger,
    )


# Work that could not use a connection, parked in the connection table until it is
# replaced (connector/state/connections.py); `PeerFlow._release_parked` sends it again.
@dataclass(frozen=True, slots=True)
class ParkedRegistration:
    """D: a PUSH_REG that reached no agent of P (to the writer's registration inbox)."""

    req_id: str
    reg: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ParkedPush:
    """P: a claimed push whose decoder's connection was being dropped (to the writer's
    deferred-push inbox; it connects again)."""

    req_id: str
    blocks: Any
    reg: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ParkedPushFail:
    """P: a PUSH_FAIL that reached no agent of the decoder (owed again)."""

    reg: dict[str, Any]
    reason: PushFailReason


class Flow:
    """Declarations only; each method is implemented by the flow named above it."""

    # ---------------------------------------------- state set by the worker's __init__
    xfer_stats: ObservedNixlStats
    _spans: SpanEmitter
    _kv_role: str
    _retry_policy: RetryPolicy
    _handshake_timeout_ms: int
    _peer_secret: PeerSecret | None  # the deployment's secret (connector/trust), if set
    _in_flight: InFlight
    # D: registration handed to the worker until the KV landed, failed or expired.
    _receive_clock: ReceiveClock
    _receive_spans: SpanTable
    _register_spans: SpanTable
    # P: PUSH_REG matched until the WRITE is done; P's own request trace contexts.
    _write_spans: SpanTable
    _request_contexts: SpanTable
    # The push state's owners (connector/state): the remote engines and connections,
    # P's leases and WRITEs, D's receives. Every thread goes through their methods.
    _connections: ConnectionTable
    _leases: LeaseLedger
    _receives: ReceiveLedger

    # ------------------------------------- each flow's part of the worker's __init__
    def _init_handshakes(self) -> None:
        """HandshakeFlow: its pool and registration lock (before the state's owners)."""
        raise NotImplementedError

    def _init_push(self, extra: Any) -> None:
        """PushFlow: its settings and writer-owned maps."""
        raise NotImplementedError

    def _init_leases(self) -> None:
        """LeaseFlow: the lease gauges' clock and D's kept heartbeats."""
        raise NotImplementedError

    def _init_peers(self, extra: Any) -> None:
        """PeerFlow: its timings."""
        raise NotImplementedError

    def _start_idle_poll(self) -> None:
        """PeerFlow: P's idle-poll thread (the worker's `__init__` only: a worker built
        without an engine starts no thread)."""
        raise NotImplementedError

    def _init_integrity(self, extra: Any) -> None:
        """IntegrityFlow: the verify policy, the digest inbox, its owned maps."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the worker
    def _internal_error(self, step: InternalStep, what: str) -> None:
        """A data-path step raised (call it in the `except`): logged at ERROR with the
        traceback and counted; the caller then ends the request by the failure path."""
        raise NotImplementedError

    # ----------------------------------------------------------- HandshakeFlow offers
    # The pool handshakes (and D's liveness probes) run on; the lock every NIXL and
    # vLLM registration call of a remote engine takes (re-entrant).
    _handshake_pool: Any
    _registration_lock: Any

    def _connect(self, trigger: Trigger, parent: Any, engine_id: str, host: str, port: int,
                 tp_size: int, tail: dict[str, Any] | None = None) -> Future | None:
        """A connection to `engine_id` for what `trigger` needs: None when usable now,
        else the future of the handshake that makes it (its spans under `parent`)."""
        raise NotImplementedError

    # ------------------------------------------------------------ ReceiveFlow offers
    def _start_receives(self, registrations: dict[str, dict[str, Any]]) -> None:
        """D (main): the receives vLLM hands over this step, started (and traced)."""
        raise NotImplementedError

    def _push_fail_from(self, agent: Any, notif: bytes) -> None:
        """D (writer, from the router): a P agent's PUSH_FAIL."""
        raise NotImplementedError

    def _push_fail_lost(self, notif: bytes) -> None:
        """D (writer, from the router): handling this PUSH_FAIL raised."""
        raise NotImplementedError

    def _write_landed_from(self, agent: Any, message: bytes) -> None:
        """D (writer, from the router): a P agent's completion notification."""
        raise NotImplementedError

    def _end_receive_spans(self, req_id: str, error_type: str, message: str) -> None:
        """D: end a receive's register and receive spans as failed."""
        raise NotImplementedError

    def _fail_receive(self, req_id: str, reason: ReceiveFailure) -> None:
        """D: fail a receive now (vLLM recomputes or fails the request): only when no
        WRITE into its blocks can come (see connector/state/receives.py)."""
        raise NotImplementedError

    def _give_up_receive(self, req_id: str, why: ReceiveAbandon) -> None:
        """D: stop waiting for a receive; it fails once no WRITE can reach it."""
        raise NotImplementedError

    # --------------------------------------------------------------- PushFlow offers
    _pending_since: dict[str, float]  # P (writer): unmatched PUSH_REGs, by D request id

    def _keep_request_contexts(self, metadata: Any) -> None:
        """P: keep the trace contexts of requests whose blocks ship this step."""
        raise NotImplementedError

    def _writer_due_work(self) -> None:
        """P (writer, after each read of the notifications): owed PUSH_FAILs sent,
        unmatched PUSH_REGs answered."""
        raise NotImplementedError

    def _settle_writes(self, results: KVConnectorTransferResults) -> None:
        """P (main, after vLLM's step): the WRITEs that settled."""
        raise NotImplementedError

    def _abort_overdue_writes(self) -> None:
        """P (main, after vLLM polled the WRITEs): claims past push_write_timeout_s."""
        raise NotImplementedError

    def _push_failed(self, req_id: str, failure_type: str, message: str) -> None:
        """P: the push of `req_id` failed (the claim fails; its decoder is told)."""
        raise NotImplementedError

    def _mark_push_failed(self, req_id: str, failure_type: str, message: str) -> None:
        """P: count the push failed (once) and end its write span (telemetry only)."""
        raise NotImplementedError

    def _count_push_fail(self, reason: PushFailReason, outcome: PushFailOutcome) -> None:
        """P: one PUSH_FAIL sent, or undeliverable."""
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
        """P (writer, from the router): a heartbeat notification from a decoder's agent."""
        raise NotImplementedError

    def _lease_events(self, req_id: str, span: Any) -> None:
        """P: put the request's renewals and expiry on its write span before it ends."""
        raise NotImplementedError

    def _leases_ended(self, req_ids: Iterable[str]) -> list[str]:
        """P (main thread): these requests were pushed or released this step; returns
        those whose push completed."""
        raise NotImplementedError

    def _report_leases(self) -> None:
        """P: refresh the lease gauges (throttled)."""
        raise NotImplementedError

    def _record_push_stages(self, settled: Any) -> None:
        """P (main): a completed push's TTFT stages into the stats (telemetry)."""
        raise NotImplementedError

    # --------------------------------------------- per-request telemetry steps
    # Declared so that benchmarks/telemetry_cost.py drives exactly the code the flows run,
    # one step at a time (each catches and counts its own faults where the flows call it).
    def _open_receive_spans(self, registrations: dict[str, dict[str, Any]]) -> None:
        """D (ReceiveFlow): the receive spans of the registrations handed over."""
        raise NotImplementedError

    def _open_register_span(self, req_id: str, reg_data: dict[str, Any]) -> Any:
        """D (ReceiveFlow): the register span; its trace context into the PUSH_REG."""
        raise NotImplementedError

    def _open_write_span(self, request_id: str, local_block_ids: Any,
                         registration_data: dict[str, Any]) -> tuple[Any, bool]:
        """P (PushFlow): the write span, and whether it is kept for the main thread."""
        raise NotImplementedError

    def _note_handshake_wait(self, request_id: str, span: Any) -> None:
        """P (PushFlow): how long the WRITE waited for its P->D handshake."""
        raise NotImplementedError

    def _observe_results(self, results: KVConnectorTransferResults, completed: Any,
                         failures: dict[str, Any]) -> None:
        """The worker (main): the step's ended pushes and receives, counted, spans ended."""
        raise NotImplementedError

    # --------------------------------------------------------------- PeerFlow offers
    def _release_kept_transfer_info(self, engine_id: str) -> None:
        """Pool thread, under the registration lock, before a handshake registers the
        engine with vLLM: drop what was kept of it since its connection was dropped."""
        raise NotImplementedError

    def _peer_restarted(self, engine_id: str, old_agents: frozenset[str]) -> None:
        """A handshake found a new agent where a dropped one was: its receives fail."""
        raise NotImplementedError

    def _peer_restart_failsafe(self, engine_id: str) -> None:
        """Failing a restarted peer's receives raised: give them up instead."""
        raise NotImplementedError

    def _release_parked(self, items: list[Any]) -> None:
        """Work parked for a new connection goes again (any thread)."""
        raise NotImplementedError

    def _suspect_write_target(self, request_id: str, why: Any = None) -> None:
        """P: a WRITE of the request failed (`why`: the error): suspect its connection."""
        raise NotImplementedError

    def _tend_due(self) -> bool:
        """Main, each step: whether `_tend_peers` has something to do."""
        raise NotImplementedError

    def _tend_peers(self) -> None:
        """Main thread, each step while a peer is suspect, dropped or waited on."""
        raise NotImplementedError

    # ---------------------------------------------------------- IntegrityFlow offers
    _digest_wanted: set[str]  # P (writer): requests whose WRITEs being posted carry a digest
    _digests: DigestInbox  # D: the digests P's ranks sent (writer puts, main takes)
    _verify_wanted: dict[str, Any]  # D (main): sampled receives, until their KV landed

    def _ask_for_digest(self, req_id: str, reg: dict[str, Any]) -> None:
        """D (writer): ask for a KV digest in this PUSH_REG copy, if sampled."""
        raise NotImplementedError

    def _digest_asked(self, reg: dict[str, Any]) -> bool:
        """P: this PUSH_REG asked for a KV digest (and P's ratio is not 0)."""
        raise NotImplementedError

    def _send_kv_digest(self, read_spec: Any, dst_engine_id: str, remote_request_id: str) -> None:
        """P (writer, before vLLM posts the WRITE of `read_spec`): its digest to its D rank."""
        raise NotImplementedError

    def _kv_digest_from(self, agent: Any, message: bytes) -> None:
        """D (writer, from the router): a P rank's KV digest."""
        raise NotImplementedError

    def _note_verify_wanted(self, registrations: dict[str, dict[str, Any]]) -> None:
        """D (main): the receives handed over this step that are checked."""
        raise NotImplementedError

    def _verify_landed(self, results: KVConnectorTransferResults) -> dict[str, ReceiveFailure]:
        """D (main, after vLLM's step): check the sampled receives whose KV landed; with
        `kv_verify_action=fail`, a mismatch or a lost digest fails the receive (returned,
        with why)."""
        raise NotImplementedError
