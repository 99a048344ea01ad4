"""The state tables of docs/architecture.md, checked row by row against the owners.

Each row of "A lease", "A receive" and "A connection" is read from the doc: for every
state of its "from" column, an owner (connector/state) is put in that state, the row's
event is made to happen through the owner's methods (what the flows call), and the state
the owner ends in must be the row's "to". A row without a driver here, or a driver
without its row, fails: the doc and the code cannot drift apart silently.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.state.connections import ConnectionTable, ConnState
from connector.state.leases import LeaseLedger
from connector.state.receives import ReceiveLedger
from connector.vocabulary import LeaseState, PeerReset, PushFailReason, ReceiveAbandon, ReceiveFailure

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
HOLD_S, LEASE_S, WRITE_S = 40.0, 30.0, 10.0


def rows(section: str) -> list[tuple[str, list[str], str, str]]:
    """(id, from states, event, to) of the table under the doc's heading `section`."""
    text = DOC.read_text()
    body = text[text.index(f"### {section}\n"):]
    body = body[:body.index("\n#", 1)] if "\n#" in body[1:] else body
    out = []
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"[LRC]\d+", cells[0]):
            froms = [f.strip() for f in cells[1].split(",")]
            out.append((cells[0], froms, cells[2], cells[4].split(" (")[0].strip()))
    return out


# ------------------------------------------------------------------ leases
P, D_REQ = "cmpl-a-0-aaaaaaaa", "cmpl-a-0-dddddddd"


def reg(**extra: object) -> dict:
    return {"request_id": D_REQ, "decode_engine_id": "d1", **extra}


def lease_in(state: str, digest: str | None = None) -> LeaseLedger:
    leases = LeaseLedger(lease_s=LEASE_S, extension_s=20.0, write_timeout_s=WRITE_S, margin_s=1.0,
                         base_of=get_base_request_id)
    if state == "(none)":
        return leases
    leases.grant({P: 100.0}, {P: digest} if digest else None, 0.0)
    if state == "RELEASED":
        leases.plan_reap(100.0, [P])
    elif state != "HELD":
        assert leases.claim(P, reg(), None, 50.0, now=1.0) is None
        if state == "FAILED":
            leases.fail(P, PushFailReason.PUSH_FAILED)
        elif state in ("POSTING", "WRITING"):
            assert leases.begin_post(P, 0.0, now=2.0) is None
            if state == "WRITING":
                leases.posted(P, 1)
    assert leases.state_of(P) is LeaseState(state.lower()), state
    return leases


def _lease(event: Callable[[LeaseLedger], object], digest: str | None = None) -> Callable[[str], str]:
    def drive(state: str) -> str:
        leases = lease_in(state, digest)
        event(leases)
        now = leases.state_of(P)
        return "(gone)" if now is None else now.value.upper()
    return drive


def _renewed(leases: LeaseLedger) -> None:
    before = leases.deadline_of(P)
    leases.renew([D_REQ], None, now=95.0, stamp_ns=0)
    assert leases.deadline_of(P) > before


def _refused_by_digest(leases: LeaseLedger) -> None:
    assert leases.intake(D_REQ) is None
    assert leases.claim(P, reg(), "other-prompt", None, now=1.0) is not None


def _late_push_reg(leases: LeaseLedger) -> None:
    refusal = leases.intake("cmpl-a-0-eeeeeeee")
    assert refusal is not None and refusal.reason is PushFailReason.LEASE_EXPIRED


def _stale_post(leases: LeaseLedger) -> None:
    # Asked at 50 (the decoder's clock = ours + 0): more than a lease ago at 100.
    assert leases.begin_post(P, 0.0, now=100.0) is not None


def _abort(released: bool) -> Callable[[LeaseLedger], None]:
    def event(leases: LeaseLedger) -> None:
        assert leases.overdue(now=1.0 + WRITE_S + 1) == [P]
        if released:
            leases.aborted(P)
    return event


LEASES: dict[str, Callable[[str], str]] = {
    "L1": _lease(lambda leases: leases.grant({P: 100.0}, None, 0.0)),
    "L2": _lease(_renewed),
    "L3": _lease(lambda leases: leases.plan_reap(100.0, [P])),
    "L4": _lease(lambda leases: (leases.intake(D_REQ), leases.claim(P, reg(), None, None, now=1.0))),
    "L5": _lease(_refused_by_digest, digest="prompt"),
    "L6": _lease(_late_push_reg),
    "L7": _lease(lambda leases: leases.begin_post(P, 0.0, now=60.0)),
    "L8": _lease(_stale_post),
    "L9": _lease(lambda leases: leases.unpost(P)),
    "L10": _lease(lambda leases: leases.fail(P, PushFailReason.PUSH_FAILED)),
    "L11": _lease(lambda leases: leases.overdue(now=1.0 + WRITE_S + 1)),
    "L12": _lease(lambda leases: leases.posted(P, 2)),
    "L13": _lease(lambda leases: leases.posted(P, 0)),
    "L14": _lease(lambda leases: leases.settle([P], set(), 3.0)),
    "L15": _lease(lambda leases: leases.settle([P], set(), 3.0)),
    "L16": _lease(lambda leases: leases.settle([], set(), 3.0)),
    "L17": _lease(_abort(released=True)),
    "L18": _lease(_abort(released=False)),
    "L19": _lease(lambda leases: leases.plan_reap(3.0, [P])),
    "L20": _lease(lambda leases: leases.ended([P])),
}


# ---------------------------------------------------------------- receives
R = "d1"


def receive_in(state: str, agents: frozenset[str] = frozenset({"a1"}),
               reached_before: bool = False) -> ReceiveLedger:
    receives = ReceiveLedger(hold_s=HOLD_S, timeout_s=480.0)
    if state == "(none)":
        return receives
    receives.start({R: {"remote_engine_id": "p"}}, now=0.0)
    if state in ("SENDING", "REGISTERED", "UNDELIVERED", "ABANDONED") or reached_before:
        assert receives.begin_send(R)
        if state != "SENDING" or reached_before:
            receives.sent(R, {}, agents if state != "UNDELIVERED" or reached_before else frozenset(),
                          now=1.0)
        if state in ("SENDING", "UNDELIVERED") and reached_before:
            assert receives.begin_send(R) == 2  # (sent again ...)
            if state == "UNDELIVERED":
                receives.sent(R, {}, frozenset(), now=1.5)  # (... to nobody)
        if state == "ABANDONED":
            assert receives.give_up(R, ReceiveAbandon.CLIENT_GONE, now=2.0) == "held"
    if state == "FAILING":
        assert receives.give_up(R, ReceiveAbandon.CLIENT_GONE, now=1.0) == "fail"
    assert receives.state_of(R).value.upper() == state, state
    return receives


def _receive(event: Callable[[ReceiveLedger], object], **setup: object) -> Callable[[str], str]:
    def drive(state: str) -> str:
        receives = receive_in(state, **setup)
        event(receives)
        now = receives.state_of(R)
        return "(gone)" if now is None else now.value.upper()
    return drive


def _in_flight_when_given_up(receives: ReceiveLedger) -> None:
    assert receives.sent(R, {}, frozenset(), now=3.0)  # True: fail it now


def _given_up_in_flight(state: str) -> str:
    receives = receive_in("SENDING")
    assert receives.give_up(R, ReceiveAbandon.CLIENT_GONE, now=2.0) == "held"
    assert receives.state_of(R).value.upper() == state
    _in_flight_when_given_up(receives)
    return receives.state_of(R).value.upper()


def _told_then_landed(state: str) -> str:
    receives = receive_in("REGISTERED", agents=frozenset({"a1", "a2"}))
    assert receives.agent_failed(R, "a1", ReceiveFailure.LEASE_EXPIRED, now=2.0) == "wait"
    assert receives.state_of(R).value.upper() == state
    assert receives.agent_done(R, "a2")
    return receives.state_of(R).value.upper()


def _restarted(receives: ReceiveLedger) -> None:
    assert receives.registered_on("p", frozenset({"a1"})) == [R]
    receives.fail(R, ReceiveFailure.PEER_RESTARTED)


RECEIVES: dict[str, Callable[[str], str]] = {
    "R1": _receive(lambda receives: receives.start({R: {"remote_engine_id": "p"}}, now=0.0)),
    "R2": _receive(lambda receives: receives.begin_send(R)),
    "R3": _receive(lambda receives: receives.sent(R, {}, frozenset({"a1"}), now=1.0)),
    "R4": _receive(lambda receives: receives.sent(R, {}, frozenset(), now=1.0)),
    "R5": _receive(lambda receives: receives.handshake_failed(R, now=2.0)),
    "R6": _receive(lambda receives: receives.handshake_failed(R, now=2.0), reached_before=True),
    "R7": _receive(lambda receives: receives.give_up(R, ReceiveAbandon.CLIENT_GONE, now=2.0)),
    "R8": _receive(lambda receives: receives.give_up(R, ReceiveAbandon.CLIENT_GONE, now=2.0)),
    "R9": _given_up_in_flight,
    "R10": _receive(lambda receives: receives.due(now=2.0 + HOLD_S)),
    "R11": _receive(lambda receives: receives.agent_failed(R, "a1", ReceiveFailure.PUSH_FAILED, now=3.0)),
    "R12": _receive(lambda receives: receives.agent_failed(R, "a1", ReceiveFailure.PUSH_FAILED, now=3.0),
                    agents=frozenset({"a1", "a2"})),
    "R13": _told_then_landed,
    "R14": _receive(_restarted, reached_before=True),
    "R15": _receive(lambda receives: receives.over(R)),
}


# ------------------------------------------------------------- connections
E = "p"


def connect(conns: ConnectionTable, notif_only: bool, agent: str = "a1") -> object:
    decision = conns.ensure(E, notif_only=notif_only, for_write=not notif_only)
    return conns.connected(E, decision.pending, {(0, 0): agent}, 0.0, 1.0)


def connection_in(state: str) -> ConnectionTable:
    conns = ConnectionTable(forget_after_s=100.0)
    if state in ("NOTIF_ONLY", "UPGRADING", "DROPPING", "DROPPED"):
        connect(conns, notif_only=True)
    elif state == "FULL":
        connect(conns, notif_only=False)
    elif state == "CONNECTING":
        conns.ensure(E, notif_only=True, for_write=False)
    if state == "UPGRADING":
        conns.ensure(E, notif_only=False, for_write=True)
    if state in ("DROPPING", "DROPPED"):
        assert conns.begin_drop(E) is not None
    if state == "DROPPED":
        conns.dropped(E, PeerReset.NOTIFICATION_FAILED, now=2.0, kept_transfer_info=False)
    assert conns.state_of(E).value.upper() == state, state
    return conns


def _connection(event: Callable[[ConnectionTable, str], object]) -> Callable[[str], str]:
    def drive(state: str) -> str:
        conns = connection_in(state)
        event(conns, state)
        return conns.state_of(E).value.upper()
    return drive


def _start(conns: ConnectionTable, _state: str) -> None:
    decision = conns.ensure(E, notif_only=True, for_write=False)
    assert decision.pending is not None


def _suspected(conns: ConnectionTable, _state: str) -> None:
    conns.failed(E, PeerReset.NOTIFICATION_FAILED, "a1")
    assert conns.is_suspect(E)


def _restart(conns: ConnectionTable, _state: str) -> None:
    outcome = connect(conns, notif_only=True, agent="a2")
    assert outcome.restarted and outcome.old_agents == frozenset({"a1"})


def _cancelled(conns: ConnectionTable, _state: str) -> None:
    conns.cancel_drop(E)


def _evicted(conns: ConnectionTable, _state: str) -> None:
    assert conns.begin_drop(E) is not None
    conns.evicted(E)


CONNECTIONS: dict[str, Callable[[str], str]] = {
    "C1": _connection(_start),
    "C5": _connection(lambda conns, _s: conns.ensure(E, notif_only=False, for_write=True)),
    "C7": _connection(_suspected),
    "C8": _connection(lambda conns, _s: (conns.failed(E, PeerReset.SILENT), conns.begin_drop(E))),
    "C9": _connection(_cancelled),
    "C10": _connection(lambda conns, _s: conns.dropped(E, PeerReset.SILENT, 2.0, kept_transfer_info=False)),
    "C11": _connection(_restart),
    "C12": _connection(lambda conns, _s: conns.forget_silent(now=200.0)),
    "C13": _connection(_evicted),
}


def _c_connected(notif_only: bool, upgrade: bool = False) -> Callable[[str], str]:
    """C2, C3, C6: a handshake started here (it reaches the row's "from" state) succeeds
    with its flavor (the table hands its `Pending` only to whoever started it)."""
    def drive(state: str) -> str:
        conns = ConnectionTable(forget_after_s=100.0)
        if upgrade:
            connect(conns, notif_only=True)
        decision = conns.ensure(E, notif_only=notif_only, for_write=not notif_only)
        assert conns.state_of(E).value.upper() == state
        conns.connected(E, decision.pending, {(0, 0): "a1"}, 0.0, 1.0)
        return conns.state_of(E).value.upper()
    return drive


def _c_failed(state: str) -> str:
    conns = ConnectionTable(forget_after_s=100.0)
    decision = conns.ensure(E, notif_only=True, for_write=False)
    assert conns.state_of(E).value.upper() == state
    conns.connect_failed(E, decision.pending)
    return conns.state_of(E).value.upper()


CONNECTIONS.update({"C2": _c_connected(notif_only=True), "C3": _c_connected(notif_only=False),
                    "C4": _c_failed, "C6": _c_connected(notif_only=False, upgrade=True)})

TABLES = {"A lease (P)": LEASES, "A receive (D)": RECEIVES, "A connection": CONNECTIONS}
CASES = [(section, rid, frm, to) for section in TABLES for rid, froms, _, to in rows(section)
         for frm in froms]


@pytest.mark.parametrize("section", TABLES)
def test_every_row_has_its_driver_and_every_driver_its_row(section: str) -> None:
    assert sorted(rid for rid, *_ in rows(section)) == sorted(TABLES[section])


@pytest.mark.parametrize("section, rid, frm, to", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_the_row_holds(section: str, rid: str, frm: str, to: str) -> None:
    got = TABLES[section][rid](frm)
    if to == "the same, suspect":
        to = frm
    elif to == "the state it had":
        to = "NOTIF_ONLY"  # (the DROPPING setup drops a notification-only connection)
    elif to == "NONE":
        to = ConnState.NONE.value.upper()
    assert got == to, (rid, frm)
