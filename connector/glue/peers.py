"""Peers that stop working: drop the dead NIXL connection, re-handshake, and do not let
requests wait for KV that is gone.

Upstream, a worker keeps a remote engine's NIXL agent until `engine_ttl` (an hour). When
the peer restarts under the same engine id (a pod restart) every notification and WRITE
goes to the dead agent, nothing re-handshakes, and the requests waiting on it wait for
`push_registration_timeout` (480 s), until the worker itself restarts.

Here:
- A notification (heartbeat, PUSH_REG, PUSH_FAIL) or a WRITE to a peer's agent that
  fails marks the peer suspect (any thread). At the next engine step, on the main
  thread, when no WRITE to it is in flight, the connection is dropped (vLLM's own
  `_cleanup_remote_engine`) and counted (`vllm:nixl_peer_resets_total{reason}`); the
  next request to it re-handshakes (its span says `after_reset`).
- D: a PUSH_REG that reached no agent is sent again once reconnected. When the
  re-handshake finds a new NIXL agent (the peer restarted: `vllm:nixl_peer_restarts`),
  the receives whose PUSH_REG reached the old agent are failed at once: their KV
  died with it. When the peer stays unreachable for longer than a lease, they are
  failed too (by then P has released them and will not WRITE into D's blocks).
- P: a request whose WRITE failed is reported to its decoder with PUSH_FAIL once the
  connection is back; a PUSH_REG no request of P matches within
  `unmatched_push_reg_timeout_s` (default: the lease) is answered with PUSH_FAIL
  (`no_prefill`: e.g. its prefill died with P's previous instance).
- P, idle: vLLM's writer reads NIXL notifications only when something wakes it, and an
  engine steps only while it has work. A PUSH_REG that reaches an idle prefill (late:
  after a network partition healed, or meant for P's previous instance) would wait
  unread, and its decoder with it, until P's next request. A timer thread wakes the
  writer and answers unmatched PUSH_REGs every `IDLE_POLL_INTERVAL_S`.
A failed receive is then recomputed or failed by vLLM, per `kv_load_failure_policy`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from connector.glue.flow import Flow
from connector.glue.wire import HEARTBEAT_PREFIX
from connector.telemetry import errors
from connector.telemetry.span_table import MAX_TRACKED_REQUESTS, BoundedIdSet
from connector.telemetry.tracing import peer_str
from connector.vocabulary import (
    Direction,
    PeerReset,
    PushFailReason,
    PushRegRejection,
    ReceiveFailure,
    TelemetryError,
)

logger = logging.getLogger(__name__)

# NIXL errors that refuse one transfer for what it asked (descriptors outside the
# registered memory, a bad parameter), not because the peer or the link failed.
REQUEST_REFUSALS = frozenset({"nixlInvalidParamError", "nixlNotFoundError", "nixlNotAllowedError",
                              "nixlMismatchError", "nixlNotSupportedError"})
# P: how often the writer is woken to read notifications, and registrations no
# request matched are looked for, also while the engine is idle (s).
IDLE_POLL_INTERVAL_S = 0.5


class PeerFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: dead peers dropped, waiting requests failed."""

    def _init_peers(self) -> None:
        extra = self.kv_transfer_config.get_from_extra_config
        lease = float(extra("kv_lease_duration", 30))
        # D fails receives bound to an unreachable P after this long without contact:
        # P's lease (and so any WRITE into them) has surely ended by then.
        self._unreachable_after_s = lease + max(1.0, lease // 6)
        self._unmatched_after_s = float(extra("unmatched_push_reg_timeout_s", lease))
        self._peer_lock = threading.Lock()
        self._agent_engines: dict[str, str] = {}  # remote agent name -> its engine id
        self._suspects: dict[str, tuple[PeerReset, set[str]]] = {}
        # Engine -> (agents dropped, when, why) until the next handshake to it ends.
        self._dropped: dict[str, tuple[frozenset[str], float, PeerReset]] = {}
        self._last_contact: dict[str, float] = {}
        # D: request -> (engine, agents its PUSH_REG reached); PUSH_REGs that reached none.
        self._registered_with: OrderedDict[str, tuple[str, frozenset[str]]] = OrderedDict()
        self._undelivered: dict[str, dict[str, dict[str, Any]]] = {}
        self._abandoned = BoundedIdSet()  # D: receives failed here: send no PUSH_REG for them
        self._fail_reasons: dict[str, ReceiveFailure] = {}  # D: until the failure is reported
        # P: request -> (decode engine, PUSH_REG) of pushes started; PUSH_FAILs owed.
        self._push_targets: OrderedDict[str, tuple[str, dict[str, Any]]] = OrderedDict()
        self._notices: dict[str, list[tuple[dict[str, Any], PushFailReason]]] = {}
        # P: D request id -> when its PUSH_REG was stored unmatched; those answered no_prefill.
        self._pending_since: dict[str, float] = {}
        self._unmatched_rejected = BoundedIdSet()
        self._kept_transfer_info: set[str] = set()  # engines dropped whose vLLM transfer info stays
        self._idle_stop = threading.Event()
        if self._kv_role != "kv_consumer":
            threading.Thread(target=self._poll_while_idle, name="nixl-idle-poll", daemon=True).start()

    @property
    def _direction(self) -> str:
        return (Direction.D_TO_P if self._kv_role == "kv_consumer" else Direction.P_TO_D).value

    # ---------------------------------------------------------------- signals
    def _notif_sent(self, notif: Any, ok: bool, agent: Any = None) -> None:
        if isinstance(notif, bytes) and notif.startswith(HEARTBEAT_PREFIX):
            self._count_heartbeat(ok)
        engine = self._agent_engines.get(agent)
        if engine is None:
            return
        if ok:
            self._last_contact[engine] = time.monotonic()
        else:
            self._peer_failed(engine, PeerReset.NOTIFICATION_FAILED, agent)

    def _peer_failed(self, engine_id: str, reason: PeerReset, agent: str | None = None) -> None:
        """Any thread: a notification or WRITE to this engine failed."""
        with self._peer_lock:
            _, agents = self._suspects.get(engine_id, (reason, set()))
            if agent is not None:
                agents.add(agent)
            self._suspects[engine_id] = (reason, agents)

    def _note_peer_agents(self, engine_id: str, agents: dict[Any, str]) -> bool:
        """A handshake to `engine_id` ended with these agents (pool thread)."""
        with self._peer_lock:
            for name in agents.values():
                self._agent_engines[name] = engine_id
            dropped = self._dropped.pop(engine_id, None)
        self._last_contact[engine_id] = time.monotonic()
        if dropped is None:
            return False
        old_agents, _, _ = dropped
        if old_agents & set(agents.values()):
            return False  # the same agent: the peer did not restart (a network blip)
        logger.warning("Remote engine %s came back with a new NIXL agent (it restarted): "
                       "requests whose KV it held are failed now", peer_str(engine_id))
        self._safe(self.xfer_stats.record_peer_restart, self._direction)
        self._fail_receives_on(engine_id, old_agents, ReceiveFailure.PEER_RESTARTED)
        return True

    def _after_reset(self, engine_id: str) -> str:
        """Why the connection a handshake starting now replaces was dropped ("" if none)."""
        dropped = self._dropped.get(engine_id)
        return dropped[2].value if dropped is not None else ""

    # ------------------------------------------------------------------- D side
    def _registration_sent(self, req_id: str, reg_data: dict[str, Any], agents: dict[Any, str],
                           failed: int) -> None:
        """D (writer thread): where a PUSH_REG went; one that reached no agent is kept
        to send again once the connection is back."""
        engine = reg_data.get("remote_engine_id")
        if not isinstance(engine, str) or not agents:
            return
        with self._peer_lock:
            if failed >= len(agents):
                self._undelivered.setdefault(engine, {})[req_id] = reg_data
            else:
                self._registered_with[req_id] = (engine, frozenset(agents.values()))
                while len(self._registered_with) > MAX_TRACKED_REQUESTS:
                    self._registered_with.popitem(last=False)

    def _receive_over(self, req_id: str) -> ReceiveFailure | None:
        """D (main thread): the receive finished or failed; why we failed it, if we did."""
        with self._peer_lock:
            self._registered_with.pop(req_id, None)
        return self._fail_reasons.pop(req_id, None)

    def _note_receive_failure(self, req_id: str, reason: ReceiveFailure) -> None:
        self._fail_reasons[req_id] = reason
        while len(self._fail_reasons) > MAX_TRACKED_REQUESTS:
            self._fail_reasons.pop(next(iter(self._fail_reasons)))

    def _fail_receive(self, req_id: str, reason: ReceiveFailure) -> None:
        """D: fail a receive now (vLLM recomputes or fails it) and send no PUSH_REG for it."""
        self._note_receive_failure(req_id, reason)
        self._abandoned.add(req_id)
        self._failed_recv_reqs.put(req_id)

    def _fail_receives_on(self, engine_id: str, agents: frozenset[str], reason: ReceiveFailure) -> None:
        with self._peer_lock:
            doomed = [r for r, (eid, sent_to) in self._registered_with.items()
                      if eid == engine_id and sent_to <= agents]
            for req_id in doomed:
                del self._registered_with[req_id]
        for req_id in doomed:
            logger.warning("Request %s: failing its KV load (%s: the KV it waits for was on "
                           "engine %s's previous NIXL agent)", req_id, reason.value, peer_str(engine_id))
            self._fail_receive(req_id, reason)

    # ------------------------------------------------------------------- P side
    def _push_started(self, request_id: str, reg: dict[str, Any]) -> None:
        """P (writer thread): a push to this decoder is under way."""
        engine = reg.get("decode_engine_id")
        if isinstance(engine, str):
            with self._peer_lock:
                self._push_targets[request_id] = (engine, reg)
                while len(self._push_targets) > MAX_TRACKED_REQUESTS:
                    self._push_targets.popitem(last=False)

    def _push_over(self, request_id: str) -> None:
        with self._peer_lock:
            self._push_targets.pop(request_id, None)

    def _push_broke(self, request_id: str, why: Any = None) -> None:
        """P: the request's WRITE failed: owe its decoder a PUSH_FAIL, and suspect the
        connection unless NIXL refused the request itself (bad descriptors: the
        connection is fine, and dropping it would cost every request in flight on it)."""
        with self._peer_lock:
            target = self._push_targets.pop(request_id, None)
            if target is None:
                return
            engine, reg = target
            if type(why).__name__ in REQUEST_REFUSALS:
                refused = True
            else:
                refused = False
                self._notices.setdefault(engine, []).append((reg, PushFailReason.PUSH_FAILED))
        if refused:
            self._tell_decoder(reg, PushFailReason.PUSH_FAILED)
        else:
            self._peer_failed(engine, PeerReset.TRANSFER_FAILED)

    def _registration_pending(self, d_request_id: str) -> None:
        """P (writer thread): a PUSH_REG waits for its prefill."""
        self._pending_since[d_request_id] = time.monotonic()

    def _registration_refused(self, d_request_id: str) -> bool:
        """P (writer thread): this PUSH_REG was answered no_prefill: never WRITE for it."""
        return d_request_id in self._unmatched_rejected

    # --------------------------------------------------------------- each step
    def _tend_peers(self) -> None:
        """Main thread, each step while there is anything to tend."""
        if self._suspects:
            self._reset_suspects()
        if self._dropped:
            self._fail_unreachable()

    def _reset_suspects(self) -> None:
        with self._peer_lock:
            suspects = dict(self._suspects)
        for engine_id, (reason, agents) in suspects.items():
            with self._handshake_lock:
                current = dict.get(self._remote_agents, engine_id) or {}
                handshaking = engine_id in self._handshake_futures
            if handshaking:
                continue  # a new connection is being made: judge it when it is done
            if not current or (agents and not agents & set(current.values())):
                self._forget_suspect(engine_id)  # already gone, or replaced since
                continue
            if self._writes_in_flight_to(engine_id):
                continue  # let them end (vLLM releases their handles) before dropping
            self._forget_suspect(engine_id)
            self._drop_peer(engine_id, frozenset(current.values()), reason)

    def _forget_suspect(self, engine_id: str) -> None:
        with self._peer_lock:
            self._suspects.pop(engine_id, None)

    def _writes_in_flight_to(self, engine_id: str) -> bool:
        with self._peer_lock:
            mine = {r for r, (eid, _) in self._push_targets.items() if eid == engine_id}
        if not mine:
            return False
        with self._sending_transfers_lock:
            return any(self._sending_transfers.get(r) for r in mine)

    def _drop_peer(self, engine_id: str, agents: frozenset[str], reason: PeerReset) -> None:
        kept = self._transfer_info_of(engine_id)
        try:
            self._cleanup_remote_engine(engine_id, log_eviction=False)
        except Exception:
            logger.warning("Could not drop the NIXL connection to %s", peer_str(engine_id),
                           exc_info=True)
            return
        if kept:
            # A WRITE the peer finished before we dropped it can still complete here:
            # vLLM's post-processing of that receive reads the peer's transfer info.
            # Kept until the next handshake to the peer registers it anew.
            for info in kept:
                self.transfer_topo.register_remote_engine(engine_id, info)
            self._kept_transfer_info.add(engine_id)
        with self._peer_lock:
            self._dropped[engine_id] = (agents, time.monotonic(), reason)
            for name in agents:
                self._agent_engines.pop(name, None)
            resend = self._undelivered.pop(engine_id, {})
            notices = self._notices.pop(engine_id, [])
        logger.warning("Dropped the NIXL connection to %s (%s); the next request to it "
                       "handshakes again", peer_str(engine_id), reason.value)
        self._safe(self.xfer_stats.record_peer_reset, self._direction, reason.value)
        for req_id, reg in resend.items():  # D: PUSH_REGs that reached nobody, again
            self._reg_send_inbox.put((req_id, reg))
        if resend:
            self._push_writer_wake.set()
        for reg, why in notices:  # P: reconnects, then tells the decoder
            self._tell_decoder(reg, why)

    def _transfer_info_of(self, engine_id: str) -> list[Any]:
        """vLLM's transfer info of every PP rank of `engine_id` (empty if none)."""
        topo, out = getattr(self, "transfer_topo", None), []
        while topo is not None:
            try:
                out.append(topo.get_engine_info(engine_id, len(out)))
            except KeyError:
                break
        return out

    def _release_kept_transfer_info(self, engine_id: str) -> None:
        """Pool thread, under the registration lock: a handshake is about to register
        `engine_id` with vLLM; the info kept since its drop goes first (vLLM would keep
        an entry already there instead of the peer's new one)."""
        if engine_id in self._kept_transfer_info:
            self._kept_transfer_info.discard(engine_id)
            self.transfer_topo.unregister_remote_engine(engine_id)

    def _fail_unreachable(self) -> None:
        now = time.monotonic()
        with self._peer_lock:
            dropped = dict(self._dropped)
        for engine_id, (agents, _, _) in dropped.items():
            last = self._last_contact.get(engine_id, 0.0)
            if now - last > self._unreachable_after_s:
                self._fail_receives_on(engine_id, agents, ReceiveFailure.PEER_UNREACHABLE)

    # ------------------------------------------------------- P, also when idle
    def _poll_while_idle(self) -> None:
        """P (own thread): wake the writer (it reads NIXL notifications) and answer the
        PUSH_REGs no request matched in time, whether or not the engine steps."""
        warned = False
        while not self._idle_stop.wait(IDLE_POLL_INTERVAL_S):
            try:
                self._push_writer_wake.set()
                if self._pending_since:
                    self._answer_unmatched(time.monotonic())
            except Exception:
                if not warned:
                    logger.warning("Checking unmatched PUSH_REGs failed; will retry", exc_info=True)
                    warned = True

    def shutdown(self) -> None:
        self._idle_stop.set()
        super().shutdown()

    def _answer_unmatched(self, now: float) -> None:
        """P: PUSH_REGs no request of P matched in time are answered with PUSH_FAIL."""
        pending = self._pending_d_registrations
        for d_id, since in list(self._pending_since.items()):
            reg = pending.get(d_id)
            if reg is None:
                self._pending_since.pop(d_id, None)  # matched (or evicted) meanwhile
                continue
            if now - since < self._unmatched_after_s:
                continue
            self._pending_since.pop(d_id, None)
            self._unmatched_rejected.add(d_id)  # the writer never WRITEs for it now
            self._evict_finished_inbox.put(d_id)  # the writer drops it from its table
            self._push_writer_wake.set()
            self._reject_push_reg(PushRegRejection.UNMATCHED,
                                  f"request {peer_str(d_id)}: no prefill request matched it within "
                                  f"{self._unmatched_after_s:.0f} s (unmatched_push_reg_timeout_s)",
                                  b"")
            self._tell_decoder(reg, PushFailReason.NO_PREFILL)

    def _safe(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)
