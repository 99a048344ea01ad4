"""Handshake failures on real sockets: each gives an ERROR span, a counted failure in
the right phase, and a cleanly failed request; the engine keeps pushing afterwards."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlHandshakePayload,
)

from connector.vocabulary import SPAN_HANDSHAKE, SPAN_PUSH_RECEIVE, Attr
from harness import PushHarness
from harness.runner import free_port
from tests.conftest import drain_stats, handshakes, has_handshakes

pytestmark = pytest.mark.real

TIMEOUT_MS = 800


class FakeSideChannel:
    """A ZMQ ROUTER on 127.0.0.1 that stays silent or answers with a given payload."""

    def __init__(self, payload: bytes | None):
        self.port = free_port()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.bind(f"tcp://127.0.0.1:{self.port}")
        self._payload = payload
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            identity, _, _msg = self._sock.recv_multipart()
            if self._payload is not None:
                ts = msgspec.msgpack.encode(time.perf_counter())
                self._sock.send_multipart([identity, b"", self._payload, ts])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)
        self._ctx.term()


def fetch_payload(port: int) -> bytes:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
    payload, _ts = sock.recv_multipart()
    sock.close(0)
    ctx.term()
    return payload


def test_handshake_failures_are_traced_counted_and_fail_the_request(tmp_path):
    with PushHarness.pd(workdir=str(tmp_path), tracing="memory",
                        extra_config={"handshake_timeout_ms": TIMEOUT_MS,
                                      "handshake_retries": 0}) as h:
        p = h["P"].address
        real = msgspec.msgpack.decode(fetch_payload(p["port"]), type=NixlHandshakePayload)
        forged = msgspec.msgpack.encode(NixlHandshakePayload(
            compatibility_hash="0" * len(real.compatibility_hash),
            agent_metadata_bytes=real.agent_metadata_bytes))
        silent, liar = FakeSideChannel(None), FakeSideChannel(forged)
        try:
            cases = {
                "unreachable": ({"engine_id": "ghost", "host": "127.0.0.1", "port": free_port()},
                                "metadata_fetch"),
                "timeout": ({"engine_id": "silent", "host": "127.0.0.1", "port": silent.port},
                            "metadata_fetch"),
                "compat_hash_mismatch": ({"engine_id": "forged", "host": "127.0.0.1", "port": liar.port},
                                         "metadata_decode"),
                "engine_id_mismatch": ({**p, "engine_id": "not-that-prefill"}, "metadata_decode"),
            }
            req_of = {}
            for error_type, (target, _phase) in cases.items():
                req_of[error_type] = f"req-{error_type}"
                h["D"].call("register", req_of[error_type], h["D"].allocate(1), target,
                            f"p-{error_type}", False)
            results = h.wait_for("D", lambda r: set(req_of.values()) <= set(r["failed_recving"]),
                                 command="results", timeout_s=30)
            assert set(req_of.values()) <= set(results["finished_recving"])
            # One failure record per case, plus the D->P handshake of the two pushes below.
            stats = drain_stats(h, "D", has_handshakes(len(cases)))
            spans = h["D"].call("spans")
            fe = h.frontend("D")
            fe.observe(stats)
            # The engine is still healthy: real pushes go through afterwards.
            after = h.push(2)
            assert after.ok, after
        finally:
            silent.close()
            liar.close()

    failed = [x for x in handshakes(stats) if x["outcome"] == "failure"]
    assert sorted((x["error_type"], x["failed_phase"]) for x in failed) == sorted(
        (e, phase) for e, (_t, phase) in cases.items())
    for error_type, (target, phase) in cases.items():
        assert fe.sample("vllm:nixl_handshake_phase_failures_total",
                         {"direction": "d_to_p", "phase": phase, "error_type": error_type}) == 1
        [hs] = [s for s in spans if s["name"] == SPAN_HANDSHAKE
                and s["attributes"][Attr.REMOTE_ENGINE_ID] == target["engine_id"]]
        assert hs["status"] == "ERROR" and hs["attributes"][Attr.ERROR_TYPE] == error_type
        assert hs["attributes"][Attr.OUTCOME] == "failure"
        assert hs["attributes"][Attr.NOTIF_AGENTS_ONLY] is True
        last = max((s for s in spans if s["parent_span_id"] == hs["span_id"]), key=lambda s: s["start"])
        assert last["name"] == f"nixl.handshake.{phase}" and last["status"] == "ERROR"
        [rcv] = [s for s in spans if s["name"] == SPAN_PUSH_RECEIVE
                 and s["attributes"][Attr.REQUEST_ID] == req_of[error_type]]
        assert rcv["status"] == "ERROR"
    assert fe.sample("vllm:nixl_handshakes_total", {"direction": "d_to_p", "trigger": "push_reg",
                                                    "notif_agents_only": "true",
                                                    "outcome": "failure"}) == 4
    # vLLM's stock counter sees them too (handshake failures are transfer failures there).
    assert fe.sample("vllm:nixl_num_failed_transfers_total") == 4
    # The timeouts used the configured bound (no 5 s stock default): the errors say so.
    timed = [s for s in spans if s["name"] == SPAN_HANDSHAKE
             and s["attributes"].get(Attr.ERROR_TYPE) in ("timeout", "unreachable")]
    assert len(timed) == 2
    assert all(f"within {TIMEOUT_MS} ms" in s["status_description"] for s in timed), timed


def test_unreachable_message_says_what_to_check(tmp_path):
    from connector.glue.side_channel import SideChannelClient
    from connector.telemetry.record import HandshakeError

    with SideChannelClient("127.0.0.1", free_port(), timeout_ms=300) as channel, \
            pytest.raises(HandshakeError) as info:
        channel.fetch(0, 0)
    assert info.value.error_type == "unreachable"
    assert "VLLM_NIXL_SIDE_CHANNEL_HOST/PORT" in str(info.value)
