"""Spans leave the engines over real OTLP (P over gRPC, D over HTTP/protobuf) intact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from connector.vocabulary import (
    SPAN_HANDSHAKE,
    SPAN_PUSH_RECEIVE,
    SPAN_PUSH_REGISTER,
    SPAN_PUSH_WRITE,
    Attr,
    Phase,
    phase_span_name,
)
from harness import PushHarness
from harness.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver
from harness.poll import wait_until

pytestmark = pytest.mark.real


def wait_for_spans(receiver: Any, predicate: Callable[[list[dict]], bool], what: str,
                   timeout_s: float = 20.0) -> list[dict]:
    """The receiver's spans once `predicate` holds for them (the batch processor exports
    on its own thread, after the flush the test asked for)."""
    def arrived() -> list[dict] | None:
        spans = receiver.snapshot()
        return spans if predicate(spans) else None

    return wait_until(arrived, what, timeout_s, interval_s=0.1,
                      last=lambda: f"{len(receiver.snapshot())} spans")


def test_spans_arrive_over_otlp_grpc_and_http(tmp_path):
    grpc_rx, http_rx = OtlpGrpcReceiver(), OtlpHttpReceiver()
    try:
        with PushHarness.pd(
            workdir=str(tmp_path),
            prefill_tracing={"endpoint": grpc_rx.endpoint, "protocol": "grpc"},
            decode_tracing={"endpoint": http_rx.endpoint, "protocol": "http/protobuf"},
        ) as h:
            report = h.push(3)
            assert report.ok
            for name in ("P", "D"):
                assert h[name].call("tracer_kind") == "Tracer"  # the SDK's, on our provider
                h[name].call("spans")  # force_flush the batch processor
            p_spans = wait_for_spans(grpc_rx, lambda s: sum(x["name"] == SPAN_PUSH_WRITE for x in s) == 3,
                                     "P's 3 write spans over gRPC")
            d_spans = wait_for_spans(http_rx, lambda s: sum(x["name"] == SPAN_PUSH_RECEIVE for x in s) == 3,
                                     "D's 3 receive spans over HTTP")
    finally:
        grpc_rx.close()
        http_rx.close()

    assert {s["service"] for s in p_spans} == {"vllm-P"}
    assert {s["service"] for s in d_spans} == {"vllm-D"}
    [d_hs] = [s for s in d_spans if s["name"] == SPAN_HANDSHAKE]
    assert d_hs["kind"] == "CLIENT"
    assert d_hs["attributes"][Attr.NOTIF_AGENTS_ONLY] is True  # a bool on the wire, not a string
    assert d_hs["attributes"][Attr.DIRECTION] == "d_to_p"
    assert d_hs["attributes"][Attr.DESCRIPTORS_SAVED] == 256
    d_phases = {s["name"] for s in d_spans if s["parent_span_id"] == d_hs["span_id"]}
    assert d_phases == {phase_span_name(p) for p in
                        (Phase.QUEUE_WAIT, Phase.METADATA_FETCH, Phase.METADATA_DECODE, Phase.AGENT_LOAD)}
    [p_hs] = [s for s in p_spans if s["name"] == SPAN_HANDSHAKE]
    assert p_hs["attributes"][Attr.NOTIF_AGENTS_ONLY] is False
    # Every phase of a full handshake; `registration_wait` only when it waited for another
    # handshake's NIXL registration (connector/glue/handshakes.py).
    p_phases = {s["name"] for s in p_spans if s["parent_span_id"] == p_hs["span_id"]}
    required = {phase_span_name(p) for p in Phase if p is not Phase.REGISTRATION_WAIT}
    assert required <= p_phases <= required | {phase_span_name(Phase.REGISTRATION_WAIT)}, p_phases
    # One trace per request across the two engines and the two protocols.
    registers = {s["attributes"][Attr.REQUEST_ID]: s for s in d_spans if s["name"] == SPAN_PUSH_REGISTER}
    writes = {s["attributes"][Attr.REMOTE_REQUEST_ID]: s for s in p_spans if s["name"] == SPAN_PUSH_WRITE}
    assert set(registers) == set(writes) == set(report.requests)
    for d_id, reg in registers.items():
        assert writes[d_id]["trace_id"] == reg["trace_id"]
        assert writes[d_id]["parent_span_id"] == reg["span_id"]
