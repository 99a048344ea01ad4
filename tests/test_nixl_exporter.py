"""NIXL's own exporter beside ours: the start-up check of its environment (against real
NIXL agents), the agent info metric that joins its series to an engine, and how a
worker names its agent. The witness itself runs on real `vllm serve` in test_e2e_serve.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from connector.glue.connector import ConnectorConfigError, check_nixl_env
from connector.glue.nixl_telemetry import NixlTelemetryEnvError, check_nixl_telemetry_env
from connector.glue.worker import AGENT_NAMED_EVERY_S, ObservedPushWorker
from connector.telemetry.stats import ObservedNixlStats
from connector.vocabulary import MAX_NIXL_AGENTS, NIXL_AGENT_INFO, StatKey
from demo import report
from demo.engines import nixl_exporter_env
from harness.poll import wait_until
from harness.ports import free_port
from tests.test_stats_and_prometheus import frontend

# One real NIXL agent, built with the environment the test gives it: did NIXL accept it?
AGENT = """
from nixl._api import nixl_agent, nixl_agent_config
try:
    nixl_agent("probe", nixl_agent_config(backends=["UCX"]))
except Exception as exc:
    print("REFUSED", exc)
else:
    print("ACCEPTED")
"""


def nixl_accepts(env: dict[str, str]) -> bool:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NIXL_TELEMETRY_")}
    out = subprocess.run([sys.executable, "-c", AGENT], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120)
    assert "ACCEPTED" in out.stdout or "REFUSED" in out.stdout, out.stdout + out.stderr
    return "ACCEPTED" in out.stdout


def enabled(**values: str) -> dict[str, str]:
    return {"NIXL_TELEMETRY_ENABLE": "y", **{f"NIXL_TELEMETRY_{k}": v for k, v in values.items()}}


# (environment, the variable our message must name): each one NIXL's constructor refuses.
REFUSED = [
    (enabled(EXPORTER="prometheus_mp"), "NIXL_TELEMETRY_MULTIPROC_DIR"),
    (enabled(EXPORTER="promethus"), "NIXL_TELEMETRY_EXPORTER"),
    (enabled(EXPORTER="prometheus", PROMETHEUS_PORT="nine"), "NIXL_TELEMETRY_PROMETHEUS_PORT"),
    (enabled(EXPORTER="prometheus", PROMETHEUS_PORT="99999"), "NIXL_TELEMETRY_PROMETHEUS_PORT"),
    (enabled(EXPORTER="prometheus", PROMETHEUS_LOCAL="maybe"), "NIXL_TELEMETRY_PROMETHEUS_LOCAL"),
    (enabled(EXPORTER="prometheus", HISTOGRAM_BUCKETS_US="100,10"), "NIXL_TELEMETRY_HISTOGRAM_BUCKETS_US"),
]


@pytest.mark.real
@pytest.mark.parametrize(("env", "variable"), REFUSED, ids=[v for _, v in REFUSED])
def test_what_nixl_refuses_stops_at_our_check_with_the_variable_named(env, variable):
    env = {**env, "NIXL_TELEMETRY_PROMETHEUS_PORT": env.get("NIXL_TELEMETRY_PROMETHEUS_PORT",
                                                              str(free_port()))}
    assert not nixl_accepts(env)  # NIXL's own verdict: the agent's constructor raises
    with pytest.raises(NixlTelemetryEnvError, match=variable):
        check_nixl_telemetry_env(env)


@pytest.mark.real
def test_the_recipes_exporter_passes_and_nixl_accepts_it(tmp_path: Path):
    env = nixl_exporter_env(free_port(), str(tmp_path / "mp"), local=True)
    found = check_nixl_telemetry_env(env, world_size=2)
    assert (found.enabled, found.exporter, found.warnings) == (True, "prometheus_mp", ())
    # The check made the directory, private to this user (NIXL would use the umask).
    assert stat.S_IMODE((tmp_path / "mp").stat().st_mode) == 0o700
    assert nixl_accepts(env)


def test_warnings_for_what_starts_but_exports_less_than_meant():
    default_port = check_nixl_telemetry_env(enabled(EXPORTER="prometheus"))
    assert [w for w in default_port.warnings if "9090" in w]
    one_rank = check_nixl_telemetry_env(enabled(EXPORTER="prometheus", PROMETHEUS_PORT="9400"), world_size=4)
    assert one_rank.warnings and "prometheus_mp" in one_rank.warnings[0]
    assert check_nixl_telemetry_env({}).enabled is False
    off = {"NIXL_TELEMETRY_ENABLE": "n", "NIXL_TELEMETRY_EXPORTER": "x"}
    assert check_nixl_telemetry_env(off).enabled is False


def test_a_multiproc_dir_that_is_a_file_is_refused(tmp_path: Path):
    (tmp_path / "f").write_text("")
    with pytest.raises(NixlTelemetryEnvError, match="not a directory"):
        check_nixl_telemetry_env(enabled(EXPORTER="prometheus_mp", MULTIPROC_DIR=str(tmp_path / "f"),
                                         PROMETHEUS_PORT="9400"))


def test_the_connector_stops_with_the_variable_named(monkeypatch: pytest.MonkeyPatch):
    from vllm.config import VllmConfig

    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    monkeypatch.setenv("NIXL_TELEMETRY_EXPORTER", "prometheus_mp")
    monkeypatch.delenv("NIXL_TELEMETRY_MULTIPROC_DIR", raising=False)
    with pytest.raises(ConnectorConfigError, match="NIXL_TELEMETRY_MULTIPROC_DIR"):
        check_nixl_env(VllmConfig())


# ---------------------------------------------------------------- the agent info metric
INFO = NIXL_AGENT_INFO.name


def agents_stats(*pairs: list) -> dict:
    data = ObservedNixlStats().to_dict()
    data[StatKey.NIXL_AGENTS] = list(pairs)
    return data


def test_each_workers_agent_becomes_one_info_series():
    fe = frontend()
    fe.observe([agents_stats([0, "agent-a"], [1, "agent-b"])])
    fe.observe([agents_stats([0, "agent-a"])])  # (named again a minute later: the same series)
    assert fe.sample(INFO, {"agent_name": "agent-a", "tp_rank": "0"}) == 1
    assert fe.sample(INFO, {"agent_name": "agent-b", "tp_rank": "1"}) == 1
    series = [s for m in fe.registry.collect() if m.name == INFO for s in m.samples]
    assert len(series) == 2 and fe.prom.dropped_records == 0


@pytest.mark.parametrize("bad", [[0, 'a"}{x'], [0, ""], [-1, "a"], [True, "a"], [0, 7], ["0", "a"]])
def test_a_malformed_agent_record_is_dropped_and_counted(bad):
    fe = frontend()
    fe.observe([agents_stats(bad)])
    assert fe.prom.dropped_records == 1
    assert not [s for m in fe.registry.collect() if m.name == INFO for s in m.samples]


def test_agent_series_stay_bounded():
    fe = frontend()
    fe.observe([agents_stats(*([i, f"agent-{i}"] for i in range(MAX_NIXL_AGENTS)))])
    fe.observe([agents_stats([0, "one-too-many"])])
    assert fe.prom.dropped_records == 1
    assert len([s for m in fe.registry.collect() if m.name == INFO for s in m.samples]) == MAX_NIXL_AGENTS


def test_a_worker_names_its_agent_on_intervals_that_ship_and_once_a_minute(monkeypatch):
    worker = ObservedPushWorker.without_engine("kv_producer")
    worker._agent_name = "agent-p0"
    now = [1000.0]
    monkeypatch.setattr("connector.glue.worker.time.monotonic", lambda: now[0])
    assert worker.get_kv_connector_stats() is None  # an idle step ships nothing, named or not
    worker.xfer_stats.record_push(StatKey.PUSHES_COMPLETED)
    first = worker.get_kv_connector_stats()
    assert first.data[StatKey.NIXL_AGENTS] == [[0, "agent-p0"]]
    now[0] += AGENT_NAMED_EVERY_S / 2
    worker.xfer_stats.record_push(StatKey.PUSHES_COMPLETED)
    assert StatKey.NIXL_AGENTS not in worker.get_kv_connector_stats().data
    now[0] += AGENT_NAMED_EVERY_S / 2
    worker.xfer_stats.record_push(StatKey.PUSHES_COMPLETED)
    assert worker.get_kv_connector_stats().data[StatKey.NIXL_AGENTS] == [[0, "agent-p0"]]


# ---------------------------------------------------------------- TP 2: every rank exported
@pytest.mark.real
def test_a_tp2_engine_exports_every_rank_through_nixls_multiprocess_plugin(tmp_path: Path):
    """P TP2 (two rank processes, real vLLM workers and NIXL agents) pushes to D TP1 with
    NIXL's exporter as the recipes run it: one endpoint shows both ranks' agents, each with
    the bytes it sent; the info metric names both with their TP ranks; and the engine's
    bytes (vLLM's, summed over its ranks as the API server does) equal NIXL's."""
    from harness.cluster import Cluster
    from harness.shapes import ShapeRunner, engine_spec

    port = free_port()
    env = nixl_exporter_env(port, str(tmp_path / "nixl-p"), local=True)
    p_spec = engine_spec("Pnixl", "kv_producer", "fork", tp=2, workdir=str(tmp_path), env=env)
    d_spec = engine_spec("Dnixl", "kv_consumer", "fork", tp=1, workdir=str(tmp_path))
    with Cluster(d_spec) as d, Cluster(p_spec) as p:
        result = ShapeRunner(requests=2).run_case(p, d)
        assert result.ok and result.bytes_ok, result.summary()
        collected = [data for rank in result.p_stats for data in rank]
        seen = [""]

        def all_writes_reported() -> bool:
            # (a WRITE's stats reach the ranks' stats a step after it completes)
            collected.extend(data for got in p.call_all("stats") for data in got)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
                seen[0] = resp.read().decode()
            nixl = sum(v for n, _, v in report.samples(seen[0]) if n == "agent_tx_bytes_total")
            return 0 < nixl == sum(sum(data.get("bytes_transferred", ())) for data in collected)

        wait_until(all_writes_reported, "every WRITE's bytes in the P ranks' stats", 60, 0.2)
        exposition = seen[0]
    fe = frontend()
    fe.observe(collected)
    info = {(s.labels["agent_name"], s.labels["tp_rank"]) for m in fe.registry.collect() if m.name == INFO
            for s in m.samples}
    assert sorted(rank for _, rank in info) == ["0", "1"]
    engine = report.samples(fe.exposition())
    witness = report.witness(engine, report.samples(exposition))
    assert set(witness.agents) == {name for name, _ in info}
    sent = {lab["agent_name"]: v for n, lab, v in report.samples(exposition) if n == "agent_tx_bytes_total"}
    assert sent.keys() == set(witness.agents) and all(v > 0 for v in sent.values()), sent
    assert witness.agrees(), witness.line("P TP2")
