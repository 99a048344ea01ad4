"""The side-channel listener with authentication (`side_channel_secret_file` set).

vLLM's listener (`_nixl_handshake_listener`) answers every `(GET_META_MSG, pp, tp)` with
that rank's metadata and has no seam for a check, so with a secret the scheduler runs
this one instead, in our own words, under the same supervision (listener.supervise):
it binds the same ROUTER socket, answers the challenge exchange of
connector/trust/proofs.py, and sends metadata only for a valid proof of the secret,
with its own proof. A request without one gets `[REFUSED, reason]`, counted and logged
(once per peer address); a malformed one or one for a rank this engine does not have
is counted as vLLM's listener's would be (listener.note_rejected) and answered with a
refusal, and the listener keeps serving. Without a secret, vLLM's listener runs as is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.utils.network_utils import make_zmq_path

from connector.glue import listener
from connector.trust import refusals
from connector.trust.proofs import (
    CHALLENGE,
    CHALLENGE_TTL_S,
    HELLO,
    NONCE_BYTES,
    REFUSED,
    answer_proof,
    new_nonce,
    request_proof_ok,
)
from connector.trust.secret import PeerSecret
from connector.vocabulary import AuthChannel, AuthRefusal

MAX_OPEN_CHALLENGES = 1024  # challenges issued and not yet answered (the oldest are dropped)
POLL_MS = 1000  # how often the loop looks at the stop event


class Challenges:
    """Nonces issued and not yet used: each valid once, for CHALLENGE_TTL_S."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._open: dict[bytes, float] = {}
        self._clock = clock

    def issue(self) -> bytes:
        nonce = new_nonce()
        self._open[nonce] = self._clock()
        while len(self._open) > MAX_OPEN_CHALLENGES:
            self._open.pop(next(iter(self._open)))
        return nonce

    def take(self, nonce: bytes) -> bool:
        issued = self._open.pop(nonce, None)
        return issued is not None and self._clock() - issued <= CHALLENGE_TTL_S


def _proof_fields(extra: Any) -> tuple[bytes, bytes, bytes]:
    nonce_s, nonce_c, proof = extra
    if not all(isinstance(x, bytes) for x in (nonce_s, nonce_c, proof)) or \
            len(nonce_s) != NONCE_BYTES or len(nonce_c) != NONCE_BYTES:
        raise ValueError("a proof must be [nonce_s, nonce_c, mac] of bytes")
    return nonce_s, nonce_c, proof


def answer(secret: PeerSecret, challenges: Challenges, encoded_data: dict[tuple[int, int], Any],
           message: bytes, peer: str) -> list[bytes]:
    """The reply frames to one request (raises ValueError/KeyError for a malformed one or
    an unknown rank: the caller counts it)."""
    request = msgspec.msgpack.decode(message)
    if not isinstance(request, list | tuple) or len(request) not in (3, 4):
        raise ValueError(f"not a 3- or 4-element request: {type(request).__name__}")
    kind, pp_rank, tp_rank = request[0], request[1], request[2]
    if kind == HELLO and len(request) == 3:
        return [CHALLENGE, challenges.issue()]
    if kind != GET_META_MSG:
        raise ValueError(f"unknown request {kind!r}")
    if len(request) == 3:
        refusals.note(AuthChannel.SIDE_CHANNEL, AuthRefusal.NO_PROOF, peer,
                      "a metadata request without proof of the secret (stock vLLM, or a fork without "
                      "side_channel_secret_file); no metadata sent")
        return [REFUSED, AuthRefusal.NO_PROOF.value.encode()]
    nonce_s, nonce_c, proof = _proof_fields(request[3])
    if not (challenges.take(nonce_s) and request_proof_ok(secret, proof, nonce_s, nonce_c, pp_rank, tp_rank)):
        refusals.note(AuthChannel.SIDE_CHANNEL, AuthRefusal.BAD_PROOF, peer,
                      "a metadata request whose proof failed (another secret, or a replayed or stale "
                      "challenge); no metadata sent")
        return [REFUSED, AuthRefusal.BAD_PROOF.value.encode()]
    payload = encoded_data[(pp_rank, tp_rank)]
    stamp = msgspec.msgpack.encode(time.perf_counter())  # (vLLM's clock-offset echo)
    return [payload, stamp, answer_proof(secret, nonce_s, nonce_c, payload, stamp)]


def authenticated_listener(secret: PeerSecret) -> Callable[..., None]:
    """A listener with vLLM's signature `(encoded_data, ready_event, stop_event, host, port)`."""

    def serve(encoded_data: dict[tuple[int, int], Any], ready_event: Any, stop_event: Any,
              host: str, port: int) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
            sock.bind(make_zmq_path("tcp", host, port))
            ready_event.set()
            challenges = Challenges()
            while not stop_event.is_set():
                try:
                    frames = sock.recv_multipart(copy=False)
                except zmq.Again:
                    continue
                peer = frames[-1].get("Peer-Address") or "unknown address"
                try:
                    if len(frames) != 3:
                        raise ValueError(f"{len(frames)} frames")
                    reply = answer(secret, challenges, encoded_data, frames[2].bytes, peer)
                except Exception as exc:  # malformed, or a rank this engine does not have
                    reason = listener.classify(exc)
                    listener.note_rejected(reason, exc, port)
                    reply = [REFUSED, reason.value.encode()]
                sock.send_multipart([frames[0].bytes, b"", *reply])
        finally:
            sock.close(linger=0)
            ctx.term()

    return serve
