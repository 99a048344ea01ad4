"""Peers that stop working: drop the dead NIXL connection, re-handshake, and do not let
requests wait for KV that is gone, nor free blocks a WRITE can still reach.

Upstream, a worker keeps a remote engine's NIXL agent until `engine_ttl` (an hour). When
the peer restarts under the same engine id (a pod restart) every notification and WRITE
goes to the dead agent, nothing re-handshakes, and the requests waiting on it wait for
`push_registration_timeout` (480 s), until the worker itself restarts.

Here (state in connector/state: the peer table, the receive and lease ledgers):
- A notification or WRITE to a peer's agent that fails marks the peer suspect (any
  thread). At the next engine step, on the main thread, when no WRITE to it is being
  posted or in flight (the lease ledger says), the connection is dropped (vLLM's own
  `_cleanup_remote_engine`) and counted; the next request to it re-handshakes.
- "Last contact" is an answer: a handshake, a notification received from the peer, or
  a reply to a side-channel probe. D probes a prefill it waits on once it has been
  silent for a third of a lease (a notification NIXL only queued proves nothing: under
  a silent partition every send still succeeds).
- D: a PUSH_REG that reached no agent is sent again after the drop. When the
  re-handshake finds a new NIXL agent (the peer restarted), the receives whose PUSH_REG
  reached only the old agent are failed at once: that process, and its WRITEs, are
  gone. When a dropped peer stays silent for longer than a lease, its receives are given
  up: they fail once no WRITE into their blocks can come.
- A dropped peer silent for `peer_forget_after_s` is forgotten: what was kept for it is
  released and counted.
- P, idle: vLLM's writer reads NIXL notifications only when something wakes it, and an
  engine steps only while it has work. A timer thread wakes the writer every
  `IDLE_POLL_INTERVAL_S`; the writer itself then answers unmatched PUSH_REGs and sends
  owed PUSH_FAILs (the timer thread touches no push state).
A failed receive is then recomputed or failed by vLLM, per `kv_load_failure_policy`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from connector.glue.flow import Flow
from connector.glue.side_channel import SideChannelClient
from connector.glue.wire import HEARTBEAT_PREFIX, PUSH_REG_PREFIX
from connector.state import agent_name
from connector.telemetry import errors
from connector.telemetry.tracing import peer_str
from connector.vocabulary import (
    PUSH_FAIL_NOTIF_PREFIX,
    Direction,
    PeerReset,
    PushFailOutcome,
    ReceiveAbandon,
    ReceiveFailure,
    TelemetryError,
)

logger = logging.getLogger(__name__)

# NIXL errors that refuse one transfer for what it asked (descriptors outside the
# registered memory, a bad parameter), not because the peer or the link failed.
REQUEST_REFUSALS = frozenset({"nixlInvalidParamError", "nixlNotFoundError", "nixlNotAllowedError",
                              "nixlMismatchError", "nixlNotSupportedError"})
# P: how often the writer is woken to read notifications also while the engine is idle (s).
IDLE_POLL_INTERVAL_S = 0.5
# Main thread: how often the slow checks (probes, forgetting, TTL eviction) run (s).
TEND_INTERVAL_S = 1.0
PROBE_TIMEOUT_MS = 2000


class PeerFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: dead peers dropped, waiting requests failed."""

    def _init_peers(self) -> None:
        extra = self.kv_transfer_config.get_from_extra_config
        lease = float(extra("kv_lease_duration", 30))
        # D gives up receives bound to a dropped P silent this long.
        self._unreachable_after_s = lease + max(1.0, lease // 6)
        self._probe_quiet_s = max(1.0, lease / 3)
        self._resend_after_s = float(extra("push_reg_resend_s", max(1.0, lease / 2)))
        self._tended_at = 0.0
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
        if not ok and agent is not None:
            self._peers.failed_agent(agent, PeerReset.NOTIFICATION_FAILED)
            if isinstance(notif, bytes) and notif.startswith(PUSH_REG_PREFIX):
                missed = getattr(self._trigger_local, "reg_failed_agents", None)
                if missed is not None:
                    missed.add(agent)

    def _notifs_received(self, notifs: dict[Any, list[bytes]]) -> dict[Any, list[bytes]]:
        """The writer's pass over NIXL's notifications (see `Flow`): contact noted,
        heartbeats applied (not forwarded: vLLM would apply them a step late, exactly),
        then P's due work on this thread, the push state's writer."""
        if notifs:
            now = time.perf_counter()
            consumer = self._kv_role != "kv_producer"
            for agent, messages in notifs.items():
                self._peers.heard_from(agent, now)
                kept = []
                for m in messages:
                    if m.startswith(HEARTBEAT_PREFIX):
                        self._renew_from(agent, m)  # (applied here, not forwarded)
                    elif m.startswith(PUSH_FAIL_NOTIF_PREFIX):
                        self._push_fail_from(agent, m)  # (which rank said it matters)
                    else:
                        if consumer and not m.startswith(PUSH_REG_PREFIX):
                            self._write_landed_from(agent, m)
                        kept.append(m)
                if len(kept) != len(messages):
                    notifs[agent] = kept
        if self._kv_role != "kv_consumer":
            if self._leases.owes:
                self._send_owed_push_fails()
            if self._pending_since:
                self._answer_unmatched(time.monotonic())
        return notifs

    def _note_peer_agents(self, engine_id: str, agents: dict[Any, str]) -> bool:
        """A handshake to `engine_id` ended with these agents (pool thread)."""
        restarted, old_agents = self._peers.connected(engine_id, frozenset(agents.values()),
                                                      time.perf_counter())
        if not restarted:
            return False
        logger.warning("Remote engine %s came back with a new NIXL agent (it restarted): "
                       "requests whose KV it held are failed now", peer_str(engine_id))
        self._safe(self.xfer_stats.record_peer_restart, self._direction)
        for req_id in self._receives.registered_on(engine_id, old_agents):
            logger.warning("Request %s: failing its KV load (peer_restarted: the KV it waits for "
                           "was on engine %s's previous NIXL agent)", req_id, peer_str(engine_id))
            self._fail_receive(req_id, ReceiveFailure.PEER_RESTARTED)
        return True

    def _after_reset(self, engine_id: str) -> str:
        """Why the connection a handshake starting now replaces was dropped ("" if none)."""
        return self._peers.drop_reason(engine_id)

    # ------------------------------------------------------------------- D side
    def _registration_sent(self, req_id: str, reg_data: dict[str, Any], agents: dict[Any, str],
                           failed: int) -> None:
        """D (writer thread): the P agents a PUSH_REG reached (`failed`: how many it did
        not; which ones, the probe told `_notif_sent`)."""
        missed = {agent_name(a) for a in getattr(self._trigger_local, "reg_failed_agents", ())}
        reached = frozenset(a for a in map(agent_name, agents.values()) if a not in missed) \
            if failed < len(agents) else frozenset()
        if self._receives.sent(req_id, reg_data, reached, time.perf_counter()):
            self._failed_recv_reqs.decided(req_id)  # given up, and P never got it: fail now

    def _write_landed_from(self, agent: Any, message: bytes) -> None:
        """D (writer): a P agent's completion notification ("<D request id>:<P TP>"):
        that rank will not write into the request's blocks any more."""
        req_id = message.rpartition(b":")[0]
        if req_id and self._receives.agent_done(req_id.decode("utf-8", "replace"), agent):
            self._failed_recv_reqs.decided(req_id.decode("utf-8", "replace"))

    def _fail_receive(self, req_id: str, reason: ReceiveFailure) -> None:
        if self._receives.fail(req_id, reason):
            self._failed_recv_reqs.decided(req_id)

    def _give_up_receive(self, req_id: str, why: ReceiveAbandon) -> None:
        outcome = self._receives.give_up(req_id, why, time.perf_counter())
        if outcome:
            self._safe(self.xfer_stats.record_receive_abandoned, why.value)
        if outcome == "fail":
            self._failed_recv_reqs.decided(req_id)  # its PUSH_REG never left: nothing can land

    # ------------------------------------------------------------------- P side
    def _push_broke(self, request_id: str, why: Any = None) -> None:
        """P: a WRITE failed: suspect the connection unless NIXL refused the request
        itself (bad descriptors: the connection is fine, and dropping it would cost
        every request in flight on it). The decoder is told once every rank settled."""
        if type(why).__name__ in REQUEST_REFUSALS:
            return
        engine = self._leases.target_of(request_id)
        if engine is not None:
            self._peers.failed(engine, PeerReset.TRANSFER_FAILED)

    # --------------------------------------------------------------- each step
    def _tend_peers(self) -> None:
        """Main thread: drop suspects, give up on silent prefills, fail given-up
        receives at their safe point, and (once a second) probe, forget, evict."""
        now = time.perf_counter()
        if self._peers.need_tending:
            self._reset_suspects(now)
            for engine_id, _ in self._peers.unreachable(now, self._unreachable_after_s):
                for req_id in self._receives.waiting_on(engine_id):
                    self._give_up_receive(req_id, ReceiveAbandon.PEER_UNREACHABLE)
        for req_id, why in self._receives.due(now):
            logger.warning("Request %s: failing its KV load (%s); no WRITE into its blocks can "
                           "come any more", req_id,
                           f"given up: {why.value}" if why else "a prefill rank said PUSH_FAIL")
            self._failed_recv_reqs.decided(req_id)
        if now - self._tended_at >= TEND_INTERVAL_S:
            self._tended_at = now
            resend = self._receives.due_resend(now, self._resend_after_s)
            for req_id, reg in resend:  # D: PUSH_REGs whose KV has not come, again
                self._reg_send_inbox.put((req_id, reg))
            if resend:
                self._push_writer_wake.set()
            self._probe_silent_prefills(now)
            self._forget_silent_peers(now)
            self._evict_stale_engines_here()

    def _reset_suspects(self, now: float) -> None:
        for engine_id, reason, failed_agents, _ in self._peers.suspects():
            with self._handshake_lock:
                connected = dict.get(self._remote_agents, engine_id) or {}
                handshaking = engine_id in self._handshake_futures
            if handshaking:
                continue  # a new connection is being made: judge it when it is done
            current = set(map(agent_name, connected.values()))
            if not connected or (failed_agents and not failed_agents & current):
                self._peers.clear_suspect(engine_id)  # already gone, or replaced since
                continue
            if self._leases.writes_to(engine_id):
                continue  # a WRITE to it is claimed or posted: let it settle (or time out)
            self._drop_peer(engine_id, frozenset(connected.values()), reason, now)

    def _drop_peer(self, engine_id: str, agents: frozenset[str], reason: PeerReset,
                   now: float) -> None:
        # Under the registration lock throughout: a handshake to the same engine cannot
        # register it between vLLM's cleanup and the transfer info kept below.
        with self._registration_lock:
            kept = self._transfer_info_of(engine_id)
            try:
                if not self._cleanup_remote_engine(engine_id, log_eviction=False):
                    return  # a WRITE to it was posted meanwhile: next step
            except Exception:
                logger.warning("Could not drop the NIXL connection to %s", peer_str(engine_id),
                               exc_info=True)
                return
            # A WRITE the peer finished before we dropped it can still complete here:
            # vLLM's post-processing of that receive reads the peer's transfer info.
            # Kept until the next handshake to the peer registers it anew.
            for info in kept:
                self.transfer_topo.register_remote_engine(engine_id, info)
            self._peers.dropped(engine_id, agents, reason, now, kept_transfer_info=bool(kept))
        logger.warning("Dropped the NIXL connection to %s (%s); the next request to it "
                       "handshakes again", peer_str(engine_id), reason.value)
        self._safe(self.xfer_stats.record_peer_reset, self._direction, reason.value)
        self._leases.connection_reset(engine_id)  # P: PUSH_FAILs its dead agent missed
        if self._leases.owes:
            self._push_writer_wake.set()
        resend = self._receives.take_undelivered(engine_id)
        for req_id, reg in resend:  # D: PUSH_REGs that reached nobody, again
            self._reg_send_inbox.put((req_id, reg))
        if resend:
            self._push_writer_wake.set()

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
        if self._peers.take_kept_transfer_info(engine_id):
            self.transfer_topo.unregister_remote_engine(engine_id)

    def _probe_silent_prefills(self, now: float) -> None:
        """D: ask the side channel of each prefill it waits on and has not heard from
        for a while whether it is there (on the handshake pool)."""
        for engine_id in self._receives.engines_waited_on():
            with self._handshake_lock:
                if engine_id in self._handshake_futures:
                    continue  # a handshake to it is its liveness check
            address = self._receives.address_of(engine_id)
            if address is None or not self._peers.begin_probe(engine_id, now, self._probe_quiet_s):
                continue
            try:
                self._handshake_pool.submit(self._probe, engine_id, *address)
            except RuntimeError:  # pool shut down (engine stopping)
                self._peers.probe_failed(engine_id)

    def _probe(self, engine_id: str, host: str, port: int) -> None:
        try:
            with SideChannelClient(host, port, PROBE_TIMEOUT_MS) as channel:
                channel.fetch(0, 0)
        except Exception as exc:
            self._peers.probe_failed(engine_id)
            self._peers.failed(engine_id, PeerReset.SILENT)
            logger.warning("Prefill %s did not answer a liveness probe (%s)", peer_str(engine_id),
                           type(exc).__name__)
            return
        self._peers.answered(engine_id, time.perf_counter())

    def _forget_silent_peers(self, now: float) -> None:
        for gone in self._peers.forget_silent(now):
            for _, reason in self._leases.forget_owed(gone.engine_id):
                self._count_push_fail(reason, PushFailOutcome.UNDELIVERABLE)
            if gone.kept_transfer_info:
                with self._registration_lock:
                    self.transfer_topo.unregister_remote_engine(gone.engine_id)
            logger.warning("Forgot remote engine %s: dropped and silent for %.0f s "
                           "(peer_forget_after_s)", peer_str(gone.engine_id),
                           self._peers.forget_after_s)
            self._safe(self.xfer_stats.record_peer_forgotten, self._direction)

    def _evict_stale_engines_here(self) -> None:
        """vLLM's idle-engine eviction (`engine_ttl`), run on the main thread only
        (vLLM starts it from whichever thread asks for a handshake); our
        `_cleanup_remote_engine` keeps an engine a WRITE is being posted to."""
        try:
            self._evict_stale_engines()
        except Exception:
            logger.warning("Evicting stale remote engines failed", exc_info=True)

    # ------------------------------------------------------- P, also when idle
    def _poll_while_idle(self) -> None:
        """P (own thread): wake the writer, whether or not the engine steps."""
        while not self._idle_stop.wait(IDLE_POLL_INTERVAL_S):
            self._push_writer_wake.set()

    def shutdown(self) -> None:
        self._idle_stop.set()
        super().shutdown()

    def _safe(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)
