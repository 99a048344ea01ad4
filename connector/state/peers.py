"""Remote engines as this worker knows them, under one lock.

Which NIXL agents belong to which engine, when each engine last *answered* (a
handshake or side-channel reply, or a notification received from one of its agents;
a notification NIXL merely queued to it is no contact: under a silent partition it
queues fine), which engines are suspect (a notification or WRITE to them failed),
dropped (connection released, waiting for a new handshake) or forgotten (dropped and
silent for `forget_after_s`: whatever was kept for them goes, counted).

Every map here is bounded (`limit` engines); the table never calls out under its lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from connector.state import agent_name
from connector.vocabulary import PeerReset

MAX_PEERS = 4096


@dataclass(slots=True)
class Peer:
    engine_id: str
    agents: frozenset[str] = frozenset()
    last_contact: float = 0.0  # perf_counter; 0: never answered
    suspect: PeerReset | None = None
    suspect_agents: set[str] = field(default_factory=set)
    dropped_at: float | None = None  # perf_counter, while dropped
    dropped_agents: frozenset[str] = frozenset()
    drop_reason: PeerReset | None = None
    kept_transfer_info: bool = False
    probing: bool = False


@dataclass(frozen=True, slots=True)
class Forgotten:
    engine_id: str
    kept_transfer_info: bool


class PeerTable:
    """See module docstring."""

    def __init__(self, *, forget_after_s: float, limit: int = MAX_PEERS):
        self.forget_after_s = forget_after_s
        self._limit = limit
        self._lock = threading.Lock()
        self._peers: OrderedDict[str, Peer] = OrderedDict()
        self._by_agent: dict[str, str] = {}
        self._suspects = 0
        self._dropped = 0

    def __len__(self) -> int:
        return len(self._peers)

    @property
    def need_tending(self) -> bool:
        """Some peer is suspect or dropped (a truth test for the per-step check)."""
        return self._suspects > 0 or self._dropped > 0

    def engine_of(self, agent: str) -> str | None:
        return self._by_agent.get(agent_name(agent))  # (one dict read: atomic)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"peers": len(self._peers), "agents": len(self._by_agent),
                    "suspects": self._suspects, "dropped": self._dropped}

    # ------------------------------------------------------------------ events
    def connected(self, engine_id: str, agents: frozenset[str], now: float) -> tuple[bool, frozenset[str]]:
        """A handshake to `engine_id` ended with these agents. Returns (it restarted:
        a new agent where a dropped one was, the dropped agents)."""
        agents = frozenset(map(agent_name, agents))
        with self._lock:
            peer = self._peer(engine_id)
            for name in peer.agents - agents:
                self._by_agent.pop(name, None)
            for name in agents:
                self._by_agent[name] = engine_id
            peer.agents = agents
            peer.last_contact = now
            dropped_agents = peer.dropped_agents
            restarted = peer.dropped_at is not None and not (dropped_agents & agents)
            if peer.dropped_at is not None:
                self._dropped -= 1
            peer.dropped_at, peer.dropped_agents, peer.drop_reason = None, frozenset(), None
            return restarted, dropped_agents

    def heard_from(self, agent: str, now: float) -> None:
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

    def last_contact(self, engine_id: str) -> float:
        with self._lock:
            peer = self._peers.get(engine_id)
            return 0.0 if peer is None else peer.last_contact

    def begin_probe(self, engine_id: str, now: float, quiet_s: float) -> bool:
        """True when `engine_id` has been silent for `quiet_s` and no probe is out."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None or peer.probing or now - peer.last_contact < quiet_s:
                return False
            peer.probing = True
            return True

    def failed(self, engine_id: str, reason: PeerReset, agent: str | None = None) -> None:
        """Any thread: a notification or WRITE to this engine failed."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None:
                return
            if peer.suspect is None:
                self._suspects += 1
                peer.suspect = reason
            if agent is not None:
                peer.suspect_agents.add(agent_name(agent))

    def failed_agent(self, agent: str, reason: PeerReset) -> None:
        engine_id = self._by_agent.get(agent_name(agent))
        if engine_id is not None:
            self.failed(engine_id, reason, agent)

    # -------------------------------------------------------- main thread: tend
    def suspects(self) -> list[tuple[str, PeerReset, frozenset[str], frozenset[str]]]:
        """(engine, why, agents that failed, its current agents) of every suspect."""
        with self._lock:
            return [(p.engine_id, p.suspect, frozenset(p.suspect_agents), p.agents)
                    for p in self._peers.values() if p.suspect is not None]

    def clear_suspect(self, engine_id: str) -> None:
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is not None and peer.suspect is not None:
                peer.suspect = None
                peer.suspect_agents.clear()
                self._suspects -= 1

    def dropped(self, engine_id: str, agents: frozenset[str], reason: PeerReset, now: float,
                kept_transfer_info: bool) -> None:
        """The connection to `engine_id` was released (vLLM's cleanup ran)."""
        with self._lock:
            peer = self._peer(engine_id)
            if peer.suspect is not None:
                peer.suspect = None
                peer.suspect_agents.clear()
                self._suspects -= 1
            if peer.dropped_at is None:
                self._dropped += 1
            peer.dropped_at, peer.drop_reason = now, reason
            peer.dropped_agents = frozenset(map(agent_name, agents))
            peer.kept_transfer_info = kept_transfer_info
            for name in peer.agents:
                self._by_agent.pop(name, None)
            peer.agents = frozenset()

    def drop_reason(self, engine_id: str) -> str:
        with self._lock:
            peer = self._peers.get(engine_id)
            return "" if peer is None or peer.drop_reason is None else peer.drop_reason.value

    def take_kept_transfer_info(self, engine_id: str) -> bool:
        """A new handshake registers the engine: True if the info kept since its drop
        must be unregistered first (once)."""
        with self._lock:
            peer = self._peers.get(engine_id)
            if peer is None or not peer.kept_transfer_info:
                return False
            peer.kept_transfer_info = False
            return True

    def unreachable(self, now: float, after_s: float) -> list[tuple[str, frozenset[str]]]:
        """Dropped engines that have not answered for `after_s`: (engine, old agents)."""
        with self._lock:
            return [(p.engine_id, p.dropped_agents) for p in self._peers.values()
                    if p.dropped_at is not None and now - p.last_contact > after_s]

    def forget_silent(self, now: float) -> list[Forgotten]:
        """Dropped engines silent for `forget_after_s` are forgotten."""
        out: list[Forgotten] = []
        with self._lock:
            for peer in list(self._peers.values()):
                if peer.dropped_at is None:
                    continue
                if now - max(peer.dropped_at, peer.last_contact) < self.forget_after_s:
                    continue
                out.append(Forgotten(peer.engine_id, peer.kept_transfer_info))
                self._remove(peer)
        return out

    # -------------------------------------------------------------- internals
    def _peer(self, engine_id: str) -> Peer:
        peer = self._peers.get(engine_id)
        if peer is None:
            while len(self._peers) >= self._limit:  # dropped peers go first, then the oldest
                victim = next((p for p in self._peers.values() if p.dropped_at is not None),
                              next(iter(self._peers.values())))
                self._remove(victim)
            peer = self._peers[engine_id] = Peer(engine_id)
        return peer

    def _remove(self, peer: Peer) -> None:
        self._peers.pop(peer.engine_id, None)
        for name in peer.agents:
            self._by_agent.pop(name, None)
        if peer.suspect is not None:
            self._suspects -= 1
        if peer.dropped_at is not None:
            self._dropped -= 1
