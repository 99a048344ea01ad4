"""Perses dashboards, translated from the Grafana dashboard the generator builds.

One source: `panels.ROWS`. `build_dashboard()` takes `panels.build_dashboard()` row by
row and panel by panel, so a row or panel added for Grafana is here too, with the same
title, description, queries, legends, units and place. A Grafana panel type without a
Perses counterpart in PANEL_KINDS fails `--check` (perses_schema.problems) instead of
being dropped. What Perses has no equivalent for is listed in dashboards/README.md.

Written as a native Perses `Dashboard` (`percli apply -f`) and as the Perses operator's
`PersesDashboard` (perses.dev/v1alpha2), both YAML.
"""

from __future__ import annotations

import re
from typing import Any

from dashboards import k8s, panels

DASHBOARD_FILE = "perses/nixl-push-handshakes.yaml"
OPERATOR_FILE = "perses/k8s/persesdashboard.yaml"
PROJECT = "nixl-push"
DATASOURCE_KIND = "PrometheusDatasource"
DATASOURCE_REF = "$datasource"
# Grafana panel type -> Perses panel plugin (the only kinds the translation knows).
PANEL_KINDS = {"timeseries": "TimeSeriesChart", "stat": "StatChart", "bargauge": "BarChart"}
# Grafana unit -> Perses format unit ("suffix: x/s" units become decimal with an axis label).
UNITS = {"s": "seconds", "percentunit": "percent-decimal", "short": "decimal", "Bps": "bytes/sec",
         "reqps": "requests/sec"}
# Grafana's named colors as Perses wants them (CSS hex).
COLORS = {"red": "#f2495c", "green": "#73bf69", "blue": "#5794f2", "orange": "#ff9830"}
CALCULATIONS = {"lastNotNull": "last-number", "max": "max", "mean": "mean", "min": "min", "sum": "sum"}
SORTS = {0: "none", 1: "alphabetical-asc", 2: "alphabetical-desc"}
_LABEL_VALUES = re.compile(r"label_values\((?P<selector>.+), (?P<label>\w+)\)")

Obj = dict[str, Any]


def panel_key(title: str, taken: set[str]) -> str:
    """A Perses panel id from a title: [a-zA-Z0-9_.-], at most 75 characters, unique."""
    base = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:70].rstrip("-") or "panel"
    key, n = base, 2
    while key in taken:
        key, n = f"{base}-{n}", n + 1
    taken.add(key)
    return key


def _format(unit: str, decimals: int | None) -> tuple[Obj, str]:
    """(Perses format, y-axis label) for a Grafana unit."""
    label = unit.removeprefix("suffix:").strip() if unit.startswith("suffix:") else ""
    fmt: Obj = {"unit": UNITS.get(unit, "decimal")}
    if decimals is not None:
        fmt["decimalPlaces"] = decimals
    return fmt, label


def _thresholds(grafana: Obj) -> Obj:
    steps = grafana.get("steps", [])
    out: Obj = {"mode": grafana.get("mode", "absolute"), "defaultColor": COLORS[steps[0]["color"]]}
    if steps[1:]:
        out["steps"] = [{"value": s["value"], "color": COLORS[s["color"]]} for s in steps[1:]]
    return out


def _plugin(panel: Obj) -> Obj:
    defaults = panel["fieldConfig"]["defaults"]
    fmt, axis_label = _format(defaults["unit"], defaults.get("decimals"))
    kind = PANEL_KINDS.get(panel["type"], panel["type"])
    if panel["type"] == "timeseries":
        custom = defaults.get("custom", {})
        legend = panel["options"]["legend"]
        y_axis: Obj = {"format": fmt, "min": defaults.get("min", 0)}
        if "max" in defaults:
            y_axis["max"] = defaults["max"]
        if axis_label:
            y_axis["label"] = axis_label
        visual: Obj = {"display": "bar" if custom.get("drawStyle") == "bars" else "line",
                       "lineWidth": custom.get("lineWidth", 1),
                       "areaOpacity": custom.get("fillOpacity", 0) / 100}
        if custom.get("stacking", {}).get("mode") == "normal":
            visual["stack"] = "all"
        spec: Obj = {"legend": {"position": legend["placement"], "mode": legend["displayMode"],
                                "values": [CALCULATIONS[c] for c in legend.get("calcs", [])]},
                     "yAxis": y_axis, "visual": visual}
    elif panel["type"] == "stat":
        spec = {"calculation": "last-number", "format": fmt,
                "thresholds": _thresholds(defaults["thresholds"]), "colorMode": "background_solid"}
    elif panel["type"] == "bargauge":
        spec = {"calculation": "last-number", "format": fmt,
                "orientation": panel["options"].get("orientation", "horizontal")}
    else:  # no Perses counterpart: kept as is, and perses_schema.problems() reports it
        spec = {}
    return {"kind": kind, "spec": spec}


def _query(target: Obj) -> Obj:
    spec: Obj = {"datasource": DATASOURCE_REF, "query": target["expr"]}
    if target.get("legendFormat", "__auto") != "__auto":
        spec["seriesNameFormat"] = target["legendFormat"]
    if target.get("instant"):
        spec["instant"] = True
    plugin = {"kind": "PrometheusTimeSeriesQuery", "spec": spec}
    return {"kind": "TimeSeriesQuery", "spec": {"plugin": plugin}}


def _panel(panel: Obj) -> Obj:
    return {"kind": "Panel", "spec": {
        "display": {"name": panel["title"], "description": panel["description"]},
        "plugin": _plugin(panel),
        "queries": [_query(t) for t in panel["targets"]],
    }}


def _variable(grafana: Obj) -> Obj | None:
    """A Grafana variable as a Perses list variable; None for the Grafana-only ones."""
    display = {"name": grafana.get("label") or grafana["name"]}
    if grafana["type"] == "datasource":
        if grafana["query"] != "prometheus":
            return None  # the $jaeger variable only serves Grafana's exemplar links
        return {"kind": "ListVariable", "spec": {
            "name": grafana["name"], "display": display, "allowAllValue": False, "allowMultiple": False,
            "plugin": {"kind": "DatasourceVariable", "spec": {"datasourcePluginKind": DATASOURCE_KIND}}}}
    match = _LABEL_VALUES.fullmatch(grafana["query"])
    assert match is not None, grafana["query"]
    spec: Obj = {"name": grafana["name"], "display": display,
                 "allowAllValue": bool(grafana.get("includeAll")),
                 "allowMultiple": bool(grafana.get("multi")),
                 "sort": SORTS.get(grafana.get("sort", 0), "none"),
                 "plugin": {"kind": "PrometheusLabelValuesVariable", "spec": {
                     "datasource": DATASOURCE_REF, "labelName": match["label"],
                     "matchers": [match["selector"]]}}}
    if grafana.get("includeAll"):
        spec["customAllValue"] = grafana.get("allValue", ".*")
        spec["defaultValue"] = ["$__all"] if grafana.get("multi") else "$__all"
    return {"kind": "ListVariable", "spec": spec}


def _rows(grafana: Obj) -> list[tuple[Obj, list[Obj]]]:
    """Each Grafana row with its panels (a collapsed row holds them; an expanded one is
    followed by them in the flat list)."""
    rows: list[tuple[Obj, list[Obj]]] = []
    for item in grafana["panels"]:
        if item.get("type") == "row":
            rows.append((item, list(item["panels"]) if item["collapsed"] else []))
        elif not rows:
            raise ValueError(f"panel {item.get('title')!r} outside a row: Perses puts every panel in a grid")
        else:
            rows[-1][1].append(item)
    return rows


def _layouts(grafana: Obj, keys: dict[int, str]) -> list[Obj]:
    """One Perses grid per Grafana row, its panels at the same place (y relative to the row)."""
    out = []
    for row, members in _rows(grafana):
        top = row["gridPos"]["y"] + 1
        items = [{"x": p["gridPos"]["x"], "y": p["gridPos"]["y"] - top, "width": p["gridPos"]["w"],
                  "height": p["gridPos"]["h"], "content": {"$ref": f"#/spec/panels/{keys[p['id']]}"}}
                 for p in members]
        out.append({"kind": "Grid", "spec": {
            "display": {"title": row["title"], "collapse": {"open": not row["collapsed"]}}, "items": items}})
    return out


def build_spec(grafana: Obj | None = None) -> Obj:
    """The Perses dashboard spec of the Grafana dashboard (default: the generator's)."""
    grafana = panels.build_dashboard() if grafana is None else grafana
    taken: set[str] = set()
    keys = {p["id"]: panel_key(p["title"], taken) for p in panels.iter_panels(grafana)}
    variables = [v for v in (_variable(g) for g in grafana["templating"]["list"]) if v is not None]
    return {
        "display": {"name": grafana["title"], "description": grafana["description"]},
        "duration": grafana["time"]["from"].removeprefix("now-"),
        "refreshInterval": grafana["refresh"],
        "variables": variables,
        "panels": {keys[p["id"]]: _panel(p) for p in panels.iter_panels(grafana)},
        "layouts": _layouts(grafana, keys),
    }


def build_dashboard(grafana: Obj | None = None) -> Obj:
    """The native Perses Dashboard resource (`percli apply -f`)."""
    return {"kind": "Dashboard",
            "metadata": {"name": panels.DASHBOARD_UID, "project": PROJECT},
            "spec": build_spec(grafana)}


def build_operator_resource(grafana: Obj | None = None) -> Obj:
    """The same dashboard as the Perses operator's PersesDashboard (its namespace is the project)."""
    return {"apiVersion": "perses.dev/v1alpha2", "kind": "PersesDashboard",
            "metadata": {"name": panels.DASHBOARD_UID,
                         "labels": {"app.kubernetes.io/part-of": "nixl-push-observed"}},
            "spec": {"config": build_spec(grafana)}}


def render() -> dict[str, str]:
    """Relative path under dashboards/ -> YAML text."""
    native = (f"# Perses (native Dashboard): percli apply -f dashboards/{DASHBOARD_FILE}\n"
              f"# (project {PROJECT}; see dashboards/README.md).\n")
    operator = ("# The Perses operator's PersesDashboard (the namespace is the Perses project):\n"
                f"# kubectl apply -n <namespace> -f dashboards/{OPERATOR_FILE}\n")
    return {DASHBOARD_FILE: k8s.HEADER + native + k8s.to_yaml(build_dashboard()),
            OPERATOR_FILE: k8s.HEADER + operator + k8s.to_yaml(build_operator_resource())}
