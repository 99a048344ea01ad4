"""P's KV leases in push mode, on real engines.

Upstream, D's heartbeats name a request by the router's id (or, from a fork decoder,
by D's own internal id) while P keys its leases by its own internal id, and vLLM's
`_handle_heartbeat` matches exactly: no heartbeat renews anything, and a request that
waits in D's queue longer than the lease loses its KV. The fork matches exact, base
and router ids (connector/glue/leases.py), counts each id by outcome and each expiry
by fate, and relies on vLLM 0.32/0.33's reaper scanning every lease.

One rig of three engine processes (real NIXL over UCX on CPU memory, real ZMQ side
channels): a fork prefill P, a stock prefill S (same settings) and a fork decode D.
The harness's D heartbeats every 5 s (the first at once); `kv_lease_duration` 12 s
makes a heartbeat extend a lease by 8 s, so a renewed lease outlives the interval.
Two narrow unit tests (no engines) pin what the engines cannot show: the heartbeat
outcome of a request P is still prefilling, and the "reaped late" count under the
upstream reaper that stopped at the first live lease (vLLM issue #58222).
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo

from connector.glue.worker import ObservedPushWorker
from connector.telemetry.record import HandshakeError
from connector.vocabulary import ErrorType, LeaseFate, LeaseRenewal, ReceiveFailure, StatKey
from harness import PushHarness
from harness.cluster import rank_context
from harness.config import FORK, STOCK, EngineSpec
from harness.poll import wait_until
from harness.runner import EngineHandle, free_port

pytestmark = pytest.mark.timeout(900)
real = pytest.mark.real

NUM_BLOCKS = 96
# P's and S's kv_lease_duration: a heartbeat extends a lease to now + 12 * 2 // 3 = 8 s,
# longer than the harness's 5 s heartbeat interval.
KV_LEASE_DURATION_S = 12
LEASE_S = 3.0  # the lease P grants when a prefill finishes (its first deadline)
SHORT_LEASE_S = 0.5
# D: a failed handshake to P is tried once more, within 2 s.
RETRY_BUDGET_S = 2.0
HANDSHAKE_TIMEOUT_S = 0.5
D_RETRIES = {"handshake_retries": 1, "handshake_retry_backoff_s": 0.2,
             "handshake_retry_budget_s": RETRY_BUDGET_S,
             "handshake_timeout_ms": int(HANDSHAKE_TIMEOUT_S * 1000)}
# Time past the retry budget a failed receive may take to reach D's results: the last
# attempt may start just inside the budget and run one timeout, then one engine step.
RECEIVE_FAIL_MARGIN_S = HANDSHAKE_TIMEOUT_S + 1.5
VLLM_NIXL_LOG = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
START_TIMEOUT_S = 600.0


def request_ids() -> tuple[str, str, str]:
    """One request's ids as real serving names them: the router's `X-Request-Id`, P's
    internal id (vLLM's OpenAI server derives `cmpl-<id>-0` from it, the engine adds a
    random `-<8 hex>`) and a fork D's internal id (same base, its own suffix)."""
    router = f"req-{secrets.token_hex(6)}"  # (12 hex: never mistaken for a suffix)
    base = f"cmpl-{router}-0"
    return router, f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"


class Collected:
    """One engine's stats records, gathered as they come (each record arrives once)."""

    def __init__(self, h: PushHarness, engine: str):
        self.h, self.engine, self.records = h, engine, []

    def refresh(self) -> list[dict]:
        self.records += self.h.stats(self.engine)
        return self.records

    def counts(self, key: str) -> Counter:
        return Counter(v for r in self.refresh() for v in r.get(key, []))

    def total(self, key: str) -> int:
        return sum(self.counts(key).values())

    def wait(self, key: str, condition: Callable[[Counter], bool], what: str,
             timeout_s: float = 30.0) -> Counter:
        wait_until(lambda: condition(self.counts(key)), f"{self.engine}: {what}", timeout_s,
                   last=lambda: self.counts(key))
        return self.counts(key)


class Rig:
    """The shared engines plus what the tests do with them one request at a time."""

    def __init__(self, h: PushHarness):
        self.h = h

    def quiet(self) -> None:
        """No heartbeats going out and no stats from earlier tests."""
        self.h["D"].call("stop_heartbeats")
        for engine in self.h.engines:
            self.h.stats(engine)

    def results(self, engine: str, until: Callable[[dict], bool], what: str,
                timeout_s: float = 30.0) -> dict:
        seen: list[dict] = [{}]

        def holds() -> dict | None:
            seen[0] = self.h[engine].call("results")
            return seen[0] if until(seen[0]) else None

        return wait_until(holds, f"{engine}: {what}", timeout_s, interval_s=0.01,
                          last=lambda: {k: list(v) for k, v in seen[0].items()})

    def leases_held(self, engine: str) -> int:
        """vLLM's own table of leases on `engine` (stock or fork)."""
        return self.h[engine].call("state_sizes", True)["_reqs_to_send"]

    def prefilled(self, engine: str, blocks: int = 2) -> list[int]:
        ids = self.h[engine].allocate(blocks)
        self.h[engine].call("fill", ids, int.from_bytes(secrets.token_bytes(4), "little"))
        return ids

    def receive(self, pairs: list[tuple[str, str, list[int]]]) -> None:
        """D registers each (router id, D id, P blocks) with P in one step (no heartbeat)
        and gets P's bytes exactly."""
        h, d = self.h, self.h["D"]
        d_blocks = [d.allocate(len(p_blocks)) for _, _, p_blocks in pairs]
        d.call_all([("register", (d_id, blocks, h["P"].address, router, False))
                    for (router, d_id, _), blocks in zip(pairs, d_blocks)], bulk=True)
        d_ids = [d_id for _, d_id, _ in pairs]
        res = self.results("D", lambda r: all(x in r["finished_recving"] for x in d_ids),
                           "the registered requests to receive their KV")
        assert not set(d_ids) & set(res["failed_recving"]), res
        for (_, _, p_blocks), blocks in zip(pairs, d_blocks):
            assert h["P"].call("digest", p_blocks) == d.call("digest", blocks)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = str(tmp_path_factory.mktemp("leases"))
    run = secrets.token_hex(3)
    common = dict(num_layers=2, num_blocks=NUM_BLOCKS, block_size=32, workdir=work)
    lease = {"kv_lease_duration": KV_LEASE_DURATION_S}
    specs = [
        EngineSpec(name="P", engine_id=f"lease-prefill-{run}", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=FORK, extra_config=lease, **common),
        EngineSpec(name="S", engine_id=f"lease-stock-prefill-{run}", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=STOCK, extra_config=lease, **common),
        EngineSpec(name="D", engine_id=f"lease-decode-{run}", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=FORK, extra_config=D_RETRIES, **common),
    ]
    ctx = rank_context()
    h = PushHarness(specs, ctx=ctx)
    try:
        for name, spec in h.specs.items():
            h.engines[name] = EngineHandle(spec, ctx)
        for handle in h.engines.values():
            handle.wait_ready(timeout=START_TIMEOUT_S)
        h["D"].call("watch_log", VLLM_NIXL_LOG)
        # Connect D with both prefills, both ways: a heartbeat goes out on its first step.
        for prefill in ("P", "S"):
            report = h.push(1, prefill=prefill, decode="D")
            assert report.ok, (prefill, report)
        yield Rig(h)
    finally:
        h.stop()


# ------------------------------------------------------------------ 1. renewal
@real
def test_fork_renews_leases_by_router_and_decoder_ids_where_stock_lets_them_expire(rig: Rig) -> None:
    """Same heartbeats to a fork and a stock prefill: (a) the router id, (b) a D-style
    internal id with another suffix. The stock P releases both at their deadline, as it
    does an unnamed control lease; the fork P releases only the control, and a
    registration after the first deadline still gets the KV byte for byte."""
    h = rig.h
    rig.quiet()
    p_stats, s_stats, d_stats = (Collected(h, e) for e in ("P", "S", "D"))
    ids = {engine: {k: request_ids() for k in "abc"} for engine in ("P", "S")}
    blocks = {"P": {"a": rig.prefilled("P"), "b": rig.prefilled("P"), "c": h["P"].allocate(1)},
              "S": {k: h["S"].allocate(1) for k in "abc"}}
    granted: dict[str, float] = {}
    for engine in ("P", "S"):
        granted[engine] = h[engine].call("now")
        # One step grants all three: the control (c) last, so its deadline is the latest.
        h[engine].call_all([("finish", (ids[engine][k][1], blocks[engine][k], LEASE_S))
                            for k in "abc"], bulk=True)
    for engine in ("P", "S"):
        wait_until(lambda engine=engine: rig.leases_held(engine) == 3, f"{engine} to hold 3 leases")
    # One D step heartbeats both prefills: (a) by the router id, (b) by D's own id.
    h["D"].call_all([("heartbeat", (h[engine].address, ids[engine][k][i]))
                     for engine in ("P", "S") for k, i in (("a", 0), ("b", 2))], bulk=True)
    p_stats.wait(StatKey.LEASE_RENEWALS, lambda c: c[LeaseRenewal.RENEWED.value] >= 2,
                 "both heartbeat ids to renew a lease")

    s_res = rig.results("S", lambda r: all(ids["S"][k][1] in r["finished_sending"] for k in "abc"),
                        "the stock prefill to release its leases", timeout_s=LEASE_S * 10)
    p_res = rig.results("P", lambda r: ids["P"]["c"][1] in r["finished_sending"],
                        "the fork prefill to release the unnamed control lease", timeout_s=LEASE_S * 10)
    # Released at (not before) their deadline, though the stock P was heartbeated for a, b.
    for k in "abc":
        assert s_res["finished_sending"][ids["S"][k][1]] >= granted["S"] + LEASE_S
    assert p_res["finished_sending"][ids["P"]["c"][1]] >= granted["P"] + LEASE_S
    # The control's deadline was the latest of the three: a and b outlived theirs.
    assert not {ids["P"][k][1] for k in "ab"} & set(p_res["finished_sending"])
    assert rig.leases_held("P") == 2
    assert d_stats.total(StatKey.HEARTBEATS_SENT) >= 2 and d_stats.total(StatKey.HEARTBEATS_FAILED) == 0

    # vLLM's own count: three expired on the stock P, none pushed; one (the control) on ours.
    s_stats.wait("num_kv_expired_reqs", lambda c: sum(c.values()) == 3, "vLLM to count 3 expiries")
    assert s_stats.counts("bytes_transferred") == Counter()
    p_stats.wait(StatKey.LEASE_EXPIRIES, lambda c: sum(c.values()) >= 1, "the control's expiry")
    assert p_stats.counts(StatKey.LEASE_EXPIRIES) == Counter({LeaseFate.UNCLAIMED.value: 1})
    assert p_stats.total("num_kv_expired_reqs") == 1

    h["D"].call("stop_heartbeats")
    rig.receive([(ids["P"][k][0], ids["P"][k][2], blocks["P"][k]) for k in "ab"])
    p_stats.wait(StatKey.PUSHES_COMPLETED, lambda c: sum(c.values()) == 2, "both pushes completed")
    renewals = p_stats.counts(StatKey.LEASE_RENEWALS)
    # Every heartbeat named both, and both were renewed each time.
    assert set(renewals) == {LeaseRenewal.RENEWED.value} and renewals[LeaseRenewal.RENEWED.value] % 2 == 0
    assert p_stats.total(StatKey.LEASES_REAPED_LATE) == 0


# ------------------------------------------------------------------ 2. outcomes
@real
def test_heartbeat_ids_are_counted_by_what_they_matched(rig: Rig) -> None:
    """One heartbeat naming a held lease (by router id), a request P pushed already (by
    D's id) and an id P never saw: one count of each outcome per heartbeat D sent.

    (A request P is still prefilling is in vLLM's `_reqs_to_process` without a lease;
    the harness's `finish` puts a request in both at once, so it cannot be made on real
    engines: `test_heartbeat_outcomes_unit` covers it.)"""
    h = rig.h
    rig.quiet()
    report = h.push(1, prefill="P", decode="D", heartbeat=False)
    assert report.verified == 1 and not report.failed, report
    p_done, d_done = report.pairs[0]
    rig.results("P", lambda r: p_done in r["finished_sending"], "P to report the push done")
    held = request_ids()
    held_blocks = rig.prefilled("P")
    h["P"].call("finish", held[1], held_blocks, 30.0)
    wait_until(lambda: rig.leases_held("P") == 1, "P to hold the lease")
    p_stats, d_stats = Collected(h, "P"), Collected(h, "D")
    unknown = f"req-{secrets.token_hex(6)}"
    h["D"].call_all([("heartbeat", (h["P"].address, x)) for x in (held[0], d_done, unknown)], bulk=True)
    p_stats.wait(StatKey.LEASE_RENEWALS, lambda c: sum(c.values()) >= 3, "the heartbeat's 3 ids counted")
    h["D"].call("stop_heartbeats")  # (the next steps send none: what D sent is all in its stats)
    sent = d_stats.total(StatKey.HEARTBEATS_SENT)
    assert sent >= 1 and d_stats.total(StatKey.HEARTBEATS_FAILED) == 0
    p_stats.wait(StatKey.LEASE_RENEWALS, lambda c: sum(c.values()) == 3 * sent,
                 f"the ids of all {sent} heartbeats D sent counted")
    assert p_stats.counts(StatKey.LEASE_RENEWALS) == Counter({
        LeaseRenewal.RENEWED.value: sent, LeaseRenewal.ALREADY_DONE.value: sent,
        LeaseRenewal.UNKNOWN_REQUEST.value: sent})
    rig.receive([(held[0], held[2], held_blocks)])


# ------------------------------------------------------------------ 3. reaper
@real
def test_expired_lease_behind_a_renewed_one_is_released_at_its_deadline(rig: Rig) -> None:
    """L1 granted first and kept renewed, L2 granted after it with a short lease: L2 is
    released at its deadline, counted unclaimed, while L1 is still held (and later
    pushed); nothing is reaped late; the gauge follows the leases held."""
    h = rig.h
    rig.quiet()
    wait_until(lambda: rig.leases_held("P") == 0, "P to hold no lease (L1 must be the oldest)")
    p_stats = Collected(h, "P")
    l1, l2 = request_ids(), request_ids()
    l1_blocks = rig.prefilled("P")
    h["P"].call("finish", l1[1], l1_blocks, LEASE_S)
    wait_until(lambda: rig.leases_held("P") == 1, "P to hold L1")
    h["D"].call("heartbeat", h["P"].address, l1[1])
    p_stats.wait(StatKey.LEASE_RENEWALS, lambda c: c[LeaseRenewal.RENEWED.value] >= 1, "L1 renewed")
    l2_granted = h["P"].call("now")
    h["P"].call("finish", l2[1], h["P"].allocate(1), SHORT_LEASE_S)

    res = rig.results("P", lambda r: l2[1] in r["finished_sending"], "P to release L2",
                      timeout_s=SHORT_LEASE_S * 40)
    assert res["finished_sending"][l2[1]] >= l2_granted + SHORT_LEASE_S
    assert l1[1] not in res["finished_sending"]
    assert rig.leases_held("P") == 1
    p_stats.wait(StatKey.LEASE_EXPIRIES, lambda c: sum(c.values()) >= 1, "L2's expiry counted")
    assert p_stats.counts(StatKey.LEASE_EXPIRIES) == Counter({LeaseFate.UNCLAIMED.value: 1})
    assert p_stats.total("num_kv_expired_reqs") == 1  # vLLM's own count agrees
    assert p_stats.total(StatKey.LEASES_REAPED_LATE) == 0

    h["D"].call("stop_heartbeats")
    rig.receive([(l1[0], l1[2], l1_blocks)])  # L1 was still held: its KV is intact

    def held_series() -> list[int]:
        series = [int(held) for r in p_stats.refresh() for held, _age in r.get(StatKey.LEASES, [])]
        deduped = [n for i, n in enumerate(series) if i == 0 or n != series[i - 1]]
        while deduped and deduped[0] == 0:  # (the gauge's return to 0 after earlier tests)
            deduped.pop(0)
        return deduped

    wait_until(lambda: held_series()[-1:] == [0], "the lease gauge back to 0", last=held_series)
    assert held_series() == [1, 2, 1, 0]
    assert p_stats.total(StatKey.LEASES_REAPED_LATE) == 0


# ------------------------------------------------------------ 4. D gives up
@real
def test_decode_fails_a_receive_whose_prefill_is_unreachable_within_the_retry_budget(rig: Rig) -> None:
    """No process listens on the P side channel D's request names: D retries once, then
    fails the receive (vLLM's `push_reg_handshake_failed`), instead of waiting for
    `push_registration_timeout` (480 s)."""
    h = rig.h
    rig.quiet()
    h["D"].call("logged", VLLM_NIXL_LOG)
    d_stats = Collected(h, "D")
    nowhere = {"engine_id": f"lease-nowhere-{secrets.token_hex(3)}", "host": "127.0.0.1",
               "port": free_port()}
    _, _, d_id = request_ids()
    started = h["D"].call("now")
    h["D"].call("register", d_id, h["D"].allocate(1), nowhere, f"req-{secrets.token_hex(6)}", False)
    res = rig.results("D", lambda r: d_id in r["failed_recving"], "D to fail the receive",
                      timeout_s=RETRY_BUDGET_S * 15)
    assert res["finished_recving"][d_id] - started <= RETRY_BUDGET_S + RECEIVE_FAIL_MARGIN_S
    d_stats.wait(StatKey.RECEIVE_FAILURES, lambda c: sum(c.values()) >= 1, "the failure counted")
    assert d_stats.counts(StatKey.RECEIVE_FAILURES) == Counter({ReceiveFailure.HANDSHAKE_FAILED.value: 1})
    # One handshake, counted once with its final outcome (its second attempt); the
    # first attempt is a retry (handshake_retries, its record marked `retried`, which
    # the metrics do not count as a handshake), both found no listener.
    attempts = [(x["attempt"], x["outcome"], x["error_type"], x.get("retried", False))
                for r in d_stats.records for x in r.get(StatKey.HANDSHAKES, [])]
    assert attempts == [(1, "failure", "unreachable", True), (2, "failure", "unreachable", False)]
    assert d_stats.counts(StatKey.HANDSHAKE_RETRIES) == Counter({"d_to_p": 1})
    logged = h["D"].call("logged", VLLM_NIXL_LOG)
    assert any("push_reg_handshake_failed" in line and d_id in line for line in logged), logged


# --------------------------------------------------------------- unit tests
def bare_lease_worker(kv_role: str = "kv_producer", handshake_pool: Any = None) -> Any:
    """A fork worker without vLLM's engine or NIXL (`ObservedPushWorker.without_engine`),
    plus the maps of vLLM's that its reaper and notification paths read."""
    w = ObservedPushWorker.without_engine(
        kv_role, extra={"kv_lease_duration": KV_LEASE_DURATION_S, "push_write_timeout_s": 10.0,
                        "push_lease_margin_s": 1.0},
        lease_extension=KV_LEASE_DURATION_S * 2 // 3, handshake_pool=handshake_pool)
    w._reqs_to_send = {}
    w._reqs_to_process = set()
    w.consumer_notification_counts_by_req = {}
    w.expected_consumer_notifications_by_req = {}
    return w


def grant(w: Any, req_id: str, expiry: float) -> None:
    """What vLLM's start_load_kv and ours do when a prefill finishes."""
    w._leases.grant({req_id: expiry}, None, time.monotonic())
    w._reqs_to_process.add(req_id)
    w._reqs_to_send[req_id] = expiry
    w._note_leases_granted([req_id])


def test_heartbeat_outcomes_unit() -> None:
    """Each of the four outcomes, including `prefilling` (scheduled, no lease yet)."""
    w = bare_lease_worker()
    held, prefilling, done = request_ids(), request_ids(), request_ids()
    now = time.perf_counter()
    grant(w, held[1], now + 1.0)
    grant(w, done[1], now + 1.0)
    w._reqs_to_process.add(prefilling[1])  # in the batch, not finished: no lease
    w._leases.note_batch([prefilling[1]], [])
    del w._reqs_to_send[done[1]]
    w._reqs_to_process.discard(done[1])
    w._leases_ended([done[1]])  # pushed
    before = time.perf_counter()
    w._handle_heartbeat(",".join([held[0], prefilling[2], done[2], f"req-{secrets.token_hex(6)}"]))
    assert Counter(w.xfer_stats.data[StatKey.LEASE_RENEWALS]) == Counter({
        LeaseRenewal.RENEWED.value: 1, LeaseRenewal.PREFILLING.value: 1,
        LeaseRenewal.ALREADY_DONE.value: 1, LeaseRenewal.UNKNOWN_REQUEST.value: 1})
    # The ledger holds the renewed deadline (vLLM's map is set from it at its reaper).
    assert w._leases.deadline_of(held[1]) >= before + KV_LEASE_DURATION_S * 2 // 3
    assert prefilling[1] not in w._reqs_to_send


def reaper_stopping_at_first_live_lease(self: Any, done_sending: set[str]) -> None:
    """vLLM's reaper before PR #50789 (issue #58222): it walks the leases in insertion
    order and stops at the first one not yet expired."""
    now = time.perf_counter()
    for req_id, expires in list(self._reqs_to_send.items()):
        if now < expires:
            break
        self.consumer_notification_counts_by_req.pop(req_id, 0)
        self.xfer_stats.record_kv_expired_req()
        self._reqs_to_process.remove(req_id)
        del self._reqs_to_send[req_id]
        done_sending.add(req_id)


@pytest.mark.parametrize("stops_at_first_live", [False, True], ids=["vllm-scans-all", "upstream-58222"])
def test_a_due_lease_is_released_at_the_first_pass_wherever_it_sits(
        monkeypatch: pytest.MonkeyPatch, stops_at_first_live: bool) -> None:
    """A renewed lease at the head of vLLM's map, an expired one behind it: released at the
    first pass past its deadline, whether vLLM's reaper scans every entry (0.32-0.34) or
    stops at the first live one (before PR #50789, issue #58222): the fork hands vLLM's
    reaper the due leases only."""
    if stops_at_first_live:
        monkeypatch.setattr(NixlBaseConnectorWorker, "_reap_expired_send_leases",
                            reaper_stopping_at_first_live_lease)
    w = bare_lease_worker()
    start = time.perf_counter()
    grant(w, "head", start + 3600.0)  # renewed: live
    grant(w, "behind", start + 0.001)
    wait_until(lambda: time.perf_counter() > start + 0.001, "the lease behind to expire",
               interval_s=0.0005)
    done: set[str] = set()
    w._reap_expired_send_leases(done)
    assert done == {"behind"} and set(w._reqs_to_send) == {"head"}
    assert w._reqs_to_process == {"head"}
    stats = w.xfer_stats.data
    assert stats[StatKey.LEASE_EXPIRIES] == [LeaseFate.UNCLAIMED.value]
    assert len(stats["num_kv_expired_reqs"]) == 1
    assert stats.get(StatKey.LEASES_REAPED_LATE, []) == []


def test_a_lease_granted_past_its_deadline_is_released_at_once_and_counted_late() -> None:
    """A lease whose deadline had passed before the previous reaper pass (a starved
    scheduler's expiry, rebased) is released at the next pass, counted late."""
    w = bare_lease_worker()
    start = time.perf_counter()
    grant(w, "live", start + 3600.0)
    w._reap_expired_send_leases(set())  # (the previous pass)
    grant(w, "stale", start - 10.0)
    done: set[str] = set()
    w._reap_expired_send_leases(done)
    assert done == {"stale"}
    assert len(w.xfer_stats.data.get(StatKey.LEASES_REAPED_LATE, [])) == 1


class RecordingExecutor:
    """A handshake pool that runs nothing: the test settles each attempt's future."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, Future]] = []

    def submit(self, fn: Any, record: Any, dcp: int) -> Future:
        inner: Future = Future()
        self.jobs.append((record, inner))
        return inner

    def settle(self, engine_id: str, result: Any = None, error: BaseException | None = None) -> None:
        (inner,) = [f for r, f in self.jobs if r.remote_engine_id == engine_id and not f.done()]
        inner.set_running_or_notify_cancel()
        if error is not None:
            inner.set_exception(error)
        else:
            inner.set_result(result)


class SentNotifs:
    """The NIXL agent's `send_notif`, recorded (a narrow unit test: no NIXL)."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, bytes]] = []

    def send_notif(self, agent: Any, notif_msg: bytes) -> None:
        self.sent.append((agent, notif_msg))


def test_a_kept_heartbeat_goes_once_its_handshake_connected_and_never_restarts_a_failed_one():
    """D keeps a heartbeat it could not send while its engine's handshake was pending.
    Once connected it goes out; while pending it stays kept; if the handshake failed it is
    dropped, else every engine step would start a new handshake to a peer that refuses
    (found on vLLM 0.34, where push refuses other block sizes at every handshake)."""
    pool = RecordingExecutor()
    w = bare_lease_worker("kv_consumer", handshake_pool=pool)
    w.nixl_wrapper = agent = SentNotifs()
    engines = ("p-failed", "p-pending", "p-connected")
    w._receives.start({f"d-{e}": {"remote_engine_id": e} for e in engines}, time.perf_counter())

    def step(*beating: str) -> list[Any]:
        """One engine step's heartbeats; the agents they went to."""
        w._send_heartbeats(SimpleNamespace(heartbeat_by_engine={
            e: HeartbeatInfo(req_ids={f"d-{e}"}, host="h", port=1, tp_size=1) for e in beating}))
        out = [a for a, _ in agent.sent]
        agent.sent.clear()
        return out

    step("p-connected")
    pool.settle("p-connected", ({(0, 0): "agent-c"}, 0.0))
    assert step(*engines) == ["agent-c"]
    assert sorted(r.remote_engine_id for r, _ in pool.jobs) == sorted(engines)
    assert all(r.notif_only for r, _ in pool.jobs)  # (every D->P handshake)
    assert step() == [] and len(pool.jobs) == 3  # still pending: kept, no new handshake
    pool.settle("p-failed", error=HandshakeError(ErrorType.CONFIG_MISMATCH, "refused"))
    pool.settle("p-pending", ({(0, 0): "agent-p"}, 0.0))
    assert step() == ["agent-p"]  # the kept heartbeat goes; p-failed's is dropped, not retried
    assert step() == [] and len(pool.jobs) == 3
