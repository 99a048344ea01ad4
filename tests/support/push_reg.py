"""PUSH_REG payloads whose fate is known by construction, independently of the validator.

Each class is built so the one rule it breaks is known (`connector.vocabulary`:
`PUSH_REG_FIELDS`, `MAX_PUSH_REG_BYTES`; the order of the checks is size, msgpack, map,
fields): a proper prefix of a msgpack map cannot decode; a value that is not a map
encoded whole is `not_a_map`; a good registration minus one required field is
`missing_field`; a good registration with one required field replaced by a value of
another type (a bool is not an int; block ids are non-negative ints) is `wrong_type`;
anything over 1 MiB is `oversized`. Valid edge cases must pass. Byte-level mutants of
these are of unknown class: a test can only check that each one is either rejected or
accepted, once.

Every payload that names a request names its own, and so does every mutant of one: no
two ids are one byte-edit apart (a counter and a hash of it), so a mutant that decodes
to a valid registration never takes another payload's place among P's pending
registrations.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from connector.vocabulary import MAX_PUSH_REG_BYTES, PUSH_REG_FIELDS, PUSH_REG_TRACE_KEY, PushRegRejection

PREFIX = b"PUSH_REG:"

_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what msgpack can carry
_scalars = (st.none() | st.booleans() | _ints | st.floats() | st.text(max_size=24)
            | st.binary(max_size=24))
_maps = st.dictionaries(st.text(max_size=8), _scalars, max_size=3)
ANYTHING = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=12) | _ints, inner, max_size=4),
    max_leaves=12)

_block_id = st.integers(0, 2**64 - 1)
VALID_BLOCK_IDS = st.lists(st.lists(_block_id, max_size=8), min_size=1, max_size=3) | st.lists(
    _block_id, max_size=8)

# Values of another type than a field's (msgpack keeps int, float, bool, str, bin apart).
_NOT_STR = (st.none() | st.booleans() | _ints | st.floats() | st.binary(max_size=24)
            | st.lists(_scalars, max_size=3) | _maps)
_NOT_INT = (st.none() | st.booleans() | st.floats() | st.text(max_size=24) | st.binary(max_size=24)
            | st.lists(_scalars, max_size=3) | _maps)
_NOT_LIST = st.none() | st.booleans() | _ints | st.floats() | st.text(max_size=24) | st.binary(
    max_size=24) | _maps
_NOT_BLOCK_ID = (st.integers(-(2**63), -1) | st.booleans() | st.floats() | st.none()
                 | st.text(max_size=8) | st.binary(max_size=8) | _maps)


def _insert(items: list[Any], item: Any, at: int) -> list[Any]:
    out = list(items)
    out.insert(at % (len(out) + 1), item)
    return out


def _into_group(groups: list[list[Any]], item: Any, group: int, at: int) -> list[list[Any]]:
    out = [list(g) for g in groups]
    out[group % len(out)] = _insert(out[group % len(out)], item, at)
    return out


# Block id lists with exactly one thing that is not a block id where one must be.
_BAD_BLOCK_IDS = (
    _NOT_LIST
    # flat, with one non-block-id element
    | st.builds(_insert, st.lists(_block_id, max_size=6), _NOT_BLOCK_ID, st.integers(0, 6))
    # flat ints with a list among them (first: read as groups, whose ints are no lists)
    | st.builds(_insert, st.lists(_block_id, min_size=1, max_size=6), st.lists(_block_id, max_size=3),
                st.integers(0, 6))
    # groups, one holding a non-block-id (a list, too: ids nested three deep)
    | st.builds(_into_group, st.lists(st.lists(_block_id, max_size=4), min_size=1, max_size=3),
                _NOT_BLOCK_ID | st.lists(_block_id, max_size=2), st.integers(0, 2), st.integers(0, 4))
)
_WRONG = {name: (_BAD_BLOCK_IDS if name == "local_block_ids"
                 else _NOT_INT if int in types else _NOT_STR)
          for name, types in PUSH_REG_FIELDS.items()}


@dataclass
class Payload:
    """One PUSH_REG body and its fate: the rejection reason, or None (accepted, kept
    pending on P under `request_id`). `reg` is the map the body encodes (its first
    `cut` bytes, when cut short), for mutants to rename."""

    body: bytes
    reason: str | None
    request_id: str | None = None
    reg: dict[str, Any] | None = None
    cut: int | None = None

    @property
    def notif(self) -> bytes:
        return PREFIX + self.body


def unique_ids(tag: str) -> Iterator[str]:
    """Request ids no two of which are one byte-edit apart."""
    for n in itertools.count():
        yield f"fuzz-{tag}-{n:06d}-{hashlib.sha256(f'{tag}/{n}'.encode()).hexdigest()[:16]}"


def draw_examples(strategy: st.SearchStrategy, n: int) -> list[Any]:
    """`n` examples from a strategy (Hypothesis as the generator, deterministic; no
    shrinking: every example's expected fate is known by construction)."""
    out: list[Any] = []

    @settings(max_examples=n, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(strategy)
    def collect(example: Any) -> None:
        out.append(example)

    collect()
    return out


def good_registration(decoder: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """What a decoder's PUSH_REG holds (its request id set later), with optional extra
    keys a stock P ignores. It names the real decoder `decoder`, so P, connected to it
    already, keeps it pending and starts no handshake."""
    return st.fixed_dictionaries({
        "request_id": st.just(""),
        "decode_engine_id": st.just(decoder["engine_id"]),
        "decode_host": st.just(decoder["host"]),
        "decode_port": st.just(decoder["port"]),
        "decode_tp_size": st.just(1),
        "local_block_ids": VALID_BLOCK_IDS,
        "remote_engine_id": st.text(max_size=20),
    }, optional={PUSH_REG_TRACE_KEY: ANYTHING, "x-extra": ANYTHING})


def valid_edge_cases(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    """Registrations that must pass although they are not what vLLM usually sends."""
    base = {"request_id": "", "decode_engine_id": decoder["engine_id"], "decode_host": decoder["host"],
            "decode_port": decoder["port"], "decode_tp_size": 1, "remote_engine_id": "p"}
    ids: list[Any] = [
        [0, 1, 2, 3],  # flat block ids
        [],  # no blocks at all
        [[]], [[], [5]],  # empty groups
        list(range(5000)),  # thousands of ids, flat
        [list(range(3000)), list(range(3000, 6000))],  # and grouped
        [[2**63, 2**64 - 1]],  # the largest ids msgpack carries
    ]
    out = [{**base, "local_block_ids": b} for b in ids]
    out.append({**base, "local_block_ids": [[1]], "some": {"extra": ["keys", 1, None]}, "more": b"\x00"})
    out.append({**base, "local_block_ids": [[1]], "request_id_note": "ü" * 300})
    return out


def classes(decoder: dict[str, Any], ids: Iterator[str], n: int = 100) -> list[Payload]:
    """Payloads of every class, about `n` of each (twice that of `wrong_type`)."""
    fields = sorted(PUSH_REG_FIELDS)
    good = good_registration(decoder)
    out: list[Payload] = []

    def named(reg: dict[str, Any]) -> dict[str, Any]:
        if isinstance(reg.get("request_id"), str):
            reg = {**reg, "request_id": next(ids)}
        return reg

    for reg, frac in draw_examples(st.tuples(good, st.floats(0, 1, exclude_max=True)), n):
        reg = named(reg)
        body = msgspec.msgpack.encode(reg)
        cut = int(frac * len(body))
        out.append(Payload(body[:cut], PushRegRejection.UNDECODABLE.value, reg=reg, cut=cut))
    for value in draw_examples(_scalars | st.lists(ANYTHING, max_size=4), n):
        out.append(Payload(msgspec.msgpack.encode(value), PushRegRejection.NOT_A_MAP.value))
    for reg, field in draw_examples(st.tuples(good, st.sampled_from(fields)), n):
        reg = named({k: v for k, v in reg.items() if k != field})
        out.append(Payload(msgspec.msgpack.encode(reg), PushRegRejection.MISSING_FIELD.value, reg=reg))
    wrong = st.tuples(good, st.sampled_from(fields)).flatmap(
        lambda t: _WRONG[t[1]].map(lambda bad, t=t: {**t[0], t[1]: bad}))
    for reg in draw_examples(wrong, 2 * n):
        reg = named(reg)
        out.append(Payload(msgspec.msgpack.encode(reg), PushRegRejection.WRONG_TYPE.value, reg=reg))
    oversized = PushRegRejection.OVERSIZED.value
    big = valid_edge_cases(decoder)[0]
    many_ids = list(range(2**16, 2**16 + 400_000))  # 5 bytes each in msgpack: 2 MB
    out += [
        Payload(b"\x00" * (MAX_PUSH_REG_BYTES + 1), oversized),
        Payload(msgspec.msgpack.encode(named({**big, "padding": "x" * MAX_PUSH_REG_BYTES})), oversized),
        Payload(msgspec.msgpack.encode(named({**big, "local_block_ids": many_ids})), oversized),
    ]
    for reg in valid_edge_cases(decoder) + draw_examples(good, n // 2):
        reg = named(reg)
        out.append(Payload(msgspec.msgpack.encode(reg), None, reg["request_id"], reg=reg))
    return out


def mutants(payloads: list[Payload], ids: Iterator[str], per_payload: int = 4) -> list[bytes]:
    """Byte-level variants (a flipped bit, cut short, garbage appended, a byte dropped)
    of payloads under 1 MiB, deterministic per payload. Each variant of a payload that
    names a request starts from a copy renamed with a fresh id."""
    out = []
    for payload in payloads:
        if len(payload.body) > MAX_PUSH_REG_BYTES:
            continue
        rnd = random.Random(payload.body)
        for i in range(per_payload):
            body = payload.body
            if payload.reg is not None and isinstance(payload.reg.get("request_id"), str):
                body = msgspec.msgpack.encode({**payload.reg, "request_id": next(ids)})[:payload.cut]
            b = bytearray(body or b"\x00")
            pos = rnd.randrange(len(b))
            if i % 4 == 0:
                b[pos] ^= 1 << rnd.randrange(8)
            elif i % 4 == 1:
                del b[pos:]
            elif i % 4 == 2:
                b += rnd.randbytes(rnd.randrange(1, 16))
            else:
                del b[pos]
            out.append(bytes(b))
    return out
