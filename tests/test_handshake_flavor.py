"""Narrow unit tests of the flavor/dedup/upgrade decisions in `_ensure_handshake`.

The worker is built without vLLM's constructor and with a recording executor; the
real-engine tests cover the same paths end to end.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from connector.glue.compat import RemoteAgentTable
from connector.glue.retry import RetryPolicy
from connector.glue.worker import ObservedPushWorker
from connector.state.peers import PeerTable
from connector.telemetry.in_flight import InFlight
from connector.telemetry.tracing import SpanEmitter
from connector.vocabulary import Direction, Trigger


class RecordingExecutor:
    def __init__(self):
        self.jobs = []

    def submit(self, fn, record, dcp):
        self.jobs.append(record)
        return Future()


def bare_worker(kv_role="kv_both"):
    w = object.__new__(ObservedPushWorker)
    w._trigger_local = threading.local()
    w._kv_role = kv_role
    w._handshake_lock = threading.RLock()
    w._remote_agents = RemoteAgentTable()
    w._notif_only_engines = set()
    w._handshake_futures = {}
    w._pending_jobs = {}
    w._spans = SpanEmitter(None)
    w.tp_rank, w.engine_id = 0, "me"
    w._evict_stale_engines = lambda: None
    w._handshake_pool = RecordingExecutor()
    w._attempt_lock = threading.Lock()
    w._engine_attempts = {}
    w._peers = PeerTable(forget_after_s=600.0)
    w._retry_policy = RetryPolicy()
    w._in_flight = InFlight()
    return w


def ensure(w, trigger, notif_only_requested=False):
    return w._run_triggered(trigger, None, w._ensure_handshake, "peer", "127.0.0.1", 1, 1, 1, 1,
                            notif_only_requested)


def test_heartbeat_is_notification_only_even_when_vllm_asks_for_full():
    w = bare_worker("kv_consumer")
    fut = ensure(w, Trigger.HEARTBEAT, notif_only_requested=False)  # stock passes False for PP=1
    [job] = w._handshake_pool.jobs
    assert (job.direction, job.trigger, job.notif_only, job.upgrade) == (
        Direction.D_TO_P, Trigger.HEARTBEAT, True, False)
    # A PUSH_REG for the same peer joins it: no second handshake.
    assert ensure(w, Trigger.PUSH_REG) is fut
    assert len(w._handshake_pool.jobs) == 1


def test_write_behind_a_queued_notif_only_handshake_queues_an_upgrade():
    w = bare_worker()
    first = ensure(w, Trigger.HEARTBEAT)
    second = ensure(w, Trigger.PUSH_WRITE)
    assert second is not first
    # One handshake at a time per remote engine: the upgrade waits behind the first.
    [running] = w._handshake_pool.jobs
    [(_, waiting)] = w._engine_attempts["peer"]
    assert [(j.notif_only, j.upgrade, j.direction) for j in (running, waiting)] == [
        (True, False, Direction.D_TO_P), (False, True, Direction.P_TO_D)]
    # Both later kinds of caller now wait for the full one.
    assert ensure(w, Trigger.PUSH_WRITE) is second
    assert ensure(w, Trigger.PUSH_REG) is second


def test_connected_notif_only_peer_is_upgraded_once_for_writes():
    w = bare_worker()
    w._remote_agents["peer"] = {(0, 0): "agent"}
    w._notif_only_engines.add("peer")
    assert ensure(w, Trigger.HEARTBEAT) is None  # notifications can go now
    upgrade = ensure(w, Trigger.PUSH_WRITE)
    assert upgrade is not None and ensure(w, Trigger.PUSH_WRITE) is upgrade
    [job] = w._handshake_pool.jobs
    assert (job.notif_only, job.upgrade) == (False, True)


def test_full_connection_serves_every_caller():
    w = bare_worker()
    w._remote_agents["peer"] = {(0, 0): "agent"}
    for trigger in Trigger:
        assert ensure(w, trigger) is None
    assert w._handshake_pool.jobs == []
