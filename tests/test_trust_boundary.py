"""The trust boundary: what an unauthenticated peer sends is bounded and never a label.

Peers reach us through the side channel (D -> P metadata replies) and PUSH_REG
notifications (D -> P over NIXL). Narrow tests of the bounds listed in
docs/reliability.md, "Trust boundary"; the PUSH_REG fuzz through real NIXL is elsewhere.
"""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from connector.telemetry import errors
from connector.telemetry.record import HandshakeError, HandshakeRecord
from connector.telemetry.stats import ObservedNixlStats
from connector.telemetry.tracing import SpanEmitter, extract_span
from connector.vocabulary import (
    MAX_ERROR_MESSAGE,
    MAX_PEER_STRING,
    Attr,
    Direction,
    ErrorType,
    StatKey,
    TelemetryError,
    Trigger,
)
from tests.support.telemetry import reset_telemetry_errors
from tests.test_stats_and_prometheus import frontend

HUGE = "x" * (1 << 20)  # 1 MiB: fits in a PUSH_REG, far past anything real


def hostile_record() -> HandshakeRecord:
    """A P->D handshake whose engine id and host came from a hostile PUSH_REG."""
    record = HandshakeRecord(direction=Direction.P_TO_D, trigger=Trigger.PUSH_WRITE,
                             notif_only=False, remote_engine_id="e" + HUGE, host="h" + HUGE,
                             port=1, remote_tp_size=1, remote_pp_size=1, local_tp_rank=0)
    record.finish(HandshakeError(ErrorType.ENGINE_ID_MISMATCH,
                                 f"Remote NIXL agent engine id mismatch: received {HUGE}"))
    return record


def test_handshake_error_text_is_bounded() -> None:
    exc = HandshakeError(ErrorType.COMPAT_HASH_MISMATCH, f"remote hash {HUGE}")
    assert len(str(exc)) <= MAX_ERROR_MESSAGE + 32
    assert str(exc).startswith("remote hash xxx")
    assert HandshakeError(ErrorType.TIMEOUT, "short").args[0] == "short"


def test_peer_strings_on_spans_are_bounded() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    SpanEmitter(provider.get_tracer("t")).emit_handshake(hostile_record())
    spans = exporter.get_finished_spans()
    assert spans
    for span in spans:
        for key, value in (span.attributes or {}).items():
            if isinstance(value, str):
                assert len(value) <= MAX_PEER_STRING, key
        assert len(span.status.description or "") <= 300
        for event in span.events:
            for value in (event.attributes or {}).values():
                assert len(str(value)) <= 500
    hs = next(s for s in spans if s.name == "nixl.handshake")
    assert hs.attributes[Attr.REMOTE_ENGINE_ID] == ("e" + HUGE)[:MAX_PEER_STRING]


def test_peer_trace_context_is_bounded_and_counted() -> None:
    reset_telemetry_errors()
    valid = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert extract_span({"traceparent": valid}) is not None
    assert extract_span({"traceparent": valid + HUGE}) is None
    assert extract_span({f"k{i}": "v" for i in range(100)}) is None
    assert extract_span({"traceparent": 12}) is None
    assert errors.drain()[TelemetryError.TRACE_CONTEXT.value] == 3


def test_nothing_a_peer_sends_becomes_a_label(caplog: pytest.LogCaptureFixture) -> None:
    """Every label value is checked against the closed vocabulary; peer text is dropped."""
    fe = frontend()
    stats = ObservedNixlStats()
    stats.record_handshake(hostile_record())
    data = stats.to_dict()
    # A peer-built stats record (another build, a corrupted process) with peer text in
    # every labelled field: dropped whole and counted, never exported as a label.
    data[StatKey.HANDSHAKES].append({**data[StatKey.HANDSHAKES][0], "trigger": "ghost-engine-7"})
    data[StatKey.HANDSHAKES].append({**data[StatKey.HANDSHAKES][0], "error_type": "evil.example"})
    data[StatKey.PUSH_REG_REJECTED] = ["10.0.0.66"]
    with caplog.at_level(logging.WARNING):
        fe.observe([data])
    text = fe.exposition()
    for peer in ("ghost-engine-7", "evil.example", "10.0.0.66", "xxxx"):
        assert peer not in text
    assert fe.sample("vllm:nixl_handshakes_total", {"direction": "p_to_d", "trigger": "push_write",
                                                    "notif_agents_only": "false",
                                                    "outcome": "failure"}) == 1
    assert fe.sample("vllm:nixl_telemetry_errors_total", {"reason": "malformed_record"}) == 3
    # The record's own stats summary carries no peer string at all.
    assert not any(isinstance(v, str) and len(v) > 64 for v in stats.handshakes[0].values())
