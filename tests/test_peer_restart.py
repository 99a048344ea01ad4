"""A peer that restarts under the same engine id, and one that dies, on real engines.

Real NIXL/UCX agents and ZMQ side channels (the harness). A restart is what a pod
restart does: the process is killed and a new one comes back with the same engine id
and side-channel port, and a new NIXL agent. Upstream the survivor keeps the dead
agent for `engine_ttl` (an hour): its notifications and WRITEs go nowhere and the
requests waiting on it wait for `push_registration_timeout` (480 s).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import Counter
from typing import Any

import pytest

from connector.vocabulary import LeaseFate, PushRegRejection, ReceiveAbandon, ReceiveFailure, StatKey
from harness import PushHarness
from harness.poll import wait_until

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

# kv_lease_duration on both engines (heartbeats extend a lease by two thirds of it). Long
# enough that a restarted engine is back before D gives its requests up as unreachable
# (after a lease without contact).
LEASE_S = 20
SHORT_LEASE_S = 6
RETRIES = {"handshake_timeout_ms": 1000, "handshake_retry_budget_s": 4,
           # (D holds a given-up receive's blocks a lease + this + 2 margins after its last ask.)
           "push_write_timeout_s": 2, "push_lease_margin_s": 0.5}


def ids() -> tuple[str, str]:
    base = f"cmpl-{secrets.token_hex(6)}"
    return f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"


class Stats:
    """An engine's stats records, collected as they come."""

    def __init__(self, h: PushHarness, engine: str):
        self.h, self.engine, self.records = h, engine, []

    def values(self, key: str) -> Counter:
        self.records += self.h.stats(self.engine)
        return Counter(v for r in self.records for v in r.get(key, []))


def restart(h: PushHarness, name: str, new_name: str) -> None:
    """Kill engine `name` (no shutdown: as a node or pod dies) and start `new_name` with
    the same engine id and side-channel port."""
    spec = h.specs[name]
    h[name].process.kill()
    h[name].process.join(10)
    h.remove([name])
    h.add([dataclasses.replace(spec, name=new_name)])


def connected(tmp_path: Any, lease_s: int) -> PushHarness:
    h = PushHarness.pd(workdir=str(tmp_path), num_blocks=64,
                       extra_config={"kv_lease_duration": lease_s, **RETRIES})
    h.start()
    try:
        assert h.push(1).ok  # both directions connected
    except BaseException:
        h.stop()
        raise
    return h


@pytest.fixture
def harness(tmp_path: Any) -> Any:
    h = connected(tmp_path, LEASE_S)
    try:
        yield h
    finally:
        h.stop()


def test_prefill_restart_fails_the_waiting_receive_at_once_and_new_requests_work(harness) -> None:
    h = harness
    d_stats = Stats(h, "D")
    p_id, d_id = ids()
    # D registered R with P (PUSH_REG delivered, P still prefilling) and heartbeats it.
    h["D"].call("register", d_id, h["D"].allocate(2), h["P"].address, p_id, True)
    wait_until(lambda: d_id in h["P"].call("pending_registrations"), "P to hold D's PUSH_REG")
    restart(h, "P", "P2")

    # D notices (a heartbeat to the dead agent fails), drops the connection, re-handshakes
    # with the new agent, and fails R now: its KV died with the old process.
    res = wait_until(lambda: (r := h["D"].call("results")) and d_id in r["failed_recving"] and r,
                     "D to fail the receive whose prefill restarted", timeout_s=60)
    assert d_id in res["finished_recving"]
    wait_until(lambda: d_stats.values(StatKey.RECEIVE_FAILURES)[ReceiveFailure.PEER_RESTARTED.value] == 1,
               "the failure counted by reason", last=lambda: d_stats.values(StatKey.RECEIVE_FAILURES))
    assert d_stats.values(StatKey.PEER_RESTARTS) == Counter({"d_to_p": 1})
    assert d_stats.values(StatKey.PEER_RESETS) == Counter({"d_to_p|notification_failed": 1})
    # (Attempts made while P was down failed as unreachable and were retried.)
    reconnect = [hs for r in d_stats.records for hs in r.get(StatKey.HANDSHAKES, [])]
    assert reconnect[-1]["outcome"] == "success" and reconnect[-1]["notif_only"]

    # New requests through the restarted prefill complete, bytes intact.
    report = h.push(2, prefill="P2")
    assert report.ok, (report.failed, report.mismatched)


def test_requests_sent_right_after_a_prefill_restart_all_complete(harness) -> None:
    """P restarts under the same engine id and requests arrive at once, before D noticed:
    their PUSH_REGs meet the dead agent (or no agent, while D drops it). Each is sent
    again with the new connection, whatever vLLM's failure policy would do with a
    receive that reached no agent: all complete, bytes intact, none failed."""
    h = harness
    d_stats = Stats(h, "D")
    prefill = "P"
    for restarted in ("P2", "P3"):
        restart(h, prefill, restarted)
        prefill = restarted
        report = h.push(3, prefill=prefill, bulk=True)
        assert report.ok, (report.failed, report.mismatched)
    assert d_stats.values(StatKey.RECEIVE_FAILURES) == Counter()
    assert d_stats.values(StatKey.PEER_RESETS) == Counter({"d_to_p|notification_failed": 2})


def test_requests_right_after_a_restart_of_a_prefill_quiet_for_long_all_complete(tmp_path) -> None:
    """The same after D heard nothing from P for longer than a lease (D idle): dropping
    the dead connection must not give up, as "unreachable", the requests whose PUSH_REGs
    found it dead: P's silence counts from the drop (found on real `vllm serve`: all
    three requests failed at the drop, recomputed or answered HTTP 500)."""
    h = connected(tmp_path, SHORT_LEASE_S)
    try:
        unreachable_after = SHORT_LEASE_S + max(1, SHORT_LEASE_S // 6)
        p_engine = h["P"].address["engine_id"]
        wait_until(lambda: h["D"].call("quiet_for", p_engine) > unreachable_after + 1,
                   "D to hear nothing from P for longer than a lease", timeout_s=60, interval_s=0.5)
        d_stats = Stats(h, "D")
        restart(h, "P", "P2")
        report = h.push(3, prefill="P2", bulk=True)
        assert report.ok, (report.failed, report.mismatched)
        assert d_stats.values(StatKey.RECEIVE_FAILURES) == Counter()
        assert d_stats.values(StatKey.RECEIVES_ABANDONED) == Counter()
    finally:
        h.stop()


def test_decode_restart_under_prefill_fails_the_caught_push_fast_then_works(harness) -> None:
    h = harness
    restart(h, "D", "D2")
    p_stats, d_stats = Stats(h, "P"), Stats(h, "D2")
    # The new D registers a request; P's WRITE goes to the dead agent and fails.
    p_id, d_id = ids()
    _, p_blocks = "P", h["P"].allocate(2)
    h["P"].call("fill", p_blocks, 7)
    h["D2"].call("register", d_id, h["D2"].allocate(2), h["P"].address, p_id, True)
    h["P"].call("finish", p_id, p_blocks, 30.0)
    # P drops the dead connection, reconnects to the new agent and tells D (PUSH_FAIL):
    # D fails the receive now instead of after push_registration_timeout.
    wait_until(lambda: d_id in h["D2"].call("results")["failed_recving"],
               "the new D to fail the receive caught by the restart", timeout_s=60)
    wait_until(lambda: d_stats.values(StatKey.RECEIVE_FAILURES)[ReceiveFailure.PUSH_FAILED.value] == 1,
               "D to count it", last=lambda: d_stats.values(StatKey.RECEIVE_FAILURES))
    assert p_stats.values(StatKey.PEER_RESETS) == Counter({"p_to_d|transfer_failed": 1})
    assert p_stats.values(StatKey.PEER_RESTARTS) == Counter({"p_to_d": 1})
    report = h.push(2, decode="D2")
    assert report.ok, (report.failed, report.mismatched)


def test_dead_prefill_fails_the_waiting_receive_within_its_hold_bound(tmp_path: Any) -> None:
    """P dies and does not come back: D's liveness probe finds it silent, D gives the
    receive up once P has been unreachable for a lease, and fails it when no WRITE into
    its blocks can come any more (a lease + the WRITE timeout after D last asked), not
    after 480 s."""
    h = connected(tmp_path, SHORT_LEASE_S)
    try:
        d_stats = Stats(h, "D")
        p_id, d_id = ids()
        h["D"].call("register", d_id, h["D"].allocate(2), h["P"].address, p_id, True)
        wait_until(lambda: d_id in h["P"].call("pending_registrations"), "P to hold D's PUSH_REG")
        h["P"].process.kill()
        wait_until(lambda: d_id in h["D"].call("results")["failed_recving"],
                   "D to fail the receive bound to a dead prefill", timeout_s=SHORT_LEASE_S * 6)
        wait_until(lambda: d_stats.values(StatKey.RECEIVE_FAILURES)[
            ReceiveFailure.ABANDONED.value] == 1, "the failure counted by reason",
                   last=lambda: d_stats.values(StatKey.RECEIVE_FAILURES))
        assert d_stats.values(StatKey.RECEIVES_ABANDONED) == Counter(
            {ReceiveAbandon.PEER_UNREACHABLE.value: 1})
        # (Dropped when a heartbeat to the dead agent failed, or when a probe went unanswered.)
        assert sum(d_stats.values(StatKey.PEER_RESETS).values()) == 1
    finally:
        h.stop()


def test_decode_dies_while_prefill_holds_a_lease_it_heartbeated(tmp_path: Any) -> None:
    """P's lease for a request D heartbeated (queued on D) expires on schedule once D is
    gone (no heartbeat renews it), and is counted with its fate."""
    h = connected(tmp_path, SHORT_LEASE_S)
    try:
        p_stats = Stats(h, "P")
        renewed = p_stats.values(StatKey.LEASE_RENEWALS)["renewed"]  # (the set-up push's)
        p_id, _ = ids()
        p_blocks = h["P"].allocate(2)
        h["P"].call("finish", p_id, p_blocks, float(SHORT_LEASE_S))
        wait_until(lambda: h["P"].call("push_state")["leases"]["leases"].get("held") == 1,
                   "P to hold the lease")
        h["D"].call("heartbeat", h["P"].address, p_id)  # the request waits in D's queue
        wait_until(lambda: p_stats.values(StatKey.LEASE_RENEWALS)["renewed"] > renewed,
                   "this lease's renewal on P")
        h["D"].process.kill()
        wait_until(lambda: p_id in h["P"].call("results")["finished_sending"],
                   "P to release the lease", timeout_s=SHORT_LEASE_S * 3)
        assert p_stats.values(StatKey.LEASE_EXPIRIES) == Counter({LeaseFate.WAITING.value: 1})
        expired_by_vllm = sum(len(r.get("num_kv_expired_reqs", [])) for r in p_stats.records)
        assert expired_by_vllm == 1  # vLLM's own count agrees
    finally:
        h.stop()


def test_registration_no_request_of_prefill_matches_is_answered_and_never_written(tmp_path: Any) -> None:
    """A PUSH_REG naming a request P does not have (its prefill died with P's previous
    instance, or was never sent): P answers it with PUSH_FAIL once
    `unmatched_push_reg_timeout_s` has passed, D fails the receive at once, and the
    prefill finishing later is not written into D's blocks."""
    unmatched_s = 2
    h = PushHarness.pd(workdir=str(tmp_path), num_blocks=64,
                       extra_config={"kv_lease_duration": SHORT_LEASE_S,
                                     "unmatched_push_reg_timeout_s": unmatched_s, **RETRIES})
    h.start()
    try:
        assert h.push(1).ok
        p_stats, d_stats = Stats(h, "P"), Stats(h, "D")
        p_id, d_id = ids()
        d_blocks = h["D"].allocate(2)
        h["D"].call("register", d_id, d_blocks, h["P"].address, p_id, False)
        wait_until(lambda: d_id in h["D"].call("results")["failed_recving"],
                   "D to fail a receive no prefill request matched", timeout_s=unmatched_s * 10)
        # (P counts the rejection before it answers; its stats reach the harness on its next step.)
        unmatched = Counter({PushRegRejection.UNMATCHED.value: 1})
        wait_until(lambda: p_stats.values(StatKey.PUSH_REG_REJECTED) == unmatched,
                   "P to count the PUSH_REG it could not match",
                   last=lambda: p_stats.values(StatKey.PUSH_REG_REJECTED))
        wait_until(lambda: d_stats.values(StatKey.RECEIVE_FAILURES)[ReceiveFailure.NO_PREFILL.value] == 1,
                   "D to count it", last=lambda: d_stats.values(StatKey.RECEIVE_FAILURES))
        # The prefill turns up after all: P keeps it for its lease and writes nothing.
        p_blocks = h["P"].allocate(2)
        h["P"].call("fill", p_blocks, 11)
        h["P"].call("finish", p_id, p_blocks, float(SHORT_LEASE_S))
        wait_until(lambda: p_id in h["P"].call("results")["finished_sending"],
                   "P to release the prefill's blocks", timeout_s=SHORT_LEASE_S * 3)
        assert not set(h["D"].call("untouched", [])) & set(d_blocks)
    finally:
        h.stop()



def test_a_receive_landing_after_decode_dropped_its_live_prefill_completes(harness) -> None:
    """D drops its connection to a prefill that is alive (a notification to it failed for
    a moment) while a receive from it waits; P then WRITEs and the receive completes.
    vLLM's post-processing of that receive reads P's transfer info, which dropping the
    connection removes (upstream: KeyError in `get_transfer_results`, the engine dies).
    The fork keeps it until the next handshake to P, so the bytes land and D goes on."""
    h = harness
    p_id, d_id = ids()
    d_blocks = h["D"].allocate(2)
    h["D"].call("register", d_id, d_blocks, h["P"].address, p_id, False)
    wait_until(lambda: d_id in h["P"].call("pending_registrations"), "P to hold D's PUSH_REG")
    h["D"].call("suspect", h["P"].address["engine_id"])
    wait_until(lambda: h["P"].address["engine_id"] not in h["D"].call("connections")["remote_agents"],
               "D to drop its connection to P")
    p_blocks = h["P"].allocate(2)
    h["P"].call("fill", p_blocks, 23)
    h["P"].call("finish", p_id, p_blocks, 30.0)
    res = wait_until(lambda: (r := h["D"].call("results")) and d_id in r["finished_recving"] and r,
                     "the receive to land")
    assert d_id not in res["failed_recving"]
    assert h["P"].call("digest", p_blocks) == h["D"].call("digest", d_blocks)
    report = h.push(2)  # D handshakes with P again; P's transfer info is registered anew
    # (Every pushed byte checked; the blocks this test filled by hand are not the harness's.)
    assert not report.failed and not report.mismatched and report.verified == 2, report
