"""The generated dashboard, rules and deployment files, and the checks that guard them.

No engines here: the generator's `--check`, its check functions on mutated dashboards,
promtool on the rules and the stack config, consistency of the provisioning files, and
docs/telemetry.md against the vocabulary. The queries against a real Prometheus are in
tests/test_prometheus_real.py.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from connector import vocabulary as V
from dashboards import (
    check,
    generate,
    k8s,
    panels,
    perses,
    perses_schema,
    promql,
    promrun,
    queries,
    rules,
    telemetry_doc,
)

REPO = Path(__file__).resolve().parents[1]
DASH = REPO / "dashboards"
RULES = DASH / rules.RULES_FILE
RULES_TEST = DASH / "rules" / "nixl-push.rules.test.yaml"
STACK = DASH / "stack"
DOC = REPO / "docs" / "telemetry.md"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool not found: `make system-deps` installs Debian's prometheus"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def run_generator(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dashboards.generate", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def mutate_expr(dashboard: dict[str, Any], old: str, new: str) -> str:
    """Replace `old` in the first query that has it; returns the panel title."""
    for panel in panels.iter_panels(dashboard):
        for target in panel["targets"]:
            if old in target["expr"]:
                target["expr"] = target["expr"].replace(old, new)
                return panel["title"]
    raise AssertionError(f"no query contains {old!r}")


def drop_panels(dashboard: dict[str, Any], metric: str) -> int:
    """Remove every panel whose queries mention `metric`; returns how many went."""
    removed = 0

    def keep(panel: dict[str, Any]) -> bool:
        nonlocal removed
        hit = any(metric in t["expr"] for t in panel.get("targets", []))
        removed += hit
        return not hit

    dashboard["panels"] = [p for p in dashboard["panels"] if keep(p)]
    for row in dashboard["panels"]:
        if row.get("type") == "row":
            row["panels"] = [p for p in row["panels"] if keep(p)]
    return removed


# ----------------------------------------------------------------- generator --check
def test_check_passes_on_checked_in_files() -> None:
    proc = run_generator("--check")
    assert proc.returncode == 0, proc.stderr
    assert "dashboards check OK" in proc.stdout
    assert check.check_files(DASH, generate.render_all()) == []
    assert DOC.read_text() == telemetry_doc.render()


def in_tmp(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The generator on a copy in `tmp_path` (dashboard files and the doc)."""
    return run_generator(*args, "--root", str(tmp_path), "--doc", str(tmp_path / DOC.name))


def test_check_fails_on_stale_or_missing_files(tmp_path: Path) -> None:
    generate.write_files(tmp_path, tmp_path / DOC.name)
    assert in_tmp(tmp_path, "--check").returncode == 0

    path = tmp_path / panels.DASHBOARD_FILE
    hand_edited = json.loads(path.read_text())
    hand_edited["title"] = "edited in the Grafana UI"
    path.write_text(json.dumps(hand_edited, indent=2) + "\n")
    (tmp_path / k8s.CONFIGMAP_FILE).unlink()
    proc = in_tmp(tmp_path, "--check")
    assert proc.returncode == 1
    assert f"{panels.DASHBOARD_FILE}: stale" in proc.stderr
    assert "edited in the Grafana UI" in proc.stderr  # the diff is shown
    assert f"{k8s.CONFIGMAP_FILE}: missing" in proc.stderr


def test_check_of_files_on_disk_reports_unknown_metric(tmp_path: Path) -> None:
    generate.write_files(tmp_path, tmp_path / DOC.name)
    path = tmp_path / panels.DASHBOARD_FILE
    path.write_text(path.read_text().replace("vllm:nixl_pushes_total", "vllm:nixl_pushes_sent_total"))
    errors = check.check_files(tmp_path, generate.render_all())
    assert any("stale" in e for e in errors)
    assert any("'vllm:nixl_pushes_sent_total' is not defined in connector.vocabulary" in e for e in errors)
    assert any("vllm:nixl_pushes is defined in connector.vocabulary but on no panel" in e for e in errors)


def test_generated_dashboard_and_rules_pass_their_checks() -> None:
    assert check.check_dashboard(panels.build_dashboard()) == []
    assert check.check_rules(rules.build_rules()) == []


def test_unknown_metric_on_a_panel_fails() -> None:
    dashboard = panels.build_dashboard()
    title = mutate_expr(dashboard, "vllm:nixl_descriptors_saved_total", "vllm:nixl_descriptor_saved_total")
    errors = check.check_dashboard(dashboard)
    wanted = "'vllm:nixl_descriptor_saved_total' is not defined"
    assert any(title in e and wanted in e for e in errors), errors


def test_unknown_series_suffix_fails() -> None:
    # A counter queried without _total, a histogram without _bucket: both unknown series.
    dashboard = panels.build_dashboard()
    mutate_expr(dashboard, "vllm:nixl_pushes_total", "vllm:nixl_pushes")
    mutate_expr(dashboard, "vllm:nixl_handshake_duration_seconds_bucket",
                "vllm:nixl_handshake_duration_seconds")
    errors = check.check_dashboard(dashboard)
    assert any("'vllm:nixl_pushes' is not defined" in e for e in errors), errors
    assert any("'vllm:nixl_handshake_duration_seconds' is not defined" in e for e in errors), errors


@pytest.mark.parametrize("spec", V.ALL_METRICS + V.STOCK_METRICS, ids=lambda s: s.name)
def test_metric_missing_from_dashboard_fails(spec: V.MetricSpec) -> None:
    dashboard = panels.build_dashboard()
    assert drop_panels(dashboard, spec.name) >= 1
    errors = check.check_dashboard(dashboard)
    assert f"metric {spec.name} is defined in connector.vocabulary but on no panel" in errors


@pytest.mark.parametrize(("old", "new", "message"), [
    ('notif_agents_only="true"', 'notif_agents_only="True"', "notif_agents_only='True' is not a value"),
    ('direction="d_to_p"', 'direction="d2p"', "direction='d2p' is not a value"),
    ('phase="queue_wait"', 'phase="queue"', "phase='queue' is not a value"),
    ('outcome="failure"', 'outcome="failed"', "outcome='failed' is not a value"),  # pushes' word
    ('direction="d_to_p"', 'dir="d_to_p"', "label 'dir' is not a label of"),
    ("by (direction, trigger, outcome)", "by (direction, trigger, result)",
     "grouping label 'result' is not a known label"),
    ("[$__rate_interval]", "[5m]", "rate() must use [$__rate_interval]"),
    ("offset $__range", "offset 1h", "offset must be $__range, not 1h"),
    ('fate=~"waiting|registered"', 'fate=~"waiting|wanted"', "fate='wanted' is not a value"),
    ('fate=~"waiting|registered"', 'fate=~"wait.*"', "a regex on a vocabulary label must list literal"),
    ('instance=~"$instance"', 'instance=~"$host"', "undefined variable $host"),
    ("histogram_quantile(", "histogram_quantil(", "unknown PromQL function 'histogram_quantil'"),
])
def test_wrong_names_in_queries_fail(old: str, new: str, message: str) -> None:
    dashboard = panels.build_dashboard()
    mutate_expr(dashboard, old, new)
    errors = check.check_dashboard(dashboard)
    assert any(message in e for e in errors), errors


def test_panel_without_unit_or_metric_in_description_fails() -> None:
    dashboard = panels.build_dashboard()
    shown = list(panels.iter_panels(dashboard))
    shown[0]["fieldConfig"]["defaults"]["unit"] = ""
    shown[1]["description"] = "Handshakes."
    shown[2]["datasource"] = {"type": "prometheus", "uid": "prometheus"}
    errors = check.check_dashboard(dashboard)
    assert f"panel {shown[0]['title']!r}: no unit" in errors
    assert any(e.startswith(f"panel {shown[1]['title']!r}: description does not name") for e in errors)
    assert f"panel {shown[2]['title']!r}: datasource must be the $datasource variable" in errors


def test_rules_with_unknown_names_fail() -> None:
    groups = rules.build_rules()
    alert = next(r for g in groups["groups"] for r in g["rules"] if r.get("alert") == "NixlPushesFailing")
    alert["expr"] = alert["expr"].replace("vllm:nixl_pushes_total", "vllm:nixl_push_total")
    record = groups["groups"][0]["rules"][0]
    record["expr"] = record["expr"].replace("[5m]", "[$__rate_interval]")
    errors = check.check_rules(groups)
    assert any("NixlPushesFailing" in e and "'vllm:nixl_push_total' is not defined" in e for e in errors)
    assert any(record["record"] in e and "cannot use Grafana variables" in e for e in errors)


# ------------------------------------------------------------------------ PromQL reading
def test_promql_reader() -> None:
    expr = ('sum by (le, direction) (rate(vllm:nixl_handshake_duration_seconds_bucket'
            '{job=~"$job",direction="d_to_p",note="a:b(c)"}[$__rate_interval])) / '
            '(sum(increase(vllm:nixl_pushes_total[5m] offset 1h)) > 1e-9) or vector(0) '
            'unless on (instance) up == bool 1')
    assert promql.metric_names(expr) == {"vllm:nixl_handshake_duration_seconds_bucket",
                                         "vllm:nixl_pushes_total", "up"}
    assert promql.range_calls(expr) == [("rate", "$__rate_interval"), ("increase", "5m")]
    assert promql.grouping_labels(expr) == {"le", "direction", "instance"}
    assert {(m.metric, m.label, m.op, m.value) for m in promql.matchers(expr)} == {
        ("vllm:nixl_handshake_duration_seconds_bucket", "job", "=~", "$job"),
        ("vllm:nixl_handshake_duration_seconds_bucket", "direction", "=", "d_to_p"),
        ("vllm:nixl_handshake_duration_seconds_bucket", "note", "=", "a:b(c)"),
    }
    assert promql.variables(expr) == {"job", "__rate_interval"}
    with pytest.raises(promql.PromQLError):
        promql.metric_names("rates(x[5m])")
    with pytest.raises(promql.PromQLError):
        promql.range_calls("rate(x)")


# ----------------------------------------------------------------------- the dashboard
def test_dashboard_shape() -> None:
    dashboard = json.loads((DASH / panels.DASHBOARD_FILE).read_text())
    assert dashboard["schemaVersion"] == 39
    assert dashboard["title"] == "NIXL push handshakes"
    variables = dashboard["templating"]["list"]
    assert [v["name"] for v in variables] == ["datasource", "job", "model_name", "instance", "engine",
                                              "jaeger"]
    assert variables[0]["type"] == "datasource" and variables[0]["query"] == "prometheus"
    assert variables[-1]["type"] == "datasource" and variables[-1]["query"] == "jaeger"
    defined: set[str] = {"datasource"}
    for var in variables[1:-1]:
        # label_values queries, each scoped only by the variables before it.
        assert var["query"].startswith("label_values(") and var["query"] == var["definition"]
        assert promql.variables(var["query"]) <= defined, var["name"]
        defined.add(var["name"])
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    for title, specs in ((panels.STOCK_ROW, V.STOCK_METRICS), (panels.ROUTER_ROW, V.ROUTER_METRICS)):
        row = next(r for r in rows if r["title"] == title)
        assert row["collapsed"] is True and row["panels"]
        names = {s.name for s in specs}
        for panel in row["panels"]:
            for t in panel["targets"]:
                assert {queries.series_index()[n].name for n in promql.metric_names(t["expr"])} <= names
    assert [r["title"] for r in rows if r["collapsed"]] == [panels.ROUTER_ROW, panels.STOCK_ROW]


def test_dashboard_layout_has_no_overlaps() -> None:
    dashboard = panels.build_dashboard()
    groups: list[list[dict[str, Any]]] = [[p for p in dashboard["panels"]]]
    groups += [r["panels"] for r in dashboard["panels"] if r["type"] == "row" and r["collapsed"]]
    for group in groups:
        cells: set[tuple[int, int]] = set()
        for panel in group:
            g = panel["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, f"{panel['title']} overlaps another panel"
            cells |= mine


def test_required_panels_exist() -> None:
    dashboard = panels.build_dashboard()
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in panels.iter_panels(dashboard)}

    def has(title: str, *needles: str) -> None:
        assert title in exprs, title
        text = " ".join(exprs[title])
        for needle in needles:
            assert needle in text, (title, needle)

    has("Handshakes/s by direction and flavor", "sum by (direction, notif_agents_only)", "rate(")
    has("D->P handshakes that were notification-only", 'notif_agents_only="true"', "offset $__range", "> 0)")
    has("Descriptor registrations saved", "vllm:nixl_descriptor_registrations_saved_total", "offset $__range")
    has("Descriptors saved", "vllm:nixl_descriptors_saved_total", "offset $__range")
    has("Descriptor registrations saved/s", "rate(vllm:nixl_descriptor_registrations_saved_total")
    has("Descriptors saved/s", "rate(vllm:nixl_descriptors_saved_total")
    has("Descriptors registered/s by full handshakes", "vllm:nixl_descriptors_registered_total")
    has("Handshake latency p50 / p95 / p99 by flavor", "histogram_quantile(0.5,", "histogram_quantile(0.95,",
        "histogram_quantile(0.99,", "vllm:nixl_handshake_duration_seconds_bucket", "notif_agents_only")
    has("Per-phase latency p95", "by (le, direction, phase)")
    has("Executor queue wait p50 / p95 / p99", 'phase="queue_wait"')
    has("Handshake failures/s by phase and error type", "by (direction, phase, error_type)")
    has("PUSH_REG notifications/s", "vllm:nixl_push_reg_notifs_total")
    has("KV pushes/s: started / completed / failed", "vllm:nixl_pushes_total", "by (outcome)")
    has("KV receive latency p50 / p95 / p99 by outcome",
        "vllm:nixl_push_receive_duration_seconds_bucket", "by (le, outcome)")
    has("KV receives/s by outcome", "rate(vllm:nixl_push_receive_duration_seconds_count")
    has("KV leases expired while the decoder waited", "vllm:nixl_kv_lease_expiries_total",
        'fate=~"waiting|registered"', "offset $__range")
    has("Heartbeat ids matching nothing", 'outcome="unknown_request"', "offset $__range")
    has("KV lease expiries/s by fate", "by (fate)", "vllm:nixl_num_kv_expired_reqs_total",
        "vllm:nixl_kv_leases_reaped_late_total")
    has("Heartbeat ids/s by what they matched (P)", "vllm:nixl_kv_lease_renewals_total", "by (outcome)")
    has("Heartbeats sent/s (D)", "vllm:nixl_heartbeats_total", "by (outcome)")
    has("Router requests by outcome (range)", "nixl_router_requests_total", "by (outcome)", "offset $__range")
    has("Router requests answered ok (range)", 'outcome="ok"', "offset $__range", "> 0)")
    has("Mean client TTFT and leg latency (range)", "nixl_router_time_to_first_token_seconds_sum",
        "nixl_router_leg_duration_seconds_count", "by (stream)", "by (leg)")
    has("Router requests/s by route and outcome", "rate(nixl_router_requests_total", "by (route, outcome)")
    has("Client TTFT p50 / p95 / p99", "nixl_router_time_to_first_token_seconds_bucket", "by (le, stream)")
    has("Leg latency p50 / p95 by leg", "nixl_router_leg_duration_seconds_bucket", 'outcome="ok"')
    has("Router requests in flight", "nixl_router_requests_in_flight")
    has("Legs cancelled/s by leg and reason", "nixl_router_legs_cancelled_total", "by (leg, reason)")
    # Where TTFT goes: vLLM's TTFT only of the engines whose KV waits moved (the decoders).
    decoders_only = "and on (job, instance, model_name, engine) (rate(vllm:nixl_push_kv_wait_seconds_count"
    has("Mean TTFT by stage (range)", 'vllm:nixl_push_kv_wait_seconds_sum{', 'outcome="success"',
        "vllm:nixl_push_write_wait_seconds_sum", "vllm:nixl_push_write_duration_seconds_count",
        "vllm:time_to_first_token_seconds_count", "offset $__range",
        "and on (job, instance, model_name, engine) (((vllm:nixl_push_kv_wait_seconds_count")
    has("Share of D's TTFT spent waiting for KV", "vllm:nixl_push_kv_wait_seconds_sum",
        "rate(vllm:time_to_first_token_seconds_sum", decoders_only)
    has("D: wait for KV p50 / p95 / p99 by outcome", "vllm:nixl_push_kv_wait_seconds_bucket",
        "by (le, outcome)")
    has("P: prefill done -> WRITE posted p50 / p95 / p99", "vllm:nixl_push_write_wait_seconds_bucket")
    has("P: PUSH_REG matched -> WRITE done p50 / p95 / p99",
        "vllm:nixl_push_write_duration_seconds_bucket")
    # The router's series have no model_name or engine: its panels are scoped by job and instance.
    for title in panels.row_titles(panels.ROUTER_ROW):
        for expr in exprs[title]:
            assert 'job=~"$job"' in expr and 'instance=~"$instance"' in expr, title
            assert "$model_name" not in expr and "$engine" not in expr, title


def test_latency_panels_show_exemplars_linked_to_jaeger() -> None:
    dashboard = panels.build_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["jaeger"]["type"] == "datasource" and variables["jaeger"]["query"] == "jaeger"
    with_exemplars = {p["title"] for p in panels.iter_panels(dashboard)
                      if any(t.get("exemplar") for t in p["targets"])}
    assert with_exemplars == {"Handshake latency p50 / p95 / p99 by flavor",
                              "Executor queue wait p50 / p95 / p99", "Per-phase latency p95",
                              "KV receive latency p50 / p95 / p99 by outcome",
                              "Client TTFT p50 / p95 / p99", "Leg latency p50 / p95 by leg",
                              "D: wait for KV p50 / p95 / p99 by outcome",
                              "P: prefill done -> WRITE posted p50 / p95 / p99",
                              "P: PUSH_REG matched -> WRITE done p50 / p95 / p99"}
    for panel in panels.iter_panels(dashboard):
        if panel["title"] in with_exemplars:
            [link] = panel["fieldConfig"]["defaults"]["links"]
            assert "${jaeger}" in link["url"] and "${__data.fields.trace_id}" in link["url"]
            # The link's Explore state is JSON once Grafana has filled in the variables.
            state = link["url"].split("panes=", 1)[1]
            filled = state.replace("${jaeger}", "jaeger-uid").replace(
                "${__data.fields.trace_id}", "4bf92f3577b34da6a3ce929d0e0e4736")
            pane = json.loads(filled)["trace"]
            assert pane["datasource"] == "jaeger-uid"
            assert pane["queries"][0]["query"] == "4bf92f3577b34da6a3ce929d0e0e4736"


# ------------------------------------------------------------ vLLM's dashboard conventions
def test_generated_dashboard_follows_vllms_conventions() -> None:
    dashboard = panels.build_dashboard()
    assert check.check_conventions(dashboard) == []
    for panel in panels.iter_panels(dashboard):
        # e.g. "...\n\nMetrics: `vllm:nixl_peer_resets_total`, `vllm:nixl_peer_restarts_total`"
        last = panel["description"].rsplit("\n\n", 1)[1]
        assert re.fullmatch(r"Metrics?: `[^`]+`(, `[^`]+`)*", last), panel["title"]
        listed = set(re.findall(r"`([^`]+)`", last))
        read = {queries.series_index()[n] for t in panel["targets"] for n in promql.metric_names(t["expr"])}
        assert listed == {panels.metric_label(spec) for spec in read}, panel["title"]


def _mutated(change: Any) -> list[str]:
    dashboard = panels.build_dashboard()
    change(dashboard)
    return check.check_conventions(dashboard)


def _first(dashboard: dict[str, Any], title: str) -> dict[str, Any]:
    return next(p for p in panels.iter_panels(dashboard) if p["title"] == title)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["templating"]["list"][1].update(type="custom"), "variable $job must be a query variable"),
    (lambda d: d["templating"]["list"][0].update(query="loki"), "must be a Prometheus data source variable"),
    (lambda d: next(r for r in d["panels"] if r["type"] == "row").update(collapsed=True),
     "a collapsed row is an optional section"),
    (lambda d: next(r for r in d["panels"] if r.get("title") == panels.ROUTER_ROW).update(title="Router"),
     "a collapsed row is an optional section"),
    (lambda d: _first(d, "Full D->P handshakes").update(description="Full handshakes."),
     "description must end with 'Metric: `vllm:nixl_handshake_duration_seconds`'"),
    (lambda d: _first(d, "Descriptors per NIXL transfer (mean)")["targets"][0].update(
        expr=_first(d, "Descriptors per NIXL transfer (mean)")["targets"][0]["expr"].replace(" > 0)", ")")),
     "ratio without a zero-denominator guard"),
    (lambda d: _first(d, "KV pushes/s: started / completed / failed")["targets"][0].update(
        expr=_first(d, "KV pushes/s: started / completed / failed")["targets"][0]["expr"].replace(
            ',engine=~"$engine"', "")),
     'vllm:nixl_pushes_total is not scoped by engine=~"$engine"'),
    (lambda d: _first(d, "Router requests in flight")["targets"][0].update(
        expr=_first(d, "Router requests in flight")["targets"][0]["expr"].replace(
            ',instance=~"$instance"', "")),
     'nixl_router_requests_in_flight is not scoped by instance=~"$instance"'),
])
def test_departures_from_vllms_conventions_fail_the_check(change: Any, message: str) -> None:
    errors = _mutated(change)
    assert any(message in e for e in errors), errors


def test_unguarded_divisions() -> None:
    assert check.unguarded_divisions("a / b") == ["b"]
    assert check.unguarded_divisions("a / (b)") == ["(b)"]
    assert check.unguarded_divisions("a / (sum(b) > 0)") == []
    assert check.unguarded_divisions("a / 1e6") == []
    assert check.unguarded_divisions('x{le="1/2"} / (y > 0)') == []


def test_latency_panel_without_exemplars_fails_the_check() -> None:
    dashboard = panels.build_dashboard()
    panel = next(p for p in panels.iter_panels(dashboard) if p["title"].startswith("KV receive latency"))
    panel["targets"][0]["exemplar"] = False
    panel["fieldConfig"]["defaults"]["links"] = []
    errors = check.check_dashboard(dashboard)
    assert any("latency histogram without exemplars" in e for e in errors), errors
    assert any("without a data link to the $jaeger" in e for e in errors), errors


# ------------------------------------------------------------------------------- rules
def test_promtool_check_rules() -> None:
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n_rules = sum(len(g["rules"]) for g in rules.build_rules()["groups"])
    assert f"SUCCESS: {n_rules} rules found" in proc.stdout


def test_promtool_test_rules() -> None:
    proc = promtool("test", "rules", str(RULES_TEST))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_rule_tests_cover_every_alert_firing_and_quiet() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())
    alerts = {r["alert"] for g in rules.build_rules()["groups"] for r in g["rules"] if "alert" in r}
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for expected in case.get("alert_rule_test", []):
            (firing if expected["exp_alerts"] else quiet).add(expected["alertname"])
    assert alerts == {"NixlFullDToPHandshake", "NixlHandshakeFailureRatioHigh",
                      "NixlHandshakeLatencyP99High", "NixlHandshakeQueueWaitHigh", "NixlPushesFailing",
                      "NixlReceivesFailing", "NixlReceiveLatencyP99High",
                      "NixlHandshakeStuck", "NixlPushRegRejected",
                      "NixlKvLeaseExpiredWhileWanted", "NixlHeartbeatsMatchNothing", "NixlPeerRestarted",
                      "NixlRemotePrefillWaitingLong", "NixlRouterLegErrorRatioHigh",
                      "NixlPushWriteAbortFailed", "NixlKvWaitShareRising", "NixlInternalError",
                      "NixlKvIntegrityMismatch", "NixlKvDeliveryErrorBudgetBurn",
                      "NixlKvDeliveryErrorBudgetSlowBurn", "NixlKvWaitErrorBudgetBurn",
                      "NixlKvWaitErrorBudgetSlowBurn", "NixlTelemetryDisagrees", "NixlUnauthenticatedPeer"}
    assert firing == alerts and quiet == alerts


def test_rule_test_series_use_the_vocabulary() -> None:
    tests = yaml.safe_load(RULES_TEST.read_text())
    series = [s["series"] for case in tests["tests"] for s in case.get("input_series", [])]
    assert series
    for selector in series:
        assert check.check_expr(selector, selector, allow_variables=False) == []
        assert promql.metric_names(selector) <= queries.series_index().keys()


def test_full_d_to_p_alert_is_the_regression_check() -> None:
    rule = next(r for g in rules.build_rules()["groups"] for r in g["rules"]
                if r.get("alert") == "NixlFullDToPHandshake")
    assert 'increase(vllm:nixl_handshakes_total{direction="d_to_p",notif_agents_only="false"}[15m])' \
        in rule["expr"]
    assert "> 0" in rule["expr"]


# ---------------------------------------------------------------------- deployment files
def test_configmap_carries_the_dashboard() -> None:
    configmap = yaml.safe_load((DASH / k8s.CONFIGMAP_FILE).read_text())
    assert configmap["kind"] == "ConfigMap"
    assert configmap["metadata"]["labels"] == {"grafana_dashboard": "1"}
    (name, text), = configmap["data"].items()
    assert name == Path(panels.DASHBOARD_FILE).name
    assert text == (DASH / panels.DASHBOARD_FILE).read_text()


def test_prometheus_rule_carries_the_rules() -> None:
    resource = yaml.safe_load((DASH / k8s.PROMETHEUS_RULE_FILE).read_text())
    assert resource["kind"] == "PrometheusRule"
    assert resource["spec"] == yaml.safe_load(RULES.read_text())


def test_promtool_check_stack_config() -> None:
    proc = promtool("check", "config", str(STACK / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The relative rule_files glob reaches our rules (and they pass too).
    assert "SUCCESS: 1 rule files found" in proc.stdout
    assert "nixl-push.rules.yaml" in proc.stdout


def test_stack_and_provisioning_agree() -> None:
    compose = yaml.safe_load((STACK / "docker-compose.yaml").read_text())
    prometheus_yml = yaml.safe_load((STACK / "prometheus.yml").read_text())
    services = compose["services"]
    assert set(services) == {"prometheus", "grafana", "jaeger"}

    def mounts(service: str) -> dict[str, str]:
        out = {}
        for volume in services[service]["volumes"]:
            src, dst = volume.split(":")[:2]
            out[dst] = src
        return out

    # Prometheus: the config's relative rule glob resolves inside the rules mount.
    prom = mounts("prometheus")
    config_arg = next(a for a in services["prometheus"]["command"] if a.startswith("--config.file="))
    config_path = config_arg.split("=", 1)[1]
    assert prom[config_path] == "./prometheus.yml"
    (rule_glob,) = prometheus_yml["rule_files"]
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(config_path), rule_glob))
    rules_dst = next(dst for dst, src in prom.items() if src == "../rules")
    assert posixpath.dirname(resolved) == rules_dst
    vllm_job = next(j for j in prometheus_yml["scrape_configs"] if j["job_name"] == "vllm")
    assert vllm_job["static_configs"][0]["targets"] == ["host.docker.internal:8000"]
    assert "host.docker.internal:host-gateway" in services["prometheus"]["extra_hosts"]

    # Grafana: provisioning mounted, the provider's path is where the dashboards are mounted.
    graf = mounts("grafana")
    assert graf["/etc/grafana/provisioning"] == "../provisioning"
    provider = yaml.safe_load((DASH / "provisioning/dashboards/nixl.yaml").read_text())["providers"][0]
    assert graf[provider["options"]["path"]] == "../grafana"
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == posixpath.join(provider["options"]["path"], Path(panels.DASHBOARD_FILE).name)
    assert services["grafana"]["image"].startswith("grafana/grafana:10.4")
    sources = yaml.safe_load((DASH / "provisioning/datasources/prometheus.yaml").read_text())["datasources"]
    prom_ds = next(s for s in sources if s["type"] == "prometheus")
    assert prom_ds["url"] == "http://prometheus:9090" and prom_ds["isDefault"] is True
    assert prom_ds["jsonData"]["timeInterval"] == prometheus_yml["global"]["scrape_interval"]
    # Exemplars: stored by Prometheus, and their trace ids link to the Jaeger data source.
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    jaeger_ds = next(s for s in sources if s["type"] == "jaeger")
    [dest] = prom_ds["jsonData"]["exemplarTraceIdDestinations"]
    assert dest == {"name": "trace_id", "datasourceUid": jaeger_ds["uid"]}

    # Jaeger all-in-one takes OTLP on both standard ports.
    jaeger = services["jaeger"]
    assert {"4317:4317", "4318:4318", "16686:16686"} <= set(jaeger["ports"])
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_dashboard_json_is_deterministic() -> None:
    first = generate.render_all()
    assert first == generate.render_all()
    assert panels.build_dashboard() == json.loads(first[panels.DASHBOARD_FILE])


def test_readme_lists_every_panel_and_rule() -> None:
    readme = (DASH / "README.md").read_text()
    for panel in panels.iter_panels(panels.build_dashboard()):
        assert f"| {panel['title']}" in readme, panel["title"]
    for group in rules.build_rules()["groups"]:
        for rule in group["rules"]:
            assert f"`{rule.get('alert') or rule.get('record')}`" in readme
    assert "preview/nixl-push-handshakes.png" in readme
    assert (DASH / "preview" / "nixl-push-handshakes.png").stat().st_size > 50_000


def test_render_all_carries_the_objects_deploy_takes() -> None:
    rendered = generate.render_all()
    resource = yaml.safe_load(rendered[k8s.PROMETHEUS_RULE_FILE])
    assert resource["kind"] == "PrometheusRule" and resource["spec"] == rules.build_rules()
    configmap = yaml.safe_load(rendered[k8s.CONFIGMAP_FILE])
    assert json.loads(configmap["data"][Path(panels.DASHBOARD_FILE).name]) == panels.build_dashboard()


# ------------------------------------------------------------ headline panels: exact counts
def test_the_counted_panels_are_headlines() -> None:
    # The panels that exist to show a count (the "1,024 descriptors saved" of a run).
    assert {"Descriptors saved", "Descriptor registrations saved", "Descriptors registered vs saved (range)",
            "Full D->P handshakes", "D->P handshakes that were notification-only",
            "KV leases expired while the decoder waited", "Router requests by outcome (range)",
            "Router requests answered ok (range)"} <= panels.headline_titles()
    for panel in panels.iter_panels(panels.build_dashboard()):
        if panel["title"] in panels.headline_titles():
            for t in panel["targets"]:
                assert t["instant"] and "offset $__range" in t["expr"], panel["title"]
                assert not promql.range_calls(t["expr"]), panel["title"]


def test_headline_panel_with_increase_fails_the_check() -> None:
    dashboard = panels.build_dashboard()
    panel = next(p for p in panels.iter_panels(dashboard) if p["title"] == "Descriptors saved")
    panel["targets"][0]["expr"] = "sum(increase(vllm:nixl_descriptors_saved_total[$__range]))"
    errors = check.check_dashboard(dashboard)
    assert any("increase() over [$__range] extrapolates" in e for e in errors), errors
    assert any("a headline panel shows the exact change" in e for e in errors), errors
    dashboard["panels"] = [p for p in dashboard["panels"] if p.get("title") != "Descriptors saved"]
    assert "headline panel 'Descriptors saved' is not on the dashboard" in check.check_dashboard(dashboard)


def test_range_change_is_exact_under_promtool(tmp_path: Path) -> None:
    """The exact range change, evaluated by promtool between scrapes (at 15m30s, range 10m,
    so the range starts at 5m30s): a step inside the range, a series born inside it at 0,
    a counter reset inside it. Expected values worked out by hand from the series."""
    series = "vllm:nixl_descriptors_saved_total"
    expr = "sum by (instance) (" + promrun.fill_variables(
        queries.range_change(f'{series}{{job="vllm"}}'), {"__range": "10m"}) + ")"
    (tmp_path / "empty.rules.yaml").write_text("groups: []\n")
    labels = 'job="vllm",model_name="m",engine="0",direction="d_to_p"'
    case = {
        "rule_files": ["empty.rules.yaml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                # 0 until 5m, 7 from 6m on: the range holds the whole step.
                {"series": f'{series}{{{labels},instance="step"}}', "values": "0x5 7x15"},
                # Created at 8m (at 0, as the connector creates its series), 3 from 9m on.
                {"series": f'{series}{{{labels},instance="born"}}', "values": "_x7 0 3x12"},
                # 60 at the range's start, restarted at 7m, 4 since: counts from the reset.
                {"series": f'{series}{{{labels},instance="reset"}}',
                 "values": "10 20 30 40 50 60 70 0 4x12"},
                {"series": f'{series}{{{labels.replace("vllm", "other")},instance="step"}}',
                 "values": "0+100x20"},
            ],
            "promql_expr_test": [{"expr": expr, "eval_time": "15m30s", "exp_samples": [
                {"labels": '{instance="step"}', "value": 7},
                {"labels": '{instance="born"}', "value": 3},
                {"labels": '{instance="reset"}', "value": 4},
            ]}],
        }],
    }
    test_file = tmp_path / "range_change.test.yaml"
    test_file.write_text(yaml.safe_dump(case))
    proc = promtool("test", "rules", str(test_file))
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


# --------------------------------------------------------------------- docs/telemetry.md
def _doc_rows(doc: str, first_cell: str) -> list[str]:
    return [line for line in doc.splitlines() if line.startswith(f"| {first_cell} |")]


def test_doc_lists_every_metric_with_its_closed_label_values() -> None:
    doc = DOC.read_text()
    for spec in (*V.ALL_METRICS, V.OBSERVED_DEGRADED, *V.STOCK_METRICS):
        exposed = spec.name if spec.kind is V.MetricKind.HISTOGRAM else spec.series_names[0]
        rows = [line for line in doc.splitlines()
                if line.startswith(f"| `{exposed}`") and f"| {spec.kind.value} |" in line]
        assert len(rows) == 1, exposed
        assert spec.help in rows[0], exposed
        for label in spec.labels:
            for value in V.allowed_values(spec.name, label):
                assert f"`{value}`" in rows[0], (exposed, label, value)


def test_doc_lists_spans_attributes_events_and_enums() -> None:
    doc = DOC.read_text()
    spans = [V.SPAN_HANDSHAKE, V.SPAN_PUSH_REGISTER, V.SPAN_PUSH_WRITE, V.SPAN_PUSH_RECEIVE,
             V.SPAN_ROUTER_REQUEST, *(V.phase_span_name(p) for p in V.Phase),
             *(V.router_leg_span_name(leg) for leg in V.RouterLeg)]
    for name in spans:
        assert f"`{name}`" in doc, name
    for keys in (V.Attr, V.RouterAttr):
        for const, key in vars(keys).items():
            if const.isupper():
                assert _doc_rows(doc, f"`{key}`"), key
    for values in (V.SpanEvent, V.Trigger, V.Direction, V.LinkRole):
        for member in values:
            assert f"`{member.value}`" in doc, member
    assert f"`{V.EXEMPLAR_TRACE_ID}`" in doc and f"`{V.EXEMPLAR_SPAN_ID}`" in doc
    phase_rows = [line for line in doc.splitlines() if re.match(r"\| \d+ \| `", line)]
    assert [row.split("`")[1] for row in phase_rows] == [p.value for p in V.Phase]


def test_doc_says_what_each_telemetry_error_loses() -> None:
    doc = DOC.read_text()
    for reason in V.TelemetryError:
        rows = [line for line in doc.splitlines() if re.fullmatch(rf"\| `{reason.value}` \| (.+) \|", line)]
        assert len(rows) == 1, reason
        assert "(no text)" not in rows[0], reason


def test_doc_relabel_config_is_the_one_the_tests_scrape_with() -> None:
    block = DOC.read_text().split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == {"metric_relabel_configs": promrun.RESTORE_VLLM_COLON}


def test_doc_reason_without_text_or_stale_doc_fails_the_check(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    generate.write_files(tmp_path, tmp_path / DOC.name)
    doc = tmp_path / DOC.name
    doc.write_text(doc.read_text().replace("| `table_full` |", "| `table_overflow` |"))
    proc = in_tmp(tmp_path, "--check")
    assert proc.returncode == 1 and f"{DOC.name}" in proc.stderr and "stale" in proc.stderr, proc.stderr
    monkeypatch.delitem(telemetry_doc.TELEMETRY_ERROR_TEXT, V.TelemetryError.SPANS_DROPPED)
    errors = generate.check_all(tmp_path, doc)
    assert any("'spans_dropped' has no text" in e for e in errors), errors


# ------------------------------------------------------------------------------- Perses
PERSES_FILES = (perses.DASHBOARD_FILE, perses.OPERATOR_FILE)


def _perses_on_disk(rel: str) -> dict[str, Any]:
    return yaml.safe_load((DASH / rel).read_text())


@pytest.mark.parametrize("rel", PERSES_FILES)
def test_perses_files_pass_perses_schema(rel: str) -> None:
    resource = _perses_on_disk(rel)
    assert perses_schema.problems(resource) == []
    assert check.check_perses(panels.build_dashboard(), [resource]) == []


def test_perses_has_every_grafana_row_panel_and_query() -> None:
    grafana = panels.build_dashboard()
    spec = _perses_on_disk(perses.DASHBOARD_FILE)["spec"]
    titles = [layout["spec"]["display"]["title"] for layout in spec["layouts"]]
    assert titles == [title for title, _, _ in panels.ROWS]
    collapsed = {layout["spec"]["display"]["title"] for layout in spec["layouts"]
                 if not layout["spec"]["display"]["collapse"]["open"]}
    assert collapsed == {title for title, folded, _ in panels.ROWS if folded}
    by_title = {p["spec"]["display"]["name"]: p["spec"] for p in spec["panels"].values()}
    for panel in panels.iter_panels(grafana):
        mine = by_title[panel["title"]]
        assert mine["display"]["description"] == panel["description"]
        assert mine["plugin"]["kind"] == perses.PANEL_KINDS[panel["type"]]
        queries = [q["spec"]["plugin"]["spec"] for q in mine["queries"]]
        assert [q["query"] for q in queries] == [t["expr"] for t in panel["targets"]]
        assert all(q["datasource"] == "$datasource" for q in queries)
    names = [v["spec"]["name"] for v in spec["variables"]]
    assert names == ["datasource", "job", "model_name", "instance", "engine"]  # $jaeger is Grafana's only


def test_a_row_added_for_grafana_appears_in_perses(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = ("Extra (requires a test)", True, lambda: [panels.Cell(panels.timeseries(
        "Extra pushes/s", "Pushes per second.",
        [panels.target(f"sum(rate({queries.sel(V.PUSHES.series_names[0])}[$__rate_interval]))", "pushes")],
        "suffix: pushes/s"), 12, 8)])
    monkeypatch.setattr(panels, "ROWS", (*panels.ROWS, extra))
    grafana = panels.build_dashboard()
    resource = perses.build_dashboard(grafana)
    assert check.check_perses(grafana, [resource]) == []
    layout = resource["spec"]["layouts"][-1]
    assert layout["spec"]["display"] == {"title": "Extra (requires a test)", "collapse": {"open": False}}
    [item] = layout["spec"]["items"]
    panel = resource["spec"]["panels"][item["content"]["$ref"].rsplit("/", 1)[1]]["spec"]
    assert panel["display"]["name"] == "Extra pushes/s"
    assert panel["plugin"]["spec"]["yAxis"]["label"] == "pushes/s"


def _perses_spec(resource: dict[str, Any]) -> dict[str, Any]:
    return resource["spec"]


def _first_panel(resource: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(p["spec"] for p in resource["spec"]["panels"].values() if p["spec"]["plugin"]["kind"] == kind)


def _first_query(resource: dict[str, Any]) -> dict[str, Any]:
    return _first_panel(resource, "TimeSeriesChart")["queries"][0]["spec"]["plugin"]["spec"]


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: _first_panel(r, "TimeSeriesChart")["plugin"]["spec"].update(exemplars=True),
     "Additional properties are not allowed ('exemplars'"),
    (lambda r: _first_panel(r, "StatChart")["plugin"].update(kind="GraphPanel"),
     "'GraphPanel' is not one of"),
    (lambda r: _first_panel(r, "StatChart")["plugin"]["spec"]["format"].update(unit="percentunit"),
     "is not valid under any of the given schemas"),
    (lambda r: _first_panel(r, "BarChart")["plugin"]["spec"].pop("calculation"),
     "'calculation' is a required"),
    (lambda r: _first_query(r).update(instant="yes"), "'yes' is not of type 'boolean'"),
    (lambda r: r["spec"]["layouts"][0]["spec"]["items"][0]["content"].update({"$ref": "#/spec/panels/nope"}),
     "names no panel"),
    (lambda r: r["spec"]["layouts"][0]["spec"]["items"].pop(), "is in no layout"),
    (lambda r: r["spec"]["layouts"][0]["spec"]["items"][1].update(x=0, y=0), "overlaps another panel"),
    (lambda r: r["spec"]["variables"][1]["spec"].update(name="9"), "variable name '9' is not valid"),
    (lambda r: r["spec"]["variables"][1]["spec"].update(allowAllValue=False),
     "customAllValue needs allowAllValue"),
    (lambda r: _first_query(r).update(query="rate(x[$window])"), "undefined variable $window"),
    (lambda r: r["metadata"].update(project="no spaces allowed"), "does not match"),
])
def test_perses_schema_catches_what_perses_would_refuse(change: Any, message: str) -> None:
    resource = perses.build_dashboard()
    change(resource)
    errors = perses_schema.problems(resource)
    assert any(message in e for e in errors), errors


def test_perses_check_fails_when_it_loses_a_panel_or_a_query_or_a_panel_type() -> None:
    grafana = panels.build_dashboard()
    lost_query = perses.build_dashboard(grafana)
    _first_panel(lost_query, "TimeSeriesChart")["queries"].pop()
    errors = check.check_perses(grafana, [lost_query])
    assert any("queries differ from the Grafana panel's" in e for e in errors), errors
    renamed = perses.build_dashboard(grafana)
    _first_panel(renamed, "StatChart")["display"]["name"] = "Renamed"
    assert any("rows and panels differ" in e for e in check.check_perses(grafana, [renamed]))
    next(panels.iter_panels(grafana))["type"] = "heatmap"
    assert any("type 'heatmap' has no Perses counterpart" in e
               for e in check.check_perses(grafana, [perses.build_dashboard(grafana)]))


def test_check_fails_when_the_perses_files_drift(tmp_path: Path) -> None:
    generate.write_files(tmp_path, tmp_path / DOC.name)
    path = tmp_path / perses.DASHBOARD_FILE
    path.write_text(path.read_text().replace("duration: 1h", "duration: 6h"))
    (tmp_path / perses.OPERATOR_FILE).unlink()
    proc = in_tmp(tmp_path, "--check")
    assert proc.returncode == 1
    assert f"{perses.DASHBOARD_FILE}: stale" in proc.stderr
    assert f"{perses.OPERATOR_FILE}: missing" in proc.stderr


# Opt-in, never in CI: Perses' own offline lint, with PERCLI naming a `percli` (PERCLI=percli when it
# is on PATH). No registry this project's machines reach has one (dashboards/README.md,
# "Validation"); what CI runs is our own schema, perses_schema.py (the tests above).
@pytest.mark.skipif(not os.environ.get("PERCLI"),
                    reason="opt-in, not in CI: PERCLI=/path/to/percli runs Perses' own lint")
@pytest.mark.parametrize("rel", PERSES_FILES[:1])
def test_percli_lint_accepts_the_perses_dashboard(rel: str) -> None:
    """Perses' own offline lint of the native dashboard (a PERCLI that is not there fails)."""
    exe = os.environ["PERCLI"]
    proc = subprocess.run([exe, "lint", "-f", str(DASH / rel)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
