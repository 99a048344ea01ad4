"""Stats aggregation and Prometheus observation, registry-scoped (client_python style)."""

from __future__ import annotations

import copy

import pytest
from prometheus_client import CollectorRegistry
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from connector.glue.connector import NixlPushConnector
from connector.telemetry.record import HandshakeRecord
from connector.telemetry.stats import ObservedNixlStats
from connector.vocabulary import ALL_METRICS, Direction, Phase, StatKey, Trigger
from harness.frontend import Frontend


def a_record(notif_only=True, direction=Direction.D_TO_P):
    r = HandshakeRecord(direction=direction, trigger=Trigger.HEARTBEAT, notif_only=notif_only,
                        remote_engine_id="p", host="h", port=1, remote_tp_size=1, remote_pp_size=1,
                        local_tp_rank=0, submitted_ns=1_000)
    r.enter(Phase.METADATA_FETCH, now_ns=2_000)
    r.enter(Phase.AGENT_LOAD, now_ns=5_000)
    r.saved_registrations, r.saved_descriptors = 1, 256
    r.finish()
    return r


def frontend():
    kv = KVTransferConfig(kv_connector="NixlPushConnector", kv_connector_module_path="connector",
                          kv_role="kv_consumer", engine_id="d")
    return Frontend(NixlPushConnector, kv)


def test_handshake_only_interval_is_not_dropped():
    stats = ObservedNixlStats()
    assert stats.is_empty()
    stats.record_handshake(a_record())
    assert not stats.is_empty()
    old = stats.clone_and_reset()
    assert stats.is_empty() and len(old.handshakes) == 1


def test_aggregate_across_workers_and_with_stock_shaped_dicts():
    w0, w1 = ObservedNixlStats(), ObservedNixlStats()
    w0.record_handshake(a_record())
    w1.record_handshake(a_record())
    w1.record_push_reg_notif(sent=True)
    stock = NixlKVConnectorStats()
    stock.record_failed_handshake()
    merged = ObservedNixlStats(data=copy.deepcopy(w0.data)).aggregate(w1).aggregate(
        ObservedNixlStats(data=copy.deepcopy(stock.data)))
    assert len(merged.handshakes) == 2
    assert merged.data[StatKey.PUSH_REG_SENT] == [1]
    assert merged.data["num_failed_handshakes"] == [1]


def test_reduce_adds_handshake_fields_to_the_kv_transfer_log_line():
    stats = ObservedNixlStats()
    stats.record_handshake(a_record())
    out = stats.reduce()
    assert out["Num handshakes"] == 1 and out["Notif-only D->P handshakes"] == 1
    assert out["Descriptors saved"] == 256 and out["Num successful transfers"] == 0


def test_observe_into_registry_and_preexisting_zero_series():
    fe = frontend()
    # Before any stats: saved counters exist at 0 (rates are 0, not absent).
    assert fe.registry.get_sample_value(
        "vllm:nixl_descriptors_saved_total",
        {"model_name": "tiny-llama", "engine": "0", "direction": "d_to_p"}) == 0.0
    stats = ObservedNixlStats()
    stats.record_handshake(a_record())
    fe.observe([stats.to_dict()])
    assert fe.sample("vllm:nixl_descriptors_saved_total", {"direction": "d_to_p"}) == 256
    assert fe.sample("vllm:nixl_handshake_phase_duration_seconds_sum",
                     {"direction": "d_to_p", "notif_agents_only": "true",
                      "phase": "agent_load"}) == pytest.approx(a_record().phase_seconds()["agent_load"])
    names = {m.name for m in fe.registry.collect()}
    for spec in ALL_METRICS:
        assert spec.name in names


@pytest.mark.parametrize("bad", [
    {"direction": "sideways"},
    {"phases": {"lunch": 1.0}},
    {"duration": -1.0},
    {"outcome": None},
])
def test_malformed_handshake_record_is_dropped_whole_and_counted(bad):
    fe = frontend()
    good = a_record().to_stats()
    broken = {**good, **bad}
    data = ObservedNixlStats().to_dict()
    data[StatKey.HANDSHAKES] = [broken, good]
    fe.observe([data])
    assert fe.prom.dropped_records == 1
    # The good record still counted; nothing of the bad one did.
    assert fe.sample("vllm:nixl_handshakes_total", {"direction": "d_to_p", "trigger": "heartbeat",
                                                    "notif_agents_only": "true",
                                                    "outcome": "success"}) == 1
    assert fe.sample("vllm:nixl_descriptors_saved_total", {"direction": "d_to_p"}) == 256


def test_metric_classes_come_from_vllm_injection_not_the_global_registry():
    from prometheus_client import REGISTRY

    before = {m.name for m in REGISTRY.collect()}
    frontend()
    assert not any(n.startswith("vllm:nixl_handshake") for n in {m.name for m in REGISTRY.collect()} - before)
    assert isinstance(frontend().registry, CollectorRegistry)
