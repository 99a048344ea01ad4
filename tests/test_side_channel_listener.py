"""vLLM's side-channel listener, stock and supervised by the fork, on real ZMQ sockets.

The listener is the metadata server every D->P and P->D handshake talks to. Stock,
one bad request ends its thread and the port goes dark for good; a port it cannot
bind leaves the scheduler waiting forever. The fork runs the same listener under
`connector.glue.listener.supervise`.
"""

from __future__ import annotations

import socket
import threading

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    GET_META_MSG,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
    NixlPushConnectorScheduler,
)

from connector.glue import listener
from connector.glue.connector import NixlPushConnector
from connector.glue.scheduler import ObservedPushScheduler
from connector.glue.side_channel import SideChannelClient
from connector.telemetry.stats import ObservedNixlStats
from harness.poll import wait_until
from harness.ports import free_port
from tests.test_stats_and_prometheus import frontend

HOST = "127.0.0.1"
PAYLOADS = {(0, 0): b"rank-0-payload"}
DEADLINE_S = 30.0

# Requests a peer (or a port scanner) can send that vLLM's listener does not survive.
BAD_REQUESTS: list[tuple[list[bytes], str]] = [
    ([b"", b"not msgpack \xc1"], "malformed"),  # 0xc1 is never valid msgpack
    ([b"one frame only"], "malformed"),  # REQ framing missing
    ([b"", msgspec.msgpack.encode(42)], "malformed"),  # not a 3-tuple
    ([b"", msgspec.msgpack.encode((GET_META_MSG, 0, 7))], "unknown_rank"),
]


def send_frames(host: str, port: int, frames: list[bytes]) -> None:
    """Frames as a ZMQ peer sends them (a DEALER: no REQ envelope added)."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart(frames)
        sock.close(linger=2000)  # delivered before the context goes
    finally:
        ctx.term()


class Listener:
    """One listener thread (stock or supervised) on a fresh port."""

    def __init__(self, cls: type):
        self.port = free_port()
        self.ready, self.stop = threading.Event(), threading.Event()
        owner = cls.__new__(cls)  # (only the listener: ours reads whether a secret is set)
        owner._peer_secret = None
        self.thread = threading.Thread(target=owner._nixl_handshake_listener, daemon=True,
                                       args=(PAYLOADS, self.ready, self.stop, HOST, self.port))
        self.thread.start()
        assert self.ready.wait(DEADLINE_S)

    def fetch(self, timeout_ms: int = 5000) -> bytes:
        with SideChannelClient(HOST, self.port, timeout_ms) as client:
            return client.fetch(0, 0).payload

    def send_raw(self, frames: list[bytes]) -> None:
        send_frames(HOST, self.port, frames)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(DEADLINE_S)


@pytest.fixture(autouse=True)
def _fresh_counts():
    listener.drain_rejected()
    yield
    listener.drain_rejected()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize(("frames", "reason"), BAD_REQUESTS, ids=[r for _, r in BAD_REQUESTS])
def test_stock_listener_dies_on_one_bad_request(frames, reason):
    """Upstream behaviour, kept as a check that the bug the fork works around is real."""
    stock = Listener(NixlPushConnectorScheduler)
    try:
        assert stock.fetch() == PAYLOADS[(0, 0)]
        stock.send_raw(frames)
        wait_until(lambda: not stock.thread.is_alive(), "the stock listener thread to end", DEADLINE_S)
        with pytest.raises(Exception, match=r"unreachable|did not answer"):
            stock.fetch(timeout_ms=500)
    finally:
        stock.close()


def test_supervised_listener_counts_each_bad_request_and_keeps_serving():
    ours = Listener(ObservedPushScheduler)
    try:
        expected: dict[str, int] = {}
        counted: dict[str, int] = {}

        def all_counted() -> bool:
            for k, n in listener.drain_rejected().items():
                counted[k] = counted.get(k, 0) + n
            return counted == expected

        for frames, reason in BAD_REQUESTS:
            ours.send_raw(frames)
            expected[reason] = expected.get(reason, 0) + 1
            # Counted means the old socket is gone; a request sent before that could be
            # lost with it (a real handshake retries), one sent now reaches the new one.
            wait_until(all_counted, f"rejections {expected}", DEADLINE_S, last=lambda: counted)
            assert ours.fetch() == PAYLOADS[(0, 0)]  # serving again, on the same port
        assert ours.thread.is_alive()
    finally:
        ours.close()
    assert not ours.thread.is_alive()  # stop_event still ends it


def test_port_in_use_fails_start_up_with_the_port_named_instead_of_waiting_forever():
    port = free_port()
    holder = socket.socket()
    holder.bind((HOST, port))
    holder.listen()
    sched = ObservedPushScheduler.__new__(ObservedPushScheduler)  # only the listener's fields
    sched._nixl_handshake_listener_t = None
    sched._peer_secret = None
    sched._stop_event = threading.Event()
    sched.side_channel_host, sched.side_channel_port = HOST, port
    sched._handshake_data, sched._registration_generation = {}, 0  # read by vLLM 0.33
    payload = NixlHandshakePayload(compatibility_hash="h", agent_metadata_bytes=b"m")
    result: dict[str, BaseException] = {}

    def start() -> None:
        try:
            sched.set_xfer_handshake_metadata({(0, 0): payload})
        except BaseException as exc:
            result["exc"] = exc

    t = threading.Thread(target=start, daemon=True)
    try:
        t.start()
        t.join(DEADLINE_S)
        assert not t.is_alive(), "set_xfer_handshake_metadata still waiting for the listener"
        exc = result.get("exc")
        assert isinstance(exc, listener.SideChannelBindError)
        assert f"{HOST}:{port}" in str(exc) and "VLLM_NIXL_SIDE_CHANNEL_PORT" in str(exc)
        assert sched._nixl_handshake_listener_t is None  # a retry may start it again
    finally:
        holder.close()
        sched._stop_event.set()


def test_rejections_reach_metrics_from_the_scheduler_process():
    """The scheduler role's stats carry the drained counts; the frontend exports them."""
    kinds = [listener.classify(ValueError("x")), listener.classify(KeyError((0, 7)))]
    for kind in kinds:
        listener.note_rejected(kind, ValueError("x"), 1)
    sched_side = NixlPushConnector.__new__(NixlPushConnector)
    sched_side.connector_worker = None
    stats = sched_side.get_kv_connector_stats()
    assert isinstance(stats, ObservedNixlStats) and not stats.is_empty()
    assert sched_side.get_kv_connector_stats() is None  # drained: nothing twice
    fe = frontend()
    fe.observe([stats.to_dict()])
    for reason in ("malformed", "unknown_rank"):
        assert fe.sample("vllm:nixl_side_channel_rejected_total", {"reason": reason}) == 1
