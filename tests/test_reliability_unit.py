"""Narrow tests of the reliability fixes: thread-safe stats, bounded state, PUSH_REG
validation, retry policy, counted telemetry faults, in-flight gauges, vLLM's log line.

Real-engine behaviour (retries over a real stalled side channel, bad PUSH_REGs through
real NIXL, hung handshakes on the gauge) is in tests/test_reliability_real.py.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import pytest

from connector.glue.retry import RetryPolicy
from connector.glue.wire import parse_push_reg
from connector.telemetry import errors
from connector.telemetry.in_flight import InFlight
from connector.telemetry.receives import ReceiveClock
from connector.telemetry.record import HandshakeRecord
from connector.telemetry.span_table import MAX_TRACKED_REQUESTS, BoundedIdSet, SpanTable
from connector.telemetry.stats import ObservedNixlStats
from connector.vocabulary import (
    MAX_PUSH_REG_BYTES,
    REGISTRATION_ARRIVAL_KEY,
    Direction,
    ErrorType,
    PeerReset,
    PushRegRejection,
    StatKey,
    TelemetryError,
    Trigger,
)
from tests.support.telemetry import reset_telemetry_errors
from tests.test_stats_and_prometheus import frontend


def a_record(direction: Direction = Direction.D_TO_P, notif_only: bool = True) -> HandshakeRecord:
    return HandshakeRecord(direction=direction, trigger=Trigger.HEARTBEAT, notif_only=notif_only,
                           remote_engine_id="p", host="127.0.0.1", port=1, remote_tp_size=1,
                           remote_pp_size=1, local_tp_rank=0)


# ---------------------------------------------------------------- stats under threads
def test_records_survive_resets_at_full_speed_and_land_exactly_once():
    """The writer records while the main thread takes intervals as fast as it can.

    Before the fix, reset() left `data` without our keys for a moment and
    record_push raised KeyError inside _xfer_blocks (a lost WRITE handle).
    """
    stats = ObservedNixlStats()
    n_writes = 50_000
    errors_seen: list[BaseException] = []
    done = threading.Event()

    def writer() -> None:
        try:
            for i in range(n_writes):
                stats.record_push(StatKey.PUSHES_STARTED)
                if i % 100 == 0:
                    stats.record_retry("p_to_d")
        except BaseException as exc:  # the bug under test
            errors_seen.append(exc)
        finally:
            done.set()

    intervals: list[ObservedNixlStats] = []
    thread = threading.Thread(target=writer)
    thread.start()
    while not done.is_set():
        intervals.append(stats.clone_and_reset())
    thread.join()
    intervals.append(stats.clone_and_reset())
    assert errors_seen == []
    assert len(intervals) > 10  # the race was really exercised
    assert sum(len(s.data.get(StatKey.PUSHES_STARTED, [])) for s in intervals) == n_writes
    assert sum(len(s.data.get(StatKey.HANDSHAKE_RETRIES, [])) for s in intervals) == n_writes // 100


# ------------------------------------------------------------------- bounded state
class FakeSpan:
    def __init__(self) -> None:
        self.ended_with: str | None = "open"

    def is_recording(self) -> bool:
        return self.ended_with == "open"

    def set_attributes(self, _attrs) -> None: ...

    def set_attribute(self, key, value) -> None:
        if key == "error.type":
            self.ended_with = value

    def set_status(self, _status) -> None: ...

    def end(self) -> None:
        if self.ended_with == "open":
            self.ended_with = None


def test_receive_clock_expires_each_receive_exactly_at_its_timeout():
    clock = ReceiveClock(timeout_s=10.0)
    clock.start("a", now=0.0)
    clock.start("b", now=5.0)
    clock.start("c", now=6.0)
    clock.start("a", now=7.0)  # re-sent: keeps its first start
    assert clock.pop_expired(now=9.99) == []
    assert clock.pop_expired(now=10.0) == [("a", 10.0)]
    assert clock.stop("b", now=12.0) == 7.0  # stopped before it expired: never reported
    assert clock.pop_expired(now=15.5) == []
    assert clock.pop_expired(now=16.0) == [("c", 10.0)]
    assert len(clock) == 0 and clock.pop_expired(now=99.0) == []
    clock.start("d", now=100.0)  # a new receive after the clock ran empty
    assert clock.pop_expired(now=109.0) == [] and clock.pop_expired(now=110.5) == [("d", 10.5)]


def test_receive_clock_starts_a_steps_receives_at_one_time():
    clock = ReceiveClock(timeout_s=10.0)
    clock.start_all(["a", "b"], now=1.0)
    clock.start_all(["b", "c"], now=2.0)  # b re-sent: keeps its first start
    assert clock.stop("b", now=4.0) == 3.0 and clock.stop("c", now=4.0) == 2.0
    assert clock.pop_expired(now=11.0) == [("a", 10.0)] and len(clock) == 0


def test_receive_clock_measures_the_wait_since_the_requests_arrival():
    clock = ReceiveClock(timeout_s=10.0)
    clock.note_arrivals({"a": {REGISTRATION_ARRIVAL_KEY: 100.0}, "b": {},
                         "c": {REGISTRATION_ARRIVAL_KEY: "x"}})
    clock.note_arrivals({"a": {REGISTRATION_ARRIVAL_KEY: 105.0}})  # re-sent: its first arrival stands
    assert clock.since_arrival("a", now_wall=102.5) == 2.5
    assert clock.since_arrival("a", now_wall=103.0) is None  # forgotten once measured
    assert clock.since_arrival("b", now_wall=103.0) is None  # no arrival given
    assert clock.since_arrival("c", now_wall=103.0) is None  # not a float: not taken
    clock.note_arrivals({"d": {REGISTRATION_ARRIVAL_KEY: 200.0}})
    assert clock.since_arrival("d", now_wall=199.0) == 0.0  # another host's clock ahead: not negative


def test_receive_clock_keeps_a_bounded_number_of_arrivals():
    clock = ReceiveClock(timeout_s=10.0)
    clock.note_arrivals({f"r{i}": {REGISTRATION_ARRIVAL_KEY: float(i)}
                         for i in range(MAX_TRACKED_REQUESTS + 5)})
    assert clock.since_arrival("r0", now_wall=1e6) is None  # the oldest were dropped
    assert clock.since_arrival(f"r{MAX_TRACKED_REQUESTS + 4}", now_wall=1e6) is not None


def test_registering_again_ends_the_span_it_replaces():
    table = SpanTable()
    first, second = FakeSpan(), FakeSpan()
    table.put("req", first)
    table.put("req", second)
    assert first.ended_with == "superseded"
    assert table.pop("req") is second and second.ended_with == "open"


def test_span_table_drops_and_ends_the_oldest_past_its_bound():
    reset_telemetry_errors()
    table = SpanTable(limit=3)
    spans = [FakeSpan() for _ in range(5)]
    for i, span in enumerate(spans):
        table.put(f"r{i}", span)
    assert [s.ended_with for s in spans] == ["abandoned", "abandoned", "open", "open", "open"]
    assert len(table) == 3
    assert errors.drain() == {TelemetryError.TABLE_FULL.value: 2}


@pytest.mark.parametrize("by_keyword", [True, False])
def test_every_posted_write_handle_is_passed_on_and_kept_for_its_request(monkeypatch, by_keyword):
    """vLLM's arguments reach vLLM unchanged (by keyword, as vLLM passes them, or by
    position), its handle comes back, and the handles of the request being posted are
    kept before vLLM publishes them (so a posting that raises midway loses none)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import (
        NixlPushConnectorWorker,
    )

    from connector.glue.worker import ObservedPushWorker

    posted = []

    def vllms(self, read_spec, dst_engine_id, request_id, remote_request_id,
              local_xfer_side_handle, remote_xfer_side_handle):
        posted.append((read_spec, dst_engine_id, request_id, remote_request_id,
                       local_xfer_side_handle, remote_xfer_side_handle))
        return None if read_spec == "nothing" else 100 + len(posted)

    monkeypatch.setattr(NixlPushConnectorWorker, "_xfer_blocks", vllms)
    monkeypatch.setattr(NixlPushConnectorWorker, "_xfer_blocks_for_req", lambda self, req_id, meta: [
        write(spec, req_id) for spec in meta])
    w = ObservedPushWorker.without_engine("kv_producer")

    def write(read_spec, request_id):
        if by_keyword:
            return w._xfer_blocks(read_spec=read_spec, dst_engine_id="d", request_id=request_id,
                                  remote_request_id="r", local_xfer_side_handle=1,
                                  remote_xfer_side_handle=2)
        return w._xfer_blocks(read_spec, "d", request_id, "r", 1, 2)

    assert write("a", "other") == 101  # (no request being posted: passed on, not kept)
    handles = {}
    w._posted_handles = {"req": handles.setdefault("req", [])}  # (what `_post_writes` sets)
    assert w._xfer_blocks_for_req(req_id="req", meta=["b", "c", "nothing"]) == [102, 103, None]
    assert posted[1] == ("b", "d", "req", "r", 1, 2)
    assert handles["req"] == [102, 103]  # every handle posted for it, kept before vLLM publishes


def test_bounded_id_set_forgets_the_oldest_not_an_arbitrary_one():
    ids = BoundedIdSet(limit=3)
    for i in range(5):
        assert ids.add(f"r{i}") is True
    assert ids.add("r4") is False
    assert [f"r{i}" in ids for i in range(5)] == [False, False, True, True, True]
    reset_telemetry_errors()


# ------------------------------------------------------------ PUSH_REG validation
def push_reg(payload: object) -> bytes:
    return b"PUSH_REG:" + msgspec.msgpack.encode(payload)


GOOD = {"request_id": "cmpl-1", "decode_engine_id": "d", "decode_host": "127.0.0.1",
        "decode_port": 5600, "decode_tp_size": 1, "local_block_ids": [[1, 2]]}


@pytest.mark.parametrize(("notif", "reason"), [
    (push_reg(GOOD), None),
    (push_reg({**GOOD, "local_block_ids": [3, 4]}), None),  # flat single group
    (push_reg({**GOOD, "otel_trace_context": "garbage"}), None),  # extra keys are not ours to judge
    (b"PUSH_REG:\xc1\xff", PushRegRejection.UNDECODABLE),
    (push_reg([1, 2, 3]), PushRegRejection.NOT_A_MAP),
    (push_reg({k: v for k, v in GOOD.items() if k != "decode_host"}), PushRegRejection.MISSING_FIELD),
    (push_reg({**GOOD, "decode_port": "5600"}), PushRegRejection.WRONG_TYPE),
    (push_reg({**GOOD, "decode_tp_size": True}), PushRegRejection.WRONG_TYPE),
    (push_reg({**GOOD, "local_block_ids": [["a"]]}), PushRegRejection.WRONG_TYPE),
    (push_reg({**GOOD, "local_block_ids": [[-1]]}), PushRegRejection.WRONG_TYPE),
    # A long prompt: thousands of ids, checked to the last one.
    (push_reg({**GOOD, "local_block_ids": [list(range(4000)), list(range(4000))]}), None),
    (push_reg({**GOOD, "local_block_ids": [list(range(4000)), [*range(3999), -1]]}),
     PushRegRejection.WRONG_TYPE),
    (push_reg({**GOOD, "local_block_ids": [*range(4000), True]}), PushRegRejection.WRONG_TYPE),
    (push_reg({**GOOD, "local_block_ids": [[1], 2]}), PushRegRejection.WRONG_TYPE),
    (push_reg({**GOOD, "local_block_ids": [[]]}), None),
    (b"PUSH_REG:" + b"\x00" * (MAX_PUSH_REG_BYTES + 1), PushRegRejection.OVERSIZED),
])
def test_push_reg_problems(notif: bytes, reason: PushRegRejection | None):
    problem = parse_push_reg(notif)[1]
    assert (problem[0] if problem else None) == reason


def test_push_reg_classes_get_the_reason_they_were_built_with():
    """The payload classes the real-engine fuzz test sends (tests/support/push_reg.py),
    in process: each gets the verdict its construction fixes, a valid one its registration."""
    from tests.support import push_reg as fuzz

    decoder = {"engine_id": "decode-unit", "host": "127.0.0.1", "port": 5600}
    for payload in fuzz.classes(decoder, fuzz.unique_ids("u"), n=60):
        reg, problem = parse_push_reg(payload.notif)
        assert (problem[0].value if problem else None) == payload.reason, (problem, payload.body[:120])
        if payload.reason is None:
            assert reg == payload.reg


# ---------------------------------------------------------------------- retries
def test_retry_policy_retries_only_transient_errors_within_budget():
    policy = RetryPolicy(retries=3, backoff_s=0.5, budget_s=20.0)
    far = time.monotonic() + 100
    assert [policy.delay(a, ErrorType.TIMEOUT, far) for a in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, None]
    assert policy.delay(1, ErrorType.UNREACHABLE, far) == 0.5
    for permanent in (ErrorType.COMPAT_HASH_MISMATCH, ErrorType.ENGINE_ID_MISMATCH,
                      ErrorType.DECODE_ERROR, ErrorType.NIXL_ERROR, ErrorType.OTHER, None):
        assert policy.delay(1, permanent, far) is None
    assert policy.delay(1, ErrorType.TIMEOUT, time.monotonic() + 0.1) is None  # past the budget
    assert RetryPolicy.from_extra_config({"handshake_retries": 0}.get).delay(
        1, ErrorType.TIMEOUT, far) is None
    with pytest.raises(ValueError, match="must be >= 0"):
        RetryPolicy.from_extra_config({"handshake_retries": -1}.get)


# -------------------------------------------------------- counted telemetry faults
def test_first_fault_of_each_reason_is_a_warning_and_all_are_counted(caplog):
    reset_telemetry_errors()
    with caplog.at_level(logging.DEBUG, logger="connector.telemetry"):
        for _ in range(3):
            errors.note(TelemetryError.SAVINGS, "boom", exc_info=False)
        errors.note(TelemetryError.SPAN, "bad span", exc_info=False)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(" (")[0] for r in warnings] == [
        "NIXL push telemetry: savings_failed", "NIXL push telemetry: span_failed"]
    assert errors.drain() == {"savings_failed": 3, "span_failed": 1}
    assert errors.drain() == {}


def test_telemetry_faults_and_rejections_reach_metrics():
    fe = frontend()
    stats = ObservedNixlStats()
    stats.record_telemetry_errors({"savings_failed": 2})
    stats.record_push_reg_rejected("undecodable")
    stats.record_retry("p_to_d")
    fe.observe([stats.to_dict()])
    assert fe.sample("vllm:nixl_telemetry_errors_total", {"reason": "savings_failed"}) == 2
    assert fe.sample("vllm:nixl_push_reg_rejected_total", {"reason": "undecodable"}) == 1
    assert fe.sample("vllm:nixl_handshake_retries_total", {"direction": "p_to_d"}) == 1
    # A malformed record is dropped whole and counted as a telemetry error, not lost silently.
    bad = ObservedNixlStats().to_dict()
    bad[StatKey.HANDSHAKES] = [{"direction": "sideways"}]
    bad[StatKey.PUSH_REG_REJECTED] = ["not-a-reason"]
    fe.observe([bad])
    assert fe.sample("vllm:nixl_telemetry_errors_total", {"reason": "malformed_record"}) == 2
    assert fe.sample("vllm:nixl_push_reg_rejected_total", {"reason": "undecodable"}) == 1


# ------------------------------------------------------------------ in flight
def test_in_flight_snapshots_sum_over_workers_and_return_to_zero():
    flight = InFlight()
    assert flight.snapshot() is None  # nothing open, nothing reported yet: no stats noise
    a, b = a_record(), a_record(Direction.P_TO_D, notif_only=False)
    a.submitted_ns -= 3_000_000_000
    flight.add(a)
    flight.add(b)
    snap = flight.snapshot()
    assert snap["d_to_p|true"][0] == 1 and snap["d_to_p|true"][1] >= 3.0
    assert snap["p_to_d|false"][0] == 1
    fe = frontend()
    worker0, worker1 = ObservedNixlStats(), ObservedNixlStats()
    worker0.set_in_flight(snap)
    worker1.set_in_flight({"d_to_p|true": [2, 1.0]})
    fe.observe([worker0.aggregate(worker1).to_dict()])
    assert fe.sample("vllm:nixl_handshakes_in_flight",
                     {"direction": "d_to_p", "notif_agents_only": "true"}) == 3
    assert fe.sample("vllm:nixl_handshake_oldest_in_flight_seconds", {"direction": "d_to_p"}) >= 3.0
    flight.discard(a)
    flight.discard(b)
    assert flight.snapshot() == {}  # once more, so the gauge goes back to 0 ...
    assert flight.snapshot() is None  # ... then quiet again
    zero = ObservedNixlStats()
    zero.set_in_flight({})
    fe.observe([zero.to_dict()])
    assert fe.sample("vllm:nixl_handshakes_in_flight",
                     {"direction": "d_to_p", "notif_agents_only": "true"}) == 0
    assert fe.sample("vllm:nixl_handshake_oldest_in_flight_seconds", {"direction": "d_to_p"}) == 0


# ------------------------------------------------------------ vLLM's failure line
def test_failure_log_line_points_at_the_code_that_failed(caplog):
    from connector.glue.worker import ObservedPushWorker

    w = ObservedPushWorker.without_engine("kv_consumer", engine_id="me")
    w._recving_metadata = {}  # (vLLM's, read for the line's context)

    def the_failing_call_site() -> None:
        w._log_failure(failure_type="transfer_failed", req_id=None, msg="boom")

    with caplog.at_level(logging.ERROR):
        the_failing_call_site()
    [rec] = [r for r in caplog.records if "NIXL transfer failure" in r.getMessage()]
    assert rec.funcName == "the_failing_call_site" and rec.pathname == __file__
    assert rec.name.startswith("vllm.distributed.kv_transfer")
    assert "transfer_failed. boom" in rec.getMessage()


# ------------------------------------------------------------------ span ids
def test_span_ids_do_not_follow_pythons_seeded_random():
    """vLLM seeds `random` with the same value in every worker: ids drawn from it repeat
    across engines (P's and D's spans of one request collided). Ours come from a
    generator of the process's own, seeded from the OS."""
    import random

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    from connector.telemetry.tracing import PrivateRandomIdGenerator, use_os_entropy

    def first_ids(generator) -> tuple[int, int]:
        random.seed(0)  # what every vLLM worker process does
        return generator.generate_trace_id(), generator.generate_span_id()

    stock = RandomIdGenerator()
    assert first_ids(stock) == first_ids(stock)  # two "engines", the same ids: the bug
    ours = PrivateRandomIdGenerator()
    assert first_ids(ours) != first_ids(ours)
    provider = TracerProvider()  # as vLLM installs it: the SDK default generator
    use_os_entropy(provider)
    assert isinstance(provider.id_generator, PrivateRandomIdGenerator)
    custom = PrivateRandomIdGenerator.__new__(type("Custom", (RandomIdGenerator.__base__,), {
        "generate_span_id": lambda self: 1, "generate_trace_id": lambda self: 1}))
    mine = TracerProvider(id_generator=custom)
    use_os_entropy(mine)
    assert mine.id_generator is custom  # a user's own generator is left alone


def test_a_forked_child_does_not_repeat_its_parents_span_ids():
    """vLLM forks its engine processes: a child's copy of the id generator is re-seeded,
    so its ids are not the ones the parent draws next."""
    import multiprocessing

    from connector.telemetry.tracing import PrivateRandomIdGenerator

    ids = PrivateRandomIdGenerator()
    ids.generate_span_id()  # state the child inherits
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=lambda: child_end.send([ids.generate_span_id() for _ in range(4)]))
    child.start()
    try:
        assert parent_end.poll(60), "the forked child sent no ids"
        from_child = parent_end.recv()
    finally:
        child.join(60)
    assert set(from_child).isdisjoint(ids.generate_span_id() for _ in range(4))


def test_push_fail_round_trip_and_what_is_refused():
    from connector.glue.wire import decode_push_fail, encode_push_fail, wants_push_fail
    from connector.vocabulary import (
        CAP_PUSH_FAIL,
        MAX_PUSH_FAIL_BYTES,
        PUSH_FAIL_NOTIF_PREFIX,
        PUSH_REG_CAPS_KEY,
        PushFailReason,
    )

    notif = encode_push_fail("cmpl-1-0123abcd", PushFailReason.LEASE_EXPIRED)
    assert decode_push_fail(notif) == ("cmpl-1-0123abcd", PushFailReason.LEASE_EXPIRED)
    import msgspec

    for body in (b"\xc1", msgspec.msgpack.encode([1]), msgspec.msgpack.encode({"request_id": "x"}),
                 msgspec.msgpack.encode({"request_id": "x", "reason": "bored"}),
                 b"\x00" * (MAX_PUSH_FAIL_BYTES + 1)):
        assert decode_push_fail(PUSH_FAIL_NOTIF_PREFIX + body) is None
    assert wants_push_fail({PUSH_REG_CAPS_KEY: [CAP_PUSH_FAIL]})
    assert not wants_push_fail({}) and not wants_push_fail({PUSH_REG_CAPS_KEY: CAP_PUSH_FAIL * 2})


def test_the_router_hands_each_kind_to_its_owner_and_a_fault_costs_one_notification():
    """vLLM's writer reads a batch through the router: contact for every agent, heartbeats
    PUSH_FAILs and KV digests to their owners (not forwarded), PUSH_REGs and completions forwarded
    (completions also to D's receive ledger), then the writer's due work. A handler that
    raises costs its one notification: the rest of the batch is handled, a completion
    still reaches vLLM, and a lost PUSH_FAIL's receive is given up."""
    from connector.glue.notifications import NotificationRouter, Owners
    from connector.glue.wire import encode_push_fail
    from connector.integrity.wire import KvDigestNotif, encode_kv_digest
    from connector.vocabulary import PushFailReason

    fail = encode_push_fail("cmpl-7-0123abcd", PushFailReason.LEASE_EXPIRED)
    kvd = encode_kv_digest(KvDigestNotif("d-1", 0, [0], [7], 32))
    batch = {"a1": [b"PUSH_REG:x", b"HB:r1", fail, kvd, b"d-1:1"], "a2": [b"HB:bad", b"d-2:1"]}
    seen: list[tuple[str, object]] = []

    def heartbeat(agent, m):
        if m == b"HB:bad":
            raise RuntimeError("defect")
        seen.append(("hb", m))

    def completion(agent, m):
        if m == b"d-2:1":
            raise RuntimeError("defect")
        seen.append(("done", m))

    def push_fail(agent, m):
        raise RuntimeError("defect")

    class Agent:
        def get_new_notifs(self):
            return {k: list(v) for k, v in batch.items()}

    router = NotificationRouter(Agent(), Owners(
        contact=lambda agent, now: seen.append(("contact", agent)), heartbeat=heartbeat,
        push_fail=push_fail, push_fail_lost=lambda m: seen.append(("lost", m)),
        completion=completion, kv_digest=lambda agent, m: seen.append(("kvd", m)),
        after_pass=lambda: seen.append(("pass", None)),
        fault=lambda step, what: seen.append(("fault", step.value))))
    forwarded = router.get_new_notifs()
    assert forwarded == {"a1": [b"PUSH_REG:x", b"d-1:1"], "a2": [b"d-2:1"]}
    assert seen == [("contact", "a1"), ("hb", b"HB:r1"), ("fault", "notification"), ("lost", fail),
                    ("kvd", kvd), ("done", b"d-1:1"), ("contact", "a2"), ("fault", "notification"),
                    ("fault", "notification"), ("pass", None)]


# ------------------------------------------------- a prefill silent for long, come back
def test_a_receive_started_after_its_prefill_went_silent_gets_its_own_chance():
    """D dropped P long ago and heard nothing since (P restarting for longer than D's
    handshake retries). A new request for P must not be given up as unreachable before
    its own PUSH_REG was sent: that send starts the re-handshake that finds P back. (The
    main thread tends peers each step; the writer may take the PUSH_REG only after it.)
    A receive that has itself waited the whole bound is still given up."""
    from connector.glue.worker import ObservedPushWorker
    from connector.state.receives import ReceiveState

    w = ObservedPushWorker.without_engine("kv_consumer", engine_id="me")
    now = time.perf_counter()
    bound = w._unreachable_after_s
    w._connections.dropped("p", PeerReset.NOTIFICATION_FAILED, now - 2 * bound, kept_transfer_info=False)
    assert w._connections.unreachable(now, bound) == ["p"]  # (the state the race needs)
    reg = {"remote_engine_id": "p", "remote_host": "10.0.0.1", "remote_port": 5600}
    w._receives.start({"old": reg}, now - 1.5 * bound)
    w._receives.start({"new": reg}, now)
    w._tend_peers()
    assert w._receives.state_of("new") is ReceiveState.QUEUED  # its PUSH_REG still goes
    assert w._receives.begin_send("new") == 1
    assert w._receives.state_of("old") is ReceiveState.FAILING  # waited the bound itself
