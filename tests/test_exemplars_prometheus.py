"""From a latency exemplar in a real Prometheus to a trace a real OTLP receiver got.

Two harness engines export spans over OTLP/gRPC to a local receiver; their metrics
front ends serve /metrics (OpenMetrics to a scraper that asks, like vLLM's); a real
Prometheus with exemplar storage scrapes both. `/api/v1/query_exemplars` must return
trace ids of traces the receiver holds, with the span the exemplar names in it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from connector import vocabulary as V
from dashboards import promrun
from dashboards.promrun import PrometheusServer
from harness.otlp_receiver import OtlpGrpcReceiver
from harness.poll import wait_until

pytestmark = [pytest.mark.real, pytest.mark.prometheus]

N_PUSHES = 4
JOB = "vllm"


T = TypeVar("T")


def _poll(what: str, fetch: Callable[[], T], done: Callable[[T], bool], timeout_s: float = 60.0) -> T:
    """`fetch()` until `done(value)`; that value (harness.poll.wait_until raises on time-out)."""
    seen: list[T] = []

    def holds() -> tuple[T] | None:
        seen[:] = [fetch()]
        return (seen[0],) if done(seen[0]) else None

    return wait_until(holds, what, timeout_s, 0.3, last=lambda: seen[0] if seen else None)[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from harness import PushHarness

    rx = OtlpGrpcReceiver()
    try:
        tracing = {"endpoint": rx.endpoint, "protocol": "grpc"}
        with PushHarness.pd(tracing=tracing, workdir=str(tmp_path_factory.mktemp("ex"))) as h:
            fronts = {name: h.frontend(name) for name in ("P", "D")}
            try:
                instances = {name: f"127.0.0.1:{fe.serve()}" for name, fe in fronts.items()}
                with PrometheusServer([promrun.scrape_job(JOB, instances.values())],
                                      features=["exemplar-storage"],
                                      workdir=tmp_path_factory.mktemp("prometheus")) as prom:
                    prom.wait_for(f'count(up{{job="{JOB}"}} == 1)', lambda v: v == 2, what="targets up")
                    start = time.time() - 5
                    router_traces = [secrets.token_hex(16) for _ in range(N_PUSHES)]
                    headers = [{"traceparent": f"00-{t}-{secrets.token_hex(8)}-01"} for t in router_traces]
                    report = h.push(N_PUSHES, trace_headers=[(hd, hd) for hd in headers])
                    assert report.ok, report
                    stats: dict[str, list[dict[str, Any]]] = {"P": [], "D": []}

                    def drained() -> dict[str, list[dict[str, Any]]]:
                        for name in stats:
                            stats[name] += h.stats(name)
                        return stats

                    _poll("stats", drained, lambda s: (
                        sum(len(d.get(V.StatKey.RECEIVES, [])) for d in s["D"]) == N_PUSHES
                        and any(d.get(V.StatKey.HANDSHAKES) for d in s["P"])))
                    for name, fe in fronts.items():
                        fe.observe(stats[name])
                    for name in ("P", "D"):
                        h[name].call("spans")  # flush the batch span processors
                    queries = {spec.name: spec.name + "_bucket" for spec in V.EXEMPLAR_METRICS}
                    exemplars = {
                        name: _poll(f"exemplars of {name}",
                                    lambda q=q: prom.query_exemplars(q, start, time.time() + 5),
                                    lambda r: bool(r))
                        for name, q in queries.items()}
                    spans = _poll("spans at the receiver", rx.snapshot, lambda s: (
                        sum(x["name"] == V.SPAN_PUSH_RECEIVE for x in s) == N_PUSHES
                        and sum(x["name"] == V.SPAN_HANDSHAKE for x in s) >= 2))
            finally:
                for fe in fronts.values():
                    fe.close()
    finally:
        rx.close()
    return {"exemplars": exemplars, "spans": spans, "router_traces": router_traces,
            "instances": instances}


def test_prometheus_returns_exemplars_for_every_latency_histogram(run: dict[str, Any]) -> None:
    for name, series in run["exemplars"].items():
        assert series, name
        for s in series:
            assert s["seriesLabels"]["__name__"] == name + "_bucket"  # relabeled back to vllm:
            assert s["seriesLabels"]["instance"] in run["instances"].values()
            for ex in s["exemplars"]:
                assert set(ex["labels"]) == {V.EXEMPLAR_TRACE_ID, V.EXEMPLAR_SPAN_ID}
                assert float(ex["value"]) >= 0


def test_every_exemplar_resolves_to_a_received_span_of_its_kind(run: dict[str, Any]) -> None:
    by_id = {(s["trace_id"], s["span_id"]): s for s in run["spans"]}
    kinds = {V.RECEIVE_DURATION.name: {V.SPAN_PUSH_RECEIVE}, V.KV_WAIT.name: {V.SPAN_PUSH_RECEIVE},
             V.PUSH_WRITE_WAIT.name: {V.SPAN_PUSH_WRITE}, V.PUSH_WRITE_DURATION.name: {V.SPAN_PUSH_WRITE},
             V.HANDSHAKE_DURATION.name: {V.SPAN_HANDSHAKE},
             V.HANDSHAKE_PHASE_DURATION.name: {V.phase_span_name(p) for p in V.Phase}}
    for name, series in run["exemplars"].items():
        for s in series:
            for ex in s["exemplars"]:
                key = (ex["labels"][V.EXEMPLAR_TRACE_ID], ex["labels"][V.EXEMPLAR_SPAN_ID])
                assert key in by_id, (name, key)
                span = by_id[key]
                assert span["name"] in kinds[name], (name, span["name"])
                if name == V.HANDSHAKE_PHASE_DURATION.name:
                    assert span["attributes"][V.Attr.PHASE] == s["seriesLabels"]["phase"]


def test_receive_exemplars_are_the_routed_requests_traces(run: dict[str, Any]) -> None:
    traces = {ex["labels"][V.EXEMPLAR_TRACE_ID]
              for s in run["exemplars"][V.RECEIVE_DURATION.name] for ex in s["exemplars"]}
    assert traces and traces <= set(run["router_traces"])
    # Those traces hold D's receive and P's write, from the two engines' exports.
    for trace_id in traces:
        names = {(s["service"], s["name"]) for s in run["spans"] if s["trace_id"] == trace_id}
        assert ("vllm-D", V.SPAN_PUSH_RECEIVE) in names and ("vllm-P", V.SPAN_PUSH_WRITE) in names
