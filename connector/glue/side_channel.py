"""Our own-words client for vLLM's NIXL side channel (one ZMQ REQ socket per handshake).

vLLM's handshake sends `(GET_META_MSG, pp_rank, tp_rank)` to the peer's
`nixl_handshake_listener` and gets back the encoded `NixlHandshakePayload` plus the
peer's perf_counter. We do the same exchange, but tell apart "no TCP connection
could be made" (unreachable) from "connected, no answer" (timeout) by watching the
socket's connect events, and raise errors that say what to check.

With the deployment's secret (`side_channel_secret_file`), the exchange is the challenge
and response of connector/trust/proofs.py: the client proves the secret, checks the
peer's proof before it reads the metadata, and refuses (counts, logs, fails the
handshake as `unauthenticated`) a peer that does not prove it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.utils.network_utils import make_zmq_path

from connector.telemetry.record import HandshakeError
from connector.trust import refusals
from connector.trust.proofs import (
    CHALLENGE,
    HELLO,
    REFUSED,
    answer_proof_ok,
    new_nonce,
    request_proof,
)
from connector.trust.secret import PeerSecret
from connector.vocabulary import AuthChannel, AuthRefusal, ErrorType


@dataclass
class MetadataReply:
    payload: bytes
    remote_perf_counter: float
    sent_at: float
    received_at: float
    authenticated: bool = False  # both sides proved the deployment's secret

    @property
    def rtt(self) -> float:
        return self.received_at - self.sent_at

    @property
    def clock_offset(self) -> float:
        return self.remote_perf_counter - (self.sent_at + self.received_at) / 2


class SideChannelClient:
    """A REQ socket to one peer's side channel; use as a context manager."""

    def __init__(self, host: str, port: int, timeout_ms: int, secret: PeerSecret | None = None):
        self.path = make_zmq_path("tcp", host, port)
        self.secret = secret
        self.timeout_ms = timeout_ms
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        # Monitor before connecting so the CONNECTED event cannot be missed.
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._connected = False
        self._sock.connect(self.path)

    def __enter__(self) -> SideChannelClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()

    def _saw_connection(self) -> bool:
        while not self._connected and self._monitor.poll(0):
            msg = self._monitor.recv_multipart()
            event = int.from_bytes(msg[0][:2], "little")
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
        return self._connected

    def fetch(self, pp_rank: int, tp_rank: int) -> MetadataReply:
        """Ask for one rank's handshake payload (with the secret: proving it, and checking
        the peer's proof)."""
        if self.secret is not None:
            return self._fetch_authenticated(self.secret, pp_rank, tp_rank)
        sent_at = time.perf_counter()
        self._sock.send(msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank)))
        parts = self._receive(pp_rank, tp_rank)
        received_at = time.perf_counter()
        if len(parts) == 2 and parts[0] == REFUSED:
            raise HandshakeError(
                ErrorType.UNAUTHENTICATED,
                f"NIXL side channel {self.path} refused us ({parts[1].decode(errors='replace')}): it "
                "requires the deployment's secret; set side_channel_secret_file on this engine too")
        if len(parts) != 2:
            raise HandshakeError(
                ErrorType.DECODE_ERROR,
                f"NIXL side channel {self.path} sent {len(parts)} frames, expected 2",
            )
        return MetadataReply(parts[0], self._stamp(parts[1]), sent_at, received_at)

    def _fetch_authenticated(self, secret: PeerSecret, pp_rank: int, tp_rank: int) -> MetadataReply:
        self._sock.send(msgspec.msgpack.encode((HELLO, pp_rank, tp_rank)))
        parts = self._receive(pp_rank, tp_rank)
        if len(parts) != 2 or parts[0] != CHALLENGE:
            self._refuse(AuthRefusal.PEER_NOT_AUTHENTICATING,
                         "it answered without a challenge: it runs without side_channel_secret_file, or is "
                         "stock vLLM")
        nonce_s, nonce_c = parts[1], new_nonce()
        proof = request_proof(secret, nonce_s, nonce_c, pp_rank, tp_rank)
        sent_at = time.perf_counter()
        self._sock.send(msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank, [nonce_s, nonce_c, proof])))
        parts = self._receive(pp_rank, tp_rank)
        received_at = time.perf_counter()
        if len(parts) == 2 and parts[0] == REFUSED:
            raise HandshakeError(
                ErrorType.UNAUTHENTICATED,
                f"NIXL side channel {self.path} refused our proof ({parts[1].decode(errors='replace')}): "
                "the two engines hold different secrets")
        if len(parts) != 3 or not answer_proof_ok(secret, parts[2], nonce_s, nonce_c, parts[0], parts[1]):
            self._refuse(AuthRefusal.PEER_BAD_PROOF, "its answer does not prove the secret (another secret)")
        return MetadataReply(parts[0], self._stamp(parts[1]), sent_at, received_at, authenticated=True)

    def _refuse(self, reason: AuthRefusal, detail: str) -> None:
        refusals.note(AuthChannel.SIDE_CHANNEL, reason, self.path, detail + "; its metadata not used")
        raise HandshakeError(ErrorType.UNAUTHENTICATED,
                             f"NIXL side channel {self.path}: {detail}; refusing its metadata")

    def _receive(self, pp_rank: int, tp_rank: int) -> list[bytes]:
        try:
            return self._sock.recv_multipart()
        except zmq.Again as exc:
            if self._saw_connection():
                raise HandshakeError(
                    ErrorType.TIMEOUT,
                    f"NIXL side channel {self.path} accepted the connection but did not "
                    f"answer within {self.timeout_ms} ms (pp_rank={pp_rank}, "
                    f"tp_rank={tp_rank}): is the peer engine overloaded or hung?",
                ) from exc
            raise HandshakeError(
                ErrorType.UNREACHABLE,
                f"NIXL side channel {self.path} is unreachable: no TCP connection within "
                f"{self.timeout_ms} ms. Check that the peer engine is running and that "
                "remote_host/remote_port match its VLLM_NIXL_SIDE_CHANNEL_HOST/PORT.",
            ) from exc

    def _stamp(self, frame: bytes) -> float:
        try:
            return float(msgspec.msgpack.decode(frame))
        except (msgspec.DecodeError, TypeError, ValueError) as exc:
            raise HandshakeError(
                ErrorType.DECODE_ERROR, f"bad timestamp frame from {self.path}: {exc}"
            ) from exc
