"""Remote engines and this worker's connection to each, under one lock.

Everything the fork knows about a remote engine lives here: its NIXL agents (rank ->
agent name) and the flavor of the connection (notification-only or full), the handshake
being made to it (the future every caller waits on, and the attempts queued behind the
one that runs), whether its connection is being dropped or was dropped (why, its old
agents, and whether vLLM's transfer info was kept for it), when it last *answered*,
whether it is suspect, and the work parked until its connection is replaced.

The lock is vLLM's `_handshake_lock`, the one vLLM documents for `_remote_agents` and
`_handshake_futures`: those two maps, and the clock-offset and last-activity maps a
handshake fills, are vLLM's view of this table. The table writes them in the same
critical section as its own state, so a reader holding that lock never sees the two
disagree; vLLM's own writers (its cleanup pops the agents under the same lock) are
named in docs/architecture.md.

The connection of an engine has an epoch, bumped when a handshake connects it and when
it is dropped. Work that could not use a connection (a PUSH_REG or PUSH_FAIL that
reached none of its agents, a WRITE to a connection being dropped) is parked with the
epoch it tried; it comes back to the caller of the next epoch change (`connected`,
`dropped`, `evicted`, `forget_silent`), or at once (`park` returns False) when that
change already happened. Nothing parked waits for a connection that is gone.

Methods take the lock, decide, change the state, and return what the caller must do;
none calls vLLM, NIXL, telemetry or another owner while holding it. Every map is
bounded (`limit` engines).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from connector.state import agent_name
from connector.vocabulary import PeerReset

MAX_PEERS = 4096


class ConnState(StrEnum):
    """Where a remote engine's connection stands (docs/architecture.md, "A connection")."""

    NONE = "none"  # not connected, nothing under way (never, or evicted)
    CONNECTING = "connecting"  # a handshake to it is under way, no connection yet
    NOTIF_ONLY = "notif_only"  # connected notification-only
    FULL = "full"  # connected with its descriptors (WRITEs can go)
    UPGRADING = "upgrading"  # connected notification-only, a full handshake under way
    DROPPING = "dropping"  # vLLM's cleanup of it is under way (nothing is sent to it)
    DROPPED = "dropped"  # released; its old agents kept to tell a restart


@dataclass(slots=True)
class Pending:
    """The handshake being made to an engine: one future for every caller."""

    future: Future
    notif_only: bool
    upgrade: bool  # a full handshake to an engine connected notification-only
    after_reset: str  # why the connection it replaces was dropped (PeerReset value, "")
    write_waits: bool = False  # a WRITE waits on it (it is retried like the WRITE's own)


@dataclass(frozen=True, slots=True)
class Ensure:
    """What `ensure` decided: use the connection (`future` None, `pending` None), wait
    for the handshake under way (`future`, `joined`), or start one (`pending`)."""

    future: Future | None = None
    pending: Pending | None = None
    joined_notif_only: bool = False


@dataclass(frozen=True, slots=True)
class Targets:
    """The agents a notification to an engine goes to, and the connection's epoch.
    `agents` is empty when there is no connection to use: `dropping` says whether one is
    being dropped (park the work) or there is none (connect first)."""

    epoch: int
    agents: dict[Any, Any]
    dropping: bool = False


@dataclass(frozen=True, slots=True)
class Connected:
    """A handshake connected an engine: whether it restarted (a new agent where a
    dropped one was), the agents it had, and the work parked for a new connection."""

    restarted: bool
    old_agents: frozenset[str]
    parked: list[Any]


@dataclass(frozen=True, slots=True)
class Suspect:
    engine_id: str
    reason: PeerReset
    failed_agents: frozenset[str]
    agents: dict[Any, Any]  # its connection's agents now (rank -> name), {} if none
    handshaking: bool


@dataclass(frozen=True, slots=True)
class Forgotten:
    engine_id: str
    kept_transfer_info: bool
    parked: list[Any]


@dataclass(slots=True)
class Peer:
    engine_id: str
    ranks: dict[Any, Any] = field(default_factory=dict)  # (pp, tp) -> agent, as vLLM keeps it
    agents: frozenset[str] = frozenset()  # the same agents, one spelling (agent_name)
    notif_only: bool = False
    epoch: int = 0
    last_contact: float = 0.0  # perf_counter; 0: never answered
    suspect: PeerReset | None = None
    suspect_agents: set[str] = field(default_factory=set)
    dropping: bool = False
    dropped_at: float | None = None  # perf_counter, while dropped
    dropped_agents: frozenset[str] = frozenset()
    drop_reason: PeerReset | None = None
    kept_transfer_info: bool = False
    probing: bool = False
    pending: Pending | None = None
    running: bool = False  # an attempt of its handshake runs on the pool
    queued: deque[Any] = field(default_factory=deque)  # attempts waiting behind it
    parked: list[Any] = field(default_factory=list)


class ConnectionTable:
    """See module docstring. `lock` is vLLM's `_handshake_lock` (re-entrant); the maps
    are vLLM's `_remote_agents`, `_handshake_futures`, `_engine_clock_offset` and
    `_engine_last_active` (None: the table keeps plain ones, for tests)."""

    def __init__(self, *, forget_after_s: float, lock: Any = None,
                 remote_agents: MutableMapping[Any, Any] | None = None,
                 futures: MutableMapping[Any, Any] | None = None,
                 clock_offsets: MutableMapping[Any, Any] | None = None,
                 last_active: MutableMapping[Any, Any] | None = None, limit: int = MAX_PEERS):
        self.forget_after_s = forget_after_s
        self._limit = limit
        self._lock = lock if lock is not None else threading.RLock()
        self._remote_agents = remote_agents if remote_agents is not None else {}
        self._futures = futures if futures is not None else {}
        self._clock_offsets = clock_offsets if clock_offsets is not None else {}
        self._last_active = last_active if last_active is not None else {}
        self._peers: OrderedDict[str, Peer] = OrderedDict()
        self._by_agent: dict[str, str] = {}
        # The suspect and the dropped peers (what tending looks at, not every peer).
        self._suspect_peers: dict[str, Peer] = {}
        self._dropped_peers: dict[str, Peer] = {}

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self._peers)

    @property
    def need_tending(self) -> bool:
        """Some peer is suspect or dropped (a truth test for the per-step check)."""
        return bool(self._suspect_peers or self._dropped_peers)

    def engine_of(self, agent: Any) -> str | None:
        return self._by_agent.get(agent_name(agent))  # (one dict read: atomic)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"peers": len(self._peers), "agents": len(self._by_agent),
                    "connected": sum(1 for p in self._peers.values() if p.ranks),
                    "notif_only": sorted(p.engine_id for p in self._peers.values()
                                         if p.ranks and p.notif_only),
                    "pending": sum(1 for p in self._peers.values() if p.pending is not None),
                    "suspects": len(self._suspect_peers), "dropped": len(self._dropped_peers),
                    "parked": sum(len(p.parked) for p in self._peers.values())}

    def state_of(self, engine_id: str) -> ConnState:
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None:
                return ConnState.NONE
            if peer.ranks:
                if peer.dropping:
                    return ConnState.DROPPING
                if peer.notif_only:
                    return ConnState.UPGRADING if peer.pending is not None else ConnState.NOTIF_ONLY
                return ConnState.FULL
            if peer.pending is not None:
                return ConnState.CONNECTING
            return ConnState.DROPPED if peer.dropped_at is not None else ConnState.NONE

    def is_suspect(self, engine_id: str) -> bool:
        with self._lock:
            peer = self._peers.get(engine_id)
            return peer is not None and peer.suspect is not None

    def is_connected(self, engine_id: str, *, full: bool = False) -> bool:
        with self._lock:
            peer = self._peers.get(engine_id)
            return peer is not None and bool(peer.ranks) and not (full and peer.notif_only)

    def is_pending(self, engine_id: str) -> bool:
        with self._lock:
            peer = self._peers.get(engine_id)
            return peer is not None and peer.pending is not None

    def clock_offset(self, engine_id: str) -> float | None:
        with self._lock:
            return self._clock_offsets.get(engine_id)

    def last_contact(self, engine_id: str) -> float:
        with self._lock:
            peer = self._peers.get(engine_id)
            return 0.0 if peer is None else peer.last_contact

    def drop_reason(self, engine_id: str) -> str:
        with self._lock:
            peer = self._peers.get(engine_id)
            return "" if peer is None or peer.drop_reason is None else peer.drop_reason.value

    # ------------------------------------------------------------- handshakes
    def ensure(self, engine_id: str, *, notif_only: bool, for_write: bool) -> Ensure:
        """A caller needs a connection to `engine_id` (`notif_only`: notifications are
        all it sends). Use the one there is, join the handshake under way (a full one
        serves a notification-only caller, not the reverse), or start one: an upgrade
        to full when the engine is reached (or being reached) notification-only.
        `for_write`: a WRITE waits on it (a joined handshake is then retried like the
        WRITE's own would be)."""
        with self._lock:
            peer = self._peer(engine_id)
            connected = bool(peer.ranks)
            # (One being dropped is not upgraded: its users park until the next one.)
            if connected and (notif_only or not peer.notif_only or peer.dropping):
                return Ensure()
            pending = peer.pending
            if pending is not None and (notif_only or not pending.notif_only):
                if for_write:
                    pending.write_waits = True
                return Ensure(future=pending.future, joined_notif_only=pending.notif_only)
            upgrade = connected or pending is not None
            future: Future = Future()
            future.set_running_or_notify_cancel()
            reason = "" if peer.drop_reason is None else peer.drop_reason.value
            peer.pending = Pending(future, notif_only=notif_only and not upgrade, upgrade=upgrade,
                                   after_reset=reason, write_waits=for_write)
            self._futures[engine_id] = future
            return Ensure(future=future, pending=peer.pending)

    def attempt_begins(self, engine_id: str, attempt: Any) -> bool:
        """An attempt of a handshake to `engine_id` is ready: True to run it now; False
        when another of this engine's attempts runs (queued behind it: one handshake
        per engine at a time, an upgrade after the notification-only one)."""
        with self._lock:
            peer = self._peer(engine_id)
            if peer.running:
                peer.queued.append(attempt)
                return False
            peer.running = True
            return True

    def attempt_over(self, engine_id: str) -> Any:
        """The engine's running attempt is over: the next queued one to run (now marked
        running), or None."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None:
                return None
            if peer.queued:
                return peer.queued.popleft()
            peer.running = False
            return None

    def connected(self, engine_id: str, pending: Pending, ranks: dict[Any, Any], clock_offset: float,
                  now: float) -> Connected:
        """A handshake (`pending`) connected `engine_id` with these agents; vLLM's maps
        take them. Restarted: the engine had been dropped and none of its old agents is
        among the new ones (a new process under the same engine id)."""
        names = frozenset(map(agent_name, ranks.values()))
        with self._lock:
            peer = self._peer(engine_id)
            if peer.pending is pending:
                peer.pending = None
                self._futures.pop(engine_id, None)
            for name in peer.agents - names:
                self._by_agent.pop(name, None)
            for name in names:
                self._by_agent[name] = engine_id
            peer.ranks, peer.agents = dict(ranks), names
            peer.notif_only = pending.notif_only
            peer.last_contact = now
            peer.epoch += 1
            self._remote_agents[engine_id] = dict(ranks)
            self._clock_offsets[engine_id] = clock_offset
            self._last_active[engine_id] = now
            old = peer.dropped_agents
            restarted = peer.dropped_at is not None and not (old & names)
            self._dropped_peers.pop(engine_id, None)
            peer.dropped_at, peer.dropped_agents, peer.drop_reason = None, frozenset(), None
            self._clear_suspect(peer)
            parked, peer.parked = peer.parked, []
            return Connected(restarted, old, parked)

    def connect_failed(self, engine_id: str, pending: Pending) -> None:
        """The handshake (`pending`) failed for good: callers are told by its future."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None and peer.pending is pending:
                peer.pending = None
                self._futures.pop(engine_id, None)

    # ------------------------------------------------------------ using it
    def targets(self, engine_id: str) -> Targets:
        """Where a notification to `engine_id` goes now (see `Targets`)."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None:
                return Targets(0, {})
            if peer.dropping or not peer.ranks:
                return Targets(peer.epoch, {}, dropping=peer.dropping)
            return Targets(peer.epoch, dict(peer.ranks))

    def for_write(self, engine_id: str) -> tuple[int, float | None] | None:
        """A WRITE is about to be posted to `engine_id`: (epoch, clock offset) of its full
        connection, or None when it has none or it is being dropped (park the WRITE)."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None or peer.dropping or not peer.ranks or peer.notif_only:
                return None
            return peer.epoch, self._clock_offsets.get(engine_id)

    def writable(self, engine_id: str, epoch: int) -> bool:
        """Still the connection of `epoch`, and not being dropped (checked again after
        the lease became POSTING: see docs/architecture.md, "Dropping a connection")."""
        with self._lock:
            peer = self._peers.get(engine_id)
            return peer is not None and peer.epoch == epoch and not peer.dropping and bool(peer.ranks)

    def park(self, engine_id: str, epoch: int, item: Any) -> bool:
        """Keep `item` until the connection of `epoch` is replaced (dropped, evicted,
        reconnected). False when that happened already: the caller acts on it now."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None or peer.epoch != epoch:
                return False
            peer.parked.append(item)
            return True

    def touch(self, engine_id: str, now: float) -> None:
        """A request used the connection: vLLM's idle-engine clock (engine_ttl) restarts."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None and peer.ranks:
                self._last_active[engine_id] = now

    # ---------------------------------------------------------------- contact
    def heard_from(self, agent: Any, now: float) -> None:
        """A notification arrived from this agent (writer thread)."""
        engine_id = self._by_agent.get(agent_name(agent))
        if engine_id is None:
            return
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None:
                peer.last_contact = now

    def answered(self, engine_id: str, now: float) -> None:
        """The engine's side channel answered a probe."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None:
                peer.last_contact = now
                peer.probing = False

    def probe_failed(self, engine_id: str) -> None:
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None:
                peer.probing = False

    def begin_probe(self, engine_id: str, now: float, quiet_s: float) -> bool:
        """True when `engine_id` has been silent for `quiet_s`, no probe is out and no
        handshake to it runs (a handshake is its own liveness check)."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None or peer.probing or peer.pending is not None \
                    or now - peer.last_contact < quiet_s:
                return False
            peer.probing = True
            return True

    def failed(self, engine_id: str, reason: PeerReset, agent: Any = None) -> None:
        """Any thread: a notification or WRITE to this engine failed (or a probe)."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None:
                return
            if peer.suspect is None:
                self._suspect_peers[engine_id] = peer
                peer.suspect = reason
            if agent is not None:
                peer.suspect_agents.add(agent_name(agent))

    def failed_agent(self, agent: Any, reason: PeerReset) -> None:
        engine_id = self._by_agent.get(agent_name(agent))
        if engine_id is not None:
            self.failed(engine_id, reason, agent)

    # -------------------------------------------------------- main thread: tend
    def suspects(self) -> list[Suspect]:
        with self._lock:
            return [Suspect(p.engine_id, p.suspect, frozenset(p.suspect_agents), dict(p.ranks),
                            p.pending is not None)
                    for p in self._suspect_peers.values()]

    def clear_suspect(self, engine_id: str) -> None:
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None:
                self._clear_suspect(peer)

    def begin_drop(self, engine_id: str) -> dict[Any, Any] | None:
        """Main: start dropping the connection to `engine_id`: its agents, or None when
        there is none or a handshake to it runs. From here no WRITE is posted to it and
        no notification sent (they park) until `dropped` or `cancel_drop`."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None or not peer.ranks or peer.dropping or peer.pending is not None:
                return None
            peer.dropping = True
            return dict(peer.ranks)

    def cancel_drop(self, engine_id: str) -> None:
        """Main: the drop did not happen (a WRITE to it was posting or in flight)."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None:
                peer.dropping = False

    def dropped(self, engine_id: str, reason: PeerReset, now: float,
                kept_transfer_info: bool) -> list[Any]:
        """Main: vLLM's cleanup released the connection (its agents are gone from vLLM's
        maps). The peer is kept as dropped: a new agent at the next handshake means it
        restarted. Returns the work parked for a new connection."""
        with self._lock:
            peer = self._peer(engine_id)
            self._clear_suspect(peer)
            self._dropped_peers[engine_id] = peer
            peer.dropped_at, peer.drop_reason = now, reason
            peer.dropped_agents = peer.agents
            peer.kept_transfer_info = kept_transfer_info
            self._unconnect(peer)
            parked, peer.parked = peer.parked, []
            return parked

    def evicted(self, engine_id: str) -> list[Any]:
        """Main: vLLM's idle-engine eviction (or shutdown) released the connection; the
        peer is forgotten. Returns the work parked for a new connection."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None:
                return []
            parked, peer.parked = peer.parked, []
            self._remove(peer)
            return parked

    def take_kept_transfer_info(self, engine_id: str) -> bool:
        """A new handshake registers the engine: True if the info kept since its drop
        must be unregistered first (once)."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None or not peer.kept_transfer_info:
                return False
            peer.kept_transfer_info = False
            return True

    def unreachable(self, now: float, after_s: float) -> list[str]:
        """Dropped engines silent for `after_s` since their drop (or their last answer,
        if later), with no handshake to them under way: one dropped after a long quiet
        spell gets its full `after_s` (a request that found it dead must not be given up
        before the re-handshake it started could answer)."""
        if not self._dropped_peers:
            return []
        with self._lock:
            return [p.engine_id for p in self._dropped_peers.values()
                    if p.pending is None and now - max(p.last_contact, p.dropped_at) > after_s]

    def forget_silent(self, now: float) -> list[Forgotten]:
        """Dropped engines silent for `forget_after_s` are forgotten."""
        if not self._dropped_peers:
            return []
        out: list[Forgotten] = []
        with self._lock:
            for peer in list(self._dropped_peers.values()):
                if peer.pending is not None:
                    continue
                if now - max(peer.dropped_at, peer.last_contact) < self.forget_after_s:
                    continue
                out.append(Forgotten(peer.engine_id, peer.kept_transfer_info, peer.parked))
                peer.parked = []
                self._remove(peer)
        return out

    # -------------------------------------------------------------- internals
    def _peer(self, engine_id: str) -> Peer:
        peer = self._peers.get(engine_id)
        if peer is None:
            while len(self._peers) >= self._limit:  # idle dropped peers go first, then the oldest idle
                victim = next((p for p in self._peers.values() if p.dropped_at is not None
                               and p.pending is None and not p.running), None) or next(
                    (p for p in self._peers.values() if p.pending is None and not p.running
                     and not p.ranks), None)
                if victim is None:
                    break  # every peer is connected or handshaking: none is dropped silently
                self._remove(victim)
            peer = self._peers[engine_id] = Peer(engine_id)
        return peer

    def _unconnect(self, peer: Peer) -> None:
        for name in peer.agents:
            self._by_agent.pop(name, None)
        peer.ranks, peer.agents, peer.notif_only = {}, frozenset(), False
        peer.dropping = False
        peer.epoch += 1

    def _clear_suspect(self, peer: Peer) -> None:
        if peer.suspect is not None:
            peer.suspect = None
            peer.suspect_agents.clear()
            del self._suspect_peers[peer.engine_id]

    def _remove(self, peer: Peer) -> None:
        self._peers.pop(peer.engine_id, None)
        for name in peer.agents:
            self._by_agent.pop(name, None)
        self._suspect_peers.pop(peer.engine_id, None)
        self._dropped_peers.pop(peer.engine_id, None)
