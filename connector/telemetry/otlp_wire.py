"""OTLP trace export requests written straight to protobuf wire bytes.

Why: with tracing on, most of the CPU our spans cost was the exporter thread turning
finished spans into OTLP (`encode_spans` builds a protobuf object per span, attribute
and value: ~30 us per span of five attributes, ~80 us for a handshake span). This
module writes the same `ExportTraceServiceRequest` directly, reusing the bytes of
what repeats (attribute keys and small values, span names, the resource and the
instrumentation scope). The message is the one the SDK builds, field for field
(`tests/test_otlp_wire.py` parses both and compares); one difference in grouping:
spans are grouped by the identity of their resource and scope objects, not by
equality (an SDK provider gives all its spans the same objects, and hashing a
`Resource` serialises its attributes to JSON on every call).

Wire format: https://protobuf.dev/programming-guides/encoding/ ; message layout:
opentelemetry-proto `trace/v1/trace.proto`, `common/v1/common.proto`.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

_Q = struct.Struct("<Q").pack  # fixed64
_I = struct.Struct("<I").pack  # fixed32
_D = struct.Struct("<d").pack  # double

_SMALL = [bytes((i,)) for i in range(128)]
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_MASK64 = (1 << 64) - 1
_SCALARS = (str, bool, int, float)  # (a tuple: `str | bool | ...` builds a union per call)

# Span flags (trace.proto SpanFlags): the "is remote" bit is known, and set when it is.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200

# Reused encodings; cleared when they reach the bound (values that never repeat, such
# as request ids, would otherwise grow them without end).
_CACHE_MAX = 4096
_kv_cache: dict[tuple[str, type, Any], bytes] = {}
_text_cache: dict[tuple[bytes, str], bytes] = {}
_field_cache: dict[tuple[Any, ...], bytes] = {}  # (tag, key, [type,] value) -> whole field


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + _varint(len(payload)) + payload


def _remember(cache: dict[Any, bytes], key: Any, out: bytes) -> bytes:
    """Keep `out` under `key` in a bounded cache (cleared when full); returns `out`."""
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = out
    return out


def _text(tag: bytes, value: str) -> bytes:
    """A string field, its encoding kept when it repeats (names, keys)."""
    key = (tag, value)
    hit = _text_cache.get(key)
    if hit is not None:
        return hit
    out = _field(tag, value.encode("utf-8"))
    if len(value) <= 128:
        _remember(_text_cache, key, out)
    return out


def _any_value(value: Any) -> bytes:
    """common.proto AnyValue payload, for the value types the SDK encodes."""
    if value is None:
        return b""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, str):
        return _field(b"\x0a", value.encode("utf-8"))
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"integer attribute {value} does not fit int64")
        return b"\x18" + _varint(value & _MASK64)
    if isinstance(value, float):
        return b"\x21" + _D(value)
    if isinstance(value, bytes):
        return _field(b"\x3a", value)
    if isinstance(value, Sequence):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any_value(v)) for v in value))
    if isinstance(value, Mapping):
        return _field(b"\x32", b"".join(_field(b"\x0a", _key_value(str(k), v))
                                        for k, v in value.items()))
    raise TypeError(f"attribute value of type {type(value).__name__} cannot be encoded")


def _key_value(key: str, value: Any) -> bytes:
    """common.proto KeyValue payload."""
    cacheable = isinstance(value, _SCALARS) and (
        not isinstance(value, str) or len(value) <= 64)
    if cacheable:
        # (A float by its bytes: -0.0 == 0.0 but encodes differently.)
        ck = (key, type(value), _D(value) if type(value) is float else value)
        hit = _kv_cache.get(ck)
        if hit is not None:
            return hit
    out = (_text(b"\x0a", key) if key else b"") + _field(b"\x12", _any_value(value))
    if cacheable:
        _remember(_kv_cache, ck, out)
    return out


def _attributes(tag: bytes, attributes: Mapping[str, Any] | None,
                skipped: list[str]) -> bytes:
    """Repeated KeyValue field; a value that cannot be encoded is left out (the SDK
    does the same) and its key reported in `skipped`.

    A scalar attribute seen before (engine ids, block counts, flags) is one dict
    lookup for its whole field; a new string (a request id) is written inline, three
    concatenations instead of a call per layer of the message.
    """
    if not attributes:
        return b""
    parts = []
    cache = _field_cache
    for key, value in attributes.items():
        kind = type(value)
        if kind is str:
            ck = (tag, key, value) if len(value) <= 64 else None
            out = cache.get(ck) if ck is not None else None
            if out is None:
                raw = value.encode("utf-8")
                any_value = b"\x0a" + _varint(len(raw)) + raw
                kv = _text(b"\x0a", key) + b"\x12" + _varint(len(any_value)) + any_value
                out = tag + _varint(len(kv)) + kv
                if ck is not None:
                    _remember(cache, ck, out)
            parts.append(out)
            continue
        if kind is int or kind is bool or kind is float:
            # (A float by its bytes: -0.0 == 0.0 but encodes differently.)
            ck = (tag, key, kind, _D(value) if kind is float else value)
            out = cache.get(ck)
            if out is None:
                try:
                    out = _field(tag, _key_value(key, value))
                except (TypeError, ValueError):
                    skipped.append(key)
                    continue
                _remember(cache, ck, out)
            parts.append(out)
            continue
        try:
            parts.append(_field(tag, _key_value(key, value)))
        except (TypeError, ValueError):
            skipped.append(key)
    return b"".join(parts)


def _flags(context: Any) -> bytes:
    flags = _HAS_IS_REMOTE | (_IS_REMOTE if context is not None and context.is_remote else 0)
    return _I(flags)


def _status(status: Any) -> bytes:
    """Status payload (present on every span, empty when unset)."""
    out = b""
    if status.description:
        out += _field(b"\x12", status.description.encode("utf-8"))
    code = status.status_code.value
    if code:
        out += b"\x18" + _varint(code)
    return out


def encode_span(span: Any, skipped: list[str]) -> bytes:
    """trace.proto Span payload of one finished SDK span (a `ReadableSpan`)."""
    ctx = span.context
    parts = [b"\x0a\x10", ctx.trace_id.to_bytes(16, "big"), b"\x12\x08", ctx.span_id.to_bytes(8, "big")]
    trace_state = ctx.trace_state
    if trace_state:
        parts.append(_field(b"\x1a", ",".join(f"{k}={v}" for k, v in trace_state.items()).encode()))
    parent = span.parent
    if parent:
        parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
    if span.name:
        parts.append(_text(b"\x2a", span.name))
    parts.append(b"\x30" + _SMALL[span.kind.value + 1])
    if span.start_time:
        parts.append(b"\x39" + _Q(span.start_time))
    if span.end_time:
        parts.append(b"\x41" + _Q(span.end_time))
    parts.append(_attributes(b"\x4a", span.attributes, skipped))
    if span.dropped_attributes:
        parts.append(b"\x50" + _varint(span.dropped_attributes))
    for event in span.events:
        body = b"\x09" + _Q(event.timestamp) if event.timestamp else b""
        if event.name:
            body += _text(b"\x12", event.name)
        body += _attributes(b"\x1a", event.attributes, skipped)
        if event.dropped_attributes:
            body += b"\x20" + _varint(event.dropped_attributes)
        parts.append(_field(b"\x5a", body))
    if span.dropped_events:
        parts.append(b"\x60" + _varint(span.dropped_events))
    for link in span.links:
        lc = link.context
        body = (b"\x0a\x10" + lc.trace_id.to_bytes(16, "big") + b"\x12\x08" + lc.span_id.to_bytes(8, "big")
                + _attributes(b"\x22", link.attributes, skipped))
        if link.dropped_attributes:
            body += b"\x28" + _varint(link.dropped_attributes)
        parts.append(_field(b"\x6a", body + b"\x35" + _flags(lc)))
    if span.dropped_links:
        parts.append(b"\x70" + _varint(span.dropped_links))
    if span.status is not None:
        parts.append(_field(b"\x7a", _status(span.status)))
    parts.append(b"\x85\x01" + _flags(parent))
    return b"".join(parts)


def _resource(resource: Any, skipped: list[str]) -> bytes:
    return _attributes(b"\x0a", resource.attributes, skipped) if resource is not None else b""


def _scope(scope: Any, skipped: list[str]) -> bytes:
    if scope is None:
        return b""
    out = _text(b"\x0a", scope.name) if scope.name else b""
    if scope.version:
        out += _text(b"\x12", scope.version)
    return out + _attributes(b"\x1a", getattr(scope, "attributes", None), skipped)


def encode_request(spans: Sequence[Any], skipped: list[str] | None = None) -> bytes:
    """ExportTraceServiceRequest bytes for finished SDK spans.

    `skipped` (if given) receives the keys of attribute values that could not be
    encoded and were left out, as the SDK's encoder does.
    """
    skipped = [] if skipped is None else skipped
    # resource id -> (resource, {scope id -> (scope, [span bytes])})
    groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
    for span in spans:
        resource = span.resource
        scope = span.instrumentation_scope or None
        by_scope = groups.get(id(resource))
        if by_scope is None:
            by_scope = groups[id(resource)] = (resource, {})
        entry = by_scope[1].get(id(scope))
        if entry is None:
            entry = by_scope[1][id(scope)] = (scope, [])
        entry[1].append(encode_span(span, skipped))
    out = []
    for resource, scopes in groups.values():
        body = [_field(b"\x0a", _resource(resource, skipped))]
        for scope, encoded in scopes.values():
            scope_spans = [_field(b"\x0a", _scope(scope, skipped))]
            scope_spans.extend(_field(b"\x12", s) for s in encoded)
            if scope is not None and scope.schema_url:
                scope_spans.append(_text(b"\x1a", scope.schema_url))
            body.append(_field(b"\x12", b"".join(scope_spans)))
        if resource is not None and resource.schema_url:
            body.append(_text(b"\x1a", resource.schema_url))
        out.append(_field(b"\x0a", b"".join(body)))
    return b"".join(out)
