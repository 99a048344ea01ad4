"""The push state's owners (connector/state) on their own: no vLLM worker, no NIXL.

Each rule of docs/architecture.md ("Push state") is a test here; a stateful test
drives random interleavings of the main thread's and the writer's calls and checks the
invariants after every step; a threaded test races the writer's claims against the
main thread's reaper on real threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from connector.state.connections import ConnectionTable
from connector.state.leases import LeaseLedger, Refusal
from connector.state.receives import ReceiveLedger, ReceiveState
from connector.vocabulary import (
    LeaseRenewal,
    LeaseState,
    PeerReset,
    PushFailReason,
    PushRegRejection,
    ReceiveAbandon,
    ReceiveFailure,
)

LEASE_S, EXT_S, WRITE_S, MARGIN_S = 30.0, 20.0, 10.0, 1.0


def ledger(limit: int = 1000) -> LeaseLedger:
    return LeaseLedger(lease_s=LEASE_S, extension_s=EXT_S, write_timeout_s=WRITE_S, margin_s=MARGIN_S,
                       base_of=get_base_request_id, limit=limit)


def p_id(base: str, suffix: str = "aaaaaaaa") -> str:
    return f"cmpl-{base}-0-{suffix}"


def reg(base: str, suffix: str = "dddddddd", engine: str = "decode-0", **extra) -> dict:
    return {"request_id": f"cmpl-{base}-0-{suffix}", "decode_engine_id": engine, **extra}


# ------------------------------------------------------------------ leases
def test_a_held_lease_past_its_deadline_is_claimable_until_the_reaper_releases_it():
    """The starved prefill: the writer matches a PUSH_REG after the deadline passed but
    before the main thread's reaper ran. The blocks are still held: the WRITE goes on."""
    leases = ledger()
    leases.grant({p_id("a"): 100.0}, None, 0.0)
    assert leases.claim(p_id("a"), reg("a"), None, None, now=150.0) is None
    assert leases.claimed_past_deadline == 1
    assert leases.plan_reap(200.0, [p_id("a")]) == []


def test_the_reaper_releases_what_expired_and_a_claim_after_that_is_refused_as_late():
    leases = ledger()
    leases.grant({p_id("a"): 100.0}, None, 0.0)
    (released,) = leases.plan_reap(100.0, [p_id("a")])
    assert released.req_id == p_id("a")
    refusal = leases.claim(p_id("a"), reg("a"), None, None, now=100.1)
    assert isinstance(refusal, Refusal) and refusal.reason is PushFailReason.LEASE_EXPIRED
    # A later PUSH_REG naming it is late (no live request of that id is left).
    late = leases.intake(reg("a", "eeeeeeee")["request_id"])
    assert late is not None and late.rejection is PushRegRejection.AFTER_LEASE


def test_a_renewal_read_by_the_writer_counts_at_the_next_reaper_pass():
    leases = ledger()
    leases.grant({p_id("a"): 100.0}, None, 0.0)
    outcomes, renewed = leases.renew([reg("a")["request_id"]], None, now=99.0, stamp_ns=1)
    assert outcomes == {LeaseRenewal.RENEWED.value: 1} and renewed == 1
    assert leases.plan_reap(110.0, [p_id("a")]) == []  # renewed to 99 + 20
    assert [r.req_id for r in leases.plan_reap(119.0, [p_id("a")])] == [p_id("a")]


def test_a_push_fail_is_owed_only_once_every_write_of_the_request_settled():
    leases = ledger()
    leases.grant({p_id("a"): 100.0}, None, 0.0)
    r = reg("a", nixl_observed_caps=["push_fail"])
    assert leases.claim(p_id("a"), r, None, None, now=1.0) is None
    assert leases.begin_post(p_id("a"), None, now=1.0) is None
    leases.posted(p_id("a"), handles=2)
    leases.fail(p_id("a"), PushFailReason.PUSH_FAILED)  # one rank's WRITE failed
    assert leases.take_owed() == []  # the other rank may still be writing
    assert leases.settle([], open_writes={p_id("a")}) == []
    (settled,) = leases.settle([], open_writes=set())
    assert not settled.pushed and settled.failure is PushFailReason.PUSH_FAILED
    assert leases.take_owed() == [(r, PushFailReason.PUSH_FAILED)]
    # Released at the next pass, as vLLM's reaper would release it.
    assert [x.req_id for x in leases.plan_reap(2.0, [p_id("a")])] == [p_id("a")]


def test_a_settled_push_carries_its_stage_times_and_a_failed_one_none():
    """What the TTFT stage figures are made of: when the prefill finished (granted), the
    PUSH_REG matched (claimed), the WRITE started posting, and the settle."""
    leases = ledger()
    leases.grant({p_id("a"): 100.0, p_id("b"): 100.0}, None, 0.0, now=10.0)
    for base, at in (("a", 11.0), ("b", 11.5)):
        assert leases.claim(p_id(base), reg(base), None, None, now=at) is None
        assert leases.begin_post(p_id(base), None, now=at + 1.0) is None
        leases.posted(p_id(base), handles=1)
    leases.fail(p_id("b"), PushFailReason.PUSH_FAILED)
    settled = {x.req_id: x for x in leases.settle([p_id("a")], open_writes=set(), now=14.0)}
    a, b = settled[p_id("a")], settled[p_id("b")]
    assert a.pushed and (a.granted, a.claimed, a.posted, a.at) == (10.0, 11.0, 12.0, 14.0)
    assert not b.pushed and b.at == 0.0  # (a failed push is no stage figure)


def test_a_write_vllm_reports_done_before_the_writer_said_posted_is_pushed_not_failed():
    """Found by the load test: vLLM publishes a request's WRITE handles at the end of its
    posting call, so the main thread's poll can find them all done, and vLLM report the
    request finished, before the writer tells the ledger what it posted. The push
    succeeded: no PUSH_FAIL, and the writer's late `posted` changes nothing."""
    leases = ledger()
    leases.grant({p_id("a"): 100.0}, None, 0.0)
    r = reg("a", nixl_observed_caps=["push_fail"])
    assert leases.claim(p_id("a"), r, None, None, now=1.0) is None
    assert leases.begin_post(p_id("a"), None, now=1.0) is None
    (settled,) = leases.settle([p_id("a")], open_writes=set())  # vLLM: finished_sending
    assert settled.pushed and leases.state_of(p_id("a")) is LeaseState.PUSHED
    leases.posted(p_id("a"), handles=1)  # the writer, late
    assert leases.settle([], open_writes=set()) == []
    assert leases.state_of(p_id("a")) is LeaseState.PUSHED and leases.take_owed() == []
    assert not leases.writing


def test_a_write_past_its_timeout_is_returned_for_abort_and_an_unposted_claim_fails():
    leases = ledger()
    leases.grant({p_id("a"): 1000.0, p_id("b"): 1000.0}, None, 0.0)
    for name in ("a", "b"):
        assert leases.claim(p_id(name), reg(name), None, None, now=1.0) is None
    assert leases.begin_post(p_id("a"), None, now=1.0) is None
    leases.posted(p_id("a"), handles=1)
    assert leases.overdue(1.0 + WRITE_S - 0.1) == []
    assert leases.overdue(1.0 + WRITE_S) == [p_id("a")]
    assert leases.state_of(p_id("b")) is LeaseState.FAILED  # the writer never posted
    assert isinstance(leases.begin_post(p_id("b"), None, now=12.0), Refusal)
    leases.aborted(p_id("a"))
    assert leases.state_of(p_id("a")) is LeaseState.FAILED


def test_two_live_requests_sharing_an_id_are_never_matched_by_guess():
    leases = ledger()
    leases.grant({p_id("x", "11111111"): 100.0}, None, 0.0)
    leases.note_batch([p_id("x", "22222222")], [])  # the other one still prefills
    d = reg("x")["request_id"]
    refusal = leases.intake(d)
    assert refusal is not None and refusal.rejection is PushRegRejection.AMBIGUOUS
    refusal = leases.claim(p_id("x", "11111111"), reg("x"), None, None, now=1.0)
    assert refusal is not None and refusal.reason is PushFailReason.AMBIGUOUS


def test_a_second_registration_for_an_id_one_is_waiting_on_is_refused():
    leases = ledger()
    leases.note_batch([p_id("x")], [])
    assert leases.intake(reg("x", "dddddddd")["request_id"]) is None
    refusal = leases.intake(reg("x", "eeeeeeee")["request_id"])
    assert refusal is not None and refusal.rejection is PushRegRejection.AMBIGUOUS


def test_a_prompt_that_differs_from_the_prefills_is_refused():
    leases = ledger()
    leases.grant({p_id("a"): 100.0}, {p_id("a"): "digest-of-prompt-1"}, 0.0)
    refusal = leases.claim(p_id("a"), reg("a"), "digest-of-prompt-2", None, now=1.0)
    assert refusal is not None and refusal.rejection is PushRegRejection.PROMPT_MISMATCH
    assert leases.state_of(p_id("a")) is LeaseState.HELD  # left for its own decoder
    assert leases.claim(p_id("a"), reg("a", "ffffffff"), "digest-of-prompt-1", None, now=1.0) is None


def test_a_duplicated_push_reg_is_dropped_not_acted_on_twice():
    leases = ledger()
    leases.note_batch([p_id("a")], [])
    d = reg("a")["request_id"]
    assert leases.intake(d) is None
    refusal = leases.intake(d)
    assert refusal is not None and refusal.rejection is PushRegRejection.DUPLICATE


def connected(conns: ConnectionTable, engine: str, agents: dict, now: float = 1.0,
              notif_only: bool = False):
    """The table as a finished handshake of that flavor leaves it."""
    decision = conns.ensure(engine, notif_only=notif_only, for_write=not notif_only)
    return conns.connected(engine, decision.pending, agents, 0.0, now)


def test_no_write_is_posted_to_a_connection_being_dropped_nor_dropped_under_a_write():
    """The drop protocol (docs/architecture.md, "Dropping a connection"): the main thread
    marks the connection dropping, then asks the lease ledger; the writer makes its lease
    POSTING, then asks the connection. Whichever comes second sees the first."""
    leases, conns = ledger(), ConnectionTable(forget_after_s=100.0)
    connected(conns, "d1", {(0, 0): "agent"})
    leases.grant({p_id("a"): 100.0, p_id("b"): 100.0}, None, 0.0)
    assert leases.claim(p_id("a"), reg("a", engine="d1"), None, None, now=1.0) is None
    # The drop first: a claimed, unposted lease does not hold it; the writer then finds
    # the connection dropping before it posts, and undoes its POSTING.
    epoch, _ = conns.for_write("d1")
    assert conns.begin_drop("d1") is not None and not leases.posting_to("d1")
    assert leases.begin_post(p_id("a"), None, now=1.0) is None
    assert not conns.writable("d1", epoch)
    leases.unpost(p_id("a"))
    assert leases.state_of(p_id("a")) is LeaseState.CLAIMED and conns.for_write("d1") is None
    conns.cancel_drop("d1")
    # The writer first: its POSTING lease keeps the drop off.
    epoch, _ = conns.for_write("d1")
    assert leases.begin_post(p_id("a"), None, now=1.0) is None
    assert conns.begin_drop("d1") is not None and leases.posting_to("d1")
    conns.cancel_drop("d1")
    assert conns.writable("d1", epoch)
    assert leases.wrote(p_id("a")) and not leases.wrote(p_id("a"))  # (counted started, once)
    leases.posted(p_id("a"), 1)
    assert leases.posting_to("d1")  # in flight: the drop waits


def drop_race(writer_checks_first: bool = False) -> list[tuple[str, int]]:
    """The writer posts while the main thread drops and reconnects the decoder's
    connection, on two real threads; the sequence of WRITEs posted and drops done, each
    with its connection's epoch. `writer_checks_first`: the writer asks the connection
    before its lease is POSTING (the wrong order)."""
    leases, conns = ledger(limit=100000), ConnectionTable(forget_after_s=1e9)
    connected(conns, "d1", {(0, 0): "agent"})
    events: list[tuple[str, int]] = []  # (list.append is atomic: one order for both threads)
    stop = threading.Event()

    attempts = [0]

    def writer() -> None:
        for i in range(3000):
            attempts[0] = i
            req = p_id(f"w{i}")
            leases.grant({req: 1e9}, None, 0.0)
            assert leases.claim(req, reg(f"w{i}", engine="d1"), None, None, now=0.0) is None
            connection = conns.for_write("d1")
            if connection is None:
                leases.fail(req, PushFailReason.PUSH_FAILED)
                continue
            epoch, _ = connection
            if writer_checks_first and not conns.writable("d1", epoch):
                leases.fail(req, PushFailReason.PUSH_FAILED)
                continue
            time.sleep(0)  # (a thread switch between the two steps, either order)
            assert leases.begin_post(req, None, now=0.0) is None
            time.sleep(0)
            if not writer_checks_first and not conns.writable("d1", epoch):
                leases.unpost(req)
                leases.fail(req, PushFailReason.PUSH_FAILED)
                continue
            events.append(("post", epoch))
            leases.posted(req, 1)
            leases.settle([req], set(), 0.0)  # (landed at once)
        stop.set()

    def main() -> None:
        while not stop.is_set():
            if conns.begin_drop("d1") is None:
                continue
            if leases.posting_to("d1"):
                conns.cancel_drop("d1")
                continue
            events.append(("drop", conns.targets("d1").epoch))
            conns.dropped("d1", PeerReset.NOTIFICATION_FAILED, 0.0, kept_transfer_info=False)
            connected(conns, "d1", {(0, 0): "agent"})
            seen = attempts[0]  # (reconnected: let the writer try on it before the next drop)
            while attempts[0] - seen < 2 and not stop.is_set():
                time.sleep(0)

    threads = [threading.Thread(target=writer), threading.Thread(target=main)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    return events


def posted_after_their_drop(events: list[tuple[str, int]]) -> list[int]:
    dropped: set[int] = set()
    late = []
    for what, epoch in events:
        if what == "drop":
            dropped.add(epoch)
        elif epoch in dropped:
            late.append(epoch)
    return late


def test_the_drop_protocol_on_real_threads_never_drops_under_a_write():
    """No WRITE is ever posted on a connection after its drop went ahead: the writer's
    POSTING comes before its check, the main thread's dropping before its."""
    events = drop_race()
    assert {what for what, _ in events} == {"post", "drop"}, events[:5]
    assert posted_after_their_drop(events) == []


def test_the_race_check_sees_a_writer_that_checks_the_connection_first():
    """The same race with the writer's two steps the other way round: WRITEs posted on
    connections already dropped (the check above can fail)."""
    assert posted_after_their_drop(drop_race(writer_checks_first=True))


def test_no_write_is_posted_more_than_a_lease_after_the_decoder_last_asked():
    leases = ledger()
    leases.grant({p_id("a"): 1000.0}, None, 0.0)
    # D's clock runs 500 s ahead of ours (offset = D - P).
    assert leases.claim(p_id("a"), reg("a"), None, want_d=510.0, now=10.0) is None
    fresh_until = 510.0 + LEASE_S - MARGIN_S - 500.0  # in our clock
    leases.renew([reg("a")["request_id"]], 520.0, now=20.0, stamp_ns=1)  # a heartbeat
    assert leases.begin_post(p_id("a"), 500.0, now=fresh_until + 10.0 - 0.01) is None
    leases2 = ledger()
    leases2.grant({p_id("a"): 1000.0}, None, 0.0)
    leases2.claim(p_id("a"), reg("a"), None, want_d=510.0, now=10.0)
    refusal = leases2.begin_post(p_id("a"), 500.0, now=fresh_until + 0.01)
    assert isinstance(refusal, Refusal) and refusal.reason is PushFailReason.REGISTRATION_STALE


def test_the_ledger_is_bounded_and_never_drops_a_live_lease():
    leases = ledger(limit=4)
    leases.grant({p_id(f"r{i}"): 100.0 for i in range(6)}, None, 0.0)
    assert len(leases) == 6  # all live: none dropped (their blocks are held)
    released = leases.plan_reap(200.0, [p_id(f"r{i}") for i in range(6)])
    assert len(released) == 6
    leases.grant({p_id("new"): 300.0}, None, 0.0)
    assert len(leases) == 4 and leases.state_of(p_id("new")) is LeaseState.HELD
    assert leases.snapshot()["ended_keys"] <= 2 * 4


def test_claims_and_the_reaper_racing_on_real_threads_never_share_a_lease():
    """The writer claims and posts every lease as it comes; the main thread reaps with
    a clock past every deadline. Each lease ends claimed or released, never both."""
    leases = ledger()
    n = 2000
    ids = [p_id(f"r{i}") for i in range(n)]
    leases.grant(dict.fromkeys(ids, 0.0), None, 0.0)  # all past their deadline
    claimed: list[str] = []
    start = threading.Barrier(2)

    def writer() -> None:
        start.wait()
        for i, req_id in enumerate(ids):
            if leases.claim(req_id, reg(f"r{i}"), None, None, now=1.0) is None:
                claimed.append(req_id)
                assert leases.begin_post(req_id, None, now=1.0) is None
                leases.posted(req_id, 1)

    thread = threading.Thread(target=writer)
    thread.start()
    start.wait()
    released: set[str] = set()
    while thread.is_alive() or not released | set(claimed) >= set(ids):
        out = leases.plan_reap(1.0, [r for r in ids if r not in released])
        released |= {x.req_id for x in out}
    thread.join()
    assert not released & set(claimed)
    assert released | set(claimed) == set(ids)
    assert all(leases.state_of(r) is LeaseState.WRITING for r in claimed)


class LeaseMachine(RuleBasedStateMachine):
    """Random interleavings of every call of the main thread and the writer, with WRITEs
    that land (vLLM reports them done), fail or never settle; the invariants hold after
    each step, and every lease that ends does so in a state the table allows."""

    @initialize()
    def setup(self) -> None:
        self.leases = ledger()
        self.now = 0.0
        self.ids = [p_id(f"r{i}") for i in range(4)]
        self.held: set[str] = set()  # what "vLLM" still holds
        self.open: set[str] = set()  # requests with open WRITE handles
        self.landed: set[str] = set()  # WRITEs done, not yet reported by vLLM's poll
        self.released: set[str] = set()
        self.pushed: set[str] = set()

    @rule(i=st.integers(0, 3), dt=st.floats(0.0, 40.0))
    def grant(self, i: int, dt: float) -> None:
        req = self.ids[i]
        if req in self.held or req in self.released or req in self.pushed:
            return
        self.leases.grant({req: self.now + dt}, None, self.now)
        self.held.add(req)

    @rule(dt=st.floats(0.0, 15.0))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(i=st.integers(0, 3))
    def heartbeat(self, i: int) -> None:
        self.leases.renew([reg(f"r{i}")["request_id"]], None, self.now, 0)

    @rule(i=st.integers(0, 3))
    def claim_and_post(self, i: int) -> None:
        req = self.ids[i]
        if self.leases.claim(req, reg(f"r{i}"), None, None, self.now) is None:
            assert req not in self.released, "a released lease was claimed"
            if self.leases.begin_post(req, None, self.now) is None:
                self.open.add(req)  # (published before `posted`, as the writer does)
                self.leases.posted(req, 1)

    @rule(i=st.integers(0, 3))
    def write_lands(self, i: int) -> None:
        req = self.ids[i]
        if req in self.open:
            self.open.discard(req)
            self.landed.add(req)

    @rule(i=st.integers(0, 3))
    def write_fails(self, i: int) -> None:
        self.open.discard(self.ids[i])  # (no handle left open, not reported done)

    @rule()
    def main_step(self) -> None:
        out = self.leases.plan_reap(self.now, self.held)
        for item in out:
            assert item.req_id not in self.open, "released under an open WRITE"
            self.held.discard(item.req_id)
            self.released.add(item.req_id)
        done, self.landed = self.landed & self.held, set()
        for settled in self.leases.settle(done, set(self.open), self.now):
            if settled.pushed:
                assert settled.req_id in done
        for req in self.leases.overdue(self.now):
            self.open.discard(req)  # (aborted)
            self.leases.aborted(req)
        if done:  # vLLM frees the blocks of what it reported done sending
            self.leases.ended(done)
            self.held -= done
            self.pushed |= done
            for req in done:
                assert self.leases.state_of(req) is LeaseState.PUSHED

    @precondition(lambda self: hasattr(self, "leases"))
    @invariant()
    def a_write_in_flight_holds_its_lease(self) -> None:
        for req in self.open:
            assert self.leases.state_of(req) is LeaseState.WRITING
            assert req in self.held

    @precondition(lambda self: hasattr(self, "leases"))
    @invariant()
    def an_ended_lease_stays_ended(self) -> None:
        for req in self.released:
            assert self.leases.state_of(req) is LeaseState.RELEASED
        for req in self.pushed:
            assert self.leases.state_of(req) is LeaseState.PUSHED


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_lease_machine_reaches_every_end():
    """The machine above is not vacuous: a run of its rules pushes one lease and releases
    another (PUSHED and RELEASED both reachable)."""
    m = LeaseMachine()
    m.setup()
    m.grant(0, 30.0)
    m.grant(1, 1.0)
    m.claim_and_post(0)
    m.write_lands(0)
    m.tick(2.0)
    m.main_step()
    assert m.pushed == {m.ids[0]} and m.released == {m.ids[1]}


# ---------------------------------------------------------------- receives
def test_a_receive_given_up_before_its_push_reg_left_fails_at_once():
    receives = ReceiveLedger(hold_s=40.0)
    receives.start({"d1": {"remote_engine_id": "p"}}, now=0.0)
    assert receives.give_up("d1", ReceiveAbandon.CLIENT_GONE, now=1.0) == "fail"
    assert not receives.begin_send("d1")  # the writer sends nothing for it


def test_a_registered_receive_given_up_fails_only_after_its_hold():
    receives = ReceiveLedger(hold_s=40.0)
    receives.start({"d1": {"remote_engine_id": "p"}}, now=0.0)
    assert receives.begin_send("d1")
    receives.sent("d1", {}, frozenset({"agent"}), now=2.0)
    receives.asked({"d1"}, now=5.0)  # a heartbeat named it
    assert receives.give_up("d1", ReceiveAbandon.CLIENT_GONE, now=6.0) == "held"
    assert receives.give_up("d1", ReceiveAbandon.TIMED_OUT, now=7.0) == ""  # (once)
    assert receives.wanted({"d1"}) == set()  # heartbeats stop naming it
    assert receives.due(45.9) == []
    assert receives.due(46.0) == [("d1", ReceiveAbandon.CLIENT_GONE)]
    assert receives.over("d1") is ReceiveFailure.ABANDONED


def test_a_push_reg_still_queued_when_its_receive_ended_never_leaves():
    """Found by the campaign (seed 2): the client went away while D's writer was stalled;
    the receive failed at once (its PUSH_REG had not left) and vLLM gave its blocks to the
    next request; then the writer woke and sent the stale PUSH_REG, and P wrote into
    those blocks."""
    receives = ReceiveLedger(hold_s=40.0)
    receives.start({"d1": {"remote_engine_id": "p"}}, now=0.0)
    assert receives.give_up("d1", ReceiveAbandon.CLIENT_GONE, now=1.0) == "fail"
    receives.over("d1")  # vLLM reported it failed: its blocks are free
    assert not receives.begin_send("d1")
    assert not receives.begin_send("never-started")


def test_a_given_up_receive_whose_push_reg_reached_nobody_fails_at_once():
    receives = ReceiveLedger(hold_s=40.0)
    receives.start({"d1": {"remote_engine_id": "p"}}, now=0.0)
    assert receives.begin_send("d1")
    assert receives.give_up("d1", ReceiveAbandon.CLIENT_GONE, now=1.0) == "held"  # may be on its way
    assert receives.sent("d1", {}, frozenset(), now=1.1)


def test_a_push_fail_fails_a_waiting_receive_once():
    receives = ReceiveLedger(hold_s=40.0)
    receives.start({"d1": {"remote_engine_id": "p"}}, now=0.0)
    receives.begin_send("d1")
    receives.sent("d1", {}, frozenset({"agent"}), now=1.0)
    assert receives.agent_failed("d1", "agent", ReceiveFailure.LEASE_EXPIRED, now=2.0) == "fail"
    assert receives.agent_failed("d1", "agent", ReceiveFailure.LEASE_EXPIRED, now=2.0) == "ignore"
    assert receives.state_of("d1") is ReceiveState.FAILING


def test_agent_names_are_one_spelling_whether_vllm_or_nixl_hands_them_over():
    """vLLM keeps remote agent names as bytes, NIXL hands them back as str with received
    notifications: a PUSH_FAIL or a contact must match the agent the PUSH_REG reached."""
    receives = ReceiveLedger(hold_s=40.0)
    receives.start({"d1": {"remote_engine_id": "p"}}, now=0.0)
    receives.begin_send("d1")
    receives.sent("d1", {}, frozenset({b"agent-1"}), now=1.0)
    assert receives.agent_failed("d1", "agent-1", ReceiveFailure.LEASE_EXPIRED, now=2.0) == "fail"
    conns = ConnectionTable(forget_after_s=100.0)
    connected(conns, "p", {(0, 0): b"agent-1"}, now=1.0, notif_only=True)
    conns.heard_from("agent-1", now=5.0)
    assert conns.last_contact("p") == 5.0 and conns.engine_of(b"agent-1") == "p"


def test_a_push_fail_from_one_prefill_rank_waits_for_the_others_writes():
    """Found by the campaign (seed 7, P TP 2): one P rank found the lease released and
    said PUSH_FAIL while the other rank's WRITE was still landing; failing at once gave
    the blocks to another request under that WRITE."""
    receives = ReceiveLedger(hold_s=40.0)
    receives.start({"d1": {"remote_engine_id": "p"}}, now=0.0)
    receives.begin_send("d1")
    receives.sent("d1", {}, frozenset({"rank0", "rank1"}), now=1.0)
    assert receives.agent_failed("d1", "rank1", ReceiveFailure.LEASE_EXPIRED, now=2.0) == "wait"
    assert receives.wanted({"d1"}) == set()  # given up: no more heartbeats
    assert receives.agent_done("d1", "rank0")  # rank 0's WRITE landed: now it fails
    assert receives.over("d1") is ReceiveFailure.LEASE_EXPIRED
    # ... or, if rank 0 never answers, at the safe point.
    receives.start({"d2": {"remote_engine_id": "p"}}, now=0.0)
    receives.begin_send("d2")
    receives.sent("d2", {}, frozenset({"rank0", "rank1"}), now=1.0)
    assert receives.agent_failed("d2", "rank1", ReceiveFailure.LEASE_EXPIRED, now=2.0) == "wait"
    assert receives.due(41.9) == [] and [r for r, _ in receives.due(42.0)] == ["d2"]


def test_the_receive_ledger_is_bounded():
    receives = ReceiveLedger(hold_s=1.0, limit=3)
    receives.start({f"d{i}": {"remote_engine_id": "p"} for i in range(5)}, now=0.0)
    assert len(receives) == 3


# ------------------------------------------------------------- connections
def test_contact_is_an_answer_not_a_send():
    conns = ConnectionTable(forget_after_s=100.0)
    connected(conns, "p", {(0, 0): "a1"}, now=1.0, notif_only=True)
    assert conns.last_contact("p") == 1.0
    conns.heard_from("a1", now=5.0)
    assert conns.last_contact("p") == 5.0
    assert conns.begin_probe("p", now=9.0, quiet_s=3.0)
    assert not conns.begin_probe("p", now=9.5, quiet_s=3.0)  # one probe out at a time
    conns.answered("p", now=10.0)
    assert conns.last_contact("p") == 10.0


def test_a_peer_back_with_a_new_agent_restarted_and_one_silent_past_the_bound_is_forgotten():
    conns = ConnectionTable(forget_after_s=100.0)
    connected(conns, "p", {(0, 0): "a1"}, now=1.0, notif_only=True)
    conns.failed("p", PeerReset.NOTIFICATION_FAILED, "a1")
    assert conns.need_tending
    assert conns.begin_drop("p") == {(0, 0): "a1"}
    conns.dropped("p", PeerReset.NOTIFICATION_FAILED, now=2.0, kept_transfer_info=True)
    assert conns.drop_reason("p") == PeerReset.NOTIFICATION_FAILED.value
    outcome = connected(conns, "p", {(0, 0): "a2"}, now=3.0, notif_only=True)
    assert (outcome.restarted, outcome.old_agents) == (True, frozenset({"a1"}))
    assert conns.begin_drop("p") is not None
    conns.dropped("p", PeerReset.SILENT, now=4.0, kept_transfer_info=False)
    assert conns.forget_silent(103.9) == []
    (gone,) = conns.forget_silent(104.0)
    assert gone.engine_id == "p" and len(conns) == 0 and not conns.need_tending


def test_the_connection_table_is_bounded_and_evicts_dropped_peers_first():
    conns = ConnectionTable(forget_after_s=100.0, limit=3)
    for i in range(3):
        connected(conns, f"p{i}", {(0, 0): f"a{i}"}, now=float(i), notif_only=True)
    assert conns.begin_drop("p1") is not None
    conns.dropped("p1", PeerReset.SILENT, now=5.0, kept_transfer_info=False)
    connected(conns, "p3", {(0, 0): "a3"}, now=6.0, notif_only=True)
    assert len(conns) == 3 and conns.engine_of("a0") == "p0" and conns.engine_of("a3") == "p3"
    assert conns.last_contact("p1") == 0.0  # the dropped one went


def test_work_parked_on_a_connection_comes_back_with_its_replacement_never_after():
    """A PUSH_REG that reached no agent waits for the connection it tried to be replaced;
    parking on one replaced already is refused (the caller sends it again now), so
    nothing waits for a connection that is gone."""
    conns = ConnectionTable(forget_after_s=100.0)
    connected(conns, "p", {(0, 0): "a1"}, notif_only=True)
    tried = conns.targets("p")
    assert conns.park("p", tried.epoch, "reg-1")
    assert conns.begin_drop("p") is not None
    assert conns.targets("p") == type(tried)(tried.epoch, {}, dropping=True)
    assert conns.park("p", tried.epoch, "reg-2")  # (being dropped: it waits for the drop)
    assert conns.dropped("p", PeerReset.NOTIFICATION_FAILED, 2.0, kept_transfer_info=False) == [
        "reg-1", "reg-2"]
    assert not conns.park("p", tried.epoch, "reg-3")  # that connection is gone: act now
    after_drop = conns.targets("p")
    assert after_drop.agents == {} and not after_drop.dropping  # none: the caller connects
    assert conns.park("p", after_drop.epoch, "reg-4")
    assert connected(conns, "p", {(0, 0): "a2"}, notif_only=True).parked == ["reg-4"]


@pytest.mark.parametrize("hb, outcome", [
    ("held", LeaseRenewal.RENEWED), ("prefilling", LeaseRenewal.PREFILLING),
    ("done", LeaseRenewal.ALREADY_DONE), ("other", LeaseRenewal.UNKNOWN_REQUEST)])
def test_each_heartbeat_id_is_counted_by_what_it_matched(hb: str, outcome: LeaseRenewal):
    leases = ledger()
    leases.grant({p_id("held"): 100.0, p_id("done"): 100.0}, None, 0.0)
    leases.note_batch([p_id("prefilling")], [])
    leases.ended([p_id("done")])
    assert leases.renew([reg(hb)["request_id"]], None, 1.0, 0)[0] == {outcome.value: 1}


# ------------------------------------------------------------------ cost
class CountingDict(OrderedDict):
    """An OrderedDict that counts how often it is walked (iteration, keys, values, items)."""

    walks = 0

    def __iter__(self):
        CountingDict.walks += 1
        return super().__iter__()

    def values(self):
        CountingDict.walks += 1
        return super().values()

    def items(self):
        CountingDict.walks += 1
        return super().items()


def test_a_step_walks_no_table_of_what_is_held():
    """With 5,000 leases held and 5,000 receives waiting, the per-step calls (reap, settle,
    timeouts, safe points, registration deadlines) walk none of the owners' tables: they
    read their indexes of what is due. (Counted walks, not time: benchmarks/scale.py
    measures the time.)"""
    leases, receives = ledger(limit=100000), ReceiveLedger(hold_s=40.0, timeout_s=480.0)
    held = {p_id(f"h{i}"): 1000.0 for i in range(5000)}
    leases.grant(held, None, 0.0)
    receives.start({f"d{i}": {"remote_engine_id": "p"} for i in range(5000)}, now=0.0)
    for i in range(5000):
        receives.begin_send(f"d{i}")
        receives.sent(f"d{i}", {}, frozenset({"a1"}), now=1.0)
    leases.grant({p_id("w"): 1000.0}, None, 0.0)  # one push in flight
    assert leases.claim(p_id("w"), reg("w"), None, None, now=1.0) is None
    assert leases.begin_post(p_id("w"), None, now=1.0) is None
    leases.posted(p_id("w"), 1)
    leases._leases = CountingDict(leases._leases)
    receives._receives = CountingDict(receives._receives)
    CountingDict.walks = 0
    for step in range(10):
        now = 2.0 + step / 10
        assert leases.plan_reap(now, held) == []
        assert leases.settle([], {p_id("w")}, now) == []
        assert leases.overdue(now) == []
        assert receives.due(now) == [] and receives.timed_out(now) == []
        assert receives.due_resend(now, every_s=100.0) == []
    assert CountingDict.walks == 0
