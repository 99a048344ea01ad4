"""`python -m benchmarks.scale --smoke` runs end to end and writes its JSON and chart (no thresholds)."""

from __future__ import annotations

import json

import pytest

from benchmarks import scale

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]


def test_scale_smoke_writes_json_and_png(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_LOG_DIR", str(tmp_path / "logs"))
    assert scale.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "scale-smoke.json").read_text())
    [size] = result["sizes"]
    assert size["fork_ms"] > 0 and size["stock_ms"] > 0
    assert size["fork_saved_descriptors"] > 0  # the fork's D->P handshake was notification-only
    assert "agent_load" in size["fork_phases_ms"] and "descriptor_registration" not in size["fork_phases_ms"]
    assert [r["producers"] for r in result["producers"]] == scale.SMOKE_PRODUCERS
    assert (tmp_path / "scale-smoke.png").stat().st_size > 0
    assert list((tmp_path / "logs").glob("*.log"))  # engine output went to files


def test_otlp_encode_benchmark_runs_and_compares_like_with_like():
    from benchmarks import otlp_encode

    result = otlp_encode.otlp_encode_bench(repeats=1)  # asserts both encoders agree first
    assert set(result) == {"write", "handshake"}
    assert all(r["sdk_us"] > 0 and r["ours_us"] > 0 for r in result.values())


def test_span_cost_benchmark_runs_both_tracers_through_the_batch_processor():
    from benchmarks import span_cost

    result = span_cost.span_cost_bench(repeats=1, n=50)  # asserts every span reached the exporter
    assert set(result) == {"sdk_make_us", "lean_make_us", "sdk_encode_us", "lean_encode_us",
                           "sdk_request_us", "lean_request_us"}
    assert all(v > 0 for v in result.values())


def test_cpu_ab_benchmark_swaps_modes_in_the_same_processes(monkeypatch, tmp_path):
    from benchmarks import cpu_ab

    (tmp_path / "logs").mkdir()
    monkeypatch.setenv("HARNESS_LOG_DIR", str(tmp_path / "logs"))
    result = cpu_ab.cpu_ab_bench(sessions=1, rounds=1, batches=1, batch=4, names=["off", "known"],
                                 bulk=True, known_us=2000.0)
    assert result["stock_us"]["off"] > 0 and result["fork_us"]["off"] > 0
    assert result["ratio"]["off"] > 0 and result["wall_ratio"]["off"] > 0
    # The calibration pair's "fork" mode burnt 4 x 2 ms per request on top of stock.
    assert result["fork_us"]["known"] - result["stock_us"]["known"] >= 4 * 2000.0
    assert result["known_rate"] > 0
