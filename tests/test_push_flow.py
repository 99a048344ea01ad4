"""The fork's push flow on real parts: two+ engine processes, NIXL over UCX, ZMQ."""

from __future__ import annotations

import os

import pytest

from harness import PushHarness
from tests.conftest import drain_stats, handshakes, has_handshakes, remote_preps

pytestmark = pytest.mark.real


def test_fork_pushes_20_requests_across_processes_bytes_verified(trio):
    report = trio.facts["report"]
    pids = trio.facts["pids"]
    assert len(report.requests) == 20
    assert report.failed == [] and report.mismatched == []
    assert report.verified == 20, "every request's blocks on D must equal P's bytes"
    assert report.dirty_blocks == [], "D blocks no push targeted must keep the sentinel"
    # P and D really are separate OS processes (and not this one).
    assert len({pids["P"], pids["D"], os.getpid()}) == 3
    assert len(report.latencies_s) == 20 and report.median_latency_s > 0
    print(f"push flow median over 20 requests: {report.median_latency_s * 1e3:.1f} ms")


def test_interop_with_stock_peers_of_the_same_vllm_version(trio):
    """Our PUSH_REG carries an extra key a stock P ignores; a stock PUSH_REG works with us."""
    for name, report in trio.facts["interop"].items():
        assert report.ok, (name, report)
        assert report.verified == 3


def test_engine_processes_have_their_cpu_affinity_restored(trio):
    # vLLM's CPU worker pins its process to one core; the harness restores it.
    for name, cpus in trio.facts["affinity"].items():
        assert len(cpus) == os.cpu_count(), f"{name} stayed pinned to {cpus}"


def test_heartbeat_first_d_to_p_handshake_is_notification_only_in_the_fork(trio):
    p_agent = trio.facts["P_agent_name"]
    calls = trio.facts["D_calls_after_heartbeat"]
    # NIXL loaded P's agent (needed for notifications) ...
    assert ("add_remote_agent", p_agent, 0) in calls
    # ... but D never asked NIXL to prepare a descriptor list on P's memory.
    assert remote_preps(calls, p_agent) == []
    conns = trio.facts["D_connections_after_heartbeat"]
    assert conns["dst_handles"].get("prefill-trio", 0) == 0
    assert "prefill-trio" in conns["notif_only"]
    # And it stayed that way through 20 pushes (PUSH_REG reuses the connection).
    assert remote_preps(trio.facts["calls"]["D"], p_agent) == []


def test_heartbeat_first_stock_connector_does_the_full_handshake(trio):
    """The same script against stock vLLM shows the bug the fork fixes."""
    calls = trio.facts["S_calls_after_heartbeat"]
    p_agent = trio.facts["P_agent_name"]
    preps = remote_preps(calls, p_agent)
    assert len(preps) == 1 and preps[0][2] > 0, "stock D prepared P's descriptors"
    assert trio.facts["S_connections_after_heartbeat"]["dst_handles"]["prefill-trio"] == 1


def test_p_to_d_handshake_before_write_stays_full(trio):
    calls = trio.facts["calls"]["P"]
    preps = remote_preps(calls)
    assert len(preps) == 1, "one full P->D handshake: one remote descriptor list"
    assert preps[0][2] == 2 * 128, "2 layers x 128 blocks of D"


def test_kv_both_notif_only_connection_is_upgraded_for_a_write(tmp_path):
    """An engine that first reached its peer notification-only can still WRITE to it.

    Also runs with tracing off: no spans, metrics still right.
    """
    with PushHarness.pd(roles=("kv_both", "kv_both"), workdir=str(tmp_path), tracing=None) as h:
        # P acts as a decode engine towards D first: heartbeat -> notif-only link.
        h["P"].call("heartbeat", h["D"].address, "some-d-request")
        conns = h.wait_for("P", lambda c: h["D"].info["engine_id"] in c["notif_only"])
        assert conns["dst_handles"].get(h["D"].info["engine_id"], 0) == 0
        h["P"].call("stop_heartbeats")
        # Now P prefills for D: the WRITE needs D's descriptors.
        report = h.push(3)
        assert report.ok, report
        d_id = h["D"].info["engine_id"]
        after = h["P"].call("connections")
        assert d_id not in after["notif_only"]
        assert after["dst_handles"][d_id] == 1
        hs = handshakes(drain_stats(h, "P", has_handshakes(2)))
        flavors = sorted((x["direction"], x["notif_only"], x["upgrade"], x["outcome"]) for x in hs)
        assert flavors == [("d_to_p", True, False, "success"), ("p_to_d", False, True, "success")]
        upgrade = next(x for x in hs if x["upgrade"])
        assert upgrade["registrations"]["remote"] == 1
        assert upgrade["descriptors"]["remote"] == 2 * 128
        # Tracing off: no tracer anywhere, no spans recorded.
        assert h["P"].call("spans") == [] and h["D"].call("spans") == []
        assert h["P"].call("tracing_enabled") is False
