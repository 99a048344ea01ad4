"""Faults and bad input, each tried on real engines (real NIXL/UCX, real ZMQ side channels).

One rig of four engine processes is shared by every case (starting engines is the
expensive part): P (prefill, fork, handshake retries on), D (decode, retries on),
E (decode, retries off, long timeout: the hung-handshake and no-retry cases) and K
(a prefill engine the tests kill). Side-channel faults are made by ZMQ proxies put
between a worker and a real peer's side channel (the peer's engine id stays the
real one, so every check of the real handshake still runs). Each case asserts what
a user sees: the request outcome, the stats that reach /metrics (through a
vLLM-like front end), the spans and the log lines, and that the engine keeps
serving other peers afterwards.
"""

from __future__ import annotations

import collections
import os
import secrets
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import strategies as st

from connector.vocabulary import (
    PUSH_REG_TRACE_KEY,
    SPAN_HANDSHAKE,
    SPAN_PUSH_REGISTER,
    SPAN_PUSH_WRITE,
    VLLM_KV_EXPIRED_TOTAL,
    Attr,
    PushRegRejection,
    ReceiveFailure,
    StatKey,
)
from harness import PushHarness
from harness.config import EngineSpec
from harness.poll import wait_until
from harness.runner import EngineHandle, free_port
from tests.conftest import handshakes
from tests.support import push_reg
from tests.support.push_reg import ANYTHING
from tests.support.side_channel import SideChannelRelay
from tests.test_side_channel_listener import BAD_REQUESTS as BAD_SIDE_CHANNEL_REQUESTS
from tests.test_side_channel_listener import send_frames

# Engine start-up on a loaded 2-core machine can take many minutes (the fixture pays it once).
pytestmark = [pytest.mark.real, pytest.mark.timeout(1800)]

NUM_BLOCKS = 512
TIMEOUT_MS = 2500  # side-channel timeout of P and D
E_TIMEOUT_MS = 4000  # E: long enough to watch a hung handshake on the gauge
RETRYING = {"handshake_timeout_ms": TIMEOUT_MS, "handshake_retries": 3,
            "handshake_retry_backoff_s": 0.1, "handshake_retry_budget_s": 20}
NO_RETRY = {"handshake_timeout_ms": E_TIMEOUT_MS, "handshake_retries": 0}
PUSH_LOG = "connector.glue.push"
RECEIVE_LOG = "connector.glue.receive"
START_TIMEOUT_S = 600.0


# ------------------------------------------------------------------ side-channel fakes
class SideChannelProxy(SideChannelRelay):
    """A relay between a worker and a real side channel.

    It stays silent for the first `silent_first` requests (the peer's engine is busy),
    then forwards each request to `upstream_port` and relays the reply; with
    `reply` set it answers every request with those frames instead (garbage).
    """

    def __init__(self, upstream_port: int | None = None, silent_first: int = 0,
                 reply: list[bytes] | None = None):
        super().__init__(upstream_port)
        self.silent_first = silent_first
        self.reply = reply
        self.requests = 0
        self.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, _empty, msg = self._sock.recv_multipart()
            self.requests += 1
            if self.reply is not None:
                self._sock.send_multipart([identity, b"", *self.reply])
            elif self.requests > self.silent_first and self.upstream_port is not None:
                self._sock.send_multipart([identity, b"", *self._forward(msg)])


# ------------------------------------------------------------------------ the rig
class Rig:
    """The shared engines plus helpers for one request at a time."""

    def __init__(self, h: PushHarness):
        self.h = h
        self.proxies: list[SideChannelProxy] = []

    def proxy(self, **kwargs: Any) -> SideChannelProxy:
        proxy = SideChannelProxy(**kwargs)
        self.proxies.append(proxy)
        return proxy

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()

    @staticmethod
    def ids() -> tuple[str, str]:
        """P's and D's request ids of one request (same base, vLLM's random suffixes)."""
        base = f"cmpl-{secrets.token_hex(6)}"
        return f"{base}-{secrets.token_hex(4)}", f"{base}-{secrets.token_hex(4)}"

    def prefill(self, p: str, blocks: int = 2) -> tuple[str, list[int]]:
        """Blocks on prefill engine `p` filled with fresh data."""
        ids = self.h[p].allocate(blocks)
        self.h[p].call("fill", ids, int.from_bytes(secrets.token_bytes(4), "little"))
        return p, ids

    def results(self, engine: str, until: Callable[[dict], bool], timeout_s: float = 60.0) -> dict:
        """`engine`'s transfer results once `until(results)` holds (polled)."""
        seen: list[dict] = [{}]

        def holds() -> dict | None:
            seen[0] = self.h[engine].call("results")
            return seen[0] if until(seen[0]) else None

        return wait_until(holds, f"{engine}'s results to satisfy the condition", timeout_s,
                          interval_s=0.01, last=lambda: seen[0])

    def same_bytes(self, p: str, p_blocks: list[int], d: str, d_blocks: list[int]) -> bool:
        return self.h[p].call("digest", p_blocks) == self.h[d].call("digest", d_blocks)

    def pristine(self, d: str, d_blocks: list[int]) -> bool:
        """No byte of these blocks of `d` was written."""
        others = [b for b in range(NUM_BLOCKS) if b not in set(d_blocks)]
        return self.h[d].call("untouched", others) == []

    def collect(self, engine: str, until: Callable[[list[dict]], bool],
                timeout_s: float = 60.0) -> list[dict]:
        """Stats dicts of `engine` until `until(collected)` holds (polled)."""
        out: list[dict] = []

        def more() -> bool:
            out.extend(self.h.stats(engine))
            return until(out)

        wait_until(more, f"{engine}'s stats to satisfy the condition", timeout_s,
                   last=lambda: summary(out))
        return out

    def drop_stats(self, *engines: str) -> None:
        for engine in engines:
            self.h.stats(engine)

    def spans(self, engine: str) -> list[dict]:
        return self.h[engine].call("spans")

    def serves(self, p: str, d: str) -> None:
        """`p` still pushes to `d`: one request, bytes verified."""
        report = self.h.push(1, prefill=p, decode=d, heartbeat=False)
        # (Not report.ok: its check of D's other blocks does not know the blocks the
        # fault cases wrote on purpose.)
        assert report.verified == 1 and not report.failed and not report.mismatched, report


def count(stats: list[dict], key: str) -> int:
    return sum(len(s.get(key, [])) for s in stats)


def values(stats: list[dict], key: str) -> list[Any]:
    return [v for s in stats for v in s.get(key, [])]


def summary(stats: list[dict]) -> dict[str, Any]:
    """Non-empty keys of a list of stats dicts (for failure messages)."""
    out: dict[str, Any] = collections.defaultdict(list)
    for s in stats:
        for k, v in s.items():
            if v:
                out[k].extend(v if isinstance(v, list) else [v])
    return {k: (v if len(v) < 20 else f"{len(v)} items") for k, v in out.items()}


def observed(h: PushHarness, engine: str, stats: list[dict]) -> Any:
    fe = h.frontend(engine)
    fe.observe(stats)
    return fe


def handshake_spans(spans: list[dict], remote_engine_id: str) -> list[dict]:
    return sorted((s for s in spans if s["name"] == SPAN_HANDSHAKE
                   and s["attributes"].get(Attr.REMOTE_ENGINE_ID) == remote_engine_id),
                  key=lambda s: s["start"])


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Any:
    work = str(tmp_path_factory.mktemp("relreal"))
    common = dict(num_layers=2, num_blocks=NUM_BLOCKS, block_size=32, workdir=work)
    run = secrets.token_hex(3)
    specs = [
        EngineSpec(name="P", engine_id=f"prefill-{run}", kv_role="kv_producer",
                   side_channel_port=free_port(), extra_config=RETRYING, tracing="memory", **common),
        EngineSpec(name="D", engine_id=f"decode-{run}", kv_role="kv_consumer",
                   side_channel_port=free_port(), extra_config=RETRYING, tracing="memory", **common),
        EngineSpec(name="E", engine_id=f"decode-e-{run}", kv_role="kv_consumer",
                   side_channel_port=free_port(), extra_config=NO_RETRY, tracing="memory", **common),
        EngineSpec(name="K", engine_id=f"prefill-k-{run}", kv_role="kv_producer",
                   side_channel_port=free_port(), extra_config=RETRYING, **common),
    ]
    h = PushHarness(specs)
    try:
        # Four engines start at once; on a busy 2-core machine that can take minutes.
        for name, spec in h.specs.items():
            h.engines[name] = EngineHandle(spec)
        for handle in h.engines.values():
            handle.wait_ready(timeout=START_TIMEOUT_S)
        r = Rig(h)
        try:
            for name in "PDE":
                h[name].call("watch_log", PUSH_LOG)
                h[name].call("watch_log", RECEIVE_LOG)
            # Connect P<->D and P<->E once, the normal way.
            for d in "DE":
                r.serves("P", d)
            yield r
        finally:
            r.close()
            k = h["K"].process
            if k.is_alive():
                os.kill(k.pid, signal.SIGCONT)
    finally:
        h.stop()


# ------------------------------------------------------------ 1. retry on a stall
def test_d_to_p_handshake_retry_rides_out_a_stalled_side_channel(rig: Rig) -> None:
    h, p_addr = rig.h, rig.h["P"].address
    proxy = rig.proxy(upstream_port=p_addr["port"], silent_first=1)
    h["D"].call("forget", p_addr["engine_id"])
    rig.drop_stats("D")
    p_id, d_id = rig.ids()
    _, p_blocks = rig.prefill("P")
    d_blocks = h["D"].allocate(2)
    h["D"].call("register", d_id, d_blocks, {**p_addr, **proxy.address}, p_id, False)
    h["P"].call("finish", p_id, p_blocks, 30.0)

    res = rig.results("D", lambda r: d_id in r["finished_recving"])
    assert d_id not in res["failed_recving"]
    assert rig.same_bytes("P", p_blocks, "D", d_blocks)
    stats = rig.collect("D", lambda s: len(handshakes(s)) >= 2)
    hs = [(x["attempt"], x["outcome"], x["error_type"], x["failed_phase"], x.get("retried"))
          for x in handshakes(stats)]
    assert hs == [(1, "failure", "timeout", "metadata_fetch", True), (2, "success", None, None, None)]
    assert values(stats, StatKey.HANDSHAKE_RETRIES) == ["d_to_p"]
    assert proxy.requests == 2
    fe = observed(h, "D", stats)
    assert fe.sample("vllm:nixl_handshake_retries_total", {"direction": "d_to_p"}) == 1
    # One handshake, counted once with its final outcome; the attempt is a retry.
    assert fe.sample("vllm:nixl_handshakes_total", {
        "direction": "d_to_p", "trigger": "push_reg", "notif_agents_only": "true",
        "outcome": "success"}) == 1
    assert fe.sample("vllm:nixl_handshakes_total", {
        "direction": "d_to_p", "trigger": "push_reg", "notif_agents_only": "true",
        "outcome": "failure"}) == 0
    assert fe.sample("vllm:nixl_handshake_phase_failures_total", {
        "direction": "d_to_p", "phase": "metadata_fetch", "error_type": "timeout"}) == 1
    spans = handshake_spans(rig.spans("D"), p_addr["engine_id"])[-2:]
    assert [(s["status"], s["attributes"][Attr.ATTEMPT]) for s in spans] == [("ERROR", 1), ("UNSET", 2)]
    assert spans[0]["attributes"][Attr.ERROR_TYPE] == "timeout"


def test_p_to_d_handshake_retry_rides_out_a_stalled_side_channel(rig: Rig) -> None:
    h, d_addr = rig.h, rig.h["D"].address
    proxy = rig.proxy(upstream_port=d_addr["port"], silent_first=1)
    h["P"].call("forget", d_addr["engine_id"])
    rig.drop_stats("P")
    p_id, d_id = rig.ids()
    _, p_blocks = rig.prefill("P")
    d_blocks = h["D"].allocate(2)
    # D's PUSH_REG tells P where D's side channel is: point it at the proxy.
    h["D"].call("register_as", d_id, d_blocks, h["P"].address, p_id,
                {"decode_port": proxy.port})
    # The PUSH_REG reaches P first, so P starts its P->D handshake early (before the
    # prefill finishes) and the WRITE joins it. Once found flaky: that early handshake
    # was never retried, so its first stalled attempt failed the joined request.
    wait_until(lambda: proxy.requests >= 1, "P's early handshake to reach the proxy", 30.0, interval_s=0.01)
    h["P"].call("finish", p_id, p_blocks, 30.0)

    res = rig.results("D", lambda r: d_id in r["finished_recving"])
    assert d_id not in res["failed_recving"]
    assert rig.same_bytes("P", p_blocks, "D", d_blocks)
    stats = rig.collect("P", lambda s: len(handshakes(s)) >= 2
                        and count(s, StatKey.PUSHES_COMPLETED) >= 1)
    hs = [(x["direction"], x["attempt"], x["outcome"], x["error_type"]) for x in handshakes(stats)]
    assert hs == [("p_to_d", 1, "failure", "timeout"), ("p_to_d", 2, "success", None)]
    assert values(stats, StatKey.HANDSHAKE_RETRIES) == ["p_to_d"]
    assert count(stats, StatKey.PUSHES_FAILED) == 0
    assert proxy.requests == 2


# ------------------------------------- 1b + 2. no retries: a hung handshake, watched
def test_hung_handshake_shows_on_the_gauge_then_fails_cleanly_without_retries(rig: Rig) -> None:
    h, p_addr = rig.h, rig.h["P"].address
    proxy = rig.proxy(upstream_port=p_addr["port"], silent_first=10**9)  # never answers
    h["E"].call("forget", p_addr["engine_id"])
    rig.drop_stats("E")
    _, d_id = rig.ids()
    h["E"].call("register", d_id, h["E"].allocate(1), {**p_addr, **proxy.address}, "p-hung", False)

    def snapshots(stats: list[dict]) -> list[dict]:
        return [snap for s in stats for snap in s.get(StatKey.IN_FLIGHT, [])]

    def growing(stats: list[dict]) -> bool:
        open_ = [snap["d_to_p|true"] for snap in snapshots(stats) if snap]
        return len(open_) >= 2 and open_[-1][1] > open_[0][1]

    hanging = rig.collect("E", growing)
    open_ = [snap["d_to_p|true"] for snap in snapshots(hanging) if snap]
    assert all(n == 1 for n, _age in open_)
    fe = observed(h, "E", hanging)
    assert fe.sample("vllm:nixl_handshakes_in_flight",
                     {"direction": "d_to_p", "notif_agents_only": "true"}) == 1
    assert fe.sample("vllm:nixl_handshake_oldest_in_flight_seconds", {"direction": "d_to_p"}) > 0
    assert handshakes(hanging) == []  # not counted until it ends

    res = rig.results("E", lambda r: d_id in r["failed_recving"])
    assert d_id in res["finished_recving"]
    after = rig.collect("E", lambda s: len(handshakes(s)) >= 1 and snapshots(s)
                        and snapshots(s)[-1] == {})
    fe.observe(after)
    assert fe.sample("vllm:nixl_handshakes_in_flight",
                     {"direction": "d_to_p", "notif_agents_only": "true"}) == 0
    assert fe.sample("vllm:nixl_handshake_oldest_in_flight_seconds", {"direction": "d_to_p"}) == 0
    [hs] = handshakes(after)
    assert (hs["outcome"], hs["error_type"], hs["failed_phase"]) == ("failure", "timeout", "metadata_fetch")
    assert count(after, StatKey.HANDSHAKE_RETRIES) == 0
    assert proxy.requests == 1
    [span] = handshake_spans(rig.spans("E"), p_addr["engine_id"])[-1:]
    assert span["status"] == "ERROR" and span["attributes"][Attr.ERROR_TYPE] == "timeout"
    assert f"within {E_TIMEOUT_MS} ms" in span["status_description"]
    rig.serves("P", "E")


# ----------------------------------------------------------- 3. side-channel faults
def test_garbage_from_the_side_channel_fails_fast_without_retry(rig: Rig) -> None:
    h = rig.h
    garbage = b"\xc1 this is not msgpack \xff" + secrets.token_bytes(64)
    proxy = rig.proxy(reply=[garbage, msgspec.msgpack.encode(time.perf_counter())])
    rig.drop_stats("D")
    _, d_id = rig.ids()
    target = {"engine_id": "garbage-prefill", **proxy.address}
    h["D"].call("register", d_id, h["D"].allocate(1), target, "p-garbage", False)
    res = rig.results("D", lambda r: d_id in r["failed_recving"], timeout_s=30)
    assert d_id in res["finished_recving"]
    stats = rig.collect("D", lambda s: len(handshakes(s)) >= 1)
    [hs] = handshakes(stats)
    assert (hs["error_type"], hs["failed_phase"]) == ("decode_error", "metadata_decode")
    assert count(stats, StatKey.HANDSHAKE_RETRIES) == 0  # not transient: no retry
    assert proxy.requests == 1
    fe = observed(h, "D", stats)
    assert fe.sample("vllm:nixl_handshake_phase_failures_total", {
        "direction": "d_to_p", "phase": "metadata_decode", "error_type": "decode_error"}) == 1
    [span] = handshake_spans(rig.spans("D"), "garbage-prefill")
    assert span["status"] == "ERROR" and span["attributes"][Attr.ERROR_TYPE] == "decode_error"
    rig.serves("P", "D")


def test_bad_requests_to_p_side_channel_are_counted_and_p_keeps_serving(rig: Rig) -> None:
    """Upstream, the first of these ends P's listener thread: no decoder could reach P again."""
    h, p_addr = rig.h, rig.h["P"].address
    rig.drop_stats("P")
    stats: list[dict] = []
    for i, (frames, _) in enumerate(BAD_SIDE_CHANNEL_REQUESTS):
        # One at a time: a request already queued in the listener's socket when it dies is
        # lost with that socket (its sender times out; a real handshake would retry).
        send_frames(p_addr["host"], p_addr["port"], frames)
        need = i + 1 - count(stats, StatKey.SIDE_CHANNEL_REJECTED)
        stats += rig.collect("P", lambda s, need=need: count(s, StatKey.SIDE_CHANNEL_REJECTED) >= need)
    want = collections.Counter(reason for _, reason in BAD_SIDE_CHANNEL_REQUESTS)
    assert collections.Counter(values(stats, StatKey.SIDE_CHANNEL_REJECTED)) == want
    fe = observed(h, "P", stats)
    for reason, n in want.items():
        assert fe.sample("vllm:nixl_side_channel_rejected_total", {"reason": reason}) == n
    # D forgets P, so its next request handshakes with P's side channel again.
    h["D"].call("forget", p_addr["engine_id"])
    rig.serves("P", "D")


def test_prefill_killed_mid_handshake_and_push_reg_that_cannot_be_sent(rig: Rig) -> None:
    """K dies while E waits for its side channel; D, connected to K before, then
    cannot send its PUSH_REG to K's agent. Both count the failure once and go on."""
    h, k_addr = rig.h, rig.h["K"].address
    k_pid = h["K"].info["pid"]
    h["D"].call("heartbeat", k_addr, "p-hb-k")  # D reaches K (notification-only)
    h.wait_for("D", lambda c: k_addr["engine_id"] in c["remote_agents"])
    h["D"].call("stop_heartbeats")
    rig.drop_stats("D", "E")

    os.kill(k_pid, signal.SIGSTOP)  # K's kernel still accepts; K never answers
    try:
        _, e_id = rig.ids()
        h["E"].call("register", e_id, h["E"].allocate(1), k_addr, "p-killed", False)

        def waiting(stats: list[dict]) -> bool:
            snaps = [x for s in stats for x in s.get(StatKey.IN_FLIGHT, []) if x]
            return bool(snaps) and snaps[-1]["d_to_p|true"][1] > 0.3

        e_stats = rig.collect("E", waiting)  # E is connected and waiting on K
        os.kill(k_pid, signal.SIGKILL)
    finally:
        os.kill(k_pid, signal.SIGCONT)
    h["K"].process.join(10)
    assert not h["K"].process.is_alive()

    res = rig.results("E", lambda r: e_id in r["failed_recving"], timeout_s=30)
    assert e_id in res["finished_recving"]
    e_stats += rig.collect("E", lambda s: len(handshakes(s)) >= 1)
    [hs] = handshakes(e_stats)
    assert (hs["outcome"], hs["error_type"], hs["failed_phase"]) == ("failure", "timeout", "metadata_fetch")
    fe = observed(h, "E", e_stats)
    assert fe.sample("vllm:nixl_handshake_phase_failures_total", {
        "direction": "d_to_p", "phase": "metadata_fetch", "error_type": "timeout"}) == 1
    [span] = handshake_spans(rig.spans("E"), k_addr["engine_id"])
    assert span["status"] == "ERROR" and span["attributes"][Attr.ERROR_TYPE] == "timeout"
    rig.serves("P", "E")

    # D still holds K's agent: its PUSH_REG cannot be delivered.
    _, d_id = rig.ids()
    h["D"].call("register", d_id, h["D"].allocate(1), k_addr, "p-dead", False)
    d_stats = rig.collect("D", lambda s: count(s, StatKey.PUSH_REG_FAILED) >= 1)
    assert count(d_stats, StatKey.PUSH_REG_SENT) == 0
    fe = observed(h, "D", d_stats)
    assert fe.sample("vllm:nixl_push_reg_notifs_total", {"outcome": "failed"}) == 1
    assert fe.sample("vllm:nixl_num_failed_notifications_total") == 1
    [reg] = [s for s in rig.spans("D") if s["name"] == SPAN_PUSH_REGISTER
             and s["attributes"][Attr.REQUEST_ID] == d_id]
    assert reg["status"] == "ERROR" and reg["attributes"][Attr.ERROR_TYPE] == "push_reg_notif_failed"
    rig.serves("P", "D")


# -------------------------------------------------------------------- 4. P side
def test_lease_expires_without_a_registration(rig: Rig) -> None:
    h = rig.h
    rig.drop_stats("P")
    p_id, _ = rig.ids()
    _, p_blocks = rig.prefill("P", 1)
    h["P"].call("finish", p_id, p_blocks, 0.3)
    rig.results("P", lambda r: p_id in r["finished_sending"])
    stats = rig.collect("P", lambda s: count(s, "num_kv_expired_reqs") >= 1)
    fe = observed(h, "P", stats)
    assert fe.sample(VLLM_KV_EXPIRED_TOTAL) == 1
    for outcome in ("started", "completed", "failed"):  # no push ever started
        assert fe.sample("vllm:nixl_pushes_total", {"outcome": outcome}) == 0
    rig.serves("P", "E")


def test_registration_after_p_lease_expired_fails_on_d_at_once(rig: Rig) -> None:
    """Upstream the late PUSH_REG waits on P for ever and D's request until its watchdog
    (480 s by default; the harness has none, so here: for ever)."""
    h = rig.h
    rig.drop_stats("P")
    p_id, d_id = rig.ids()
    _, p_blocks = rig.prefill("P", 1)
    h["P"].call("finish", p_id, p_blocks, 0.3)
    rig.results("P", lambda r: p_id in r["finished_sending"])  # lease over, nothing pushed
    d_blocks = h["D"].allocate(1)
    h["D"].call("register", d_id, d_blocks, h["P"].address, p_id, False)
    rig.results("D", lambda r: d_id in r["failed_recving"], timeout_s=30)
    stats = rig.collect("P", lambda s: count(s, StatKey.PUSH_REG_REJECTED) >= 1)
    assert values(stats, StatKey.PUSH_REG_REJECTED) == ["after_lease_expired"]
    assert d_id not in h["P"].call("pending_registrations")  # upstream: kept for ever
    assert count(stats, StatKey.PUSHES_STARTED) == 0
    assert any(d_id in line and "lease" in line for line in h["D"].call("logged", RECEIVE_LOG))
    rig.serves("P", "D")


def test_a_claimed_lease_outlives_its_deadline_until_its_write_lands(rig: Rig) -> None:
    """D registered in time, then P's handshake to D stalls past the request's lease.
    The PUSH_REG claimed the lease when it matched P's blocks: vLLM's reaper does not
    release a claimed lease before its WRITE settles, so the WRITE lands and nothing is
    released under it (before, such a lease expired and the WRITE was refused or,
    upstream, read blocks already given back)."""
    h, d_addr = rig.h, rig.h["D"].address
    proxy = rig.proxy(upstream_port=d_addr["port"], silent_first=1)
    h["P"].call("forget", d_addr["engine_id"])
    rig.drop_stats("P")
    p_id, d_id = rig.ids()
    _, p_blocks = rig.prefill("P")
    d_blocks = h["D"].allocate(2)
    h["D"].call("register_as", d_id, d_blocks, h["P"].address, p_id, {"decode_port": proxy.port})
    h["P"].call("finish", p_id, p_blocks, 0.5)  # shorter than one handshake timeout

    res = rig.results("D", lambda r: d_id in r["finished_recving"])
    assert d_id not in res["failed_recving"]
    assert rig.same_bytes("P", p_blocks, "D", d_blocks)
    stats = rig.collect("P", lambda s: count(s, StatKey.PUSHES_COMPLETED) >= 1)
    fe = observed(h, "P", stats)
    assert fe.sample(VLLM_KV_EXPIRED_TOTAL) == 0
    assert fe.sample("vllm:nixl_pushes_total", {"outcome": "failed"}) == 0
    assert fe.sample("vllm:nixl_handshake_retries_total", {"direction": "p_to_d"}) >= 1
    rig.serves("P", "E")
    rig.serves("P", "D")


def test_a_registration_after_the_lease_was_released_gets_push_fail_and_no_write(rig: Rig) -> None:
    """P released the lease (no decoder asked in time); D's PUSH_REG comes later: P
    does not WRITE (the blocks may hold another request's KV by now) and tells D."""
    h = rig.h
    rig.drop_stats("P")
    rig.drop_stats("D")
    p_id, d_id = rig.ids()
    _, p_blocks = rig.prefill("P")
    h["P"].call("finish", p_id, p_blocks, 0.5)
    rig.results("P", lambda r: p_id in r["finished_sending"])  # released unpushed
    d_blocks = h["D"].allocate(2)
    h["D"].call("register", d_id, d_blocks, h["P"].address, p_id, False)
    res = rig.results("D", lambda r: d_id in r["failed_recving"])
    assert d_id in res["finished_recving"]
    assert rig.pristine("D", d_blocks)
    d_stats = rig.collect("D", lambda s: count(s, StatKey.RECEIVE_FAILURES) >= 1)
    assert values(d_stats, StatKey.RECEIVE_FAILURES) == [ReceiveFailure.LEASE_EXPIRED.value]
    p_stats = rig.collect("P", lambda s: count(s, StatKey.PUSH_REG_REJECTED) >= 1)
    fe = observed(h, "P", p_stats)
    assert fe.sample("vllm:nixl_pushes_total", {"outcome": "started"}) == 0
    assert fe.sample("vllm:nixl_push_reg_rejected_total", {"reason": "after_lease_expired"}) == 1
    assert fe.sample("vllm:nixl_push_fail_notifs_total",
                     {"reason": "lease_expired", "outcome": "sent"}) == 1
    rig.serves("P", "D")


@pytest.mark.parametrize("bad_block", [NUM_BLOCKS, 10**6])
def test_write_to_blocks_outside_d_fails_once_and_writes_nothing(rig: Rig, bad_block: int) -> None:
    """D's registration names a block D does not have: no WRITE lands anywhere in D."""
    h = rig.h
    rig.drop_stats("P")
    p_id, d_id = rig.ids()
    _, p_blocks = rig.prefill("P", 1)
    before = h["D"].call("digest", list(range(NUM_BLOCKS)))
    h["D"].call("register_as", d_id, [1], h["P"].address, p_id, {"local_block_ids": ([bad_block],)})
    h["P"].call("finish", p_id, p_blocks, 30.0)
    stats = rig.collect("P", lambda s: count(s, StatKey.PUSHES_FAILED) >= 1)
    fe = observed(h, "P", stats)
    assert fe.sample("vllm:nixl_pushes_total", {"outcome": "failed"}) == 1
    assert fe.sample("vllm:nixl_pushes_total", {"outcome": "completed"}) == 0
    assert h["D"].call("digest", list(range(NUM_BLOCKS))) == before
    [write] = [s for s in rig.spans("P") if s["name"] == SPAN_PUSH_WRITE
               and s["attributes"][Attr.REQUEST_ID] == p_id]
    assert write["status"] == "ERROR"
    assert write["attributes"][Attr.ERROR_TYPE] == "transfer_setup_failed"
    rig.serves("P", "E")
    rig.serves("P", "D")


# ------------------------------------------------------------ 5. PUSH_REG fuzz
# The classes tests/support/push_reg.py builds, each with the reason it must get.
BUILT_REASONS = (PushRegRejection.UNDECODABLE, PushRegRejection.NOT_A_MAP, PushRegRejection.MISSING_FIELD,
                 PushRegRejection.WRONG_TYPE, PushRegRejection.OVERSIZED)
# Verdicts P gives a PUSH_REG as it arrives (any other reason drops one kept pending).
ON_ARRIVAL = {r.value for r in (*BUILT_REASONS, PushRegRejection.FAILED, PushRegRejection.AFTER_LEASE)}
HOSTILE_CONTEXTS = st.one_of(
    ANYTHING,
    st.fixed_dictionaries({"traceparent": st.text(max_size=200) | ANYTHING}),
    st.just({"traceparent": "00-" + "f" * 32 + "-" + "f" * 16 + "-01", "tracestate": "x" * 5000}),
    st.just({"traceparent": "x" * 100_000}),
)


def test_push_reg_fuzz_through_real_nixl(rig: Rig) -> None:
    """Thousands of PUSH_REGs, mostly malformed, from D's real NIXL agent into P's writer,
    in batches with good pushes (carrying hostile trace contexts) in between.

    First payloads whose fate is known by construction (tests/support/push_reg.py):
    each rejected with its reason, counted once, and every valid one kept pending on P.
    Then byte-level mutants of them, of unknown class: each one rejected (for some
    reason, counted once) or accepted (then pending on P), none lost or counted twice.
    """
    h, p_eid = rig.h, rig.h["P"].address["engine_id"]
    built = push_reg.classes(h["D"].address, push_reg.unique_ids("c"))
    mutants = push_reg.mutants(built, push_reg.unique_ids("m"))
    expected = collections.Counter(x.reason for x in built if x.reason is not None)
    valid_ids = {x.request_id for x in built if x.reason is None}
    assert set(expected) == {r.value for r in BUILT_REASONS}  # every class was built
    contexts = push_reg.draw_examples(HOSTILE_CONTEXTS, 10)
    batches = [[x.notif for x in built[i::3]] for i in range(3)]
    batches += [[push_reg.PREFIX + m for m in mutants[i::2]] for i in range(2)]

    rig.drop_stats("P")
    h["P"].call("logged", PUSH_LOG)
    pending_before = set(h["P"].call("pending_registrations"))
    good: set[str] = set()
    p_stats: list[dict] = []
    sent = [0]
    accepted: set[str] = set()  # pending now, of those sent
    left = [0]  # accepted, then dropped while pending (a later verdict, e.g. no prefill matched)

    def rejected() -> list[str]:
        """Verdicts on arrival, by reason (counted once each)."""
        return [r for r in values(p_stats, StatKey.PUSH_REG_REJECTED) if r in ON_ARRIVAL]

    def conserved() -> bool:
        """Every payload sent so far was rejected on arrival or accepted, exactly once."""
        p_stats.extend(h.stats("P"))
        pending = set(h["P"].call("pending_registrations"))
        accepted.clear()
        accepted.update(pending - pending_before - good)
        later = len(values(p_stats, StatKey.PUSH_REG_REJECTED)) - len(rejected())
        left[0] = later - len(pending_before - pending)  # (not those pending before)
        return len(rejected()) + len(accepted) + left[0] == sent[0]

    after_classes: tuple[collections.Counter, set[str]] | None = None
    for i, batch in enumerate(batches):
        assert h["D"].call("send_notifs", p_eid, batch, timeout=120) == len(batch)
        sent[0] += len(batch)
        # Good requests right behind the bad ones (P's writer reads the notifications in
        # order), with hostile trace contexts.
        for ctx in contexts[2 * i:2 * i + 2]:
            p_id, d_id = rig.ids()
            good.add(d_id)
            _, p_blocks = rig.prefill("P")
            d_blocks = h["D"].allocate(2)
            h["D"].call("register_as", d_id, d_blocks, h["P"].address, p_id, {PUSH_REG_TRACE_KEY: ctx})
            h["P"].call("finish", p_id, p_blocks, 30.0)
            try:
                res = rig.results("D", lambda r, d_id=d_id: d_id in r["finished_recving"])
            except TimeoutError as exc:
                raise AssertionError(
                    f"good request lost after fuzz batch {i} (context {ctx!r:.200}); P holds "
                    f"{len(h['P'].call('pending_registrations'))} pending registrations, "
                    f"P's results: {h['P'].call('results')}") from exc
            assert d_id not in res["failed_recving"]
            assert rig.same_bytes("P", p_blocks, "D", d_blocks)
        wait_until(conserved, f"each of the {sent[0]} PUSH_REGs sent so far to be rejected or accepted by P",
                   120, interval_s=0.05, last=lambda: f"{len(rejected())} rejected, {len(accepted)} pending, "
                                                      f"{left[0]} dropped later, {sent[0]} sent")
        if i == 2:  # the payloads of known class, all sent and judged
            after_classes = (collections.Counter(rejected()), set(accepted))

    # P counts a push completed when it sees its WRITE done, which can be after D's receive.
    def all_pushed() -> bool:
        p_stats.extend(h.stats("P"))
        return count(p_stats, StatKey.PUSHES_COMPLETED) >= len(contexts)

    wait_until(all_pushed, f"P to count its {len(contexts)} good pushes completed", 60,
               last=lambda: count(p_stats, StatKey.PUSHES_COMPLETED))
    assert conserved()  # every payload, classes and mutants: one verdict each
    assert after_classes is not None
    by_class, pending_classes = after_classes
    assert by_class == expected  # each bad one counted once, by its reason
    assert pending_classes == valid_ids  # and every valid edge case kept
    # The mutants reached both fates (else conservation would say little).
    assert len(rejected()) > sum(by_class.values()) and accepted - pending_classes
    assert count(p_stats, StatKey.PUSHES_COMPLETED) == len(contexts)
    assert count(p_stats, StatKey.PUSHES_FAILED) == 0
    counted = collections.Counter(values(p_stats, StatKey.PUSH_REG_REJECTED))
    fe = observed(h, "P", p_stats)
    for reason in (r.value for r in PushRegRejection):
        assert fe.sample("vllm:nixl_push_reg_rejected_total", {"reason": reason}) == counted[reason]
    logged = [line for line in h["P"].call("logged", PUSH_LOG) if line.startswith("Dropped a PUSH_REG")]
    assert collections.Counter(line.split("(", 1)[1].split(":", 1)[0] for line in logged) == counted
    rig.serves("P", "E")
