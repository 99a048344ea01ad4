"""Dashboards as code: Grafana dashboard, Prometheus rules and the Kubernetes variants.

Everything is built from `connector.vocabulary`, so a renamed metric, label or label
value cannot drift between the connector and what operators look at.

    python -m dashboards.generate          # (re)write every generated file
    python -m dashboards.generate --check  # fail if a file is stale or a query is wrong

`--check` fails when a checked-in file differs from what this module generates, when
a panel or rule selects a metric, label or label value the vocabulary does not
define, when a metric of the vocabulary is on no panel, and when a panel lacks a unit
or a description naming its metrics, or a rate does not use `$__rate_interval`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

from connector import vocabulary as V
from connector.vocabulary import Label, MetricKind, MetricSpec
from dashboards import promql

ROOT = Path(__file__).resolve().parent
DASHBOARD_FILE = "grafana/nixl-push-handshakes.json"
RULES_FILE = "rules/nixl-push.rules.yaml"
CONFIGMAP_FILE = "k8s/configmap.yaml"
PROMETHEUS_RULE_FILE = "k8s/prometheusrule.yaml"

DASHBOARD_UID = "nixl-push-handshakes"
DASHBOARD_TITLE = "NIXL push handshakes"
SCHEMA_VERSION = 39

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
RANGE = "$__range"
# Every panel query is scoped by the dashboard variables (multi-value, hence =~).
SCOPE = ('job=~"$job"', 'model_name=~"$model_name"', 'instance=~"$instance"', 'engine=~"$engine"')
VARIABLES = ("datasource", "job", "model_name", "instance", "engine", "jaeger")
BUILTIN_VARIABLES = {"__rate_interval", "__range", "__interval", "__range_s", "__interval_ms"}
# The series the variables are read from: pre-created at 0 by every engine running the fork.
VARIABLE_SOURCE = V.PUSHES.series_names[0]

# Labels Prometheus or vLLM put on every series, besides the vocabulary's own.
BASE_LABELS = frozenset({"job", "instance", Label.MODEL_NAME, Label.ENGINE})
VOCAB_LABELS = frozenset(V.LABEL_VALUES)
# Per-metric label value sets (e.g. `outcome`) come from the vocabulary.
VALUE_SETS: dict[tuple[str, str], tuple[str, ...]] = V.METRIC_LABEL_VALUES

# Exemplars: the latency histograms carry {trace_id, span_id} exemplars (OpenMetrics);
# their panels show them, and a click opens the trace in the $jaeger data source.
JAEGER_VARIABLE = "jaeger"
TRACE_LINK = {
    "title": "Open trace ${__data.fields.trace_id} in Jaeger",
    "url": '/explore?schemaVersion=1&orgId=1&panes={"trace":{"datasource":"${jaeger}",'
           '"queries":[{"refId":"A","datasource":{"type":"jaeger","uid":"${jaeger}"},'
           '"query":"${__data.fields.trace_id}"}],"range":{"from":"now-1h","to":"now"}}}',
    "targetBlank": True,
}

# Alert thresholds (seconds / ratios); see dashboards/README.md.
FAILURE_RATIO_THRESHOLD = 0.10
P99_LATENCY_THRESHOLD_S = 2.5
QUEUE_WAIT_P95_THRESHOLD_S = 0.5
RECEIVE_P99_THRESHOLD_S = 5.0
FULL_D_TO_P_WINDOW = "15m"
# Three default side-channel timeouts (5 s each): past this a handshake is hung, not slow.
STUCK_THRESHOLD_S = 15

COUNT_UNIT = "short"


# ----------------------------------------------------------------- vocabulary helpers
def _all_specs() -> tuple[MetricSpec, ...]:
    return V.ALL_METRICS + V.STOCK_METRICS


def series_index() -> dict[str, MetricSpec]:
    """Series name (as stored by Prometheus) -> its metric spec."""
    return {series: spec for spec in _all_specs() for series in spec.series_names}


def total(spec: MetricSpec) -> str:
    assert spec.kind is MetricKind.COUNTER, spec.name
    return spec.series_names[0]


def bucket(spec: MetricSpec) -> str:
    assert spec.kind is MetricKind.HISTOGRAM, spec.name
    return spec.name + "_bucket"


def hcount(spec: MetricSpec) -> str:
    assert spec.kind is MetricKind.HISTOGRAM, spec.name
    return spec.name + "_count"


def hsum(spec: MetricSpec) -> str:
    assert spec.kind is MetricKind.HISTOGRAM, spec.name
    return spec.name + "_sum"


def eq(label: str, value: object) -> str:
    """An exact label matcher; the value must be one the vocabulary allows."""
    text = str(value)
    allowed = set(V.LABEL_VALUES[label]).union(
        *(values for (_, lab), values in VALUE_SETS.items() if lab == label))
    if text not in allowed:
        raise ValueError(f"{label}={text!r} is not in the vocabulary ({sorted(allowed)})")
    return f'{label}="{text}"'


def sel(series: str, *matchers: str, scoped: bool = True) -> str:
    parts = (*SCOPE, *matchers) if scoped else matchers
    return series + "{" + ",".join(parts) + "}" if parts else series


def by(*labels: str) -> str:
    return "by (" + ", ".join(labels) + ")"


D_TO_P = eq(Label.DIRECTION, V.Direction.D_TO_P)
NOTIF_ONLY = eq(Label.NOTIF_AGENTS_ONLY, V.bool_label(True))
FULL = eq(Label.NOTIF_AGENTS_ONLY, V.bool_label(False))
FAILURE = eq(Label.OUTCOME, V.Outcome.FAILURE)
QUEUE_WAIT = eq(Label.PHASE, V.Phase.QUEUE_WAIT)
RECEIVE_SUCCESS = eq(Label.OUTCOME, V.ReceiveOutcome.SUCCESS)
NOT_SUCCESS = f'{Label.OUTCOME}!="{V.ReceiveOutcome.SUCCESS.value}"'
FLAVOR = (Label.DIRECTION, Label.NOTIF_AGENTS_ONLY)


def quantile(q: float, spec: MetricSpec, labels: Iterable[str], window: str, *matchers: str,
             scoped: bool = True, drop_nan: bool = True, multiline: bool = False) -> str:
    """histogram_quantile over rate of _bucket; `>= 0` drops the NaN of idle windows."""
    inner = f"rate({sel(bucket(spec), *matchers, scoped=scoped)}[{window}])"
    start, end = ("\n  ", "\n") if multiline else (" ", "")
    expr = f"histogram_quantile({q},{start}sum {by('le', *labels)} ({inner}){end})"
    return expr + " >= 0" if drop_nan else expr


# --------------------------------------------------------------------- panel builders
def target(expr: str, legend: str = "__auto", *, instant: bool = False) -> dict[str, Any]:
    return {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend,
            "range": not instant, "instant": instant, "refId": ""}


def _panel(kind: str, title: str, description: str, targets: list[dict[str, Any]], unit: str,
           defaults: dict[str, Any] | None = None, options: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return {
        "type": kind, "title": title, "description": description, "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, **(defaults or {})}, "overrides": []},
        "options": options or {}, "targets": targets,
    }


def _thresholds(*steps: tuple[str, float | None]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


def timeseries(title: str, description: str, targets: list[dict[str, Any]], unit: str, *,
               stacked: bool = False, bars: bool = False, max_value: float | None = None,
               decimals: int | None = None, exemplars: bool = False) -> dict[str, Any]:
    custom = {
        "drawStyle": "bars" if bars else "line", "lineWidth": 1, "fillOpacity": 60 if bars else 10,
        "showPoints": "never", "spanNulls": False, "axisSoftMin": 0,
        "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
    }
    defaults: dict[str, Any] = {"custom": custom, "color": {"mode": "palette-classic"}, "min": 0}
    if max_value is not None:
        defaults["max"] = max_value
    if decimals is not None:
        defaults["decimals"] = decimals
    options = {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                          "calcs": ["lastNotNull", "max"]},
               "tooltip": {"mode": "multi", "sort": "desc"}}
    if exemplars:
        # Grafana queries the exemplars of each target and draws them as points; the
        # link opens the trace an exemplar names in the $jaeger data source.
        for t in targets:
            t["exemplar"] = True
        defaults["links"] = [dict(TRACE_LINK)]
        description += EXEMPLAR_NOTE
    return _panel("timeseries", title, description, targets, unit, defaults, options)


EXEMPLAR_NOTE = (" Exemplars (points) carry the trace_id of a traced observation: click one and "
                 "open its trace in the $jaeger data source (tracing on, Prometheus with "
                 "--enable-feature=exemplar-storage).")


def stat(title: str, description: str, expr: str, unit: str, *, thresholds: dict[str, Any],
         no_value: str, decimals: int | None = None, legend: str = "") -> dict[str, Any]:
    defaults: dict[str, Any] = {"color": {"mode": "thresholds"}, "thresholds": thresholds,
                                "noValue": no_value}
    if decimals is not None:
        defaults["decimals"] = decimals
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "colorMode": "background", "graphMode": "none", "justifyMode": "center",
               "orientation": "auto", "textMode": "value", "wideLayout": True,
               "showPercentChange": False}
    return _panel("stat", title, description, [target(expr, legend or title, instant=True)], unit,
                  defaults, options)


def bargauge(title: str, description: str, targets: list[dict[str, Any]], unit: str, *,
             no_value: str, decimals: int | None = None) -> dict[str, Any]:
    for t in targets:
        t.update(instant=True, range=False)
    defaults: dict[str, Any] = {"color": {"mode": "palette-classic"}, "min": 0, "noValue": no_value,
                                "thresholds": _thresholds(("green", None))}
    if decimals is not None:
        defaults["decimals"] = decimals
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "displayMode": "basic", "orientation": "horizontal", "showUnfilled": True,
               "valueMode": "color", "namePlacement": "auto", "sizing": "auto", "minVizHeight": 16,
               "minVizWidth": 8, "maxVizHeight": 300}
    return _panel("bargauge", title, description, targets, unit, defaults, options)


# ------------------------------------------------------------------------- the panels
def _overview() -> list[tuple[dict[str, Any], int, int]]:
    dur_count = hcount(V.HANDSHAKE_DURATION)
    notif = f"sum(increase({sel(dur_count, D_TO_P, NOTIF_ONLY)}[{RANGE}]))"
    all_d_to_p = f"sum(increase({sel(dur_count, D_TO_P)}[{RANGE}]))"
    full = f"sum(increase({sel(dur_count, D_TO_P, FULL)}[{RANGE}]))"
    regs = f"sum(increase({sel(total(V.DESCRIPTOR_REGISTRATIONS_SAVED))}[{RANGE}]))"
    descs = f"sum(increase({sel(total(V.DESCRIPTORS_SAVED))}[{RANGE}]))"
    counted = (f"Counted from {V.HANDSHAKE_DURATION.name}_count (one observation per handshake); "
               "its success series exist at 0 from start-up, so even the single D->P handshake "
               f"of a P/D pair is seen by increase(), unlike a first {V.HANDSHAKES.name} sample.")
    return [
        (stat("D->P handshakes that were notification-only",
              "Share of decode-to-prefill handshakes in the dashboard range that were "
              "notification-only (notif_agents_only=\"true\"). In push mode D only needs P's "
              "agent to send PUSH_REG, so this should be 100%; anything lower means D prepared "
              f"descriptors it never uses. {counted} Shows 'no D->P handshakes' when none "
              "happened in the range (a guarded denominator instead of NaN).",
              f"{notif} / ({all_d_to_p} > 0)", "percentunit",
              thresholds=_thresholds(("red", None), ("green", 1)),
              no_value="no D->P handshakes", decimals=1), 6, 5),
        (stat("Full D->P handshakes",
              "Full (descriptor-preparing) decode-to-prefill handshakes in the dashboard range; "
              f"should be 0 in push mode. {counted}",
              full, COUNT_UNIT, thresholds=_thresholds(("green", None), ("red", 1)),
              no_value="0", decimals=0), 6, 5),
        (stat("Descriptor registrations saved",
              "NIXL descriptor lists (prep_xfer_dlist calls) that notification-only handshakes "
              "skipped in the dashboard range: increase of "
              f"{V.DESCRIPTOR_REGISTRATIONS_SAVED.name}_total over $__range (an estimate: "
              "increase() extrapolates to the range edges).",
              regs, COUNT_UNIT, thresholds=_thresholds(("blue", None)), no_value="0", decimals=0),
         6, 5),
        (stat("Descriptors saved",
              "Descriptors that notification-only handshakes did not prepare in the dashboard "
              f"range: increase of {V.DESCRIPTORS_SAVED.name}_total over $__range (an estimate: "
              "increase() extrapolates to the range edges).",
              descs, COUNT_UNIT, thresholds=_thresholds(("blue", None)), no_value="0", decimals=0),
         6, 5),
    ]


def _handshakes() -> list[tuple[dict[str, Any], int, int]]:
    dur_count = hcount(V.HANDSHAKE_DURATION)
    hs_total = total(V.HANDSHAKES)
    return [
        (timeseries("Handshakes/s by direction and flavor",
                    "NIXL handshakes per second by direction (d_to_p: decode to prefill, p_to_d: "
                    "prefill to decode) and flavor (notif_agents_only). From "
                    f"{V.HANDSHAKE_DURATION.name}_count, whose series are pre-created at 0 so the "
                    "first handshake of each flavor is counted.",
                    [target(f"sum {by(*FLAVOR)} (rate({sel(dur_count)}[{RATE}]))",
                            "{{direction}} notif_agents_only={{notif_agents_only}}")],
                    "suffix: handshakes/s"), 12, 8),
        (timeseries("Handshakes/s by trigger and outcome",
                    "NIXL handshakes per second by direction, trigger (push_reg, heartbeat, "
                    "push_write, push_reg_early: P->D started on D's PUSH_REG, other) and outcome, "
                    f"from {V.HANDSHAKES.name}_total. A label "
                    "combination's very first handshake creates its series and is not visible "
                    "to rate().",
                    [target(f"sum {by(Label.DIRECTION, Label.TRIGGER, Label.OUTCOME)} "
                            f"(rate({sel(hs_total)}[{RATE}]))",
                            "{{direction}} {{trigger}} {{outcome}}")],
                    "suffix: handshakes/s"), 12, 8),
    ]


def _descriptors() -> list[tuple[dict[str, Any], int, int]]:
    regs_saved, descs_saved = total(V.DESCRIPTOR_REGISTRATIONS_SAVED), total(V.DESCRIPTORS_SAVED)
    regs, descs = total(V.DESCRIPTOR_REGISTRATIONS), total(V.DESCRIPTORS_REGISTERED)
    return [
        (timeseries("Descriptor registrations saved/s",
                    "Descriptor lists per second that notification-only handshakes did not "
                    f"prepare, by direction: rate of {V.DESCRIPTOR_REGISTRATIONS_SAVED.name}_total.",
                    [target(f"sum {by(Label.DIRECTION)} (rate({sel(regs_saved)}[{RATE}]))",
                            "saved {{direction}}")],
                    "suffix: lists/s"), 8, 8),
        (timeseries("Descriptors saved/s",
                    "Descriptors per second that notification-only handshakes did not prepare, "
                    f"by direction: rate of {V.DESCRIPTORS_SAVED.name}_total.",
                    [target(f"sum {by(Label.DIRECTION)} (rate({sel(descs_saved)}[{RATE}]))",
                            "saved {{direction}}")],
                    "suffix: descriptors/s"), 8, 8),
        (bargauge("Descriptors registered vs saved (range)",
                  "Contrast over the dashboard range: descriptors full handshakes prepared "
                  f"({V.DESCRIPTORS_REGISTERED.name}_total, by direction and list) against those "
                  f"notification-only handshakes skipped ({V.DESCRIPTORS_SAVED.name}_total).",
                  [target(f"sum {by(Label.DIRECTION, Label.LIST)} "
                          f"(increase({sel(descs)}[{RANGE}]))",
                          "registered {{direction}} {{list}}"),
                   target(f"sum {by(Label.DIRECTION)} (increase({sel(descs_saved)}[{RANGE}]))",
                          "saved {{direction}}")],
                  COUNT_UNIT, no_value="0", decimals=0), 8, 8),
        (timeseries("Descriptor lists prepared/s by full handshakes",
                    "prep_xfer_dlist calls per second during handshakes, by direction and list "
                    f"(remote/local): rate of {V.DESCRIPTOR_REGISTRATIONS.name}_total. In push "
                    "mode only p_to_d (P preparing D's blocks) should be non-zero.",
                    [target(f"sum {by(Label.DIRECTION, Label.LIST)} (rate({sel(regs)}[{RATE}]))",
                            "{{direction}} {{list}}")],
                    "suffix: lists/s"), 12, 8),
        (timeseries("Descriptors registered/s by full handshakes",
                    "Descriptors in the lists prepared during handshakes, per second, by "
                    f"direction and list: rate of {V.DESCRIPTORS_REGISTERED.name}_total.",
                    [target(f"sum {by(Label.DIRECTION, Label.LIST)} (rate({sel(descs)}[{RATE}]))",
                            "{{direction}} {{list}}")],
                    "suffix: descriptors/s"), 12, 8),
    ]


def _latency() -> list[tuple[dict[str, Any], int, int]]:
    dur, phase = V.HANDSHAKE_DURATION, V.HANDSHAKE_PHASE_DURATION
    nan_note = ("Quantiles of windows without handshakes are dropped (`>= 0` filters NaN) "
                "instead of drawn as NaN.")
    return [
        (timeseries("Handshake latency p50 / p95 / p99 by flavor",
                    "Handshake wall time (submission to vLLM's handshake executor until done, "
                    "queue wait included) by direction and flavor: histogram_quantile over the "
                    f"rate of {dur.name}_bucket. {nan_note}",
                    [target(quantile(q, dur, FLAVOR, RATE),
                            f"p{round(q * 100)} {{{{direction}}}} notif_agents_only="
                            "{{notif_agents_only}}")
                     for q in (0.5, 0.95, 0.99)],
                    "s", exemplars=True), 12, 9),
        (timeseries("Executor queue wait p50 / p95 / p99",
                    "Time handshakes waited in vLLM's handshake executor queue before running "
                    f"(phase=\"queue_wait\" of {phase.name}). Growing values mean handshakes "
                    f"queue behind each other. {nan_note}",
                    [target(quantile(q, phase, (Label.DIRECTION,), RATE, QUEUE_WAIT),
                            f"p{round(q * 100)} {{{{direction}}}}")
                     for q in (0.5, 0.95, 0.99)],
                    "s", exemplars=True), 12, 9),
        (timeseries("Per-phase latency p95",
                    "p95 of the time one handshake spent in each phase (queue_wait, "
                    "metadata_fetch, metadata_decode, agent_load, transfer_plan, "
                    "descriptor_registration), by direction: histogram_quantile over the rate of "
                    f"{phase.name}_bucket. {nan_note}",
                    [target(quantile(0.95, phase, (Label.DIRECTION, Label.PHASE), RATE),
                            "{{direction}} {{phase}}")],
                    "s", exemplars=True), 12, 9),
        (bargauge("Mean time per phase (range)",
                  "Where handshake time goes: mean seconds per handshake in each phase over the "
                  f"dashboard range, increase of {phase.name}_sum divided by increase of "
                  f"{phase.name}_count (denominator guarded with > 0, so phases that did not run "
                  "are absent rather than NaN).",
                  [target(f"sum {by(Label.DIRECTION, Label.PHASE)} "
                          f"(increase({sel(hsum(phase))}[{RANGE}])) / "
                          f"(sum {by(Label.DIRECTION, Label.PHASE)} "
                          f"(increase({sel(hcount(phase))}[{RANGE}])) > 0)",
                          "{{direction}} {{phase}}")],
                  "s", no_value="no handshake phases in range"), 12, 9),
    ]


def _failures() -> list[tuple[dict[str, Any], int, int]]:
    hs_total, fails = total(V.HANDSHAKES), total(V.HANDSHAKE_PHASE_FAILURES)
    all_rate = f"sum {by(Label.DIRECTION)} (rate({sel(hs_total)}[{RATE}]))"
    fail_rate = f"sum {by(Label.DIRECTION)} (rate({sel(hs_total, FAILURE)}[{RATE}]))"
    return [
        (timeseries("Handshake failure ratio by direction",
                    f"Failed / all handshakes per direction, from {V.HANDSHAKES.name}_total. "
                    "0 while handshakes succeed; absent (not NaN) while no handshake happens "
                    "(denominator guarded with > 0).",
                    [target(f"({fail_rate} or {all_rate} * 0) / ({all_rate} > 0)",
                            "{{direction}}")],
                    "percentunit", max_value=1), 8, 8),
        (timeseries("Handshake failures/s by phase and error type",
                    "Failed handshakes per second by direction, the phase that failed and a "
                    f"bounded error type: rate of {V.HANDSHAKE_PHASE_FAILURES.name}_total.",
                    [target(f"sum {by(Label.DIRECTION, Label.PHASE, Label.ERROR_TYPE)} "
                            f"(rate({sel(fails)}[{RATE}]))",
                            "{{direction}} {{phase}} {{error_type}}")],
                    "suffix: failures/s", bars=True, stacked=True), 16, 8),
    ]


def _push_flow() -> list[tuple[dict[str, Any], int, int]]:
    notifs, pushes = total(V.PUSH_REG_NOTIFS), total(V.PUSHES)
    rcv = V.RECEIVE_DURATION
    return [
        (timeseries("KV receive latency p50 / p95 / p99 by outcome",
                    "Decode side, per request: from the registration handed to the worker until "
                    "the pushed KV landed (success), the receive failed (failure) or nothing "
                    "landed within the registration timeout (expired). Covers PUSH_REG, P's "
                    "prefill finishing, handshakes and the WRITE: the P/D health number. "
                    f"histogram_quantile over the rate of {rcv.name}_bucket; windows without "
                    "receives are dropped (`>= 0`).",
                    [target(quantile(q, rcv, (Label.OUTCOME,), RATE),
                            f"p{round(q * 100)} {{{{outcome}}}}")
                     for q in (0.5, 0.95, 0.99)],
                    "s", exemplars=True), 12, 8),
        (timeseries("KV receives/s by outcome",
                    "Decode-side receives per second by outcome (success, failure, expired): "
                    f"rate of {rcv.name}_count, whose series are pre-created at 0.",
                    [target(f"sum {by(Label.OUTCOME)} (rate({sel(hcount(rcv))}[{RATE}]))",
                            "{{outcome}}")],
                    "suffix: receives/s"), 12, 8),
        (timeseries("PUSH_REG notifications/s",
                    "PUSH_REG notifications decode workers sent to prefill agents per second, by "
                    f"outcome (sent/failed): rate of {V.PUSH_REG_NOTIFS.name}_total.",
                    [target(f"sum {by(Label.OUTCOME)} (rate({sel(notifs)}[{RATE}]))",
                            "{{outcome}}")],
                    "suffix: notifs/s"), 12, 8),
        (timeseries("KV pushes/s: started / completed / failed",
                    "KV pushes (WRITEs of one request's blocks) on prefill workers per second, by "
                    f"outcome: rate of {V.PUSHES.name}_total.",
                    [target(f"sum {by(Label.OUTCOME)} (rate({sel(pushes)}[{RATE}]))",
                            "{{outcome}}")],
                    "suffix: pushes/s"), 12, 8),
    ]


def _reliability() -> list[tuple[dict[str, Any], int, int]]:
    in_flight, oldest = V.HANDSHAKES_IN_FLIGHT, V.HANDSHAKE_OLDEST_IN_FLIGHT
    retries, rejected = total(V.HANDSHAKE_RETRIES), total(V.PUSH_REG_REJECTED)
    lost, sc_rejected = total(V.TELEMETRY_ERRORS), total(V.SIDE_CHANNEL_REJECTED)
    return [
        (timeseries("Handshakes in flight",
                    "Handshakes submitted and not finished (queued in vLLM's handshake executor "
                    f"or running), by direction and flavor: {in_flight.name}, summed over the "
                    "engine's workers. A handshake that hangs shows here before it is counted.",
                    [target(f"sum {by(*FLAVOR)} ({sel(in_flight.name)})",
                            "{{direction}} notif_only={{notif_agents_only}}")],
                    COUNT_UNIT), 6, 8),
        (timeseries("Oldest handshake in flight",
                    f"Age of the oldest unfinished handshake by direction: {oldest.name} "
                    f"(0 when none). Alert NixlHandshakeStuck fires above {STUCK_THRESHOLD_S}s.",
                    [target(f"max {by(Label.DIRECTION)} ({sel(oldest.name)})", "{{direction}}")],
                    "s"), 6, 8),
        (timeseries("Handshake retries/s",
                    "Attempts re-queued after a transient failure (peer side channel unreachable "
                    f"or silent), by direction: rate of {retries}.",
                    [target(f"sum {by(Label.DIRECTION)} (rate({sel(retries)}[{RATE}]))",
                            "{{direction}}")],
                    "suffix: retries/s"), 4, 8),
        (timeseries("Peer input rejected/s",
                    "PUSH_REG notifications a prefill worker dropped (malformed, oversized, failing) "
                    f"by reason: rate of {rejected}; and side-channel requests an engine dropped "
                    f"(malformed, unknown rank): rate of {sc_rejected}. Each costs only itself; "
                    "the engine keeps serving.",
                    [target(f"sum {by(Label.REASON)} (rate({sel(rejected)}[{RATE}]))",
                            "PUSH_REG {{reason}}"),
                     target(f"sum {by(Label.REASON)} (rate({sel(sc_rejected)}[{RATE}]))",
                            "side channel {{reason}}")],
                    "suffix: msgs/s"), 4, 8),
        (timeseries("Telemetry errors/s",
                    f"Telemetry lost to an internal error, by reason: rate of {lost}. The push is "
                    "never affected; the first of each reason is logged at WARNING.",
                    [target(f"sum {by(Label.REASON)} (rate({sel(lost)}[{RATE}]))", "{{reason}}")],
                    "suffix: errors/s"), 4, 8),
    ]


def _stock() -> list[tuple[dict[str, Any], int, int]]:
    stock = {spec.name.removeprefix("vllm:nixl_"): spec for spec in V.STOCK_METRICS}
    xfer, post = stock["xfer_time_seconds"], stock["post_time_seconds"]
    nbytes, ndescs = stock["bytes_transferred"], stock["num_descriptors"]
    failed_x, failed_n = stock["num_failed_transfers"], stock["num_failed_notifications"]
    expired, after = stock["num_kv_expired_reqs"], stock["num_notifications_after_expiry"]
    return [
        (timeseries("NIXL transfers/s and failures/s",
                    f"Completed transfers per second (rate of {xfer.name}_count), failed "
                    f"transfers ({failed_x.name}_total) and failed notifications "
                    f"({failed_n.name}_total). vLLM's stock NIXL metrics.",
                    [target(f"sum(rate({sel(hcount(xfer))}[{RATE}]))", "transfers"),
                     target(f"sum(rate({sel(total(failed_x))}[{RATE}]))", "failed transfers"),
                     target(f"sum(rate({sel(total(failed_n))}[{RATE}]))", "failed notifications")],
                    "suffix: transfers/s"), 12, 8),
        (timeseries("NIXL transfer and post time p50 / p99",
                    f"Transfer duration ({xfer.name}) and post time ({post.name}) quantiles, "
                    "histogram_quantile over the rate of their _bucket series; idle windows "
                    "dropped with `>= 0`. vLLM's stock NIXL metrics.",
                    [target(quantile(0.5, xfer, (), RATE), "transfer p50"),
                     target(quantile(0.99, xfer, (), RATE), "transfer p99"),
                     target(quantile(0.99, post, (), RATE), "post p99")],
                    "s"), 12, 8),
        (timeseries("NIXL bytes transferred/s",
                    f"Bytes moved by NIXL transfers per second: rate of {nbytes.name}_sum. "
                    "vLLM's stock NIXL metric.",
                    [target(f"sum(rate({sel(hsum(nbytes))}[{RATE}]))", "bytes/s")],
                    "Bps"), 8, 8),
        (timeseries("Descriptors per NIXL transfer (mean)",
                    f"Mean descriptors per transfer: rate of {ndescs.name}_sum over rate of "
                    f"{ndescs.name}_count (absent while idle). vLLM's stock NIXL metric.",
                    [target(f"sum(rate({sel(hsum(ndescs))}[{RATE}])) / "
                            f"(sum(rate({sel(hcount(ndescs))}[{RATE}])) > 0)", "descriptors")],
                    COUNT_UNIT), 8, 8),
        (timeseries("KV lease expiries/s",
                    f"Requests whose KV lease expired ({expired.name}_total) and completion "
                    f"notifications that arrived after expiry ({after.name}_total), per second. "
                    "vLLM's stock NIXL metrics.",
                    [target(f"sum(rate({sel(total(expired))}[{RATE}]))", "expired leases"),
                     target(f"sum(rate({sel(total(after))}[{RATE}]))", "notifications after expiry")],
                    "suffix: requests/s"), 8, 8),
    ]


ROWS: tuple[tuple[str, bool, Any], ...] = (
    ("Overview", False, _overview),
    ("Handshakes", False, _handshakes),
    ("Descriptor registrations", False, _descriptors),
    ("Latency and executor queue", False, _latency),
    ("Failures", False, _failures),
    ("Push flow", False, _push_flow),
    ("Reliability", False, _reliability),
    ("NIXL transfers (vLLM stock)", True, _stock),
)


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "definition": query, "query": query, "refresh": 2, "sort": 1, "regex": "",
        "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0,
    }


def _templating() -> dict[str, Any]:
    src = VARIABLE_SOURCE
    return {"list": [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "refresh": 1, "regex": "", "hide": 0, "current": {}, "options": [],
         "multi": False, "includeAll": False},
        _variable("job", "job", f"label_values({src}, job)"),
        _variable("model_name", "model", f'label_values({src}{{job=~"$job"}}, model_name)'),
        _variable("instance", "instance",
                  f'label_values({src}{{job=~"$job",model_name=~"$model_name"}}, instance)'),
        _variable("engine", "engine",
                  f'label_values({src}{{job=~"$job",model_name=~"$model_name",'
                  f'instance=~"$instance"}}, engine)'),
        {"name": JAEGER_VARIABLE, "label": "Traces (Jaeger)", "type": "datasource",
         "query": "jaeger", "refresh": 1, "regex": "", "hide": 0, "current": {}, "options": [],
         "multi": False, "includeAll": False},
    ]}


def _layout() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    y, next_id = 0, 1
    for title, collapsed, build in ROWS:
        row = {"type": "row", "title": title, "collapsed": collapsed, "id": next_id,
               "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []}
        next_id += 1
        y += 1
        panels.append(row)
        x, line_h = 0, 0
        for panel, w, h in build():
            if x + w > 24:
                x, y, line_h = 0, y + line_h, 0
            panel = {"id": next_id, "gridPos": {"h": h, "w": w, "x": x, "y": y}, **panel}
            next_id += 1
            (row["panels"] if collapsed else panels).append(panel)
            x, line_h = x + w, max(line_h, h)
        y += line_h
    return panels


def build_dashboard() -> dict[str, Any]:
    return {
        "uid": DASHBOARD_UID,
        "title": DASHBOARD_TITLE,
        "description": "NIXL push-mode KV connector: handshakes by flavor, descriptor "
                       "registrations saved, phase latency, executor queue wait, failures, "
                       "PUSH_REG and pushes. Generated by dashboards/generate.py from "
                       "connector/vocabulary.py; do not edit by hand.",
        "tags": ["vllm", "nixl", "kv-transfer", "push"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "weekStart": "",
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": _templating(),
        "panels": _layout(),
    }


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every non-row panel, including those inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


# Latency histograms whose observations carry exemplars (their panels must show them).
EXEMPLAR_BUCKETS = frozenset(bucket(spec) for spec in V.EXEMPLAR_METRICS)

# ------------------------------------------------------------------------------ rules
INSTANCE = ("job", "instance", Label.MODEL_NAME, Label.ENGINE)


def _rules() -> dict[str, Any]:
    dur_count, hs_total = hcount(V.HANDSHAKE_DURATION), total(V.HANDSHAKES)

    def s(series: str, *m: str) -> str:
        return sel(series, *m, scoped=False)

    full_d_to_p = s(hs_total, D_TO_P, FULL)
    recording = [
        {"record": "instance:vllm_nixl_handshakes:rate5m",
         "expr": f"sum {by(*INSTANCE, *FLAVOR)} (\n  rate({dur_count}[5m])\n)"},
        {"record": "instance:vllm_nixl_handshakes_d_to_p_notif_only:ratio1h",
         "expr": f"sum {by(*INSTANCE)} (increase({s(dur_count, D_TO_P, NOTIF_ONLY)}[1h]))\n"
                 f"/\n(sum {by(*INSTANCE)} (increase({s(dur_count, D_TO_P)}[1h])) > 0)"},
        {"record": "instance:vllm_nixl_handshake_failures:ratio_rate5m",
         "expr": f"(\n  sum {by(*INSTANCE, Label.DIRECTION)} (rate({s(hs_total, FAILURE)}[5m]))\n"
                 f"  or\n  sum {by(*INSTANCE, Label.DIRECTION)} (rate({hs_total}[5m])) * 0\n)\n"
                 f"/\n(sum {by(*INSTANCE, Label.DIRECTION)} (rate({hs_total}[5m])) > 0)"},
        {"record": "instance:vllm_nixl_handshake_duration_seconds:p99_rate5m",
         "expr": quantile(0.99, V.HANDSHAKE_DURATION, (*INSTANCE, *FLAVOR), "5m", scoped=False,
                          multiline=True)},
        {"record": "instance:vllm_nixl_handshake_queue_wait_seconds:p95_rate5m",
         "expr": quantile(0.95, V.HANDSHAKE_PHASE_DURATION, (*INSTANCE, Label.DIRECTION), "5m",
                          QUEUE_WAIT, scoped=False, multiline=True)},
        {"record": "instance:vllm_nixl_push_receive_duration_seconds:p99_rate5m",
         "expr": quantile(0.99, V.RECEIVE_DURATION, (*INSTANCE, Label.OUTCOME), "5m",
                          scoped=False, multiline=True)},
        {"record": "instance:vllm_nixl_descriptors_saved:rate5m",
         "expr": f"sum {by(*INSTANCE, Label.DIRECTION)} (\n  rate({total(V.DESCRIPTORS_SAVED)}[5m])\n)"},
    ]
    win = FULL_D_TO_P_WINDOW
    alerts = [
        {"alert": "NixlFullDToPHandshake",
         "expr": f"(sum {by(*INSTANCE)} (increase({full_d_to_p}[{win}])) > 0)\nor\n"
                 f"count {by(*INSTANCE)} (({full_d_to_p} > 0) unless {full_d_to_p} offset {win})",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Full D->P NIXL handshake in push mode on {{ $labels.instance }}",
             "description": "{{ $value }} full (descriptor-preparing) decode-to-prefill "
                            f"handshake(s) in the last {win} on {{{{ $labels.instance }}}} "
                            "(engine {{ $labels.engine }}). In push mode D only needs P's agent "
                            "for notifications, so the notification-only handshake has "
                            "regressed. The second branch catches a series born by its first "
                            "handshake, which increase() cannot see."}},
        {"alert": "NixlHandshakeFailureRatioHigh",
         "expr": f"sum {by(*INSTANCE, Label.DIRECTION)} (rate({s(hs_total, FAILURE)}[15m]))\n"
                 f"/\nsum {by(*INSTANCE, Label.DIRECTION)} (rate({hs_total}[15m]))\n"
                 f"> {FAILURE_RATIO_THRESHOLD}",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "NIXL handshakes failing on {{ $labels.instance }}",
             "description": "{{ $value | humanizePercentage }} of {{ $labels.direction }} "
                            "handshakes failed over 15m (threshold "
                            f"{FAILURE_RATIO_THRESHOLD:.0%}); see the failures by phase and "
                            "error type on the NIXL push handshakes dashboard."}},
        {"alert": "NixlHandshakeLatencyP99High",
         "expr": quantile(0.99, V.HANDSHAKE_DURATION, (*INSTANCE, *FLAVOR), "10m", scoped=False,
                          drop_nan=False, multiline=True) + f" > {P99_LATENCY_THRESHOLD_S}",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Slow NIXL handshakes on {{ $labels.instance }}",
             "description": "p99 of {{ $labels.direction }} handshakes (notif_agents_only="
                            "{{ $labels.notif_agents_only }}) is {{ $value | humanizeDuration }} "
                            f"over 10m (threshold {P99_LATENCY_THRESHOLD_S}s)."}},
        {"alert": "NixlHandshakeQueueWaitHigh",
         "expr": quantile(0.95, V.HANDSHAKE_PHASE_DURATION, (*INSTANCE, Label.DIRECTION), "10m",
                          QUEUE_WAIT, scoped=False, drop_nan=False, multiline=True)
         + f" > {QUEUE_WAIT_P95_THRESHOLD_S}",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "NIXL handshakes queueing in the executor on {{ $labels.instance }}",
             "description": "p95 executor queue wait of {{ $labels.direction }} handshakes is "
                            "{{ $value | humanizeDuration }} over 10m (threshold "
                            f"{QUEUE_WAIT_P95_THRESHOLD_S}s): handshakes wait behind each "
                            "other in vLLM's handshake executor."}},
        {"alert": "NixlHandshakeStuck",
         "expr": f"max {by(*INSTANCE, Label.DIRECTION)} ({V.HANDSHAKE_OLDEST_IN_FLIGHT.name})"
                 f" > {STUCK_THRESHOLD_S}",
         "for": "1m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "NIXL handshake stuck on {{ $labels.instance }}",
             "description": "A {{ $labels.direction }} handshake has been in flight for "
                            "{{ $value | humanizeDuration }} (threshold "
                            f"{STUCK_THRESHOLD_S}s, three side-channel timeouts): it is hung, "
                            "and every handshake queued behind it in vLLM's one-thread "
                            "executor waits too."}},
        {"alert": "NixlPushRegRejected",
         "expr": f"sum {by(*INSTANCE, Label.REASON)} (increase({s(total(V.PUSH_REG_REJECTED))}[10m]))"
                 "\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Malformed PUSH_REG notifications on {{ $labels.instance }}",
             "description": "{{ $value }} PUSH_REG notification(s) dropped as "
                            "{{ $labels.reason }} in the last 10m: a decoder runs an "
                            "incompatible build, or something else sends to this agent."}},
        {"alert": "NixlPushesFailing",
         "expr": f"sum {by(*INSTANCE)} "
                 f"(increase({s(total(V.PUSHES), eq(Label.OUTCOME, V.PushEvent.FAILED))}[10m]))\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "KV pushes failing on {{ $labels.instance }}",
             "description": "{{ $value }} KV push(es) failed on prefill engine "
                            "{{ $labels.instance }} in the last 10m."}},
        {"alert": "NixlReceivesFailing",
         "expr": f"sum {by(*INSTANCE, Label.OUTCOME)} (increase({s(hcount(V.RECEIVE_DURATION), NOT_SUCCESS)}"
                 f"[10m]))\n> 0",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "KV receives failing on {{ $labels.instance }}",
             "description": "{{ $value }} KV receive(s) ended with outcome {{ $labels.outcome }} "
                            "on decode engine {{ $labels.instance }} in the last 10m: the request "
                            "got no pushed KV (failure: handshake or PUSH_REG failed; expired: "
                            "nothing landed within the registration timeout). Open an exemplar "
                            "of the receive latency panel for the request's trace."}},
        {"alert": "NixlReceiveLatencyP99High",
         "expr": quantile(0.99, V.RECEIVE_DURATION, INSTANCE, "10m", RECEIVE_SUCCESS,
                          scoped=False, drop_nan=False, multiline=True)
         + f" > {RECEIVE_P99_THRESHOLD_S}",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {
             "summary": "Slow KV receives on {{ $labels.instance }}",
             "description": "p99 of successful KV receives on decode engine {{ $labels.instance }} "
                            "is {{ $value | humanizeDuration }} over 10m (threshold "
                            f"{RECEIVE_P99_THRESHOLD_S}s), from registration to KV landed."}},
    ]
    return {"groups": [
        {"name": "nixl-push.recording", "rules": recording},
        {"name": "nixl-push.alerts", "rules": alerts},
    ]}


def build_rules() -> dict[str, Any]:
    return _rules()


# -------------------------------------------------------------------------- rendering
class _Dumper(yaml.SafeDumper):
    """YAML with literal blocks for multi-line strings (readable PromQL)."""


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str_presenter)


def to_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=1000, allow_unicode=True)


HEADER = ("# Generated by dashboards/generate.py from connector/vocabulary.py. Do not edit:\n"
          "# change the generator and run `make dashboards`.\n")


def render_dashboard(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=2) + "\n"


def render_configmap(dashboard_json: str) -> str:
    body = "".join("    " + line + "\n" for line in dashboard_json.splitlines())
    return (HEADER
            + "# Grafana's dashboard sidecar (e.g. kube-prometheus-stack, sidecar.dashboards.enabled)\n"
            + "# loads ConfigMaps labelled grafana_dashboard=\"1\"; the folder annotation is read\n"
            + "# when the sidecar's folderAnnotation is set to grafana_folder.\n"
            + to_yaml({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "nixl-push-dashboards",
                                    "labels": {"grafana_dashboard": "1"},
                                    "annotations": {"grafana_folder": "vLLM"}}})
            + "data:\n"
            + f"  {Path(DASHBOARD_FILE).name}: |\n"
            + body)


def render_prometheus_rule(rules: dict[str, Any]) -> str:
    return (HEADER
            + "# For the Prometheus Operator; add the label your Prometheus' ruleSelector expects.\n"
            + to_yaml({"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
                       "metadata": {"name": "nixl-push", "labels": {"app.kubernetes.io/part-of": "vllm"}},
                       "spec": rules}))


def render_all() -> dict[str, str]:
    """Relative path -> file content, for every generated file."""
    dashboard_json = render_dashboard(build_dashboard())
    rules = build_rules()
    return {
        DASHBOARD_FILE: dashboard_json,
        RULES_FILE: HEADER + to_yaml(rules),
        CONFIGMAP_FILE: render_configmap(dashboard_json),
        PROMETHEUS_RULE_FILE: render_prometheus_rule(rules),
    }


# ----------------------------------------------------------------------------- checks
def check_expr(expr: str, where: str, *, allow_variables: bool) -> list[str]:
    """Names in one query: metrics, labels and exact label values from the vocabulary."""
    index = series_index()
    try:
        names = promql.metric_names(expr)
        calls = promql.range_calls(expr)
    except promql.PromQLError as exc:
        return [f"{where}: {exc}"]
    errors = [f"{where}: metric {name!r} is not defined in connector.vocabulary "
              "(ALL_METRICS or STOCK_METRICS)" for name in sorted(names - index.keys())]
    all_labels = BASE_LABELS | VOCAB_LABELS | {"le"}
    for m in promql.matchers(expr):
        spec = index.get(m.metric)
        if spec is not None:
            allowed = BASE_LABELS | set(spec.labels) | ({"le"} if m.metric.endswith("_bucket") else set())
        else:
            allowed = all_labels
        if m.label not in allowed:
            errors.append(f"{where}: label {m.label!r} is not a label of {m.metric or 'the selector'}")
            continue
        if m.op in ("=", "!=") and m.label in VOCAB_LABELS:
            values = VALUE_SETS.get((spec.name, m.label)) if spec else None
            values = values or V.LABEL_VALUES[m.label]
            if m.value not in values:
                errors.append(f"{where}: {m.label}={m.value!r} is not a value the vocabulary "
                              f"allows for {m.metric or m.label} {sorted(values)}")
    errors += [f"{where}: grouping label {label!r} is not a known label"
               for label in sorted(promql.grouping_labels(expr) - all_labels)]
    used = promql.variables(expr)
    if allow_variables:
        for func, window in calls:
            if func in ("rate", "irate") and window != "$__rate_interval":
                errors.append(f"{where}: {func}() must use [$__rate_interval], not [{window}]")
            elif window not in ("$__rate_interval", "$__range"):
                errors.append(f"{where}: {func}() window must be $__rate_interval or $__range, "
                              f"not [{window}]")
        errors += [f"{where}: undefined variable ${v}"
                   for v in sorted(used - set(VARIABLES) - BUILTIN_VARIABLES)]
    elif used:
        errors.append(f"{where}: rules cannot use Grafana variables {sorted(used)}")
    return errors


def check_dashboard(dashboard: dict[str, Any]) -> list[str]:
    """Everything `--check` verifies about one dashboard dict."""
    errors: list[str] = []
    index = series_index()
    if dashboard.get("schemaVersion") != SCHEMA_VERSION:
        errors.append(f"schemaVersion must be {SCHEMA_VERSION}")
    names = [v.get("name") for v in dashboard.get("templating", {}).get("list", [])]
    errors += [f"missing dashboard variable ${v}" for v in VARIABLES if v not in names]
    seen: set[str] = set()
    ids: set[int] = set()
    for panel in iter_panels(dashboard):
        where = f"panel {panel.get('title')!r}"
        if panel.get("id") in ids:
            errors.append(f"{where}: duplicate id {panel.get('id')}")
        ids.add(panel.get("id"))
        if panel.get("datasource") != DS:
            errors.append(f"{where}: datasource must be the $datasource variable")
        if not panel.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            errors.append(f"{where}: no unit")
        description = panel.get("description") or ""
        targets = panel.get("targets") or []
        if not targets:
            errors.append(f"{where}: no queries")
        panel_metrics: set[str] = set()
        wants_exemplars = False
        for t in targets:
            expr = t.get("expr", "")
            errors += check_expr(expr, f"{where} query {t.get('refId')}", allow_variables=True)
            with contextlib.suppress(promql.PromQLError):  # already reported by check_expr
                names = promql.metric_names(expr)
                panel_metrics |= {index[n].name for n in names if n in index}
                if names & EXEMPLAR_BUCKETS:
                    wants_exemplars = True
                    if not t.get("exemplar"):
                        errors.append(f"{where} query {t.get('refId')}: latency histogram "
                                      "without exemplars")
        links = panel.get("fieldConfig", {}).get("defaults", {}).get("links") or []
        if wants_exemplars and not any("${" + JAEGER_VARIABLE + "}" in link.get("url", "")
                                       for link in links):
            errors.append(f"{where}: exemplars without a data link to the ${JAEGER_VARIABLE} "
                          "data source")
        for metric in sorted(panel_metrics):
            if metric not in description:
                errors.append(f"{where}: description does not name its metric {metric}")
        seen |= panel_metrics
    for spec in _all_specs():
        if spec.name not in seen:
            errors.append(f"metric {spec.name} is defined in connector.vocabulary but on no panel")
    return errors


def check_rules(rules: dict[str, Any]) -> list[str]:
    errors: list[str] = []
    names: set[str] = set()
    for group in rules.get("groups", []):
        for rule in group.get("rules", []):
            name = rule.get("alert") or rule.get("record")
            if name in names:
                errors.append(f"rule {name}: duplicate name")
            names.add(name)
            errors += check_expr(rule.get("expr", ""), f"rule {name}", allow_variables=False)
    return errors


def check_files(root: Path) -> list[str]:
    """Staleness of every generated file plus the vocabulary checks of what is on disk."""
    errors: list[str] = []
    for rel, text in render_all().items():
        path = root / rel
        if not path.exists():
            errors.append(f"{rel}: missing; run `make dashboards`")
            continue
        current = path.read_text()
        if current != text:
            diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(),
                                             f"{rel} (on disk)", f"{rel} (generated)", lineterm="", n=1))
            errors.append(f"{rel}: stale (differs from the generator); run `make dashboards`\n  "
                          + "\n  ".join(diff[:12]))
    dashboard_path = root / DASHBOARD_FILE
    if dashboard_path.exists():
        try:
            errors += [f"{DASHBOARD_FILE}: {e}" for e in
                       check_dashboard(json.loads(dashboard_path.read_text()))]
        except json.JSONDecodeError as exc:
            errors.append(f"{DASHBOARD_FILE}: invalid JSON: {exc}")
    rules_path = root / RULES_FILE
    if rules_path.exists():
        errors += [f"{RULES_FILE}: {e}" for e in
                   check_rules(yaml.safe_load(rules_path.read_text()) or {})]
    return errors


def write_files(root: Path) -> list[Path]:
    written = []
    for rel, text in render_all().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="verify instead of writing; non-zero exit on any problem")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="directory holding grafana/, rules/ and k8s/ (default: this package)")
    args = parser.parse_args(argv)
    # The generated artefacts themselves must pass the checks before anything is written.
    errors = check_dashboard(build_dashboard()) + check_rules(build_rules())
    if not errors and args.check:
        errors = check_files(args.root)
    if errors:
        print(f"dashboards check FAILED ({len(errors)} problem(s)):", file=sys.stderr)
        for error in errors:
            print(f"- {error}", file=sys.stderr)
        return 1
    if args.check:
        print(f"dashboards check OK: {', '.join(render_all())} up to date; every query uses "
              f"vocabulary names and all {len(_all_specs())} metrics are on a panel")
        return 0
    for path in write_files(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
