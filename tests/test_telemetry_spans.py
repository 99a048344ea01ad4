"""Spans from a real two-process push, captured in memory (TestBase style)."""

from __future__ import annotations

import pytest

from connector.vocabulary import (
    SPAN_HANDSHAKE,
    SPAN_PUSH_RECEIVE,
    SPAN_PUSH_REGISTER,
    SPAN_PUSH_WRITE,
    Attr,
    Phase,
    Trigger,
    phase_span_name,
)

pytestmark = pytest.mark.real

NOTIF_ONLY_PHASES = [Phase.QUEUE_WAIT, Phase.METADATA_FETCH, Phase.METADATA_DECODE, Phase.AGENT_LOAD]


def by_name(spans, name):
    return [s for s in spans if s["name"] == name]


def children(spans, parent):
    return [s for s in spans if s["parent_span_id"] == parent["span_id"]]


def test_d_to_p_handshake_span_is_notification_only_with_its_phases(trio):
    spans = trio.facts["spans"]["D"]
    [hs] = by_name(spans, SPAN_HANDSHAKE)
    a = hs["attributes"]
    assert a[Attr.NOTIF_AGENTS_ONLY] is True
    assert a[Attr.DIRECTION] == "d_to_p" and a[Attr.TRIGGER] == "heartbeat"
    assert a[Attr.OUTCOME] == "success" and hs["status"] == "UNSET"
    assert a[Attr.REMOTE_ENGINE_ID] == "prefill-trio"
    assert a[Attr.SERVER_ADDRESS] == "127.0.0.1"
    assert a[Attr.SERVER_PORT] == trio.harness["P"].info["port"]
    assert a[Attr.REMOTE_TP_SIZE] == 1 and a[Attr.REMOTE_PP_SIZE] == 1 and a[Attr.LOCAL_TP_RANK] == 0
    assert a[Attr.DESCRIPTORS_REGISTERED] == 0 and a[Attr.DESCRIPTOR_REGISTRATIONS] == 0
    assert a[Attr.DESCRIPTOR_REGISTRATIONS_SAVED] == 1 and a[Attr.DESCRIPTORS_SAVED] == 256
    kids = sorted(children(spans, hs), key=lambda s: s["start"])
    assert [k["name"] for k in kids] == [phase_span_name(p) for p in NOTIF_ONLY_PHASES]
    for k in kids:
        assert k["attributes"][Attr.NOTIF_AGENTS_ONLY] is True
        assert hs["start"] <= k["start"] <= k["end"] <= hs["end"]
        assert k["trace_id"] == hs["trace_id"]


def test_p_to_d_handshake_span_is_full_with_descriptor_phases(trio):
    spans = trio.facts["spans"]["P"]
    [hs] = by_name(spans, SPAN_HANDSHAKE)
    a = hs["attributes"]
    assert a[Attr.NOTIF_AGENTS_ONLY] is False
    assert a[Attr.DIRECTION] == "p_to_d" and a[Attr.TRIGGER] in ("push_write", "push_reg_early")
    assert a[Attr.DESCRIPTOR_REGISTRATIONS] == 1 and a[Attr.DESCRIPTORS_REGISTERED] == 256
    assert a[Attr.DESCRIPTORS_SAVED] == 0
    names = {k["name"] for k in children(spans, hs)}
    # Every phase of a full handshake; `registration_wait` only when it waited for another
    # handshake's NIXL registration (connector/glue/handshakes.py).
    required = {phase_span_name(p) for p in Phase if p is not Phase.REGISTRATION_WAIT}
    assert required <= names <= required | {phase_span_name(Phase.REGISTRATION_WAIT)}, names
    assert all(k["attributes"][Attr.NOTIF_AGENTS_ONLY] is False for k in children(spans, hs))
    # Triggered by a WRITE, it sits inside that request's write span; started early by
    # D's PUSH_REG, under D's register span of that request (the PUSH_REG's context).
    if a[Attr.TRIGGER] == "push_write":
        parent = next(s for s in spans if s["span_id"] == hs["parent_span_id"])
        assert parent["name"] == SPAN_PUSH_WRITE
    else:
        parent = next(s for s in trio.facts["spans"]["D"] if s["span_id"] == hs["parent_span_id"])
        assert parent["name"] == SPAN_PUSH_REGISTER and parent["trace_id"] == hs["trace_id"]


def test_request_spans_form_one_trace_across_both_engines(trio):
    d_spans, p_spans = trio.facts["spans"]["D"], trio.facts["spans"]["P"]
    report = trio.facts["report"]
    receives = {s["attributes"][Attr.REQUEST_ID]: s for s in by_name(d_spans, SPAN_PUSH_RECEIVE)}
    registers = {s["attributes"][Attr.REQUEST_ID]: s for s in by_name(d_spans, SPAN_PUSH_REGISTER)}
    writes = {s["attributes"][Attr.REMOTE_REQUEST_ID]: s for s in by_name(p_spans, SPAN_PUSH_WRITE)}
    assert set(receives) == set(registers) == set(writes) == set(report.requests)
    for p_id, d_id in report.pairs:
        rcv, reg, wr = receives[d_id], registers[d_id], writes[d_id]
        assert rcv["parent_span_id"] is None
        assert reg["parent_span_id"] == rcv["span_id"]
        # Context crossed engines inside the PUSH_REG payload.
        assert wr["parent_span_id"] == reg["span_id"]
        assert rcv["trace_id"] == reg["trace_id"] == wr["trace_id"]
        assert wr["attributes"][Attr.REQUEST_ID] == p_id
        assert wr["service"] == "vllm-P" and rcv["service"] == "vllm-D"
        for s in (rcv, reg, wr):
            assert s["status"] != "ERROR" and s["end"] >= s["start"]
        # D's receive ends after P's write started (KV landed after the WRITE).
        assert rcv["end"] >= wr["start"]


def test_requests_that_wait_on_a_pending_handshake_say_so(trio):
    """vLLM dedups handshakes per engine: later WRITEs join the first one's handshake.

    Who started P's P->D handshake is a race: the first WRITE (its parent is that write
    span, which did not join) or, when D's PUSH_REG reached P before the prefill
    finished, that PUSH_REG (`push_reg_early`: its parent is D's register span, whose
    context the PUSH_REG carried; then no write started it and every write that began
    while it was pending joined it)."""
    p_spans, d_spans = trio.facts["spans"]["P"], trio.facts["spans"]["D"]
    writes = by_name(p_spans, SPAN_PUSH_WRITE)
    [hs] = by_name(p_spans, SPAN_HANDSHAKE)
    trigger = hs["attributes"][Attr.TRIGGER]
    if trigger == Trigger.PUSH_WRITE.value:
        [starter] = [w for w in writes if w["span_id"] == hs["parent_span_id"]]
        assert starter["trace_id"] == hs["trace_id"]
        assert "nixl.handshake.joined" not in starter["events"]
        others = [w for w in writes if w is not starter]
    else:
        assert trigger == Trigger.PUSH_REG_EARLY.value, trigger
        [register] = [s for s in d_spans if s["span_id"] == hs["parent_span_id"]]
        assert register["name"] == SPAN_PUSH_REGISTER and register["trace_id"] == hs["trace_id"]
        assert not [w for w in writes if w["span_id"] == hs["parent_span_id"]]
        others = writes
    joined = [w for w in writes if "nixl.handshake.joined" in w["events"]]
    # Every write that started while the handshake was pending joined it.
    pending = [w for w in others if w["start"] < hs["end"]]
    assert pending, "20 back-to-back requests: some must arrive during the ~10+ ms handshake"
    assert {w["span_id"] for w in joined} == {w["span_id"] for w in pending}
