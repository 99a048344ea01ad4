"""One trace per request across P and D, from the traceparent each leg arrived with.

Real engines (harness: NIXL over UCX on CPU memory, ZMQ side channels), spans captured
in memory in each engine process. The harness hands the workers what our schedulers
would: D's registration with the request's W3C context, P's step metadata with P's
request context. (Stock peers with these keys: tests/test_write_span_placement.py for
the parent rule, tests/test_push_flow.py for the PUSH_REG interop.)
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from connector import vocabulary as V
from connector.vocabulary import (
    SPAN_HANDSHAKE,
    SPAN_PUSH_RECEIVE,
    SPAN_PUSH_REGISTER,
    SPAN_PUSH_WRITE,
    Attr,
    LinkRole,
    SpanEvent,
)
from harness import PushHarness
from harness.config import FORK, EngineSpec
from harness.poll import wait_until
from harness.runner import free_port

pytestmark = pytest.mark.real


def traceparent() -> tuple[str, str, dict[str, str]]:
    """A fresh (trace id, parent span id, headers) as a router would send them."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, {"traceparent": f"00-{trace_id}-{span_id}-01", "tracestate": "rt=1"}


@dataclass
class Leg:
    trace_id: str
    span_id: str
    headers: dict[str, str]


@dataclass
class Run:
    spans: dict[str, list[dict[str, Any]]]
    stats: dict[str, list[dict[str, Any]]]
    reports: dict[str, Any]
    legs: dict[str, tuple[Leg | None, Leg | None]]
    openmetrics: str

    def one(self, engine: str, name: str, **attrs: Any) -> dict[str, Any]:
        found = [s for s in self.spans[engine] if s["name"] == name
                 and all(s["attributes"].get(k) == v for k, v in attrs.items())]
        assert len(found) == 1, (engine, name, attrs, len(found))
        return found[0]


def leg(router_trace: str | None = None) -> Leg:
    trace_id, span_id, headers = traceparent()
    if router_trace is not None:  # a second leg of the same router trace
        trace_id = router_trace
        headers = {"traceparent": f"00-{trace_id}-{span_id}-01"}
    return Leg(trace_id, span_id, headers)


def _wait_stats(h: PushHarness, engines: tuple[str, ...], done: Any, timeout_s: float = 60.0
                ) -> dict[str, list[dict[str, Any]]]:
    stats: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}

    def more() -> bool:
        for e in engines:
            stats[e] += h.stats(e)
        return done(stats)

    wait_until(more, f"the stats of {', '.join(engines)} to be complete", timeout_s, interval_s=0.2,
               last=lambda: stats)
    return stats


def _records(stats: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [r for data in stats for r in data.get(key, [])]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    work = str(tmp_path_factory.mktemp("tracejoin"))
    common = dict(num_layers=2, num_blocks=64, block_size=32, tracing="memory", workdir=work)
    specs = [
        EngineSpec(name="P", engine_id="prefill-tj", kv_role="kv_producer",
                   side_channel_port=free_port(), connector=FORK, **common),
        EngineSpec(name="D", engine_id="decode-tj", kv_role="kv_consumer",
                   side_channel_port=free_port(), connector=FORK, **common),
    ]
    router = leg()
    legs: dict[str, tuple[Leg | None, Leg | None]] = {
        # name: (D leg, P leg)
        "joined": (router, leg(router.trace_id)),  # a router sent both legs its trace
        "d_only": (leg(), None),
        "p_only": (None, leg()),
        "none": (None, None),
    }
    with PushHarness(specs) as h:
        reports = {}
        # The first request has no heartbeat before it, so its PUSH_REG starts the D->P
        # handshake and its WRITE the P->D one: both must sit in its trace.
        for name in ("joined", "d_only", "p_only", "none"):
            d_leg, p_leg = legs[name]
            reports[name] = h.push(1, heartbeat=False, trace_headers=[(
                d_leg.headers if d_leg else None, p_leg.headers if p_leg else None)])
        stats = _wait_stats(h, ("P", "D"), lambda s: (
            len(_records(s["D"], V.StatKey.RECEIVES)) == 4
            and any(_records(s["P"], V.StatKey.HANDSHAKES))
            and any(_records(s["D"], V.StatKey.HANDSHAKES))))
        spans = {n: h[n].call("spans") for n in ("P", "D")}
        fe = h.frontend("D")
        fe.observe(stats["D"])
        openmetrics = fe.exposition(openmetrics=True)
    return Run(spans, stats, reports, legs, openmetrics)


def ids(run: Run, name: str) -> tuple[str, str]:
    """(P request id, D request id) of one scenario's single request."""
    [(p_id, d_id)] = run.reports[name].pairs
    return p_id, d_id


def test_every_push_landed(run: Run) -> None:
    for name, report in run.reports.items():
        assert report.ok, (name, report)


def test_receive_and_register_sit_under_the_requests_traceparent(run: Run) -> None:
    d_leg, p_leg = run.legs["joined"]
    p_id, d_id = ids(run, "joined")
    rcv = run.one("D", SPAN_PUSH_RECEIVE, **{Attr.REQUEST_ID: d_id})
    reg = run.one("D", SPAN_PUSH_REGISTER, **{Attr.REQUEST_ID: d_id})
    wr = run.one("P", SPAN_PUSH_WRITE, **{Attr.REQUEST_ID: p_id})
    assert rcv["trace_id"] == reg["trace_id"] == wr["trace_id"] == d_leg.trace_id
    assert rcv["parent_span_id"] == d_leg.span_id  # the router's span
    assert reg["parent_span_id"] == rcv["span_id"]
    assert wr["parent_span_id"] == reg["span_id"]  # across engines, in the PUSH_REG payload
    # P's own request context is a link (same trace here: the router sent both legs).
    assert wr["links"] == [{"trace_id": p_leg.trace_id, "span_id": p_leg.span_id,
                            "attributes": {Attr.LINK_ROLE: LinkRole.PREFILL_REQUEST.value}}]


def test_the_spans_carry_the_ttft_stage_boundaries(run: Run) -> None:
    """One trace shows the split the stage histograms count: D's receive span its wait since
    the request arrived; P's write span when the prefill finished and when its WRITE was
    posted, at their times, and the wait between them."""
    p_id, d_id = ids(run, "joined")
    rcv = run.one("D", SPAN_PUSH_RECEIVE, **{Attr.REQUEST_ID: d_id})
    wr = run.one("P", SPAN_PUSH_WRITE, **{Attr.REQUEST_ID: p_id})
    # The wait since arrival covers the whole receive span (the registration came later).
    assert rcv["attributes"][Attr.KV_WAIT] >= (rcv["end"] - rcv["start"]) / 1e9 - 0.005
    times = wr["event_times"]
    done, posted = times[SpanEvent.PREFILL_DONE], times[SpanEvent.WRITE_POSTED]
    assert done <= posted <= wr["end"] and wr["start"] <= posted
    assert wr["attributes"][Attr.WRITE_WAIT] == pytest.approx((posted - done) / 1e9, abs=2e-6)


def test_handshakes_a_request_started_sit_in_its_trace(run: Run) -> None:
    d_leg, _ = run.legs["joined"]
    p_id, d_id = ids(run, "joined")
    reg = run.one("D", SPAN_PUSH_REGISTER, **{Attr.REQUEST_ID: d_id})
    wr = run.one("P", SPAN_PUSH_WRITE, **{Attr.REQUEST_ID: p_id})
    d_hs = run.one("D", SPAN_HANDSHAKE, **{Attr.REMOTE_ENGINE_ID: "prefill-tj"})
    p_hs = run.one("P", SPAN_HANDSHAKE, **{Attr.REMOTE_ENGINE_ID: "decode-tj"})
    assert d_hs["attributes"][Attr.TRIGGER] == "push_reg"
    assert d_hs["attributes"][Attr.NOTIF_AGENTS_ONLY] is True
    assert (d_hs["trace_id"], d_hs["parent_span_id"]) == (d_leg.trace_id, reg["span_id"])
    # P starts it when D's PUSH_REG arrives (under D's register span) or, when P's blocks
    # were there first, at the WRITE (under the write span).
    trigger = p_hs["attributes"][Attr.TRIGGER]
    assert trigger in ("push_reg_early", "push_write")
    parent = reg["span_id"] if trigger == "push_reg_early" else wr["span_id"]
    assert (p_hs["trace_id"], p_hs["parent_span_id"]) == (d_leg.trace_id, parent)
    for hs, engine in ((d_hs, "D"), (p_hs, "P")):
        phases = [s for s in run.spans[engine] if s["parent_span_id"] == hs["span_id"]]
        assert phases and {s["trace_id"] for s in phases} == {d_leg.trace_id}


def test_without_a_traceparent_the_receive_is_a_root(run: Run) -> None:
    for name in ("none", "p_only"):
        p_id, d_id = ids(run, name)
        rcv = run.one("D", SPAN_PUSH_RECEIVE, **{Attr.REQUEST_ID: d_id})
        reg = run.one("D", SPAN_PUSH_REGISTER, **{Attr.REQUEST_ID: d_id})
        wr = run.one("P", SPAN_PUSH_WRITE, **{Attr.REQUEST_ID: p_id})
        assert rcv["parent_span_id"] is None, name
        assert reg["parent_span_id"] == rcv["span_id"] and wr["parent_span_id"] == reg["span_id"]
        assert rcv["trace_id"] == wr["trace_id"]
    # Only P's leg carried a context: the write still follows D's PUSH_REG and links P's.
    _, p_leg = run.legs["p_only"]
    p_id, _ = ids(run, "p_only")
    wr = run.one("P", SPAN_PUSH_WRITE, **{Attr.REQUEST_ID: p_id})
    assert [(x["trace_id"], x["span_id"]) for x in wr["links"]] == [(p_leg.trace_id, p_leg.span_id)]
    assert wr["trace_id"] != p_leg.trace_id
    p_id, _ = ids(run, "none")
    assert run.one("P", SPAN_PUSH_WRITE, **{Attr.REQUEST_ID: p_id})["links"] == []


def test_d_only_context_has_no_link(run: Run) -> None:
    d_leg, _ = run.legs["d_only"]
    p_id, d_id = ids(run, "d_only")
    rcv = run.one("D", SPAN_PUSH_RECEIVE, **{Attr.REQUEST_ID: d_id})
    wr = run.one("P", SPAN_PUSH_WRITE, **{Attr.REQUEST_ID: p_id})
    assert rcv["parent_span_id"] == d_leg.span_id and wr["trace_id"] == d_leg.trace_id
    assert wr["links"] == []


def test_receive_records_carry_the_receive_span_as_exemplar(run: Run) -> None:
    receives = _records(run.stats["D"], V.StatKey.RECEIVES)
    assert len(receives) == 4 and {r["outcome"] for r in receives} == {"success"}
    spans = {s["span_id"]: s for s in run.spans["D"] if s["name"] == SPAN_PUSH_RECEIVE}
    for r in receives:
        span = spans[r["span_id"]]
        assert span["trace_id"] == r["trace_id"]
        assert 0 <= r["duration"] <= (span["end"] - span["start"]) / 1e9 + 0.5
    d_leg, _ = run.legs["joined"]
    assert d_leg.trace_id in {r["trace_id"] for r in receives}


def test_handshake_records_carry_their_span_ids(run: Run) -> None:
    for engine in ("D", "P"):
        spans = {s["span_id"]: s for s in run.spans[engine]}
        for hs in _records(run.stats[engine], V.StatKey.HANDSHAKES):
            span = spans[hs["span_id"]]
            assert span["name"] == SPAN_HANDSHAKE and span["trace_id"] == hs["trace_id"]
            for phase, span_id in hs["phase_span_ids"].items():
                assert spans[span_id]["attributes"][Attr.PHASE] == phase
                assert spans[span_id]["parent_span_id"] == hs["span_id"]


def test_openmetrics_exemplars_resolve_to_d_spans(run: Run) -> None:
    traced = {s["trace_id"] for s in run.spans["D"]}
    found: dict[str, list[str]] = {}
    for family in text_string_to_metric_families(run.openmetrics):
        for sample in family.samples:
            if sample.exemplar is not None:
                found.setdefault(family.name, []).append(sample.exemplar.labels["trace_id"])
    assert set(found) == {V.RECEIVE_DURATION.name, V.KV_WAIT.name, V.HANDSHAKE_DURATION.name,
                          V.HANDSHAKE_PHASE_DURATION.name}
    for name, trace_ids in found.items():
        assert set(trace_ids) <= traced, name
