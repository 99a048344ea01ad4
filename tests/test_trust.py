"""The opt-in authentication between fork peers (connector/trust), on real ZMQ sockets:
the side channel's challenge and response against our listener and vLLM's, the MAC on
notifications, and the secret file's rotation."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

from connector.glue import listener
from connector.glue.auth_listener import authenticated_listener
from connector.glue.side_channel import SideChannelClient
from connector.telemetry.record import HandshakeError
from connector.trust import refusals
from connector.trust.proofs import HELLO, unwrap_notif, wrap_notif
from connector.trust.secret import PeerSecret, SecretFileError, load_secret
from connector.vocabulary import AuthRefusal, ErrorType
from harness.ports import free_port

KEY_A = b"a" * 32
KEY_B = b"b" * 32
PAYLOAD = b"the metadata that reads this engine's KV"


def secret_file(tmp_path: Path, *keys: bytes, name: str = "secret") -> Path:
    path = tmp_path / name
    path.write_bytes(b"\n".join(keys) + b"\n")
    return path


class Listening:
    """A listener thread on a free loopback port, stopped on exit."""

    def __init__(self, serve):
        self.port = free_port()
        self.stop, ready = threading.Event(), threading.Event()
        args = (serve, {(0, 0): PAYLOAD}, ready, self.stop, "127.0.0.1", self.port)
        self.thread = threading.Thread(target=listener.supervise, daemon=True, args=args)
        self.thread.start()
        assert ready.wait(10)

    def __enter__(self) -> Listening:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive()

    def fetch(self, secret: PeerSecret | None):
        with SideChannelClient("127.0.0.1", self.port, 5000, secret=secret) as channel:
            return channel.fetch(0, 0)


@pytest.fixture(autouse=True)
def no_refusals_left():
    refusals.drain()
    yield
    refusals.drain()


def test_peers_with_the_secret_get_the_metadata_and_prove_it_both_ways(tmp_path: Path):
    secret = PeerSecret(secret_file(tmp_path, KEY_A), 300)
    with Listening(authenticated_listener(secret)) as side:
        reply = side.fetch(PeerSecret(secret_file(tmp_path, KEY_A, name="other"), 300))
    assert reply.payload == PAYLOAD and reply.authenticated
    assert refusals.drain() == {}


@pytest.mark.parametrize(("client_keys", "reason"), [(None, AuthRefusal.NO_PROOF),
                                                     ((KEY_B,), AuthRefusal.BAD_PROOF)])
def test_a_peer_without_the_secret_gets_no_metadata_and_is_counted(tmp_path: Path, client_keys, reason):
    secret = PeerSecret(secret_file(tmp_path, KEY_A), 300)
    client = None if client_keys is None else PeerSecret(secret_file(tmp_path, *client_keys, name="c"), 300)
    with Listening(authenticated_listener(secret)) as side, pytest.raises(HandshakeError) as failed:
        side.fetch(client)
    assert failed.value.error_type is ErrorType.UNAUTHENTICATED and PAYLOAD.decode() not in str(failed.value)
    assert refusals.drain() == {f"side_channel|{reason.value}": 1}


def test_a_captured_exchange_cannot_be_replayed(tmp_path: Path):
    """The proof of one exchange, sent again (a new challenge issued meanwhile): refused."""
    secret = PeerSecret(secret_file(tmp_path, KEY_A), 300)
    with Listening(authenticated_listener(secret)) as side:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(f"tcp://127.0.0.1:{side.port}")
        try:
            from connector.trust.proofs import new_nonce, request_proof

            sock.send(msgspec.msgpack.encode((HELLO, 0, 0)))
            _, nonce_s = sock.recv_multipart()
            nonce_c = new_nonce()
            request = msgspec.msgpack.encode(
                (GET_META_MSG, 0, 0, [nonce_s, nonce_c, request_proof(secret, nonce_s, nonce_c, 0, 0)]))
            sock.send(request)
            assert sock.recv_multipart()[0] == PAYLOAD  # the genuine exchange
            sock.send(msgspec.msgpack.encode((HELLO, 0, 0)))
            sock.recv_multipart()  # (a fresh challenge, which the replay does not answer)
            sock.send(request)
            replayed = sock.recv_multipart()
        finally:
            sock.close(linger=0)
            ctx.term()
    assert PAYLOAD not in replayed
    assert refusals.drain() == {"side_channel|bad_proof": 1}


def test_a_fork_with_the_secret_refuses_a_peer_that_does_not_authenticate(tmp_path: Path):
    """vLLM's own listener answers our hello with its metadata: we do not use it."""
    secret = PeerSecret(secret_file(tmp_path, KEY_A), 300)
    with Listening(NixlPushConnectorScheduler._nixl_handshake_listener) as side:
        with pytest.raises(HandshakeError, match="without a challenge"):
            side.fetch(secret)
        assert side.fetch(None).payload == PAYLOAD  # (without the secret: today's exchange)
    assert refusals.drain() == {"side_channel|peer_not_authenticating": 1}
    assert listener.drain_rejected() == {}  # vLLM's listener did not die of the hello


def test_notifications_carry_a_mac_over_message_and_sender(tmp_path: Path):
    secret = PeerSecret(secret_file(tmp_path, KEY_A), 300)
    other = PeerSecret(secret_file(tmp_path, KEY_B, name="b"), 300)
    wrapped = wrap_notif(secret, b"decode-0", b"PUSH_REG:...")
    assert unwrap_notif(secret, wrapped) == (b"PUSH_REG:...", b"decode-0", None)
    assert unwrap_notif(secret, b"PUSH_REG:...") == (None, b"", AuthRefusal.NO_PROOF)
    assert unwrap_notif(other, wrapped)[2] is AuthRefusal.BAD_PROOF
    forged_sender = wrapped.replace(b"decode-0", b"decode-1")
    assert unwrap_notif(secret, forged_sender)[2] is AuthRefusal.BAD_PROOF
    assert unwrap_notif(secret, wrapped[:-1] + b"X")[2] is AuthRefusal.BAD_PROOF  # (content changed)


def test_rotation_accepts_the_previous_key_for_the_window_then_not(tmp_path: Path):
    now = [0.0]
    path = secret_file(tmp_path, KEY_A)
    secret = PeerSecret(path, 300, clock=lambda: now[0])
    old = PeerSecret(secret_file(tmp_path, KEY_A, name="old"), 300)
    signed_old = old.sign(b"x")
    secret_file(tmp_path, KEY_B)  # one-step rotation: the file now holds the new key only
    os.utime(path, ns=(1, 1))  # (a different stamp even within the file system's time granularity)
    now[0] += 2
    assert secret.sign(b"x") == PeerSecret(secret_file(tmp_path, KEY_B, name="new"), 0).sign(b"x")
    assert secret.verify(signed_old, b"x")  # the old key, within the window
    now[0] += 300
    assert not secret.verify(signed_old, b"x")


def test_a_proof_with_a_key_not_yet_read_reads_the_file_at_once(tmp_path: Path):
    path = secret_file(tmp_path, KEY_A)
    secret = PeerSecret(path, 300, clock=lambda: 0.0)  # (its clock never lets the check come due)
    signed_new = PeerSecret(secret_file(tmp_path, KEY_B, name="new"), 300).sign(b"x")
    secret_file(tmp_path, KEY_B)
    os.utime(path, ns=(1, 1))
    assert secret.verify(signed_new, b"x")


@pytest.mark.parametrize(("content", "problem"), [(b"", "holds no key"), (b"short\n", "shorter than 16"),
                                                  (b"# only a comment\n", "holds no key")])
def test_an_unusable_secret_file_stops_the_engine(tmp_path: Path, content: bytes, problem: str):
    (tmp_path / "s").write_bytes(content)
    with pytest.raises(SecretFileError, match=problem):
        load_secret({"side_channel_secret_file": str(tmp_path / "s")}.get)
    with pytest.raises(SecretFileError, match="cannot read"):
        load_secret({"side_channel_secret_file": str(tmp_path / "missing")}.get)
    with pytest.raises(ValueError, match="side_channel_secret_previous_s"):
        load_secret({"side_channel_secret_file": str(secret_file(tmp_path, KEY_A)),
                     "side_channel_secret_previous_s": -1}.get)
    assert load_secret({}.get) is None


def test_the_router_wraps_what_it_sends_and_drops_what_fails_before_any_owner_sees_it(tmp_path: Path):
    """A narrow unit test of the seam (the real agents are in tests/test_trust_serve.py)."""
    from connector.glue.notifications import NotifAuth, NotificationRouter, Owners

    secret = PeerSecret(secret_file(tmp_path, KEY_A), 300)
    sent: list[tuple[str, bytes]] = []
    seen: list[tuple[str, bytes]] = []
    contacts: list[str] = []

    class Agent:
        batch: dict[str, list[bytes]] = {}

        def send_notif(self, name: str, notif_msg: bytes) -> None:
            sent.append((name, notif_msg))

        def get_new_notifs(self) -> dict[str, list[bytes]]:
            return self.batch

    def noop(*_: object) -> None:
        return None

    router = NotificationRouter(Agent(), Owners(
        contact=lambda agent, _now: contacts.append(agent), heartbeat=lambda a, m: seen.append((a, m)),
        push_fail=noop, push_fail_lost=noop, completion=None, kv_digest=None, after_pass=noop, fault=noop),
        auth=NotifAuth(secret, b"decode-0"))
    router.send_notif("p-agent", notif_msg="HB:r1")
    [(name, wire)] = sent
    assert name == "p-agent" and wire != b"HB:r1" and unwrap_notif(secret, wire)[0] == b"HB:r1"
    Agent.batch = {"peer": [wire, b"HB:forged"], "outsider": [b"HB:forged"]}
    assert router.get_new_notifs() == {"peer": []}  # (heartbeats are applied, never forwarded)
    assert seen == [("peer", b"HB:r1")] and contacts == ["peer"]
    assert refusals.drain() == {"notification|no_proof": 2}
