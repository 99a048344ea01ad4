"""The KV digest notification (P -> D), checked at the edge like every peer message.

A fork prefill sends one to each decoder rank it WRITEs a sampled request to, before
that WRITE is posted: `KV_DIGEST_NOTIF_PREFIX` + msgpack of `KvDigestNotif`. A peer
controls it (NIXL notifications are unauthenticated): the size is bounded and every
field typed by msgspec before the decoder keeps it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from connector.vocabulary import KV_DIGEST_NOTIF_PREFIX, MAX_KV_DIGEST_BYTES, MAX_PEER_STRING

_INDEX = Annotated[int, msgspec.Meta(ge=0, lt=1 << 20)]


class KvDigestNotif(msgspec.Struct, frozen=True):
    """What one P rank's WRITE to one D rank carried.

    `request_id`: D's request id (the completion notification's id). `sender`: the P
    rank (pp rank x tp size + tp rank), so a digest sent twice replaces itself instead
    of adding up. `layers`/`values`: per global layer index, the digest of the heads
    this WRITE carries. `tokens`: how many token positions it covers. `writers`: how
many P ranks send this D rank a part of the same layers (P TP2 -> D TP1: 2), so that
D knows when it has them all. `skip`: set
    instead of a digest when P could not compute one (a KvVerifySkip value). `version`:
    the digest version it was computed with."""

    request_id: Annotated[str, msgspec.Meta(max_length=MAX_PEER_STRING)]
    sender: _INDEX
    layers: list[_INDEX] = []
    values: list[int] = []  # unsigned 64-bit (checked after decoding: msgspec bounds stop at int64)
    tokens: _INDEX = 0
    writers: _INDEX = 1  # P ranks whose WRITEs carry this D rank's heads of these layers
    skip: Annotated[str, msgspec.Meta(max_length=64)] = ""
    # The digest's definition (connector/integrity/digest.py); an older fork sends none
    # (and its decoder ignores this field).
    version: _INDEX = 1


def encode_kv_digest(notif: KvDigestNotif) -> bytes:
    return KV_DIGEST_NOTIF_PREFIX + msgspec.msgpack.encode(notif)


def decode_kv_digest(message: bytes) -> KvDigestNotif:
    """The notification, or ValueError naming what is wrong with it."""
    body = message[len(KV_DIGEST_NOTIF_PREFIX):]
    if len(body) > MAX_KV_DIGEST_BYTES:
        raise ValueError(f"KV digest notification of {len(body)} bytes > {MAX_KV_DIGEST_BYTES}")
    try:
        notif = msgspec.msgpack.decode(body, type=KvDigestNotif)
    except msgspec.DecodeError as exc:
        raise ValueError(f"undecodable KV digest notification: {str(exc)[:120]}") from None
    if len(notif.layers) != len(notif.values):
        raise ValueError(f"KV digest names {len(notif.layers)} layers but has {len(notif.values)} values")
    if any(not 0 <= v < 1 << 64 for v in notif.values):
        raise ValueError("KV digest value outside 0..2^64-1")
    return notif
