"""`python -m benchmarks` runs end to end at tiny sizes and writes its JSON (figures, no thresholds)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

from benchmarks.__main__ import BENCHMARKS, main
from harness.poll import wait_until

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]


def _run(tmp_path, monkeypatch, *argv: str) -> dict:
    monkeypatch.setenv("HARNESS_LOG_DIR", str(tmp_path / "logs"))
    name = argv[0]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / f"{name}.json").read_text())
    assert result["benchmark"] == name and result["date"] and result["commit"]
    assert list((tmp_path / "logs").glob("*.log"))  # engine output went to files
    return result


def test_every_benchmark_has_a_subcommand_with_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHMARKS)


def test_handshake_smoke_writes_json_and_png(tmp_path, monkeypatch):
    result = _run(tmp_path, monkeypatch, "handshake", "--sizes", "2x256", "--rounds", "1")
    [row] = result["sizes"]
    assert row["fork_ms"] > 0 and row["stock_ms"] > 0
    # The fork's D->P handshake prepared no descriptors; stock's full one prepared P's.
    assert row["fork_descriptors"] == 0 < row["stock_descriptors"]
    assert row["fork_notif_only"] and row["fork_saved_descriptors"] > 0
    assert "agent_load" in row["fork_phases_ms"]
    assert (tmp_path / "handshake.png").stat().st_size > 0


def test_producers_smoke_reports_both_connectors_per_m(tmp_path, monkeypatch):
    result = _run(tmp_path, monkeypatch, "producers", "--producers", "1,2", "--rounds", "1", "--late-ms", "5")
    assert [(r["late_ms"], r["producers"], r["connector"]) for r in result["rows"]] == [
        (0, 1, "fork"), (0, 1, "stock"), (0, 2, "fork"), (0, 2, "stock"),
        (5, 1, "fork"), (5, 1, "stock"), (5, 2, "fork"), (5, 2, "stock")]
    for row in result["rows"]:
        assert row["all_done_ms"] > 0 and row["cpu_ms_per_handshake"] > 0
        assert (row["max_queue_wait_ms"] is None) == (row["connector"] == "stock")
    assert (tmp_path / "producers.png").stat().st_size > 0


def test_telemetry_cost_smoke_exports_the_connectors_spans_per_request(tmp_path):
    # The per-request trace shape reaches the receiver: receive, register and write
    # spans for every traced request, none with tracing off.
    assert main(["telemetry-cost", "--requests", "48", "--repeats", "1", "--modes", "off,traced",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "telemetry-cost.json").read_text())
    off, traced = result["modes"]["off"], result["modes"]["traced"]
    assert off["spans_per_request"] == 0 and traced["spans_per_request"] == 3
    assert off["stages_us"]["export"] < traced["stages_us"]["export"]
    assert traced["vllm_us"] > 0 and off["vllm_us"] == 0
    assert set(traced["stages_us"]) == {"receive_start", "register", "write_start", "write_done",
                                        "landed", "stats", "serialise", "observe", "export"}


def test_kv_verify_alternatives_checks_each_candidate_against_its_eager_form(tmp_path):
    # Each candidate is compared with its eager form before it is timed (a wrong kernel
    # stops the run); the figures land in the JSON for every size and cache state.
    assert main(["kv-verify", "--parts", "alternatives", "--repeats", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kv-verify.json").read_text())["alternatives"]
    assert result["native_build_s"] is not None  # (this machine has a compiler)
    assert [r["kv_mib"] for r in result["rows"]] == [8, 64]
    for row in result["rows"]:
        for name in ("gather", "digest", "compiled", "int8_gemm", "native"):
            assert row[f"{name}_gbps_cold"] > 0 and row[f"{name}_gbps_warm"] > 0
    tiny = result["tiny_request"]
    assert tiny["shipped_ms"] > 0 and tiny["native_rows_torch_fold_ms"] > 0 and tiny["native_one_call_ms"] > 0


def test_engine_cpu_names_threads_by_role_and_compares_each_round_with_its_stock_pair():
    from benchmarks.engine_cpu import role, summarize

    assert role("MainThread") == "main"
    assert role("nixl-push-writer") == "push writer"
    assert role("nixl-handshake_3") == role("vllm-nixl-handshake-initiator_0") == "handshakes"
    assert role("Thread-12 (process_input_sockets)") == "other Python: Thread-N (process_input_sockets)"
    assert role(None) == "native (NIXL/UCX, torch)"

    def row(rnd: int, variant: str, p_main: float, wall_s: float) -> dict:
        return {"round": rnd, "variant": variant, "requests": 10, "wall_s": wall_s,
                "ms_per_request": {"P total": p_main + 1.0, "P worker: main": p_main}}

    runs = [row(0, "fork", 12.0, 1.0), row(0, "stock", 10.0, 1.0),   # +2 ms in round 1
            row(1, "stock", 20.0, 2.0), row(1, "fork", 21.0, 2.2),   # +1 ms in round 2 (a slower pair)
            row(2, "fork", 9.0, 1.0), row(2, "stock", 10.0, 1.0),    # -1 ms in round 3
            row(3, "fork", 30.0, 1.0)]                               # no stock pair: left out
    by_group = {r["group"]: r for r in summarize(runs, "fork")}
    main_row = by_group["P worker: main"]
    assert (main_row["ms"], main_row["stock_ms"], main_row["diff_ms"]) == (12.0, 10.0, 1.0)
    assert (main_row["diff_min_ms"], main_row["diff_max_ms"], main_row["rounds_higher"]) == (-1.0, 2.0, 2)
    assert main_row["rounds"] == 3
    wall = by_group["wall time per request"]
    assert wall["diff_ms"] == 0.0 and wall["diff_pct"] == [0.0, 10.0, 0.0]


SIGTERMED = '''
import subprocess, sys, threading, types
import benchmarks.__main__ as bm

fake = types.ModuleType("fake", "A benchmark stopped while it waits.")
fake.add_arguments = lambda parser: None

def run(args, bench):
    child = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # (stands for an engine it started)
    try:
        (bench.dir / "child.pid").write_text(str(child.pid))
        threading.Event().wait()
    finally:
        child.kill()
        child.wait()
        (bench.dir / "child.stopped").write_text("")

fake.run = run
bm._modules = lambda argv=None: {"fake": fake}
sys.exit(bm.main(["fake", "--out", sys.argv[1]]))
'''


def test_sigterm_unwinds_a_benchmark_so_it_stops_what_it_started(tmp_path):
    """SIGTERM (what `kill` and CI send) runs the benchmark's `finally`, which stops its
    engines; Python's default would end the process and leave them running."""
    proc = subprocess.Popen([sys.executable, "-c", SIGTERMED, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    child = None
    try:
        pid_file = tmp_path / "child.pid"
        wait_until(lambda: pid_file.exists() and pid_file.read_text(), "the benchmark's child",
                   timeout_s=120)
        child = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert "fake interrupted" in out
        assert (tmp_path / "child.stopped").exists()
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
