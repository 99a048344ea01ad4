"""What crosses the wire between P and D besides vLLM's own messages, checked at the edge.

- PUSH_REG (D -> P, a NIXL notification; vLLM's format): decoded and validated here
  before P acts on it. A peer controls it (the side channel and NIXL notifications
  are unauthenticated), so every field P uses is type-checked and the size bounded.
- PUSH_FAIL (P -> D, ours): "the KV of your registered request will never come".
  Sent only to a decoder whose PUSH_REG lists `push_fail` under `nixl_observed_caps`;
  a stock decoder would misread an unknown notification. A stock peer ignores the
  extra PUSH_REG keys (vLLM reads the dict with `.get`).
- HB (D -> P, vLLM's): `HB:` + comma-separated request ids. A fork decoder names its
  own request ids and adds one `@<perf_counter>` entry: when it sent the heartbeat, in
  its clock (a stock prefill looks that "id" up, finds nothing, and goes on).
- Extra PUSH_REG keys of a fork decoder: the request's prompt digest and when the
  PUSH_REG was sent (see connector/state/receives.py for why P needs both).
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from collections.abc import Iterable
from typing import Annotated, Any

import msgspec

from connector.vocabulary import (
    CAP_PUSH_FAIL,
    HEARTBEAT_SENT_AT_PREFIX,
    MAX_PUSH_FAIL_BYTES,
    MAX_PUSH_REG_BYTES,
    PUSH_FAIL_NOTIF_PREFIX,
    PUSH_REG_CAPS_KEY,
    PUSH_REG_DIGEST_KEY,
    PUSH_REG_FIELDS,
    PUSH_REG_SENT_AT_KEY,
    PushFailReason,
    PushRegRejection,
)

PUSH_REG_PREFIX = b"PUSH_REG:"
HEARTBEAT_PREFIX = b"HB:"
# What a fork decoder announces in its PUSH_REG (msgpack sends the tuple as a list).
OUR_CAPS = (CAP_PUSH_FAIL,)
# (A tuple, not `list | tuple`: that builds a union object at every call.)
SEQUENCE_TYPES = (list, tuple)

# A block id as PUSH_REG must carry it: an int (not a bool), not negative. Checked by
# msgspec in C: a PUSH_REG of a long prompt names thousands of blocks.
_BLOCK_ID = Annotated[int, msgspec.Meta(ge=0)]
_FLAT_IDS = list[_BLOCK_ID]
_GROUPED_IDS = list[list[_BLOCK_ID]]
# The usual PUSH_REG (what vLLM sends: grouped block ids) passes one check in C; a
# PUSH_REG that does not fit it is looked at field by field, which names the problem.
_UsualPushReg = msgspec.defstruct("_UsualPushReg", [
    (name, _GROUPED_IDS if name == "local_block_ids" else types[0])
    for name, types in PUSH_REG_FIELDS.items()])

Problem = tuple[PushRegRejection, str]


def parse_push_reg(notif: bytes) -> tuple[dict[str, Any] | None, Problem | None]:
    """The decoded PUSH_REG, or why P must not act on it."""
    body = notif[len(PUSH_REG_PREFIX):]
    if len(body) > MAX_PUSH_REG_BYTES:
        return None, (PushRegRejection.OVERSIZED, f"{len(body)} bytes > {MAX_PUSH_REG_BYTES}")
    try:
        reg = msgspec.msgpack.decode(body)
    except Exception as exc:
        return None, (PushRegRejection.UNDECODABLE, f"{type(exc).__name__}: {str(exc)[:100]}")
    try:
        msgspec.convert(reg, _UsualPushReg)
        return reg, None
    except msgspec.ValidationError:
        return _checked_field_by_field(reg)


def _checked_field_by_field(reg: Any) -> tuple[dict[str, Any] | None, Problem | None]:
    """The same rules one field at a time: accepts flat block ids too, and names what
    is wrong with a PUSH_REG that breaks them."""
    if not isinstance(reg, dict):
        return None, (PushRegRejection.NOT_A_MAP, f"a {type(reg).__name__}")
    for name, types in PUSH_REG_FIELDS.items():
        if name not in reg:
            return None, (PushRegRejection.MISSING_FIELD, name)
        value = reg[name]
        if not isinstance(value, types) or isinstance(value, bool):
            return None, (PushRegRejection.WRONG_TYPE, f"{name} is a {type(value).__name__}")
    if not _valid_block_ids(reg["local_block_ids"]):
        return None, (PushRegRejection.WRONG_TYPE, "local_block_ids are not (lists of) block ids")
    return reg, None


def _valid_block_ids(block_ids: Any) -> bool:
    if not block_ids:
        return True
    try:
        msgspec.convert(block_ids, _GROUPED_IDS if isinstance(block_ids[0], SEQUENCE_TYPES) else _FLAT_IDS)
    except msgspec.ValidationError:
        return False
    return True


def count_blocks(block_ids: Any) -> int:
    """Blocks in a flat or per-group block id list (for a span attribute)."""
    if not block_ids:
        return 0
    if isinstance(block_ids[0], SEQUENCE_TYPES):
        return sum(map(len, block_ids))
    return len(block_ids)


def encode_push_fail(request_id: str, reason: PushFailReason) -> bytes:
    return PUSH_FAIL_NOTIF_PREFIX + msgspec.msgpack.encode({"request_id": request_id,
                                                            "reason": reason.value})


def decode_push_fail(notif: bytes) -> tuple[str, PushFailReason] | None:
    """(D's request id, reason) of a well-formed PUSH_FAIL, else None."""
    body = notif[len(PUSH_FAIL_NOTIF_PREFIX):]
    if len(body) > MAX_PUSH_FAIL_BYTES:
        return None
    try:
        msg = msgspec.msgpack.decode(body)
        return str(msg["request_id"]), PushFailReason(msg["reason"])
    except Exception:
        return None


def wants_push_fail(reg: dict[str, Any]) -> bool:
    """Whether the decoder that sent this PUSH_REG understands PUSH_FAIL."""
    caps = reg.get(PUSH_REG_CAPS_KEY)
    return isinstance(caps, SEQUENCE_TYPES) and CAP_PUSH_FAIL in caps


def heartbeat_ids(notif: bytes | str) -> list[str]:
    """The request ids a heartbeat names (empty strings and its send time dropped)."""
    return parse_heartbeat(notif)[0]


def parse_heartbeat(notif: bytes | str) -> tuple[list[str], float | None]:
    """(request ids, when the decoder sent it in its clock, if it said)."""
    text = notif.decode("utf-8", "replace") if isinstance(notif, bytes) else notif
    if text.startswith("HB:"):
        text = text[3:]
    ids, sent_at = [], None
    for rid in text.split(","):
        if not rid:
            continue
        if rid.startswith(HEARTBEAT_SENT_AT_PREFIX):
            with contextlib.suppress(ValueError):
                sent_at = float(rid[len(HEARTBEAT_SENT_AT_PREFIX):])
            continue
        ids.append(rid)
    return ids, sent_at


def sent_at_token(now: float) -> str:
    """The heartbeat entry that says when it was sent."""
    return f"{HEARTBEAT_SENT_AT_PREFIX}{now:.6f}"


def prompt_digest(token_ids: Iterable[int] | None, extra: Iterable[Any] = ()) -> str | None:
    """A short digest of a request's prompt (token ids, plus multimodal identifiers):
    the same on P and D for the same request, different for different prompts."""
    if token_ids is None:
        return None
    try:
        h = hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=12)
    except (TypeError, OverflowError):
        return None
    for item in extra:
        h.update(str(item).encode())
    return h.hexdigest()


def push_reg_digest(reg: dict[str, Any]) -> str | None:
    value = reg.get(PUSH_REG_DIGEST_KEY)
    return value if isinstance(value, str) and len(value) <= 64 else None


def push_reg_sent_at(reg: dict[str, Any]) -> float | None:
    value = reg.get(PUSH_REG_SENT_AT_KEY)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
