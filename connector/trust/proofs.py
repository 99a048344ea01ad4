"""What the secret changes on the wire, between two fork engines that both hold it.

The side channel (vLLM's ZMQ REQ/ROUTER exchange, one REQ socket per handshake), as a
challenge and a response, so a captured exchange cannot be replayed:
1. the client sends `(HELLO, pp_rank, tp_rank)` (vLLM's three-tuple shape: a listener
   without the secret answers it as a metadata request, which tells the client that
   peer does not authenticate; a stock listener does not die of it);
2. the listener answers `[CHALLENGE, nonce_s]` (16 random bytes, single use, valid
   CHALLENGE_TTL_S);
3. the client sends `(GET_META_MSG, pp_rank, tp_rank, [nonce_s, nonce_c, proof])`,
   proof = MAC("meta-request", nonce_s, nonce_c, pp, tp);
4. the listener checks the proof and answers `[payload, timestamp, answer]`,
   answer = MAC("meta-answer", nonce_s, nonce_c, sha256(payload), timestamp): the
   client checks it before it reads the payload. A request without a valid proof gets
   `[REFUSED, reason]` and no metadata.

NIXL notifications (PUSH_REG, heartbeats, PUSH_FAIL, KV digests, WRITE completions):
`MAGIC | len(sender) | sender | MAC("notif", sender, message) | message`, where sender
is the sending engine's id. The receiver strips it before anything else reads the
message, and drops (counts, logs) a notification without a valid one.
"""

from __future__ import annotations

import hashlib
import secrets

from connector.trust.secret import PeerSecret
from connector.vocabulary import AuthRefusal

HELLO = "nixl_push_auth_hello"
CHALLENGE = b"nixl_push_auth_challenge"
REFUSED = b"nixl_push_auth_refused"
NONCE_BYTES = 16
CHALLENGE_TTL_S = 10.0
MAC_BYTES = 32
NOTIF_MAGIC = b"NPX1:"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _ranks(pp_rank: int, tp_rank: int) -> tuple[bytes, bytes]:
    return str(pp_rank).encode(), str(tp_rank).encode()


def request_proof(secret: PeerSecret, nonce_s: bytes, nonce_c: bytes, pp_rank: int, tp_rank: int) -> bytes:
    return secret.sign(b"meta-request", nonce_s, nonce_c, *_ranks(pp_rank, tp_rank))


def request_proof_ok(secret: PeerSecret, proof: bytes, nonce_s: bytes, nonce_c: bytes, pp_rank: int,
                     tp_rank: int) -> bool:
    return secret.verify(proof, b"meta-request", nonce_s, nonce_c, *_ranks(pp_rank, tp_rank))


def _answer_parts(nonce_s: bytes, nonce_c: bytes, payload: bytes, timestamp: bytes) -> tuple[bytes, ...]:
    return b"meta-answer", nonce_s, nonce_c, hashlib.sha256(payload).digest(), timestamp


def answer_proof(secret: PeerSecret, nonce_s: bytes, nonce_c: bytes, payload: bytes,
                 timestamp: bytes) -> bytes:
    return secret.sign(*_answer_parts(nonce_s, nonce_c, payload, timestamp))


def answer_proof_ok(secret: PeerSecret, proof: bytes, nonce_s: bytes, nonce_c: bytes, payload: bytes,
                    timestamp: bytes) -> bool:
    return secret.verify(proof, *_answer_parts(nonce_s, nonce_c, payload, timestamp))


def wrap_notif(secret: PeerSecret, sender: bytes, message: bytes) -> bytes:
    """`message` as it travels between fork peers with the secret."""
    if len(sender) > 255:
        raise ValueError(f"engine id of {len(sender)} bytes: at most 255 travel with a notification")
    return NOTIF_MAGIC + bytes((len(sender),)) + sender + secret.sign(b"notif", sender, message) + message


def unwrap_notif(secret: PeerSecret, data: bytes) -> tuple[bytes | None, bytes, AuthRefusal | None]:
    """(the message, its sender's engine id, None) when the MAC holds; else (None, the
    claimed sender or b"", why)."""
    if not data.startswith(NOTIF_MAGIC) or len(data) < len(NOTIF_MAGIC) + 1:
        return None, b"", AuthRefusal.NO_PROOF
    at = len(NOTIF_MAGIC) + 1
    sender = data[at:at + data[at - 1]]
    at += len(sender)
    tag, message = data[at:at + MAC_BYTES], data[at + MAC_BYTES:]
    if len(tag) != MAC_BYTES or not secret.verify(tag, b"notif", sender, message):
        return None, sender, AuthRefusal.BAD_PROOF
    return message, sender, None
