"""Worker stats -> build_prom_metrics -> /metrics, checked against the run's ground truth."""

from __future__ import annotations

import shutil
import subprocess
import urllib.request

import pytest

from tests.conftest import handshakes

pytestmark = pytest.mark.real

SAVED_PER_HANDSHAKE = 2 * 128  # 2 layers x 128 blocks of P


@pytest.fixture(scope="module")
def frontends(trio):
    fes = {}
    for name in ("P", "D"):
        fe = trio.harness.frontend(name)
        fe.observe(trio.facts["stats"][name])
        fes[name] = fe
    yield fes
    for fe in fes.values():
        fe.close()


def test_handshake_counts_equal_ground_truth(trio, frontends):
    d, p = frontends["D"], frontends["P"]
    hs_d = handshakes(trio.facts["stats"]["D"])
    hs_p = handshakes(trio.facts["stats"]["P"])
    assert len(hs_d) == 1 and len(hs_p) == 1
    labels = {"direction": "d_to_p", "trigger": "heartbeat", "notif_agents_only": "true",
              "outcome": "success"}
    assert d.sample("vllm:nixl_handshakes_total", labels) == 1
    assert d.sample("vllm:nixl_handshakes_total", {**labels, "notif_agents_only": "false"}) == 0
    # P->D starts either when D's PUSH_REG arrives before P's prefill is done (early) or
    # at the WRITE: exactly one of the two, once.
    p_to_d = {t: p.sample("vllm:nixl_handshakes_total", {"direction": "p_to_d", "trigger": t,
                                                         "notif_agents_only": "false",
                                                         "outcome": "success"})
              for t in ("push_write", "push_reg_early")}
    assert sorted(p_to_d.values()) == [0, 1], p_to_d
    dur = d.sample("vllm:nixl_handshake_duration_seconds_sum",
                   {"direction": "d_to_p", "notif_agents_only": "true", "outcome": "success"})
    assert dur == pytest.approx(hs_d[0]["duration"])
    for phase, seconds in hs_d[0]["phases"].items():
        got = d.sample("vllm:nixl_handshake_phase_duration_seconds_sum",
                       {"direction": "d_to_p", "notif_agents_only": "true", "phase": phase})
        assert got == pytest.approx(seconds)
    assert d.sample("vllm:nixl_handshake_phase_duration_seconds_count",
                    {"direction": "d_to_p", "notif_agents_only": "true",
                     "phase": "descriptor_registration"}) == 0


def test_descriptor_and_saving_counts(trio, frontends):
    d, p = frontends["D"], frontends["P"]
    assert d.sample("vllm:nixl_descriptor_registrations_saved_total", {"direction": "d_to_p"}) == 1
    assert d.sample("vllm:nixl_descriptors_saved_total", {"direction": "d_to_p"}) == SAVED_PER_HANDSHAKE
    assert d.sample("vllm:nixl_descriptors_registered_total",
                    {"direction": "d_to_p", "list": "remote"}) == 0
    assert p.sample("vllm:nixl_descriptor_registrations_total",
                    {"direction": "p_to_d", "list": "remote"}) == 1
    assert p.sample("vllm:nixl_descriptors_registered_total",
                    {"direction": "p_to_d", "list": "remote"}) == SAVED_PER_HANDSHAKE


def test_saved_is_what_a_full_handshake_to_the_same_p_prepares(trio):
    """Honesty check: the stock engine S did the full D->P handshake to the same P."""
    [fork_hs] = handshakes(trio.facts["stats"]["D"])
    p_agent = trio.facts["P_agent_name"]
    full = [c for c in trio.facts["S_calls_after_heartbeat"]
            if c[0] == "prep_xfer_dlist" and c[1] == p_agent]
    assert fork_hs["saved_registrations"] == len(full)
    assert fork_hs["saved_descriptors"] == sum(c[2] for c in full)
    print(f"ground truth: fork D saved {fork_hs['saved_descriptors']} descriptors in "
          f"{fork_hs['saved_registrations']} list(s); stock S's full handshake to the same P prepared "
          f"{sum(c[2] for c in full)} in {len(full)}")


def test_push_counters(trio, frontends):
    d, p = frontends["D"], frontends["P"]
    n = len(trio.facts["report"].requests)
    assert d.sample("vllm:nixl_push_reg_notifs_total", {"outcome": "sent"}) == n
    assert d.sample("vllm:nixl_push_reg_notifs_total", {"outcome": "failed"}) == 0
    assert p.sample("vllm:nixl_pushes_total", {"outcome": "started"}) == n
    assert p.sample("vllm:nixl_pushes_total", {"outcome": "completed"}) == n
    assert p.sample("vllm:nixl_pushes_total", {"outcome": "failed"}) == 0
    # vLLM's stock NIXL metrics keep flowing: one WRITE per request.
    assert p.sample("vllm:nixl_xfer_time_seconds_count") == n


def test_log_stats_line_reports_handshakes(frontends):
    line = " | ".join(frontends["D"].log_lines)
    assert "Num handshakes=1" in line and "Notif-only D->P handshakes=1" in line
    assert "Descriptors saved=256" in line


def test_real_metrics_endpoint_passes_promtool(frontends):
    fe = frontends["D"]
    port = fe.serve()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    # Parse the exposition as a scraper would and compare every one of our samples with
    # the ground truth the registry was fed from.
    from prometheus_client.parser import text_string_to_metric_families

    from connector.vocabulary import ALL_METRICS

    ours = {spec.name for spec in ALL_METRICS}
    parsed = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in text_string_to_metric_families(body) if fam.name in ours
              for s in fam.samples}
    assert parsed[("vllm:nixl_descriptors_saved_total",
                   (("direction", "d_to_p"), ("engine", "0"), ("model_name", "tiny-llama")))] == 256
    # Every counter is exposed, except phase failures: created at the first failure.
    from connector.vocabulary import MetricKind

    counters = {spec.series_names[0] for spec in ALL_METRICS
                if spec.kind in (MetricKind.COUNTER, MetricKind.GAUGE)}
    assert {name for name, _ in parsed} >= counters - {"vllm:nixl_handshake_phase_failures_total"}
    for (name, labels), value in parsed.items():
        if name.endswith("_created"):
            continue
        assert fe.registry.get_sample_value(name, dict(labels)) == value, (name, labels)
    promtool = shutil.which("promtool")
    assert promtool, "make test installs Debian's prometheus (promtool)"
    res = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True)
    # vLLM names its metrics `vllm:...`; promtool's lint reserves colons for recording
    # rules. That convention is vLLM's (dashboards and users depend on it), so that
    # one finding is expected for every vllm: series and nothing else may appear.
    problems = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
    colon_lint = "metric names should not contain ':'"
    colon = [p for p in problems if p.startswith("vllm:") and p.endswith(colon_lint)]
    assert problems == colon, "\n".join(set(problems) - set(colon))
    assert colon, "expected vLLM's colon-named series in the exposition"


def test_no_unbounded_label_values(frontends):
    """Every label value is from a closed set; the one open one, NIXL's agent name on the info
    metric that joins NIXL's exporter, is one series per worker (here: one per engine)."""
    from connector.vocabulary import NIXL_AGENT_INFO, AgentLabel, allowed_values

    for fe in frontends.values():
        for family in fe.registry.collect():
            if family.name == NIXL_AGENT_INFO.name:
                assert len(family.samples) == 1, family.samples  # (one worker per engine here)
                assert {k for k in family.samples[0].labels} == {
                    "model_name", "engine", AgentLabel.AGENT_NAME, AgentLabel.TP_RANK}
                continue
            for sample in family.samples:
                for key, value in sample.labels.items():
                    if key in {"model_name", "engine", "le"}:
                        continue
                    assert value in allowed_values(family.name, key), (sample.name, key, value)
