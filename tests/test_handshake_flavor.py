"""Narrow unit tests of the flavor/dedup/upgrade decisions of `HandshakeFlow._connect`
and the connection table behind it.

The worker is built without vLLM's engine (`ObservedPushWorker.without_engine`, the
declared seam) and with a recording executor; the real-engine tests cover the same
paths end to end.
"""

from __future__ import annotations

from concurrent.futures import Future

from connector.glue.worker import ObservedPushWorker
from connector.vocabulary import Direction, Trigger


class RecordingExecutor:
    def __init__(self):
        self.jobs = []

    def submit(self, fn, record, dcp):
        self.jobs.append(record)
        return Future()


def bare_worker(kv_role="kv_both"):
    return ObservedPushWorker.without_engine(kv_role, engine_id="me", handshake_pool=RecordingExecutor())


def connect(w, trigger, notif_only_requested=False):
    return w._connect(trigger, None, "peer", "127.0.0.1", 1, 1,
                      {"dcp_size": 1, "pp_size": 1, "notif_agents_only": notif_only_requested})


def connected(w, notif_only: bool) -> None:
    """The table as a finished handshake of that flavor leaves it."""
    decision = w._connections.ensure("peer", notif_only=notif_only, for_write=False)
    w._connections.connected("peer", decision.pending, {(0, 0): "agent"}, 0.0, 1.0)


def test_heartbeat_is_notification_only_even_when_vllm_asks_for_full():
    w = bare_worker("kv_consumer")
    fut = connect(w, Trigger.HEARTBEAT, notif_only_requested=False)  # stock passes False for PP=1
    [job] = w._handshake_pool.jobs
    assert (job.direction, job.trigger, job.notif_only, job.upgrade) == (
        Direction.D_TO_P, Trigger.HEARTBEAT, True, False)
    # A PUSH_REG for the same peer joins it: no second handshake.
    assert connect(w, Trigger.PUSH_REG) is fut
    assert len(w._handshake_pool.jobs) == 1
    # vLLM's map of pending handshakes shows it (the table writes it).
    assert w._handshake_futures == {"peer": fut}


def test_vllms_own_call_goes_by_its_flavor_flag():
    w = bare_worker("kv_both")
    w._ensure_handshake("peer", "127.0.0.1", 1, 1, 1, 1, True)
    [job] = w._handshake_pool.jobs
    assert (job.direction, job.trigger, job.notif_only) == (Direction.D_TO_P, Trigger.OTHER, True)


def test_write_behind_a_queued_notif_only_handshake_queues_an_upgrade():
    w = bare_worker()
    first = connect(w, Trigger.HEARTBEAT)
    second = connect(w, Trigger.PUSH_WRITE)
    assert second is not first
    # One handshake at a time per remote engine: the upgrade waits behind the first.
    [running] = w._handshake_pool.jobs
    assert [(r.notif_only, r.upgrade, r.direction) for r in (running,)] == [(True, False, Direction.D_TO_P)]
    assert w._connections.snapshot()["pending"] == 1
    # Both later kinds of caller now wait for the full one.
    assert connect(w, Trigger.PUSH_WRITE) is second
    assert connect(w, Trigger.PUSH_REG) is second
    # The first attempt over: the upgrade runs next.
    (_job, record) = w._connections.attempt_over("peer")
    assert (record.notif_only, record.upgrade, record.direction) == (False, True, Direction.P_TO_D)


def test_connected_notif_only_peer_is_upgraded_once_for_writes():
    w = bare_worker()
    connected(w, notif_only=True)
    assert connect(w, Trigger.HEARTBEAT) is None  # notifications can go now
    upgrade = connect(w, Trigger.PUSH_WRITE)
    assert upgrade is not None and connect(w, Trigger.PUSH_WRITE) is upgrade
    [job] = w._handshake_pool.jobs
    assert (job.notif_only, job.upgrade) == (False, True)


def test_full_connection_serves_every_caller():
    w = bare_worker()
    connected(w, notif_only=False)
    for trigger in Trigger:
        assert connect(w, trigger) is None
    assert w._handshake_pool.jobs == []
    assert w._remote_agents == {"peer": {(0, 0): "agent"}}  # vLLM's map, written by the table


def test_a_connection_being_dropped_starts_no_upgrade():
    """A WRITE that finds a notification-only connection being dropped waits for the
    drop (it parks) rather than upgrading the dying connection."""
    w = bare_worker()
    connected(w, notif_only=True)
    assert w._connections.begin_drop("peer") is not None
    assert connect(w, Trigger.PUSH_WRITE) is None
    assert w._connections.for_write("peer") is None
    assert w._handshake_pool.jobs == []
