"""Peers that stop working: drop the dead NIXL connection, re-handshake, and do not let
requests wait for KV that is gone, nor free blocks a WRITE can still reach.

Upstream, a worker keeps a remote engine's NIXL agent until `engine_ttl` (an hour). When
the peer restarts under the same engine id (a pod restart) every notification and WRITE
goes to the dead agent, nothing re-handshakes, and the requests waiting on it wait for
`push_registration_timeout` (480 s), until the worker itself restarts.

Here (state in connector/state: the connection table, the receive and lease ledgers):
- A notification or WRITE to a peer's agent that fails marks the peer suspect (any
  thread). At the next engine step, on the main thread, when no WRITE to it is claimed,
  being posted or in flight (the lease ledger says), the connection is dropped (vLLM's
  own `_cleanup_remote_engine`) and counted; what was parked for a new connection
  (PUSH_REGs and PUSH_FAILs that reached no agent, WRITEs that waited for the drop)
  goes again, and the next request to it re-handshakes.
- "Last contact" is an answer: a handshake, a notification received from the peer, or
  a reply to a side-channel probe. D probes a prefill it waits on once it has been
  silent for a third of a lease (a notification NIXL only queued proves nothing: under
  a silent partition every send still succeeds).
- D: when the re-handshake finds a new NIXL agent (the peer restarted), the receives
  whose PUSH_REG reached only the old agent are failed at once: that process, and its
  WRITEs, are gone. When a dropped peer stays silent for longer than a lease, its
  receives are given up: they fail once no WRITE into their blocks can come.
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

from connector import settings
from connector.glue.flow import Flow, ParkedPush, ParkedPushFail, ParkedRegistration
from connector.glue.side_channel import SideChannelClient
from connector.state import agent_name
from connector.telemetry import errors
from connector.telemetry.tracing import peer_str
from connector.vocabulary import (
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
# Main thread: how often the slow checks (resends, probes, forgetting, TTL eviction) run (s).
TEND_INTERVAL_S = 1.0
PROBE_TIMEOUT_MS = 2000


class PeerFlow(Flow):
    """Mixin for `NixlPushConnectorWorker`: dead peers dropped, waiting requests failed."""

    def _init_peers(self, extra: Any) -> None:
        lease = settings.lease_s(extra)
        # D gives up receives bound to a dropped P silent this long.
        self._unreachable_after_s = lease + max(1.0, lease // 6)
        self._probe_quiet_s = max(1.0, lease / 3)
        self._resend_after_s = settings.push_reg_resend_s(extra)
        self._tended_at = 0.0
        self._idle_stop = threading.Event()

    def _start_idle_poll(self) -> None:
        if self._kv_role != "kv_consumer":
            threading.Thread(target=self._poll_while_idle, name="nixl-idle-poll", daemon=True).start()

    @property
    def _direction(self) -> str:
        return (Direction.D_TO_P if self._kv_role == "kv_consumer" else Direction.P_TO_D).value

    # --------------------------------------------------------- connection events
    def _peer_restarted(self, engine_id: str, old_agents: frozenset[str]) -> None:
        """A handshake found a new agent where a dropped one was (pool thread): the
        receives whose PUSH_REG reached only the old agents fail now."""
        logger.warning("Remote engine %s came back with a new NIXL agent (it restarted): "
                       "requests whose KV it held are failed now", peer_str(engine_id))
        self._digests.forget_engine(engine_id)  # (it may be back without KV digests)
        if self._kv_role != "kv_producer":  # (the scheduler checks its next requests: new_peer)
            self.xfer_stats.record_prefill_restarted(engine_id)
        for req_id in self._receives.registered_on(engine_id, old_agents):
            logger.warning("Request %s: failing its KV load (peer_restarted: the KV it waits for "
                           "was on engine %s's previous NIXL agent)", req_id, peer_str(engine_id))
            self._fail_receive(req_id, ReceiveFailure.PEER_RESTARTED)
        self._safe(self.xfer_stats.record_peer_restart, self._direction)

    def _peer_restart_failsafe(self, engine_id: str) -> None:
        """Failing a restarted peer's receives raised: give up every receive still waiting
        on it instead (each fails at its safe point, or lands first)."""
        try:
            for req_id in self._receives.waiting_on(engine_id):
                self._give_up_receive(req_id, ReceiveAbandon.INTERNAL_ERROR)
        except Exception:
            logger.error("Giving up the receives of restarted engine %s failed too; they fail at "
                         "their registration timeout", peer_str(engine_id), exc_info=True)

    def _release_parked(self, items: list[Any]) -> None:
        """Work parked for a new connection goes again (any thread: queues and the lease
        ledger only): PUSH_REGs to the writer's registration inbox, WRITEs to its
        deferred-push inbox, PUSH_FAILs owed again."""
        if not items:
            return
        for item in items:
            if isinstance(item, ParkedRegistration):
                self._reg_send_inbox.put((item.req_id, item.reg))
            elif isinstance(item, ParkedPush):
                self._deferred_push_inbox.put((item.req_id, item.blocks, item.reg))
            elif isinstance(item, ParkedPushFail):
                self._leases.owe_again(item.reg, item.reason)
        self._push_writer_wake.set()

    def _suspect_write_target(self, request_id: str, why: Any = None) -> None:
        """P: a WRITE failed: suspect the connection unless NIXL refused the request
        itself (bad descriptors: the connection is fine, and dropping it would cost
        every request in flight on it)."""
        if type(why).__name__ in REQUEST_REFUSALS:
            return
        engine = self._leases.target_of(request_id)
        if engine is not None:
            self._connections.failed(engine, PeerReset.TRANSFER_FAILED)

    # --------------------------------------------------------------- each step
    def _tend_peers(self) -> None:
        """Main thread: drop suspects, give up on silent prefills, fail given-up
        receives at their safe point, and (once a second) resend, probe, forget, evict."""
        now = time.perf_counter()
        if self._connections.need_tending:
            self._reset_suspects(now)
            # Only receives that have waited as long themselves: a newer one's PUSH_REG
            # may not have left yet (the writer takes it after this step), and its
            # send starts the re-handshake that finds a prefill come back.
            cutoff = now - self._unreachable_after_s
            for engine_id in self._connections.unreachable(now, self._unreachable_after_s):
                for req_id in self._receives.waiting_on(engine_id, started_before=cutoff):
                    self._give_up_receive(req_id, ReceiveAbandon.PEER_UNREACHABLE)
        for req_id, why in self._receives.due(now):
            logger.warning("Request %s: failing its KV load (%s); no WRITE into its blocks can "
                           "come any more", req_id,
                           f"given up: {why.value}" if why else "a prefill rank said PUSH_FAIL")
            self._failed_recv_reqs.put(req_id)
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

    def _tend_due(self) -> bool:
        """Whether this step has something to tend (a truth test per step)."""
        return bool(self._connections.need_tending or self._receives.abandoned or self._receives
                    or time.perf_counter() - self._tended_at >= TEND_INTERVAL_S)

    def _reset_suspects(self, now: float) -> None:
        for suspect in self._connections.suspects():
            if suspect.handshaking:
                continue  # a new connection is being made: judge it when it is done
            current = set(map(agent_name, suspect.agents.values()))
            if not current or (suspect.failed_agents and not suspect.failed_agents & current):
                self._connections.clear_suspect(suspect.engine_id)  # gone, or replaced since
                continue
            if self._leases.writes_to(suspect.engine_id):
                continue  # a WRITE to it is claimed or posted: let it settle (or time out)
            self._drop_peer(suspect.engine_id, suspect.reason, now)

    def _drop_peer(self, engine_id: str, reason: PeerReset, now: float) -> None:
        # Under the registration lock throughout: a handshake to the same engine cannot
        # register it between vLLM's cleanup and the transfer info kept below.
        with self._registration_lock:
            kept = self._transfer_info_of(engine_id)
            try:
                if not self._release_connection(engine_id, log_eviction=False):
                    return  # a WRITE to it is being posted: next step
            except Exception:
                logger.warning("Could not drop the NIXL connection to %s", peer_str(engine_id),
                               exc_info=True)
                self._connections.cancel_drop(engine_id)
                return
            # A WRITE the peer finished before we dropped it can still complete here:
            # vLLM's post-processing of that receive reads the peer's transfer info.
            # Kept until the next handshake to the peer registers it anew.
            for info in kept:
                self.transfer_topo.register_remote_engine(engine_id, info)
            parked = self._connections.dropped(engine_id, reason, now, kept_transfer_info=bool(kept))
        logger.warning("Dropped the NIXL connection to %s (%s); the next request to it "
                       "handshakes again", peer_str(engine_id), reason.value)
        self._release_parked(parked)
        self._safe(self.xfer_stats.record_peer_reset, self._direction, reason.value)

    def _cleanup_remote_engine(self, engine_id: str, *args: Any, **kwargs: Any) -> bool:
        """vLLM's cleanup of a remote engine when vLLM asks for it (its idle-engine
        eviction, shutdown): the same drop, the peer then forgotten. False: kept (a
        WRITE to it is being posted or in flight)."""
        if not self._release_connection(engine_id, *args, **kwargs):
            return False
        self._release_parked(self._connections.evicted(engine_id))
        return True

    def _release_connection(self, engine_id: str, *args: Any, **kwargs: Any) -> bool:
        """Main: vLLM's cleanup of the connection, if no WRITE to it is being posted or
        in flight. The order matters (a WRITE is being posted on the writer meanwhile):
        first the connection is marked dropping (the writer parks a WRITE that finds it
        so), then the lease ledger is asked; the writer does the opposite (its lease
        POSTING first, then the connection checked), so one of the two always sees the
        other. Under the registration lock: no handshake's NIXL calls meanwhile."""
        if self._connections.begin_drop(engine_id) is None:
            return False
        stopping = self._push_writer_stop.is_set()
        if self._leases.posting_to(engine_id) and not stopping:
            self._connections.cancel_drop(engine_id)
            logger.debug("Kept remote engine %s: a WRITE to it is in flight", peer_str(engine_id))
            return False
        with self._registration_lock:
            super()._cleanup_remote_engine(engine_id, *args, **kwargs)
        return True

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
        if self._connections.take_kept_transfer_info(engine_id):
            self.transfer_topo.unregister_remote_engine(engine_id)

    def _probe_silent_prefills(self, now: float) -> None:
        """D: ask the side channel of each prefill it waits on and has not heard from
        for a while whether it is there (on the handshake pool)."""
        for engine_id in self._receives.engines_waited_on():
            address = self._receives.address_of(engine_id)
            if address is None or not self._connections.begin_probe(engine_id, now, self._probe_quiet_s):
                continue
            try:
                self._handshake_pool.submit(self._probe, engine_id, *address)
            except RuntimeError:  # pool shut down (engine stopping)
                self._connections.probe_failed(engine_id)

    def _probe(self, engine_id: str, host: str, port: int) -> None:
        try:
            with SideChannelClient(host, port, PROBE_TIMEOUT_MS, secret=self._peer_secret) as channel:
                channel.fetch(0, 0)
        except Exception as exc:
            self._connections.probe_failed(engine_id)
            self._connections.failed(engine_id, PeerReset.SILENT)
            logger.warning("Prefill %s did not answer a liveness probe (%s)", peer_str(engine_id),
                           type(exc).__name__)
            return
        self._connections.answered(engine_id, time.perf_counter())

    def _forget_silent_peers(self, now: float) -> None:
        for gone in self._connections.forget_silent(now):
            for item in gone.parked:
                if isinstance(item, ParkedPushFail):
                    self._count_push_fail(item.reason, PushFailOutcome.UNDELIVERABLE)
            self._release_parked([i for i in gone.parked if not isinstance(i, ParkedPushFail)])
            if gone.kept_transfer_info:
                with self._registration_lock:
                    self.transfer_topo.unregister_remote_engine(gone.engine_id)
            logger.warning("Forgot remote engine %s: dropped and silent for %.0f s "
                           "(peer_forget_after_s)", peer_str(gone.engine_id),
                           self._connections.forget_after_s)
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
        """A telemetry call: its fault is counted, never raised."""
        try:
            fn(*args)
        except Exception as exc:
            errors.note(TelemetryError.STATS, exc)
