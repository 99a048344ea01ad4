"""The Grafana dashboard: panel builders, the rows, the variables and the layout.

Headline panels (`Cell.headline`) show a count an operator reads as a fact ("1,024
descriptors saved"): their queries take the counters' exact change over the range
(`queries.range_change`), never `increase()`, and tests/test_prometheus_real.py compares
each with the engines' own /metrics after a known run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from connector import vocabulary as V
from connector.vocabulary import AgentLabel, Label, MetricKind, MetricSpec, RouterLabel
from dashboards import promql, rules, slo, witness
from dashboards.queries import (
    D_TO_P,
    FAILURE,
    FLAVOR,
    FULL,
    LEG_OK,
    NOT_SUCCESS,
    NOTIF_ONLY,
    QUEUE_WAIT,
    RATE,
    RECEIVE_SUCCESS,
    RENEWED,
    ROUTER_OK,
    STILL_WANTED,
    UNKNOWN_REQUEST,
    bucket,
    by,
    eq,
    gauge,
    hcount,
    hsum,
    on_decoders,
    quantile,
    range_change,
    sel,
    series_index,
    total,
)

DASHBOARD_FILE = "grafana/nixl-push-handshakes.json"
DASHBOARD_UID = "nixl-push-handshakes"
DASHBOARD_TITLE = "NIXL push handshakes"
SCHEMA_VERSION = 39

DS = {"type": "prometheus", "uid": "${datasource}"}
VARIABLES = ("datasource", "job", "model_name", "instance", "engine", "jaeger")
BUILTIN_VARIABLES = {"__rate_interval", "__range", "__interval", "__range_s", "__interval_ms"}
# The series the variables are read from: pre-created at 0 by every engine running the fork
# (model_name, engine) and, for the scrape targets (job, instance), by the router too.
VARIABLE_SOURCE = V.PUSHES.series_names[0]
TARGET_SOURCE = '{__name__=~"' + "|".join((VARIABLE_SOURCE, V.ROUTER_REQUESTS.series_names[0])) + '"}'
COUNT_UNIT = "short"
# vLLM's convention: a description ends with the metrics its panel reads.
METRICS_LINE = "\n\nMetric{s}: {names}"
# A collapsed row is an optional section; its title says what it needs.
REQUIRES = re.compile(r".+ \(requires .+\)$")

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
EXEMPLAR_NOTE = (" Exemplars (points) carry the trace_id of a traced observation: click one and "
                 "open its trace in the $jaeger data source (tracing on, Prometheus with "
                 "--enable-feature=exemplar-storage).")
# Latency histograms whose observations carry exemplars (their panels must show them).
EXEMPLAR_BUCKETS = frozenset(bucket(spec) for spec in V.EXEMPLAR_METRICS + V.ROUTER_EXEMPLAR_METRICS)
EXACT_NOTE = (" Exact: the counters' change between the range's start and end (no "
              "extrapolation; a series born inside the range counts from 0).")

Panel = dict[str, Any]


@dataclass(frozen=True)
class Cell:
    """A panel with its grid size; `headline`: a count shown as a fact (exact, tested)."""

    panel: Panel
    w: int
    h: int
    headline: bool = False


# --------------------------------------------------------------------- panel builders
def target(expr: str, legend: str = "__auto", *, instant: bool = False) -> dict[str, Any]:
    return {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend,
            "range": not instant, "instant": instant, "refId": ""}


def quantile_targets(spec: MetricSpec, labels: tuple[str, ...], legend: str, *matchers: str,
                     qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[dict[str, Any]]:
    """One target per quantile of a latency histogram, legend "p<NN> <legend>"."""
    return [target(quantile(q, spec, labels, RATE, *matchers), f"p{round(q * 100)} {legend}".rstrip())
            for q in qs]


def metric_label(spec: MetricSpec) -> str:
    """How a description names a metric: as /metrics shows a counter (`_total`), else its name."""
    return spec.series_names[0] if spec.kind is MetricKind.COUNTER else spec.name


def read_metrics(targets: list[dict[str, Any]]) -> list[MetricSpec]:
    """The vocabulary metrics the queries select, in the order they first appear."""
    index, found = series_index(), []
    for t in targets:
        names = sorted(promql.metric_names(t["expr"]), key=t["expr"].index)
        found += [index[n] for n in names if n in index]
    return list(dict.fromkeys(found))


def metrics_line(targets: list[dict[str, Any]]) -> str:
    names = [f"`{metric_label(spec)}`" for spec in read_metrics(targets)]
    return METRICS_LINE.format(s="s" if len(names) > 1 else "", names=", ".join(names))


def _panel(kind: str, title: str, description: str, targets: list[dict[str, Any]], unit: str,
           defaults: dict[str, Any], options: dict[str, Any]) -> Panel:
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return {
        "type": kind, "title": title, "description": description + metrics_line(targets), "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, **defaults}, "overrides": []},
        "options": options, "targets": targets,
    }


def thresholds(*steps: tuple[str, float | None]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


def timeseries(title: str, description: str, targets: list[dict[str, Any]], unit: str, *,
               stacked: bool = False, bars: bool = False, max_value: float | None = None,
               exemplars: bool = False) -> Panel:
    custom = {
        "drawStyle": "bars" if bars else "line", "lineWidth": 1, "fillOpacity": 60 if bars else 10,
        "showPoints": "never", "spanNulls": False, "axisSoftMin": 0,
        "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
    }
    defaults: dict[str, Any] = {"custom": custom, "color": {"mode": "palette-classic"}, "min": 0}
    if max_value is not None:
        defaults["max"] = max_value
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


def stat(title: str, description: str, expr: str, unit: str, *, steps: dict[str, Any],
         no_value: str, decimals: int | None = None) -> Panel:
    defaults: dict[str, Any] = {"color": {"mode": "thresholds"}, "thresholds": steps,
                                "noValue": no_value}
    if decimals is not None:
        defaults["decimals"] = decimals
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "colorMode": "background", "graphMode": "none", "justifyMode": "center",
               "orientation": "auto", "textMode": "value", "wideLayout": True,
               "showPercentChange": False}
    return _panel("stat", title, description, [target(expr, title, instant=True)], unit,
                  defaults, options)


def bargauge(title: str, description: str, targets: list[dict[str, Any]], unit: str, *,
             no_value: str, decimals: int | None = None) -> Panel:
    for t in targets:
        t.update(instant=True, range=False)
    defaults: dict[str, Any] = {"color": {"mode": "palette-classic"}, "min": 0, "noValue": no_value,
                                "thresholds": thresholds(("green", None))}
    if decimals is not None:
        defaults["decimals"] = decimals
    options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
               "displayMode": "basic", "orientation": "horizontal", "showUnfilled": True,
               "valueMode": "color", "namePlacement": "auto", "sizing": "auto", "minVizHeight": 16,
               "minVizWidth": 8, "maxVizHeight": 300}
    return _panel("bargauge", title, description, targets, unit, defaults, options)


def count_stat(title: str, description: str, expr: str, *, bad_from: float | None = None) -> Panel:
    """A whole-number stat: blue for information, or green until `bad_from`, then red."""
    steps = (thresholds(("blue", None)) if bad_from is None
             else thresholds(("green", None), ("red", bad_from)))
    return stat(title, description, expr, COUNT_UNIT, steps=steps, no_value="0", decimals=0)


def changed(series: str, *matchers: str, labels: tuple[str, ...] = ()) -> str:
    """Sum (by `labels`) of the exact range change of a scoped counter series."""
    grouping = f" {by(*labels)} " if labels else ""
    return f"sum{grouping}({range_change(sel(series, *matchers))})"


def range_mean(spec: MetricSpec, *matchers: str, labels: tuple[str, ...] = ()) -> str:
    """A histogram's mean over the range (by `labels`): the exact change of its _sum over that
    of its _count, the zero denominators of idle series dropped."""
    return (f"{changed(hsum(spec), *matchers, labels=labels)} / "
            f"({changed(hcount(spec), *matchers, labels=labels)} > 0)")


# ------------------------------------------------------------------------- the rows
def _overview() -> list[Cell]:
    dur_count = hcount(V.HANDSHAKE_DURATION)
    all_d_to_p = changed(dur_count, D_TO_P)
    counted = (f"Counted from {V.HANDSHAKE_DURATION.name}_count (one observation per handshake), "
               "whose success series exist at 0 from start-up.")
    return [
        Cell(stat("D->P handshakes that were notification-only",
                  "Share of decode-to-prefill handshakes in the dashboard range that were "
                  "notification-only (notif_agents_only=\"true\"). In push mode D only needs P's "
                  "agent to send PUSH_REG, so this should be 100%; anything lower means D prepared "
                  f"descriptors it never uses. {counted} Shows 'no D->P handshakes' when none "
                  "happened in the range (a guarded denominator instead of NaN)." + EXACT_NOTE,
                  f"{changed(dur_count, D_TO_P, NOTIF_ONLY)} / ({all_d_to_p} > 0)", "percentunit",
                  steps=thresholds(("red", None), ("green", 1)),
                  no_value="no D->P handshakes", decimals=1), 6, 5, headline=True),
        Cell(count_stat("Full D->P handshakes",
                        "Full (descriptor-preparing) decode-to-prefill handshakes in the dashboard "
                        f"range; should be 0 in push mode. {counted}" + EXACT_NOTE,
                        changed(dur_count, D_TO_P, FULL), bad_from=1), 6, 5, headline=True),
        Cell(count_stat("Descriptor registrations saved",
                        "NIXL descriptor lists (prep_xfer_dlist calls) that notification-only "
                        "handshakes skipped in the dashboard range, from "
                        f"{V.DESCRIPTOR_REGISTRATIONS_SAVED.name}_total." + EXACT_NOTE,
                        changed(total(V.DESCRIPTOR_REGISTRATIONS_SAVED))), 6, 5, headline=True),
        Cell(count_stat("Descriptors saved",
                        "Descriptors that notification-only handshakes did not prepare in the "
                        f"dashboard range, from {V.DESCRIPTORS_SAVED.name}_total." + EXACT_NOTE,
                        changed(total(V.DESCRIPTORS_SAVED))), 6, 5, headline=True),
    ]


def _handshakes() -> list[Cell]:
    dur_count, hs_total = hcount(V.HANDSHAKE_DURATION), total(V.HANDSHAKES)
    return [
        Cell(timeseries("Handshakes/s by direction and flavor",
                        "NIXL handshakes per second by direction (d_to_p: decode to prefill, "
                        "p_to_d: prefill to decode) and flavor (notif_agents_only). From "
                        f"{V.HANDSHAKE_DURATION.name}_count, whose series are pre-created at 0 so "
                        "the first handshake of each flavor is counted.",
                        [target(f"sum {by(*FLAVOR)} (rate({sel(dur_count)}[{RATE}]))",
                                "{{direction}} notif_agents_only={{notif_agents_only}}")],
                        "suffix: handshakes/s"), 12, 8),
        Cell(timeseries("Handshakes/s by trigger and outcome",
                        "NIXL handshakes per second by direction, trigger (push_reg, heartbeat, "
                        "push_write, push_reg_early: P->D started on D's PUSH_REG, other) and "
                        f"outcome, from {V.HANDSHAKES.name}_total (every label combination is "
                        "pre-created at 0).",
                        [target(f"sum {by(Label.DIRECTION, Label.TRIGGER, Label.OUTCOME)} "
                                f"(rate({sel(hs_total)}[{RATE}]))",
                                "{{direction}} {{trigger}} {{outcome}}")],
                        "suffix: handshakes/s"), 12, 8),
    ]


def _descriptors() -> list[Cell]:
    regs_saved, descs_saved = total(V.DESCRIPTOR_REGISTRATIONS_SAVED), total(V.DESCRIPTORS_SAVED)
    regs, descs = total(V.DESCRIPTOR_REGISTRATIONS), total(V.DESCRIPTORS_REGISTERED)
    return [
        Cell(timeseries("Descriptor registrations saved/s",
                        "Descriptor lists per second that notification-only handshakes did not "
                        f"prepare, by direction: rate of {V.DESCRIPTOR_REGISTRATIONS_SAVED.name}_total.",
                        [target(f"sum {by(Label.DIRECTION)} (rate({sel(regs_saved)}[{RATE}]))",
                                "saved {{direction}}")],
                        "suffix: lists/s"), 8, 8),
        Cell(timeseries("Descriptors saved/s",
                        "Descriptors per second that notification-only handshakes did not "
                        f"prepare, by direction: rate of {V.DESCRIPTORS_SAVED.name}_total.",
                        [target(f"sum {by(Label.DIRECTION)} (rate({sel(descs_saved)}[{RATE}]))",
                                "saved {{direction}}")],
                        "suffix: descriptors/s"), 8, 8),
        Cell(bargauge("Descriptors registered vs saved (range)",
                      "Contrast over the dashboard range: descriptors full handshakes prepared "
                      f"({V.DESCRIPTORS_REGISTERED.name}_total, by direction and list) against "
                      f"those notification-only handshakes skipped ({V.DESCRIPTORS_SAVED.name}_total)."
                      + EXACT_NOTE,
                      [target(changed(descs, labels=(Label.DIRECTION, Label.LIST)),
                              "registered {{direction}} {{list}}"),
                       target(changed(descs_saved, labels=(Label.DIRECTION,)), "saved {{direction}}")],
                      COUNT_UNIT, no_value="0", decimals=0), 8, 8, headline=True),
        Cell(timeseries("Descriptor lists prepared/s by full handshakes",
                        "prep_xfer_dlist calls per second during handshakes, by direction and "
                        f"list (remote/local): rate of {V.DESCRIPTOR_REGISTRATIONS.name}_total. In "
                        "push mode only p_to_d (P preparing D's blocks) should be non-zero.",
                        [target(f"sum {by(Label.DIRECTION, Label.LIST)} (rate({sel(regs)}[{RATE}]))",
                                "{{direction}} {{list}}")],
                        "suffix: lists/s"), 12, 8),
        Cell(timeseries("Descriptors registered/s by full handshakes",
                        "Descriptors in the lists prepared during handshakes, per second, by "
                        f"direction and list: rate of {V.DESCRIPTORS_REGISTERED.name}_total.",
                        [target(f"sum {by(Label.DIRECTION, Label.LIST)} (rate({sel(descs)}[{RATE}]))",
                                "{{direction}} {{list}}")],
                        "suffix: descriptors/s"), 12, 8),
    ]


def _latency() -> list[Cell]:
    dur, phase = V.HANDSHAKE_DURATION, V.HANDSHAKE_PHASE_DURATION
    nan_note = ("Quantiles of windows without handshakes are dropped (`>= 0` filters NaN) "
                "instead of drawn as NaN.")
    per_phase = (Label.DIRECTION, Label.PHASE)
    return [
        Cell(timeseries("Handshake latency p50 / p95 / p99 by flavor",
                        "Handshake wall time (submission to vLLM's handshake executor until done, "
                        "queue wait included) by direction and flavor: histogram_quantile over the "
                        f"rate of {dur.name}_bucket. {nan_note}",
                        quantile_targets(dur, FLAVOR,
                                         "{{direction}} notif_agents_only={{notif_agents_only}}"),
                        "s", exemplars=True), 12, 9),
        Cell(timeseries("Executor queue wait p50 / p95 / p99",
                        "Time handshakes waited in vLLM's handshake executor queue before running "
                        f"(phase=\"queue_wait\" of {phase.name}). Growing values mean handshakes "
                        f"queue behind each other. {nan_note}",
                        quantile_targets(phase, (Label.DIRECTION,), "{{direction}}", QUEUE_WAIT),
                        "s", exemplars=True), 12, 9),
        Cell(timeseries("Per-phase latency p95",
                        "p95 of the time one handshake spent in each phase (queue_wait, "
                        "metadata_fetch, metadata_decode, agent_load, transfer_plan, "
                        "descriptor_registration), by direction: histogram_quantile over the rate "
                        f"of {phase.name}_bucket. {nan_note}",
                        [target(quantile(0.95, phase, per_phase, RATE), "{{direction}} {{phase}}")],
                        "s", exemplars=True), 12, 9),
        Cell(bargauge("Mean time per phase (range)",
                      "Where handshake time goes: mean seconds per handshake in each phase over "
                      f"the dashboard range, the change of {phase.name}_sum divided by the change "
                      f"of {phase.name}_count (denominator guarded with > 0, so phases that did "
                      "not run are absent rather than NaN)." + EXACT_NOTE,
                      [target(range_mean(phase, labels=per_phase), "{{direction}} {{phase}}")],
                      "s", no_value="no handshake phases in range"), 12, 9, headline=True),
    ]


def _failures() -> list[Cell]:
    hs_total, fails = total(V.HANDSHAKES), total(V.HANDSHAKE_PHASE_FAILURES)
    all_rate = f"sum {by(Label.DIRECTION)} (rate({sel(hs_total)}[{RATE}]))"
    fail_rate = f"sum {by(Label.DIRECTION)} (rate({sel(hs_total, FAILURE)}[{RATE}]))"
    return [
        Cell(timeseries("Handshake failure ratio by direction",
                        f"Failed / all handshakes per direction, from {V.HANDSHAKES.name}_total. "
                        "0 while handshakes succeed; absent (not NaN) while no handshake happens "
                        "(denominator guarded with > 0).",
                        [target(f"({fail_rate} or {all_rate} * 0) / ({all_rate} > 0)",
                                "{{direction}}")],
                        "percentunit", max_value=1), 8, 8),
        Cell(timeseries("Handshake failures/s by phase and error type",
                        "Failed handshakes per second by direction, the phase that failed and a "
                        f"bounded error type: rate of {V.HANDSHAKE_PHASE_FAILURES.name}_total.",
                        [target(f"sum {by(Label.DIRECTION, Label.PHASE, Label.ERROR_TYPE)} "
                                f"(rate({sel(fails)}[{RATE}]))",
                                "{{direction}} {{phase}} {{error_type}}")],
                        "suffix: failures/s", bars=True, stacked=True), 16, 8),
    ]


def _push_flow() -> list[Cell]:
    notifs, pushes = total(V.PUSH_REG_NOTIFS), total(V.PUSHES)
    rcv = V.RECEIVE_DURATION
    return [
        Cell(timeseries("KV receive latency p50 / p95 / p99 by outcome",
                        "Decode side, per request: from the registration handed to the worker "
                        "until the pushed KV landed (success), the receive failed (failure) or "
                        "nothing landed within the registration timeout (expired). Covers "
                        "PUSH_REG, P's prefill finishing, handshakes and the WRITE: the P/D health "
                        f"number. histogram_quantile over the rate of {rcv.name}_bucket; windows "
                        "without receives are dropped (`>= 0`).",
                        quantile_targets(rcv, (Label.OUTCOME,), "{{outcome}}"),
                        "s", exemplars=True), 12, 8),
        Cell(timeseries("KV receives/s by outcome",
                        "Decode-side receives per second by outcome (success, failure, expired): "
                        f"rate of {rcv.name}_count, whose series are pre-created at 0.",
                        [target(f"sum {by(Label.OUTCOME)} (rate({sel(hcount(rcv))}[{RATE}]))",
                                "{{outcome}}")],
                        "suffix: receives/s"), 12, 8),
        Cell(timeseries("PUSH_REG notifications/s",
                        "PUSH_REG notifications decode workers sent to prefill agents per second, "
                        f"by outcome (sent/failed): rate of {V.PUSH_REG_NOTIFS.name}_total.",
                        [target(f"sum {by(Label.OUTCOME)} (rate({sel(notifs)}[{RATE}]))",
                                "{{outcome}}")],
                        "suffix: notifs/s"), 12, 8),
        Cell(timeseries("KV pushes/s: started / completed / failed",
                        "KV pushes (WRITEs of one request's blocks) on prefill workers per second, "
                        f"by outcome: rate of {V.PUSHES.name}_total.",
                        [target(f"sum {by(Label.OUTCOME)} (rate({sel(pushes)}[{RATE}]))",
                                "{{outcome}}")],
                        "suffix: pushes/s"), 12, 8),
    ]


TTFT_ROW = "Where TTFT goes"


def _decoder_ttft(part: str, window: str | None) -> str:
    """Sum of vLLM's TTFT `part` (`hsum`/`hcount`) over the decode engines: exact over the
    range (`window` None) or as a rate over `window`."""
    ttft, waits = sel(part(V.VLLM_TTFT)), sel(hcount(V.KV_WAIT))
    if window is None:
        return f"sum({on_decoders(range_change(ttft), range_change(waits))})"
    return f"sum({on_decoders(f'rate({ttft}[{window}])', f'rate({waits}[{window}])')})"


def kv_wait_share(window: str | None) -> str:
    """Seconds decode engines waited for KV over seconds of their TTFT (all outcomes: a
    failed receive's recompute is in its TTFT too); exact over the range when `window` is None."""
    waited = (changed(hsum(V.KV_WAIT)) if window is None
              else f"sum(rate({sel(hsum(V.KV_WAIT))}[{window}]))")
    return f"{waited} / ({_decoder_ttft(hsum, window)} > 0)"


def _ttft() -> list[Cell]:
    wait, pwait, pwrite = V.KV_WAIT, V.PUSH_WRITE_WAIT, V.PUSH_WRITE_DURATION
    nan_note = "Windows without requests are dropped (`>= 0`)."
    stages = ("A request's TTFT on a decode engine is its wait for KV (arrival at D until the "
              "pushed KV landed: P's queue and prefill, the PUSH_REG, handshakes, the WRITE) and "
              "then D's own work until the first token. On the prefill engine the handoff is the "
              "wait from prefill done to the WRITE posted, and the WRITE from the PUSH_REG matched "
              "until done.")

    def ratio(numerator: str, denominator: str) -> str:
        return f"{numerator} / ({denominator} > 0)"

    waited_mean = ratio(f"sum(rate({sel(hsum(wait))}[{RATE}]))", f"sum(rate({sel(hcount(wait))}[{RATE}]))")

    return [
        Cell(bargauge("Mean TTFT by stage (range)",
                      f"{stages} Means per request over the dashboard range: the change of each "
                      "histogram's _sum divided by the change of its _count (denominator guarded "
                      "with > 0). D's TTFT is vLLM's own, over the decode engines only (engines "
                      "whose KV waits moved); the client's TTFT is on the Router row." + EXACT_NOTE,
                      [target(range_mean(wait, RECEIVE_SUCCESS), "D: wait for KV (arrival -> KV landed)"),
                       target(ratio(_decoder_ttft(hsum, None), _decoder_ttft(hcount, None)),
                              "D: TTFT (vLLM)"),
                       target(range_mean(pwait), "P: prefill done -> WRITE posted"),
                       target(range_mean(pwrite), "P: PUSH_REG matched -> WRITE done")],
                      "s", no_value="no requests in range"), 14, 6, headline=True),
        Cell(stat("Share of D's TTFT spent waiting for KV (range)",
                  "Seconds decode engines spent waiting for remote KV over the seconds of their "
                  "requests' TTFT, over the dashboard range (every receive outcome: a failed "
                  "receive's recompute is in its TTFT too). Shows 'no requests' when no decode "
                  "engine served one (a guarded denominator instead of NaN)." + EXACT_NOTE,
                  kv_wait_share(None), "percentunit",
                  steps=thresholds(("green", None), ("orange", rules.KV_WAIT_SHARE_FLOOR)),
                  no_value="no requests", decimals=1), 10, 6, headline=True),
        Cell(timeseries("D: wait for KV p50 / p95 / p99 by outcome",
                        "Per request on a decode engine: from its arrival (vLLM's arrival_time, "
                        "where vLLM's TTFT starts) until its KV landed (success), the receive "
                        "failed (failure) or expired. The push receive latency on the Push flow "
                        f"row starts later, at the registration. {nan_note}",
                        quantile_targets(wait, (Label.OUTCOME,), "{{outcome}}"),
                        "s", exemplars=True), 12, 8),
        Cell(timeseries("Mean TTFT on D: waiting for KV, then D's own work",
                        "Mean TTFT of decode engines split in two, stacked: the wait for KV, and "
                        "the rest of vLLM's TTFT (D's queue after the KV landed and its first "
                        f"step). {nan_note}",
                        [target(waited_mean, "waiting for KV"),
                         target(f"{ratio(_decoder_ttft(hsum, RATE), _decoder_ttft(hcount, RATE))} - "
                                f"{waited_mean}", "after the KV landed")],
                        "s", stacked=True), 12, 8),
        Cell(timeseries("P: prefill done -> WRITE posted p50 / p95 / p99",
                        "Per completed push on a prefill engine: from its KV lease granted (prefill "
                        "done) until its WRITE was posted. Long when decoders register late (their "
                        f"own queue), a handshake runs first, or the writer is busy. {nan_note}",
                        quantile_targets(pwait, (), ""),
                        "s", exemplars=True), 8, 8),
        Cell(timeseries("P: PUSH_REG matched -> WRITE done p50 / p95 / p99",
                        "Per completed push on a prefill engine: from the decoder's PUSH_REG "
                        "matched to the finished prefill until NIXL reported the WRITE done "
                        f"(the transfer itself, and any handshake before it). {nan_note}",
                        quantile_targets(pwrite, (), ""),
                        "s", exemplars=True), 8, 8),
        Cell(timeseries("Share of D's TTFT spent waiting for KV",
                        "Seconds decode engines spent waiting for KV per second of their TTFT, over "
                        "the rate window: what the NixlKvWaitShareRising alert watches (per engine, "
                        f"over 5m). {nan_note}",
                        [target(kv_wait_share(RATE), "KV-wait share")],
                        "percentunit", max_value=1), 8, 8),
    ]


def _leases() -> list[Cell]:
    renewals, expiries = total(V.KV_LEASE_RENEWALS), total(V.KV_LEASE_EXPIRIES)
    expired_stock = V.VLLM_KV_EXPIRED
    held, oldest = gauge(V.KV_LEASES_HELD), gauge(V.KV_LEASE_OLDEST_AGE)
    waiting, oldest_wait = gauge(V.REMOTE_PREFILLS_WAITING), gauge(V.REMOTE_PREFILL_OLDEST_WAIT)
    per_worker = "One count per prefill worker and heartbeat id."
    return [
        Cell(stat("KV leases held now",
                  "Finished prefills whose blocks the prefill engines hold for their decoder's "
                  f"push right now: {V.KV_LEASES_HELD.name}, summed over the selected engines.",
                  f"sum({sel(held)})", COUNT_UNIT, steps=thresholds(("blue", None)),
                  no_value="0", decimals=0), 6, 5),
        Cell(count_stat("KV leases renewed by heartbeats",
                        "Heartbeat ids that extended a KV lease a prefill held, in the dashboard "
                        f"range: {V.KV_LEASE_RENEWALS.name}_total{{outcome=\"renewed\"}}. "
                        + per_worker + EXACT_NOTE,
                        changed(renewals, RENEWED)), 6, 5, headline=True),
        Cell(count_stat("Heartbeat ids matching nothing",
                        "Heartbeat ids that matched nothing the prefill holds or recently held, in "
                        f"the dashboard range: {V.KV_LEASE_RENEWALS.name}_total"
                        "{outcome=\"unknown_request\"}. Persistently non-zero: a decoder heartbeats "
                        "the wrong prefill, or request ids no longer match (alert "
                        "NixlHeartbeatsMatchNothing). " + per_worker + EXACT_NOTE,
                        changed(renewals, UNKNOWN_REQUEST), bad_from=1), 6, 5, headline=True),
        Cell(count_stat("KV leases expired while the decoder waited",
                        "KV leases that expired before their push although a decoder still wanted "
                        "the request (fate waiting: it heartbeated, no PUSH_REG yet; registered: "
                        "PUSH_REG arrived, no WRITE posted), in the dashboard range: "
                        f"{V.KV_LEASE_EXPIRIES.name}_total. That request's KV is lost (alert "
                        "NixlKvLeaseExpiredWhileWanted)." + EXACT_NOTE,
                        changed(expiries, STILL_WANTED), bad_from=1), 6, 5, headline=True),
        Cell(timeseries("KV leases held (P) and requests waiting for KV (D)",
                        f"Prefill side: leases held ({V.KV_LEASES_HELD.name}, the largest of an "
                        "engine's workers). Decode side: requests waiting for KV from a prefill, "
                        f"queued or registered ({V.REMOTE_PREFILLS_WAITING.name}). Both are 0 when "
                        "idle.",
                        [target(f"sum {by('instance')} ({sel(held)})", "leases held {{instance}}"),
                         target(f"sum {by('instance')} ({sel(waiting)})",
                                "waiting for KV {{instance}}")],
                        COUNT_UNIT), 8, 8),
        Cell(timeseries("Oldest KV lease (P) and oldest wait for KV (D)",
                        f"Age of the oldest lease held ({V.KV_LEASE_OLDEST_AGE.name}) and of the "
                        f"oldest request waiting for a remote prefill ({V.REMOTE_PREFILL_OLDEST_WAIT.name}), "
                        "0 when none. A lease near its duration (30 s by default, extended by "
                        "heartbeats) is about to expire.",
                        [target(f"max {by('instance')} ({sel(oldest)})", "oldest lease {{instance}}"),
                         target(f"max {by('instance')} ({sel(oldest_wait)})",
                                "oldest wait {{instance}}")],
                        "s"), 8, 8),
        Cell(timeseries("KV lease expiries/s by fate",
                        f"Leases that expired before their push, by fate ({V.KV_LEASE_EXPIRIES.name}"
                        "_total: unclaimed, waiting, registered, push_failed); vLLM's own count of "
                        f"the same releases ({expired_stock.name}_total); and expired leases "
                        f"released later than due ({V.KV_LEASES_REAPED_LATE.name}_total).",
                        [target(f"sum {by(Label.FATE)} (rate({sel(expiries)}[{RATE}]))", "{{fate}}"),
                         target(f"sum(rate({sel(total(expired_stock))}[{RATE}]))", "vLLM: expired"),
                         target(f"sum(rate({sel(total(V.KV_LEASES_REAPED_LATE))}[{RATE}]))",
                                "released late")],
                        "suffix: leases/s"), 8, 8),
        Cell(timeseries("Heartbeat ids/s by what they matched (P)",
                        "Request ids named in decoders' heartbeats, per second, by what they "
                        "matched on the prefill (renewed, prefilling, already_done, "
                        f"unknown_request): rate of {V.KV_LEASE_RENEWALS.name}_total. " + per_worker,
                        [target(f"sum {by(Label.OUTCOME)} (rate({sel(renewals)}[{RATE}]))",
                                "{{outcome}}")],
                        "suffix: ids/s"), 12, 8),
        Cell(timeseries("Heartbeats sent/s (D)",
                        "Heartbeat notifications decode workers sent to prefill agents per second "
                        f"(one per agent), by outcome (sent/failed): rate of {V.HEARTBEATS.name}_total.",
                        [target(f"sum {by(Label.OUTCOME)} (rate({sel(total(V.HEARTBEATS))}[{RATE}]))",
                                "{{outcome}}")],
                        "suffix: notifs/s"), 12, 8),
    ]


def _peers() -> list[Cell]:
    resets, restarts = total(V.PEER_RESETS), total(V.PEER_RESTARTS)
    failures, refused = total(V.RECEIVE_FAILURES), total(V.PEER_AUTH_REFUSALS)
    return [
        Cell(count_stat("Peers that restarted",
                        "Re-handshakes that found a remote engine back under the same engine id with "
                        f"a new NIXL agent, in the dashboard range: {restarts}. The requests whose "
                        "KV it held were failed at once (recomputed or failed by vLLM) instead of "
                        "waiting for push_registration_timeout (alert NixlPeerRestarted)." + EXACT_NOTE,
                        changed(restarts), bad_from=1), 6, 8, headline=True),
        Cell(timeseries("Peer connections dropped/s",
                        "NIXL connections to a remote engine dropped because a notification or a "
                        f"WRITE to its agent failed, by direction and reason: rate of {resets}; the "
                        "next request to it handshakes again. Re-handshakes that found the peer "
                        f"restarted: rate of {restarts}.",
                        [target(f"sum {by(Label.DIRECTION, Label.REASON)} (rate({sel(resets)}[{RATE}]))",
                                "dropped {{direction}} {{reason}}"),
                         target(f"sum {by(Label.DIRECTION)} (rate({sel(restarts)}[{RATE}]))",
                                "restarted {{direction}}")],
                        "suffix: peers/s"), 9, 8),
        Cell(timeseries("Receives failed/s by reason (D)",
                        "KV receives a decode worker failed instead of waiting for "
                        "push_registration_timeout, by reason: rate of "
                        f"{failures} (handshake_failed, lease_expired, push_failed, no_prefill, "
                        "peer_restarted, peer_unreachable, other). vLLM recomputes or fails each "
                        "request, per kv_load_failure_policy.",
                        [target(f"sum {by(Label.REASON)} (rate({sel(failures)}[{RATE}]))",
                                "{{reason}}")],
                        "suffix: receives/s"), 9, 8),
        Cell(timeseries("Peers refused/s by channel and reason",
                        "With side_channel_secret_file: metadata requests, answers to ours and NIXL "
                        "notifications refused for want of the deployment's secret, by channel and "
                        f"reason: rate of {refused}. no_proof: a stock engine or a fork without the "
                        "secret; bad_proof: another secret, or a replayed or stale challenge; "
                        "peer_not_authenticating / peer_bad_proof: a peer this engine asked did not "
                        "prove it (alert NixlUnauthenticatedPeer). 0 without the setting.",
                        [target(f"sum {by(Label.CHANNEL, Label.REASON)} (rate({sel(refused)}[{RATE}]))",
                                "{{channel}} {{reason}}")],
                        "suffix: refusals/s"), 24, 8),
    ]


def _push_state() -> list[Cell]:
    push_fails, aborts = total(V.PUSH_FAIL_NOTIFS), total(V.WRITE_ABORTS)
    abandoned, forgotten = total(V.RECEIVES_ABANDONED), total(V.PEERS_FORGOTTEN)
    return [
        Cell(timeseries("PUSH_FAILs owed/s (P)",
                        "PUSH_FAIL notifications a prefill owed a decoder (its request gets no KV "
                        "from here: the decoder recomputes at once instead of waiting for "
                        f"push_registration_timeout), by reason and whether they were sent: rate of "
                        f"{push_fails}. Sent only once every rank's WRITE of the request settled; "
                        "undeliverable ones leave their decoder waiting for its own timeout.",
                        [target(f"sum {by(Label.REASON, Label.OUTCOME)} (rate({sel(push_fails)}[{RATE}]))",
                                "{{reason}} {{outcome}}")],
                        "suffix: notifs/s"), 8, 8),
        Cell(timeseries("WRITEs aborted/s (P)",
                        "WRITEs that did not settle within push_write_timeout_s: aborted (NIXL "
                        "released them, the lease is released and the decoder told) or abort_failed "
                        f"(NIXL kept them: the blocks stay held): rate of {aborts}. Alert "
                        "NixlPushWriteAbortFailed fires on abort_failed.",
                        [target(f"sum {by(Label.OUTCOME)} (rate({sel(aborts)}[{RATE}]))", "{{outcome}}")],
                        "suffix: writes/s"), 6, 8),
        Cell(timeseries("Receives given up/s (D)",
                        "Registered receives a decode worker gave up (client gone, registration "
                        f"timeout, prefill silent), by reason: rate of {abandoned}. Their blocks stay "
                        "held until no WRITE into them can come (a lease plus the WRITE timeout "
                        "after the decoder last asked), then vLLM frees or recomputes.",
                        [target(f"sum {by(Label.REASON)} (rate({sel(abandoned)}[{RATE}]))", "{{reason}}")],
                        "suffix: receives/s"), 6, 8),
        Cell(count_stat("Peers forgotten",
                        "Remote engines dropped and silent for peer_forget_after_s, then forgotten "
                        f"(what was kept for them released), in the dashboard range: {forgotten}."
                        + EXACT_NOTE, changed(forgotten)), 4, 8),
    ]


def budget_left(error_ratio: str, objective: float) -> str:
    """The share of an SLO's error budget left over the range: 1 - error ratio / budget."""
    return f"1 - ({error_ratio}) * {1 / (1 - objective):.6g}"


def _service_levels() -> list[Cell]:
    """The SLOs' error budgets left over the dashboard range (dashboards/slo.py)."""
    obj = slo.OBJECTIVES
    count, waits = hcount(V.RECEIVE_DURATION), hcount(V.KV_WAIT)
    in_time = sel(bucket(V.KV_WAIT), RECEIVE_SUCCESS, f'le="{obj.kv_wait_threshold_s:g}"')
    delivery = f"{changed(count, NOT_SUCCESS)} / ({changed(count)} > 0)"
    late = (f"({changed(waits, RECEIVE_SUCCESS)} - sum({range_change(in_time)})) / "
            f"({changed(waits, RECEIVE_SUCCESS)} > 0)")
    steps = thresholds(("red", None), ("orange", 0), ("green", 0.25))
    note = (" Set the dashboard range to the SLO period (30 days); below 0 the objective is missed. The "
            "burn-rate alerts: docs/runbooks.md.")
    return [
        Cell(stat("KV delivery error budget left (range)",
                  f"Objective: {obj.kv_delivery:.4g} of remote-prefill requests get their KV over NIXL. "
                  "The share of the error budget left over the range: 1 - (receives that did not succeed "
                  f"/ all receives) / {1 - obj.kv_delivery:.4g}, from the exact counter changes." + note,
                  budget_left(delivery, obj.kv_delivery), "percentunit", steps=steps, no_value="-",
                  decimals=1), 12, 5),
        Cell(stat("KV wait error budget left (range)",
                  f"Objective: {obj.kv_wait:.4g} of the requests whose KV arrived waited at most "
                  f"{obj.kv_wait_threshold_s:g}s for it from their arrival at the decoder. The share of the "
                  "error budget left over the range: 1 - (those that waited longer / all whose KV arrived) "
                  f"/ {1 - obj.kv_wait:.4g}." + note,
                  budget_left(late, obj.kv_wait), "percentunit", steps=steps, no_value="-",
                  decimals=1), 12, 5),
    ]


def _by_engine(expr: str, *labels: str) -> str:
    """NIXL's series `expr`, summed per engine (and `labels`) through the agent info join."""
    return f"sum {by('instance', *labels)} (" + witness.joined(expr, scoped=True) + ")"


def _nixl_quantile(q: float, spec: MetricSpec) -> str:
    """A quantile of one of NIXL's histograms (microseconds) per engine."""
    inner = _by_engine(f"rate({sel(bucket(spec))}[{RATE}])", "le")
    return f"histogram_quantile({q}, {inner}) >= 0"


def _nixl_agents() -> list[Cell]:
    """NIXL's own exporter, joined to the engines (docs/telemetry.md "NIXL's own counters")."""
    ours = V.VLLM_BYTES_TRANSFERRED
    join = ("Each NIXL series gets its engine from vllm:nixl_push_agent_info (one per worker, "
            "value 1): `* on (agent_name) group_left (instance, model_name, engine, tp_rank)`.")
    nixl_changed = ("sum(" + witness.joined(range_change(sel(total(V.NIXL_TX_BYTES))), scoped=True)
                    + ")")
    return [
        Cell(timeseries("Bytes sent/s: NIXL's count and the engine's",
                        "Per engine: the bytes NIXL's own exporter counts for its agents' transfers "
                        "(agent_tx_bytes_total) and those the engine reports (vLLM's per-transfer "
                        f"{ours.name}). The two lines lie on each other; where they part, one count "
                        "is wrong (alert NixlTelemetryDisagrees). " + join,
                        [target(_by_engine(f"rate({sel(total(V.NIXL_TX_BYTES))}[{RATE}])"),
                                "NIXL {{instance}}"),
                         target(f"sum by (instance) (rate({sel(hsum(ours))}[{RATE}]))",
                                "engine {{instance}}")],
                        "Bps"), 12, 8),
        Cell(timeseries("Transfers/s: NIXL's requests and the engine's WRITEs",
                        "Per engine: transfer requests NIXL's agents posted (agent_tx_requests_num_total) "
                        f"and WRITEs the engine saw done ({ours.name}_count). One WRITE is one NIXL "
                        "request per remote rank. " + join,
                        [target(_by_engine(f"rate({sel(total(V.NIXL_TX_REQUESTS))}[{RATE}])"),
                                "NIXL {{instance}}"),
                         target(f"sum by (instance) (rate({sel(hcount(ours))}[{RATE}]))",
                                "engine {{instance}}")],
                        "suffix: transfers/s"), 12, 8),
        Cell(timeseries("NIXL agents' transfer and post time p50 / p99",
                        "NIXL's own histograms of a transfer's time from post to completion "
                        f"({V.NIXL_XFER_TIME.name}) and of posting it ({V.NIXL_POST_TIME.name}), per "
                        "engine, in microseconds; idle windows dropped with `>= 0`. " + join,
                        [target(_nixl_quantile(0.5, V.NIXL_XFER_TIME), "transfer p50 {{instance}}"),
                         target(_nixl_quantile(0.99, V.NIXL_XFER_TIME), "transfer p99 {{instance}}"),
                         target(_nixl_quantile(0.99, V.NIXL_POST_TIME), "post p99 {{instance}}")],
                        "µs"), 8, 8),
        Cell(timeseries("NIXL memory registered",
                        "Bytes of memory each worker's agent registered with NIXL "
                        f"({total(V.NIXL_MEMORY_REGISTERED)}): its KV cache, once at start-up. " + join,
                        [target(_by_engine(sel(total(V.NIXL_MEMORY_REGISTERED)), AgentLabel.TP_RANK),
                                "{{instance}} rank {{tp_rank}}")],
                        "bytes"), 8, 8),
        Cell(timeseries("NIXL errors/s by status",
                        f"Errors NIXL's agents counted ({total(V.NIXL_ERRORS)}), per engine and NIXL "
                        "status. " + join,
                        [target(_by_engine(f"rate({sel(total(V.NIXL_ERRORS))}[{RATE}])", V.NixlLabel.STATUS),
                                "{{instance}} {{status}}")],
                        "suffix: errors/s"), 8, 8),
        Cell(count_stat("Engine bytes minus NIXL's (range)",
                        f"The exact change over the range of the engines' {hsum(ours)} minus that of "
                        "NIXL's agent_tx_bytes_total for the same agents: 0 when the two agree (a WRITE "
                        "or two in flight at the range's edges aside). " + join,
                        f"sum({range_change(sel(hsum(ours)))}) - {nixl_changed}",
                        bad_from=None), 12, 5),
        Cell(count_stat("NIXL telemetry events dropped (range)",
                        "Events NIXL's exporter dropped before counting them "
                        f"({total(V.NIXL_EVENTS_DROPPED)}), exact change over the range: above 0, "
                        "NIXL's counts undercount and the comparison above means less. " + join,
                        "sum(" + witness.joined(range_change(sel(total(V.NIXL_EVENTS_DROPPED))),
                                                scoped=True) + ")", bad_from=1), 12, 5),
    ]


def _reliability() -> list[Cell]:
    in_flight, oldest = gauge(V.HANDSHAKES_IN_FLIGHT), gauge(V.HANDSHAKE_OLDEST_IN_FLIGHT)
    retries, rejected = total(V.HANDSHAKE_RETRIES), total(V.PUSH_REG_REJECTED)
    lost, sc_rejected = total(V.TELEMETRY_ERRORS), total(V.SIDE_CHANNEL_REJECTED)
    internal = total(V.INTERNAL_ERRORS)
    verify = total(V.KV_VERIFY)
    mismatch = eq(Label.OUTCOME, V.KvVerifyOutcome.MISMATCH.value)
    return [
        Cell(timeseries("KV integrity checks/s",
                        "Receives a decode engine checked against the KV digest its prefill computed "
                        f"before the WRITE, by verdict and reason: rate of {verify} (match, mismatch, "
                        "skipped: no digest came, from a stock or verify-off prefill; sampled by "
                        "kv_verify_ratio, or, below ratio 1, escalated after a mismatch, new_peer, "
                        "at_risk). Any mismatch is an incident: alert NixlKvIntegrityMismatch.",
                        [target(f"sum {by(Label.OUTCOME, Label.REASON)} (rate({sel(verify)}[{RATE}]))",
                                "{{outcome}} ({{reason}})")],
                        "suffix: checks/s"), 8, 8),
        Cell(count_stat("KV mismatches",
                        "Receives whose KV differed from what their prefill sent, in the dashboard "
                        f"range: {verify}{{{mismatch}}}." + EXACT_NOTE,
                        changed(verify, mismatch), bad_from=1), 4, 8),
        Cell(timeseries("KV digest time p50 / p99",
                        f"Time one KV digest took on an engine's worker: {V.KV_DIGEST_DURATION.name} "
                        "(a prefill: before each WRITE of a sampled request; a decode: after its KV "
                        "landed, before its first decode step). The cost control is kv_verify_ratio.",
                        quantile_targets(V.KV_DIGEST_DURATION, (), "", qs=(0.5, 0.99)), "s"), 12, 8),
        Cell(timeseries("Handshakes in flight",
                        "Handshakes submitted and not finished (queued or running on the "
                        f"handshake pool), by direction and flavor: {in_flight}, summed over "
                        "the engine's workers. A handshake that hangs shows here before it is counted.",
                        [target(f"sum {by(*FLAVOR)} ({sel(in_flight)})",
                                "{{direction}} notif_only={{notif_agents_only}}")],
                        COUNT_UNIT), 6, 8),
        Cell(timeseries("Oldest handshake in flight",
                        f"Age of the oldest unfinished handshake by direction: {oldest} (0 when "
                        f"none). Alert NixlHandshakeStuck fires above {rules.STUCK_THRESHOLD_S}s.",
                        [target(f"max {by(Label.DIRECTION)} ({sel(oldest)})", "{{direction}}")],
                        "s"), 6, 8),
        Cell(timeseries("Handshake retries/s",
                        "Attempts re-queued after a transient failure (peer side channel "
                        f"unreachable or silent), by direction: rate of {retries}.",
                        [target(f"sum {by(Label.DIRECTION)} (rate({sel(retries)}[{RATE}]))",
                                "{{direction}}")],
                        "suffix: retries/s"), 4, 8),
        Cell(timeseries("Peer input rejected/s",
                        "PUSH_REG notifications a prefill worker dropped (malformed, oversized, "
                        f"failing, after its lease) by reason: rate of {rejected}; and side-channel "
                        f"requests an engine dropped (malformed, unknown rank): rate of {sc_rejected}. "
                        "Each costs only itself; the engine keeps serving.",
                        [target(f"sum {by(Label.REASON)} (rate({sel(rejected)}[{RATE}]))",
                                "PUSH_REG {{reason}}"),
                         target(f"sum {by(Label.REASON)} (rate({sel(sc_rejected)}[{RATE}]))",
                                "side channel {{reason}}")],
                        "suffix: msgs/s"), 4, 8),
        Cell(timeseries("Telemetry errors/s",
                        f"Telemetry lost to an internal error, by reason: rate of {lost}. The push "
                        "is never affected; the first of each reason is logged at WARNING.",
                        [target(f"sum {by(Label.REASON)} (rate({sel(lost)}[{RATE}]))", "{{reason}}")],
                        "suffix: errors/s"), 4, 8),
        Cell(count_stat("Internal errors",
                        "Steps of the push's data path that raised, in the dashboard range: a defect "
                        "of the connector (never a peer's input). Each request concerned ended by the "
                        "failure path (a push failed and its decoder told, a receive given up), none "
                        f"was left waiting; the ERROR log line has the traceback: {internal}. Alert "
                        "NixlInternalError fires on any." + EXACT_NOTE, changed(internal)), 4, 8),
    ]


def _stock() -> list[Cell]:
    stock = {spec.name.removeprefix("vllm:nixl_"): spec for spec in V.STOCK_METRICS}
    xfer, post = stock["xfer_time_seconds"], stock["post_time_seconds"]
    nbytes, ndescs = stock["bytes_transferred"], stock["num_descriptors"]
    failed_x, failed_n = stock["num_failed_transfers"], stock["num_failed_notifications"]
    after = stock["num_notifications_after_expiry"]
    return [
        Cell(timeseries("NIXL transfers/s and failures/s",
                        f"Completed transfers per second (rate of {xfer.name}_count), failed "
                        f"transfers ({failed_x.name}_total) and failed notifications "
                        f"({failed_n.name}_total). vLLM's stock NIXL metrics.",
                        [target(f"sum(rate({sel(hcount(xfer))}[{RATE}]))", "transfers"),
                         target(f"sum(rate({sel(total(failed_x))}[{RATE}]))", "failed transfers"),
                         target(f"sum(rate({sel(total(failed_n))}[{RATE}]))", "failed notifications")],
                        "suffix: transfers/s"), 12, 8),
        Cell(timeseries("NIXL transfer and post time p50 / p99",
                        f"Transfer duration ({xfer.name}) and post time ({post.name}) quantiles, "
                        "histogram_quantile over the rate of their _bucket series; idle windows "
                        "dropped with `>= 0`. vLLM's stock NIXL metrics.",
                        [target(quantile(0.5, xfer, (), RATE), "transfer p50"),
                         target(quantile(0.99, xfer, (), RATE), "transfer p99"),
                         target(quantile(0.99, post, (), RATE), "post p99")],
                        "s"), 12, 8),
        Cell(timeseries("NIXL bytes transferred/s",
                        f"Bytes moved by NIXL transfers per second: rate of {nbytes.name}_sum. "
                        "vLLM's stock NIXL metric.",
                        [target(f"sum(rate({sel(hsum(nbytes))}[{RATE}]))", "bytes/s")],
                        "Bps"), 8, 8),
        Cell(timeseries("Descriptors per NIXL transfer (mean)",
                        f"Mean descriptors per transfer: rate of {ndescs.name}_sum over rate of "
                        f"{ndescs.name}_count (absent while idle). vLLM's stock NIXL metric.",
                        [target(f"sum(rate({sel(hsum(ndescs))}[{RATE}])) / "
                                f"(sum(rate({sel(hcount(ndescs))}[{RATE}])) > 0)", "descriptors")],
                        COUNT_UNIT), 8, 8),
        Cell(timeseries("Completion notifications after lease expiry/s",
                        "Completion notifications that arrived after their request's KV lease "
                        f"had expired ({after.name}_total), per second. vLLM's stock NIXL metric; "
                        "the expiries themselves are in the KV leases row.",
                        [target(f"sum(rate({sel(total(after))}[{RATE}]))", "notifications after expiry")],
                        "suffix: notifs/s"), 8, 8),
    ]


def _router() -> list[Cell]:
    reqs, cancelled = total(V.ROUTER_REQUESTS), total(V.ROUTER_LEGS_CANCELLED)
    ttft, leg = V.ROUTER_TTFT, V.ROUTER_LEG_DURATION
    in_flight = gauge(V.ROUTER_REQUESTS_IN_FLIGHT)
    outcome, stream, route = Label.OUTCOME, RouterLabel.STREAM, RouterLabel.ROUTE
    scoped = ("The router's own /metrics carry no model_name or engine label: its panels follow "
              "the job and instance filters only.")
    nan_note = "Windows without requests are dropped (`>= 0`)."
    return [
        Cell(bargauge("Router requests by outcome (range)",
                      "Client requests the router finished in the dashboard range, by outcome: ok "
                      "(D's answer reached the client), prefill_failed, decode_failed, "
                      "client_disconnected (both legs stopped), bad_request (refused, no leg sent). "
                      f"{scoped}" + EXACT_NOTE,
                      [target(changed(reqs, labels=(outcome,)), "{{outcome}}")],
                      COUNT_UNIT, no_value="0", decimals=0), 8, 6, headline=True),
        Cell(stat("Router requests answered ok (range)",
                  "Share of the client requests the router finished in the dashboard range whose "
                  "answer reached the client (outcome ok). Shows 'no requests' when none finished "
                  f"(a guarded denominator instead of NaN). {scoped}" + EXACT_NOTE,
                  f"{changed(reqs, ROUTER_OK)} / ({changed(reqs)} > 0)", "percentunit",
                  steps=thresholds(("red", None), ("orange", 0.99), ("green", 1)),
                  no_value="no requests", decimals=1), 6, 6, headline=True),
        Cell(bargauge("Mean client TTFT and leg latency (range)",
                      "Mean time to first token as the client saw it (not streamed: the whole answer), "
                      "by stream, and mean wall time of the legs that succeeded, by leg, over the "
                      "dashboard range: the change of the histograms' _sum divided by the change of "
                      "their _count (denominator guarded with > 0)." + EXACT_NOTE,
                      [target(range_mean(ttft, labels=(stream,)), "TTFT stream={{stream}}"),
                       target(range_mean(leg, LEG_OK, labels=(RouterLabel.LEG,)), "{{leg}} leg")],
                      "s", no_value="no requests in range"), 10, 6, headline=True),
        Cell(timeseries("Router requests/s by route and outcome",
                        "Client requests the router finished per second, by route and outcome: rate of "
                        f"{reqs}, whose series exist at 0 from start-up.",
                        [target(f"sum {by(route, outcome)} (rate({sel(reqs)}[{RATE}]))",
                                "{{route}} {{outcome}}")],
                        "reqps"), 12, 8),
        Cell(timeseries("Client TTFT p50 / p95 / p99",
                        "Time to first token as the client sees it, from the request's arrival at the "
                        "router until its first token was sent (streamed: D's first event; not "
                        "streamed: the whole answer), by stream; successful requests only. Anchored on "
                        f"llm-d's true_ttft_ms. {nan_note}",
                        quantile_targets(ttft, (stream,), "stream={{stream}}"),
                        "s", exemplars=True), 12, 8),
        Cell(timeseries("Leg latency p50 / p95 by leg",
                        "Wall time of the legs that succeeded, from the router sending a leg until its "
                        "answer was read to the end (D streamed: its last event), by leg (prefill: P's "
                        f"one-token answer; decode: D's whole answer). {nan_note}",
                        quantile_targets(leg, (RouterLabel.LEG,), "{{leg}}", LEG_OK, qs=(0.5, 0.95)),
                        "s", exemplars=True), 8, 8),
        Cell(timeseries("Router requests in flight",
                        "Client requests the router is handling now (received, answer not yet "
                        f"delivered), by route: {in_flight}.",
                        [target(f"sum {by(route)} ({sel(in_flight)})", "{{route}}")],
                        COUNT_UNIT), 8, 8),
        Cell(timeseries("Legs cancelled/s by leg and reason",
                        "Legs the router stopped while in flight, per second, by leg and reason "
                        "(other_leg_failed: D must not wait for KV that never comes; "
                        "client_disconnected; request_served: D's stream ended before P's answer): "
                        f"rate of {cancelled}.",
                        [target(f"sum {by(RouterLabel.LEG, Label.REASON)} (rate({sel(cancelled)}[{RATE}]))",
                                "{{leg}} {{reason}}")],
                        "suffix: legs/s"), 8, 8),
    ]


# The rows in layout order: (title, collapsed, builder). A collapsed row is an optional
# section titled "... (requires ...)". dashboards/perses.py renders the same rows for Perses.
ROUTER_ROW = "Router (requires python -m connector.router)"
STOCK_ROW = "NIXL transfers (requires NixlConnector)"
NIXL_AGENTS_ROW = "NIXL agents (NIXL's own counters)"
ROWS: tuple[tuple[str, bool, Callable[[], list[Cell]]], ...] = (
    ("Overview", False, _overview),
    ("Service levels", False, _service_levels),
    (TTFT_ROW, False, _ttft),
    ("Handshakes", False, _handshakes),
    ("Descriptor registrations", False, _descriptors),
    ("Latency and executor queue", False, _latency),
    ("Failures", False, _failures),
    ("Push flow", False, _push_flow),
    (NIXL_AGENTS_ROW, False, _nixl_agents),
    ("KV leases", False, _leases),
    ("Peers", False, _peers),
    ("Push state", False, _push_state),
    ("Reliability", False, _reliability),
    (ROUTER_ROW, True, _router),
    (STOCK_ROW, True, _stock),
)


def cells() -> list[Cell]:
    """Every panel of the dashboard with its size and headline mark, in layout order."""
    return [cell for _, _, build in ROWS for cell in build()]


def headline_titles() -> frozenset[str]:
    return frozenset(cell.panel["title"] for cell in cells() if cell.headline)


def row_titles(row: str) -> frozenset[str]:
    """Titles of the panels of one row."""
    return frozenset(cell.panel["title"] for title, _, build in ROWS if title == row for cell in build())


# ------------------------------------------------------------------ variables, layout
def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "definition": query, "query": query, "refresh": 2, "sort": 1, "regex": "",
        "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0,
    }


def _datasource_variable(name: str, label: str, kind: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "datasource", "query": kind, "refresh": 1,
            "regex": "", "hide": 0, "current": {}, "options": [], "multi": False, "includeAll": False}


# name -> (label, the series selector its values are read from, the label read)
QUERY_VARIABLES: dict[str, tuple[str, str, str]] = {
    "job": ("Job", TARGET_SOURCE, "job"),
    "model_name": ("Model", f'{VARIABLE_SOURCE}{{job=~"$job"}}', "model_name"),
    "instance": ("Instance", TARGET_SOURCE[:-1] + ',job=~"$job",model_name=~"$model_name"}', "instance"),
    "engine": ("Engine", f'{VARIABLE_SOURCE}{{job=~"$job",model_name=~"$model_name",instance=~"$instance"}}',
               "engine"),
}


def _templating() -> dict[str, Any]:
    return {"list": [
        _datasource_variable("datasource", "Data source", "prometheus"),
        *(_variable(name, label, f"label_values({source}, {read})")
          for name, (label, source, read) in QUERY_VARIABLES.items()),
        _datasource_variable(JAEGER_VARIABLE, "Traces (Jaeger)", "jaeger"),
    ]}


def _layout() -> list[Panel]:
    panels: list[Panel] = []
    y, next_id = 0, 1
    for title, collapsed, build in ROWS:
        row = {"type": "row", "title": title, "collapsed": collapsed, "id": next_id,
               "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []}
        next_id += 1
        y += 1
        panels.append(row)
        x, line_h = 0, 0
        for cell in build():
            if x + cell.w > 24:
                x, y, line_h = 0, y + line_h, 0
            panel = {"id": next_id, "gridPos": {"h": cell.h, "w": cell.w, "x": x, "y": y}, **cell.panel}
            next_id += 1
            (row["panels"] if collapsed else panels).append(panel)
            x, line_h = x + cell.w, max(line_h, cell.h)
        y += line_h
    return panels


def build_dashboard() -> dict[str, Any]:
    return {
        "uid": DASHBOARD_UID,
        "title": DASHBOARD_TITLE,
        "description": "NIXL push-mode KV connector: handshakes by flavor, descriptor "
                       "registrations saved, phase latency, executor queue wait, failures, "
                       "PUSH_REG, pushes, KV leases and the router. Generated by "
                       "dashboards/generate.py from connector/vocabulary.py; do not edit by hand.",
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


def iter_panels(dashboard: dict[str, Any]) -> Iterator[Panel]:
    """Every non-row panel, including those inside collapsed rows."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel
