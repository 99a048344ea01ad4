"""D's receives, from the registration vLLM hands the worker until the KV landed or
the receive failed, under one lock.

The main thread starts receives, fails them and learns they ended; the writer sends
their PUSH_REGs. A receive is failed at once only when no WRITE into its blocks can
come: its PUSH_REG never left, P said so (PUSH_FAIL), or the P process that could
WRITE is gone (a new agent answers under its engine id). Otherwise (the client went
away, the registration timed out, P stopped answering) the receive is *abandoned*:
its heartbeats stop at once, and it fails when `safe_at` passes, a lease plus the
WRITE timeout after the decoder last asked for the KV. A fork P never posts a WRITE
more than a lease after that last ask and aborts any WRITE older than the timeout,
so by then nothing can land in the blocks vLLM is about to free.

The state machine is the table in docs/architecture.md ("Push state"). A step costs
what is due, not what waits: the registration deadlines are in start order, the safe
points in a heap, the registered receives in the order their PUSH_REG last left (the
resends look at the oldest only), and receives are indexed by the prefill they wait on.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from connector.state import agent_name
from connector.vocabulary import ReceiveAbandon, ReceiveFailure

MAX_RECEIVES = 65536


class ReceiveState(StrEnum):
    QUEUED = "queued"  # handed to the writer, PUSH_REG not sent
    SENDING = "sending"  # the writer is sending the PUSH_REG
    REGISTERED = "registered"  # the PUSH_REG reached at least one of P's agents
    UNDELIVERED = "undelivered"  # it reached none (kept to send again once reconnected)
    ABANDONED = "abandoned"  # given up: failed once `safe_at` passes, unless it lands first
    FAILING = "failing"  # handed to vLLM to fail (reported on its next step)


_WAITING = frozenset({ReceiveState.QUEUED, ReceiveState.SENDING, ReceiveState.REGISTERED,
                      ReceiveState.UNDELIVERED})


@dataclass(slots=True)
class Receive:
    req_id: str
    engine: str | None
    started_at: float  # perf_counter
    state: ReceiveState = ReceiveState.QUEUED
    agents: frozenset[str] = frozenset()  # P agents (ranks) its PUSH_REG reached
    settled: frozenset[str] = frozenset()  # of those: done writing, or said PUSH_FAIL
    reg: dict[str, Any] | None = None
    last_want: float = 0.0  # PUSH_REG sent, or last heartbeat naming it
    sent_at: float = 0.0  # the PUSH_REG last reached P
    safe_at: float = 0.0  # perf_counter, while ABANDONED
    abandon: ReceiveAbandon | None = None
    failure: ReceiveFailure | None = None


class ReceiveLedger:
    """See module docstring. `hold_s`: lease + WRITE timeout + margin (how long after
    the decoder's last ask a WRITE may still land)."""

    def __init__(self, hold_s: float, timeout_s: float = float("inf"), limit: int = MAX_RECEIVES):
        self.hold_s = hold_s
        self.timeout_s = timeout_s  # push_registration_timeout: a receive waits no longer
        self._next_timeout = float("inf")  # no receive times out before this (perf_counter)
        self._limit = limit
        self._lock = threading.Lock()
        self._receives: OrderedDict[str, Receive] = OrderedDict()
        # Receives vLLM reported over: a PUSH_REG of one still queued to the writer must
        # not leave (its blocks may hold another request by now).
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._abandoned = 0
        # Indexes kept with every state change (`_set_state`): the safe points of
        # abandoned receives (a heap; an entry superseded by a later safe point or a
        # state change is skipped when popped), REGISTERED receives in the order their
        # PUSH_REG last reached P, receives by the prefill engine they wait on, and each
        # such engine's side-channel address.
        self._safe_points: list[tuple[float, int, str]] = []
        self._pushed_safe_points = 0
        self._registered: OrderedDict[str, Receive] = OrderedDict()
        self._by_engine: dict[str, set[str]] = {}
        self._addresses: dict[str, tuple[str, int]] = {}

    def __len__(self) -> int:
        return len(self._receives)

    @property
    def abandoned(self) -> bool:
        """Some receive waits for its safe point (a truth test, no lock)."""
        return self._abandoned > 0

    def state_of(self, req_id: str) -> ReceiveState | None:
        with self._lock:
            rec = self._receives.get(req_id)
            return None if rec is None else rec.state

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            counts: dict[str, int] = {}
            for rec in self._receives.values():
                counts[rec.state.value] = counts.get(rec.state.value, 0) + 1
            return counts

    # ------------------------------------------------------------ main thread
    def start(self, registrations: dict[str, dict[str, Any]], now: float) -> None:
        with self._lock:
            for req_id, reg in registrations.items():
                if req_id in self._receives:
                    continue
                engine = reg.get("remote_engine_id")
                self._receives[req_id] = Receive(req_id, engine, now, reg=reg, last_want=now)
                self._next_timeout = min(self._next_timeout, now + self.timeout_s)
                if engine is not None:
                    self._by_engine.setdefault(engine, set()).add(req_id)
                    host, port = reg.get("remote_host"), reg.get("remote_port")
                    if isinstance(host, str) and type(port) is int:
                        self._addresses[engine] = (host, port)
            while len(self._receives) > self._limit:
                self._remove(next(iter(self._receives.values())))

    def timed_out(self, now: float) -> list[str]:
        """Receives still waiting `timeout_s` after they started (the caller gives them
        up). Receives are kept in start order: one look at the oldest while none can."""
        if now < self._next_timeout:
            return []
        out = []
        with self._lock:
            self._next_timeout = float("inf")
            for rec in self._receives.values():
                if now - rec.started_at < self.timeout_s:
                    self._next_timeout = rec.started_at + self.timeout_s
                    break
                if rec.state in _WAITING:
                    out.append(rec.req_id)
        return out

    def wanted(self, req_ids: set[str]) -> set[str]:
        """Of the requests a heartbeat would name, those still wanted (abandoned and
        failing ones are left out)."""
        with self._lock:
            return {r for r in req_ids if (rec := self._receives.get(r)) is None
                    or rec.state in _WAITING}

    def asked(self, req_ids: set[str], now: float) -> None:
        """A heartbeat naming these requests left now: their last ask moves to `now`."""
        with self._lock:
            for req_id in req_ids:
                rec = self._receives.get(req_id)
                if rec is not None and rec.state in _WAITING:
                    rec.last_want = now

    def give_up(self, req_id: str, why: ReceiveAbandon, now: float) -> str:
        """Stop waiting for this receive. "fail": fail it now (no WRITE can come);
        "held": abandoned, it fails at its safe point or when every P agent it reached
        settled; "": already given up, or over."""
        with self._lock:
            rec = self._receives.get(req_id)
            if rec is None:
                return ""
            if rec.state in (ReceiveState.QUEUED, ReceiveState.UNDELIVERED):
                self._set_state(rec, ReceiveState.FAILING)
                rec.failure = ReceiveFailure.ABANDONED
                rec.abandon = why
                return "fail"
            if rec.state in (ReceiveState.SENDING, ReceiveState.REGISTERED):
                self._set_state(rec, ReceiveState.ABANDONED)
                rec.abandon = why
                self._set_safe_at(rec, max(rec.last_want, now) + self.hold_s)
                return "held"
            if rec.state is ReceiveState.ABANDONED and rec.abandon is None:
                rec.abandon = why
            return ""

    def due(self, now: float) -> list[tuple[str, ReceiveAbandon | None]]:
        """Abandoned receives whose blocks no WRITE can reach any more: fail them now."""
        heap = self._safe_points  # (only this thread pops: non-empty stays non-empty)
        if not self._abandoned or not heap or heap[0][0] > now:
            return []
        out = []
        with self._lock:
            while heap and heap[0][0] <= now:
                safe_at, _, req_id = heapq.heappop(heap)
                rec = self._receives.get(req_id)
                if rec is None or rec.state is not ReceiveState.ABANDONED or rec.safe_at != safe_at:
                    continue  # (over, failed, or its safe point moved later: a later entry stands)
                self._set_state(rec, ReceiveState.FAILING)
                rec.failure = rec.failure or ReceiveFailure.ABANDONED
                out.append((rec.req_id, rec.abandon))
        return out

    def fail(self, req_id: str, why: ReceiveFailure) -> bool:
        """P said the KV will not come (PUSH_FAIL), or the P process is gone: fail now.
        True when the receive was waiting (the caller hands it to vLLM)."""
        with self._lock:
            rec = self._receives.get(req_id)
            if rec is None or rec.state is ReceiveState.FAILING:
                return False
            self._set_state(rec, ReceiveState.FAILING)
            rec.failure = why
            return True

    def agent_done(self, req_id: str, agent: str) -> bool:
        """A P agent's WRITE of this receive completed (its notification arrived). True
        when the receive was told to fail and every agent it reached has now settled
        (the caller fails it now)."""
        with self._lock:
            rec = self._receives.get(req_id)
            if rec is None:
                return False
            rec.settled = rec.settled | {agent_name(agent)}
            return self._fail_if_settled(rec)

    def agent_failed(self, req_id: str, agent: str | None, why: ReceiveFailure, now: float) -> str:
        """A P agent said PUSH_FAIL. "fail": every agent the PUSH_REG reached has settled,
        fail it now; "wait": another rank of P may still WRITE into its blocks, so it is
        given up (heartbeats stop) and fails when they settle or at its safe point;
        "ignore": not waiting here."""
        with self._lock:
            rec = self._receives.get(req_id)
            if rec is None or rec.state is ReceiveState.FAILING:
                return "ignore"
            rec.failure = rec.failure or why
            if agent is not None:
                rec.settled = rec.settled | {agent_name(agent)}
            if self._fail_if_settled(rec):
                return "fail"
            if rec.state is not ReceiveState.ABANDONED:
                self._set_state(rec, ReceiveState.ABANDONED)
                rec.abandon = None
                self._set_safe_at(rec, max(rec.last_want, now) + self.hold_s)
            return "wait"

    def _fail_if_settled(self, rec: Receive) -> bool:
        if rec.failure is None or not rec.agents or not rec.agents <= rec.settled:
            return False
        if rec.state is ReceiveState.FAILING:
            return False
        self._set_state(rec, ReceiveState.FAILING)
        return True

    def handshake_failed(self, req_id: str, now: float) -> str:
        """The D->P handshake its PUSH_REG waited for failed for good. "fail": its
        PUSH_REG never reached P, fail it now (no WRITE can come); "held": an earlier
        PUSH_REG of it reached P (this was a resend), so it is given up and fails at its
        safe point; "": not waiting here."""
        with self._lock:
            rec = self._receives.get(req_id)
            if rec is None or rec.state in (ReceiveState.FAILING, ReceiveState.ABANDONED):
                return ""
            if not rec.agents:
                self._set_state(rec, ReceiveState.FAILING)
                rec.failure = ReceiveFailure.HANDSHAKE_FAILED
                return "fail"
            self._set_state(rec, ReceiveState.ABANDONED)
            rec.abandon = ReceiveAbandon.PEER_UNREACHABLE
            self._set_safe_at(rec, max(rec.last_want, now) + self.hold_s)
            return "held"

    def over(self, req_id: str) -> ReceiveFailure | None:
        """vLLM reported the receive finished (landed or failed): why we failed it."""
        with self._lock:
            rec = self._receives.get(req_id)
            self._ended[req_id] = None
            while len(self._ended) > self._limit:
                self._ended.popitem(last=False)
            if rec is None:
                return None
            self._remove(rec)
            return rec.failure

    def reached_prefill(self, req_id: str) -> bool:
        """Its PUSH_REG reached P at least once (and it is not over)."""
        with self._lock:
            rec = self._receives.get(req_id)
            return rec is not None and rec.sent_at > 0 and rec.state is not ReceiveState.FAILING

    def registered_on(self, engine_id: str, agents: frozenset[str]) -> list[str]:
        """Receives whose PUSH_REG reached only these (now gone) agents of `engine_id`,
        whatever they are doing now (a resend in flight, or one that reached nobody, goes
        to a process that never had the request)."""
        agents = frozenset(map(agent_name, agents))
        with self._lock:
            recs = [self._receives[r] for r in self._by_engine.get(engine_id, ())]
            return [r.req_id for r in recs if r.agents and r.agents <= agents
                    and r.state is not ReceiveState.FAILING]

    def waiting_on(self, engine_id: str, started_before: float = float("inf")) -> list[str]:
        """Receives still waiting for this engine (not abandoned, not over), of those
        started before `started_before` (perf_counter)."""
        with self._lock:
            return [r for r in self._by_engine.get(engine_id, ())
                    if (rec := self._receives[r]).state in _WAITING and rec.started_at < started_before]

    def engines_waited_on(self) -> set[str]:
        """Prefills that hold a PUSH_REG of a receive still waiting."""
        with self._lock:
            return {r.engine for r in self._registered.values() if r.engine is not None}

    def address_of(self, engine_id: str) -> tuple[str, int] | None:
        """The side-channel address of a prefill, from a registration that names it."""
        with self._lock:
            return self._addresses.get(engine_id) if self._by_engine.get(engine_id) else None

    def due_resend(self, now: float, every_s: float) -> list[tuple[str, dict[str, Any]]]:
        """Registered receives whose KV has not come `every_s` after their PUSH_REG last
        left: it is sent again (a notification can be lost; P drops a repeat of one it
        has, and answers again one it refused)."""
        with self._lock:
            due = []
            for rec in self._registered.values():  # (oldest send first)
                if now - rec.sent_at < every_s:
                    break
                due.append(rec)
            out = []
            for rec in due:
                rec.sent_at = now
                self._registered.move_to_end(rec.req_id)
                if rec.reg:
                    out.append((rec.req_id, rec.reg))
            return out

    # ----------------------------------------------------------- writer thread
    def begin_send(self, req_id: str) -> int:
        """The writer is about to send this receive's PUSH_REG: 0 if it must not (given
        up, or failing), 1 for its first send, 2 when it is sent again."""
        with self._lock:
            rec = self._receives.get(req_id)
            if rec is None:
                # Over already (its registration waited in the writer's queue while vLLM
                # failed it and freed its blocks), or never started here: nothing to send.
                return 0
            if rec.state in _WAITING:
                again = 2 if rec.sent_at else 1
                self._set_state(rec, ReceiveState.SENDING)
                return again
            return 0

    def sent(self, req_id: str, reg: dict[str, Any], agents: frozenset[str], now: float) -> bool:
        """The P agents the PUSH_REG reached. True when it reached none and the receive
        was given up meanwhile (the caller fails it now: no WRITE can come)."""
        agents = frozenset(map(agent_name, agents))
        reached = len(agents)
        with self._lock:
            rec = self._receives.get(req_id)
            if rec is None:
                return False
            rec.reg = reg
            if reached > 0:
                rec.agents = rec.agents | agents
                rec.last_want = max(rec.last_want, now)
                rec.sent_at = now
                if rec.state is ReceiveState.SENDING:
                    self._set_state(rec, ReceiveState.REGISTERED)
                elif rec.state is ReceiveState.ABANDONED and now + self.hold_s > rec.safe_at:
                    self._set_safe_at(rec, now + self.hold_s)
                return False
            if rec.state is ReceiveState.SENDING:
                self._set_state(rec, ReceiveState.UNDELIVERED)
                return False
            if rec.state is ReceiveState.ABANDONED and not rec.agents:
                self._set_state(rec, ReceiveState.FAILING)
                rec.failure = ReceiveFailure.ABANDONED
                return True
            return False

    # -------------------------------------------------------------- internals
    def _set_state(self, rec: Receive, state: ReceiveState) -> None:
        """The one place a receive changes state: the indexes follow."""
        old = rec.state
        if old is state:
            return
        self._abandoned += (state is ReceiveState.ABANDONED) - (old is ReceiveState.ABANDONED)
        if old is ReceiveState.REGISTERED:
            del self._registered[rec.req_id]
        elif state is ReceiveState.REGISTERED:
            self._registered[rec.req_id] = rec  # (its PUSH_REG just reached P: the newest)
        rec.state = state

    def _set_safe_at(self, rec: Receive, safe_at: float) -> None:
        rec.safe_at = safe_at
        self._pushed_safe_points += 1
        heapq.heappush(self._safe_points, (safe_at, self._pushed_safe_points, rec.req_id))

    def _remove(self, rec: Receive) -> None:
        """Take a receive out of the ledger (its indexes with it)."""
        self._set_state(rec, ReceiveState.FAILING)
        del self._receives[rec.req_id]
        engine_receives = self._by_engine.get(rec.engine)
        if engine_receives is not None:
            engine_receives.discard(rec.req_id)
            if not engine_receives:
                del self._by_engine[rec.engine]
                self._addresses.pop(rec.engine, None)
