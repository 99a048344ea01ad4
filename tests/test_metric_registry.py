"""The connector's metrics under vLLM's real registry life cycle.

Each scenario runs vLLM's real `PrometheusStatLogger` / `KVConnectorProm` (which
call our `build_prom_metrics`) in a fresh API-server-like subprocess
(`tests/registry_api_server.py`) and compares the exposition with the ground truth
of what was observed:
- rebuilt in one process, the way vLLM rebuilds its loggers (`unregister_vllm_metrics`
  first, then everything registered again);
- built again without unregistering (a second `KVConnectorProm` in the process),
  which used to crash on the duplicate registration;
- Prometheus multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` set before
  prometheus_client is imported, as vLLM does for several API servers): two API
  server processes write, the parent collects with prometheus_client's
  `MultiProcessCollector`; counters add up across processes and the in-flight
  gauges show the most recent engine-level value, without a `pid` label.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from connector.vocabulary import StatKey

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "registry_api_server.py"
HS_LABELS = {"direction": "d_to_p", "trigger": "heartbeat", "notif_agents_only": "true",
             "outcome": "success"}


def batch(k: int, in_flight: list[float] | None = None) -> dict[str, Any]:
    """A worker stats dict with k handshakes, k completed pushes and k transfers."""
    from connector.telemetry.stats import ObservedNixlStats

    data = ObservedNixlStats().data
    data = {key: list(v) for key, v in data.items()}
    data[StatKey.HANDSHAKES] = [{
        "direction": "d_to_p", "trigger": "heartbeat", "notif_only": True, "upgrade": False,
        "attempt": 1, "outcome": "success", "error_type": None, "failed_phase": None,
        "duration": 0.01, "phases": {"metadata_fetch": 0.004}, "registrations": {},
        "descriptors": {}, "saved_registrations": 1, "saved_descriptors": 64,
    } for _ in range(k)]
    data[StatKey.PUSHES_COMPLETED] = [1] * k
    data["transfer_duration"] = [0.001] * k
    data["post_duration"] = [0.0001] * k
    data["bytes_transferred"] = [4096] * k
    data["num_descriptors"] = [2] * k
    if in_flight is not None:
        data[StatKey.IN_FLIGHT] = [{"d_to_p|true": in_flight}]
    return data


def run_api_server(plan: list[Any], tmp: Path, multiproc_dir: Path | None = None) -> subprocess.Popen:
    plan_file = tmp / f"plan-{len(list(tmp.iterdir()))}.json"
    plan_file.write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if multiproc_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    log = open(tmp / f"{plan_file.stem}.log", "w")  # noqa: SIM115 - closed by the process end
    return subprocess.Popen([sys.executable, str(SCRIPT), str(plan_file)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=log, text=True)


def finish(proc: subprocess.Popen, timeout_s: float = 900) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"API-server process failed (exit {proc.returncode}); see its log"
    return out.split("===EXPOSITION===\n", 1)[1]


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value)
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    found = [v for n, lab, v in samples(text)
             if n == name and all(lab.get(k) == x for k, x in (labels or {}).items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def assert_no_duplicate_series(text: str) -> None:
    keys = [(n, tuple(sorted(lab.items()))) for n, lab, _ in samples(text) if n.startswith("vllm:nixl")]
    assert keys, "no NIXL series exported"
    assert len(keys) == len(set(keys))


# Rebuild the way vLLM does, then a second KVConnectorProm without unregistering.
PLAN = [
    ["logger", "L1"], ["observe", "L1", batch(1)],
    ["logger", "L2"], ["observe", "L2", batch(2)],
    ["kv_prom", "K3"], ["observe", "K3", batch(4)],
    ["observe", "L2", batch(8, in_flight=[2, 5.0])],
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("registry")
    mp_dir = tmp / "multiproc"
    mp_dir.mkdir()
    single = run_api_server(PLAN, tmp)
    first = run_api_server(PLAN, tmp, mp_dir)
    out = {"single": finish(single)}
    out["mp_first"] = finish(first)
    # A second API server, started after the first wrote its last snapshot.
    second = run_api_server([["logger", "L"], ["observe", "L", batch(16, in_flight=[1, 3.0])]],
                            tmp, mp_dir)
    out["mp_second"] = finish(second)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(mp_dir))
    out["multiproc"] = generate_latest(registry).decode()
    return out


def test_rebuilt_and_duplicate_builds_do_not_crash_or_double_count(runs: dict[str, str]) -> None:
    text = runs["single"]
    assert_no_duplicate_series(text)
    # vLLM's rebuild unregisters L1's metrics (as for every vLLM metric): L1's one
    # handshake is gone; L2 and the duplicate K3 share the series: 2 + 4 + 8.
    assert value(text, "vllm:nixl_handshakes_total", HS_LABELS) == 14
    assert value(text, "vllm:nixl_pushes_total", {"outcome": "completed"}) == 14
    assert value(text, "vllm:nixl_xfer_time_seconds_count") == 14
    assert value(text, "vllm:nixl_descriptors_saved_total", {"direction": "d_to_p"}) == 14 * 64
    assert value(text, "vllm:nixl_handshakes_in_flight",
                 {"direction": "d_to_p", "notif_agents_only": "true"}) == 2


def test_multiprocess_counters_add_up_across_api_servers(runs: dict[str, str]) -> None:
    text = runs["multiproc"]
    assert_no_duplicate_series(text)
    # Multiprocess values live in per-process files keyed by series: a rebuilt
    # metric continues from its file, so nothing observed is lost: 1+2+4+8 and 16.
    assert value(text, "vllm:nixl_handshakes_total", HS_LABELS) == 31
    assert value(text, "vllm:nixl_pushes_total", {"outcome": "completed"}) == 31
    assert value(text, "vllm:nixl_xfer_time_seconds_count") == 31
    assert value(text, "vllm:nixl_handshake_duration_seconds_count",
                 {"direction": "d_to_p", "notif_agents_only": "true", "outcome": "success"}) == 31
    assert value(text, "vllm:nixl_descriptors_saved_total", {"direction": "d_to_p"}) == 31 * 64


def test_multiprocess_gauges_show_the_latest_engine_value(runs: dict[str, str]) -> None:
    text = runs["multiproc"]
    gauges = [(n, lab) for n, lab, _ in samples(text)
              if n in ("vllm:nixl_handshakes_in_flight", "vllm:nixl_handshake_oldest_in_flight_seconds")]
    assert gauges and not any("pid" in lab for _, lab in gauges)  # one engine-level series each
    assert value(text, "vllm:nixl_handshakes_in_flight",
                 {"direction": "d_to_p", "notif_agents_only": "true"}) == 1
    assert value(text, "vllm:nixl_handshake_oldest_in_flight_seconds", {"direction": "d_to_p"}) == 3.0
    assert value(text, "vllm:nixl_handshakes_in_flight",
                 {"direction": "p_to_d", "notif_agents_only": "false"}) == 0
