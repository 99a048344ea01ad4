"""Exemplars: trace ids ride in the stats records and show up on OpenMetrics /metrics.

Registry-scoped, like client_python's own tests: worker-side stats objects, the
API-server-side observation, and both exposition formats of prometheus_client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from vllm.config import KVTransferConfig

from connector import vocabulary as V
from connector.glue.connector import NixlPushConnector
from connector.telemetry.prometheus import ObservedPromMetrics, exemplar_of
from connector.telemetry.record import HandshakeRecord
from connector.telemetry.stats import ObservedNixlStats
from harness.frontend import Frontend

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
PHASE_SPAN = "1111222233334444"


def frontend() -> Frontend:
    kv = KVTransferConfig(kv_connector="NixlPushConnector", kv_connector_module_path="connector",
                          kv_role="kv_consumer", engine_id="d")
    return Frontend(NixlPushConnector, kv)


def traced_handshake(trace_id: str = TRACE) -> HandshakeRecord:
    r = HandshakeRecord(direction=V.Direction.D_TO_P, trigger=V.Trigger.PUSH_REG, notif_only=True,
                        remote_engine_id="p", host="h", port=1, remote_tp_size=1, remote_pp_size=1,
                        local_tp_rank=0, submitted_ns=1_000)
    r.enter(V.Phase.AGENT_LOAD, now_ns=2_000_000)
    r.finish()
    r.trace_id, r.span_id = trace_id, SPAN
    r.phase_span_ids[V.Phase.AGENT_LOAD.value] = PHASE_SPAN
    return r


def exemplars(text: str, metric: str) -> list[tuple[dict[str, str], dict[str, str], float]]:
    """(sample labels, exemplar labels, exemplar value) of every bucket that has one."""
    out = []
    for family in parse_openmetrics(text):
        if family.name != metric:
            continue
        for s in family.samples:
            if s.exemplar is not None:
                out.append((s.labels, s.exemplar.labels, s.exemplar.value))
    return out


def test_receive_histogram_by_outcome_with_exemplar_in_openmetrics():
    fe = frontend()
    stats = ObservedNixlStats()
    stats.record_receive("success", 0.042, (TRACE, SPAN))
    stats.record_receive("failure", 1.5, None)
    stats.record_receive("expired", 480.0, None)
    fe.observe([stats.to_dict()])
    name = V.RECEIVE_DURATION.name
    for outcome, total in (("success", 0.042), ("failure", 1.5), ("expired", 480.0)):
        assert fe.sample(name + "_count", {"outcome": outcome}) == 1
        assert fe.sample(name + "_sum", {"outcome": outcome}) == pytest.approx(total)
    [(labels, ex, value)] = exemplars(fe.exposition(openmetrics=True), name)
    assert ex == {"trace_id": TRACE, "span_id": SPAN}
    assert value == pytest.approx(0.042)
    assert labels["outcome"] == "success" and labels["le"] == "0.05"  # the bucket it fell in


def test_ttft_stages_observed_with_their_exemplars():
    """D's wait for KV rides in the receive record (same outcome, same span); P's two
    stages in one record per completed push (its write span)."""
    fe = frontend()
    stats = ObservedNixlStats()
    stats.record_receive("success", 0.042, (TRACE, SPAN), kv_wait=0.3)
    stats.record_receive("expired", 480.0, None, kv_wait=481.0)
    stats.record_receive("failure", 1.5, None)  # no arrival known: no wait observed
    stats.record_push_stages(0.02, 0.07, (TRACE, PHASE_SPAN))
    stats.record_push_stages(0.5, 0.001, None)
    fe.observe([stats.to_dict()])
    wait = V.KV_WAIT.name
    assert fe.sample(wait + "_count", {"outcome": "success"}) == 1
    assert fe.sample(wait + "_sum", {"outcome": "success"}) == pytest.approx(0.3)
    assert fe.sample(wait + "_sum", {"outcome": "expired"}) == pytest.approx(481.0)
    assert fe.sample(wait + "_count", {"outcome": "failure"}) == 0
    assert fe.sample(V.PUSH_WRITE_WAIT.name + "_count", {}) == 2
    assert fe.sample(V.PUSH_WRITE_WAIT.name + "_sum", {}) == pytest.approx(0.52)
    assert fe.sample(V.PUSH_WRITE_DURATION.name + "_sum", {}) == pytest.approx(0.071)
    text = fe.exposition(openmetrics=True)
    [(labels, ex, value)] = exemplars(text, wait)
    assert ex == {"trace_id": TRACE, "span_id": SPAN} and labels["le"] == "0.5" and value == 0.3
    [(labels, ex, _)] = exemplars(text, V.PUSH_WRITE_WAIT.name)
    assert ex == {"trace_id": TRACE, "span_id": PHASE_SPAN} and labels["le"] == "0.025"
    [(labels, ex, _)] = exemplars(text, V.PUSH_WRITE_DURATION.name)
    assert ex == {"trace_id": TRACE, "span_id": PHASE_SPAN} and labels["le"] == "0.1"


@pytest.mark.parametrize("record", [
    {"wait": -0.1, "write": 0.1}, {"wait": 0.1}, {"wait": "x", "write": 0.1}])
def test_a_malformed_push_stages_record_is_dropped_whole_and_counted(record):
    fe = frontend()
    stats = ObservedNixlStats()
    stats.data[V.StatKey.PUSH_STAGES] = [record, {"wait": 0.2, "write": 0.3}]
    fe.observe([stats.to_dict()])
    assert fe.sample(V.PUSH_WRITE_WAIT.name + "_count", {}) == 1  # only the good one
    assert fe.sample(V.PUSH_WRITE_DURATION.name + "_count", {}) == 1
    assert fe.sample(V.TELEMETRY_ERRORS.series_names[0], {"reason": "malformed_record"}) == 1


def test_a_negative_kv_wait_drops_its_receive_record_whole():
    fe = frontend()
    stats = ObservedNixlStats()
    stats.record_receive("success", 0.1, None, kv_wait=-1.0)
    fe.observe([stats.to_dict()])
    assert fe.sample(V.RECEIVE_DURATION.name + "_count", {"outcome": "success"}) == 0
    assert fe.sample(V.KV_WAIT.name + "_count", {"outcome": "success"}) == 0
    assert fe.sample(V.TELEMETRY_ERRORS.series_names[0], {"reason": "malformed_record"}) == 1


def test_handshake_duration_and_phase_exemplars_point_at_their_spans():
    fe = frontend()
    stats = ObservedNixlStats()
    stats.record_handshake(traced_handshake())
    fe.observe([stats.to_dict()])
    text = fe.exposition(openmetrics=True)
    [(_, ex, _)] = exemplars(text, V.HANDSHAKE_DURATION.name)
    assert ex == {"trace_id": TRACE, "span_id": SPAN}
    [(labels, ex, _)] = exemplars(text, V.HANDSHAKE_PHASE_DURATION.name)
    assert labels["phase"] == "agent_load"
    assert ex == {"trace_id": TRACE, "span_id": PHASE_SPAN}


def test_plain_text_format_still_parses_and_carries_no_exemplar():
    fe = frontend()
    stats = ObservedNixlStats()
    stats.record_handshake(traced_handshake())
    stats.record_receive("success", 0.01, (TRACE, SPAN))
    fe.observe([stats.to_dict()])
    text = fe.exposition()
    assert TRACE not in text and "# {" not in text
    families = {f.name: f for f in parse_text(text)}
    count = [s for s in families[V.RECEIVE_DURATION.name].samples
             if s.name.endswith("_count") and s.labels["outcome"] == "success"]
    assert [s.value for s in count] == [1.0]


def test_untraced_records_observe_without_exemplars():
    fe = frontend()
    stats = ObservedNixlStats()
    untraced = traced_handshake()
    untraced.trace_id = ""
    stats.record_handshake(untraced)
    stats.record_receive("success", 0.01, None)
    fe.observe([stats.to_dict()])
    text = fe.exposition(openmetrics=True)
    assert "trace_id" not in text
    assert fe.sample(V.RECEIVE_DURATION.name + "_count", {"outcome": "success"}) == 1
    assert "trace_id" not in json.dumps(untraced.to_stats())


@pytest.mark.parametrize("trace_id, span_id, expected", [
    (TRACE, SPAN, {"trace_id": TRACE, "span_id": SPAN}),
    (TRACE, None, {"trace_id": TRACE}),
    (TRACE, "xyz", {"trace_id": TRACE}),
    ("0" * 32, SPAN, None),  # the invalid all-zero id
    (TRACE.upper(), SPAN, None),
    (TRACE + "00", SPAN, None),
    (None, SPAN, None),
    (12, SPAN, None),
])
def test_exemplar_labels_are_validated_before_observing(trace_id, span_id, expected):
    assert exemplar_of(trace_id, span_id) == expected


def test_bad_ids_never_half_observe_a_record():
    fe = frontend()
    data = ObservedNixlStats().to_dict()
    data[V.StatKey.RECEIVES] = [
        {"outcome": "success", "duration": 0.2, "trace_id": "not-hex" * 10, "span_id": SPAN},
        {"outcome": "sideways", "duration": 0.2, "trace_id": TRACE},
        {"outcome": "success", "duration": -1.0},
    ]
    fe.observe([data])
    assert fe.prom.dropped_records == 2
    assert fe.sample(V.RECEIVE_DURATION.name + "_count", {"outcome": "success"}) == 1
    assert "trace_id" not in fe.exposition(openmetrics=True)


def test_metric_classes_without_exemplar_support_just_observe():
    """Ray's wrappers (vLLM's metric_types under Ray) take `observe(value)` only."""
    observed: list[float] = []

    class ValueOnly:
        def __init__(self, *args, **kwargs):
            pass

        def labels(self, *values):
            return self

        def inc(self, value=1.0):
            pass

        def set(self, value):
            pass

        def observe(self, value):
            observed.append(value)

    from prometheus_client import Counter, Gauge, Histogram

    kv = KVTransferConfig(kv_connector="NixlPushConnector", kv_connector_module_path="connector",
                          kv_role="kv_consumer", engine_id="d")
    prom = ObservedPromMetrics(type("Cfg", (), {"kv_transfer_config": kv})(),
                               {Counter: ValueOnly, Gauge: ValueOnly, Histogram: ValueOnly},
                               ["model_name", "engine"], {0: ["m", "0"]})
    stats = ObservedNixlStats()
    stats.record_receive("success", 0.3, (TRACE, SPAN))
    stats.record_handshake(traced_handshake())
    prom.observe(stats.to_dict(), 0)
    assert prom.dropped_records == 0
    assert 0.3 in observed and len(observed) >= 3


_MULTIPROC = """
import json, sys
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import ALLOWUTF8, generate_latest
from vllm.config import KVTransferConfig
from connector.telemetry.prometheus import ObservedPromMetrics
from connector.telemetry.stats import ObservedNixlStats
kv = KVTransferConfig(kv_connector="NixlPushConnector", kv_connector_module_path="connector",
                      kv_role="kv_consumer", engine_id="d")
prom = ObservedPromMetrics(type("Cfg", (), {"kv_transfer_config": kv})(),
                           {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                           ["model_name", "engine"], {0: ["m", "0"]})
stats = ObservedNixlStats()
stats.record_receive("success", 0.3, (sys.argv[1], sys.argv[2]))
prom.observe(stats.to_dict(), 0)
registry = CollectorRegistry()
MultiProcessCollector(registry)
text = generate_latest(registry, escaping=ALLOWUTF8).decode()
print(json.dumps({"dropped": prom.dropped_records, "text": text}))
"""


def test_multiprocess_mode_degrades_silently(tmp_path):
    """vLLM's --api-server-count > 1 uses prometheus_client's multiprocess mode: no exemplars."""
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _MULTIPROC, TRACE, SPAN], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["dropped"] == 0
    text = out["text"]
    count = [s for f in parse_openmetrics(text) if f.name == V.RECEIVE_DURATION.name
             for s in f.samples if s.name.endswith("_count") and s.labels.get("outcome") == "success"]
    assert [s.value for s in count] == [1.0]
    assert TRACE not in text
