"""Offline validation of the generated Perses dashboards against Perses' published schema.

This is our own transcription, not Perses' validator. Perses' own offline check is
`percli lint`; it needs a Go build of perses/perses that this project cannot install
(dashboards/README.md, "Validation"), so its test is opt-in (PERCLI=/path/to/percli) and
never runs in CI. What always runs is this: a JSON Schema written here by hand from
Perses' published CUE definitions and Go model, at these versions:

- perses/perses v0.54.0 (cue/model/api/v1: Dashboard, ProjectMetadata), which takes
- perses/spec v0.3.0-beta.1 (cue/dashboard: Spec, Panel, Query, Grid layout, ListSpec;
  go/dashboard: its UnmarshalJSON/validate checks) and
- perses/shared cue v0.55.0-beta.1 (cue/common: format, thresholds, legend, calculation,
  datasource selector),
- perses/plugins schemas of 2026-08: TimeSeriesChart, StatChart, BarChart,
  PrometheusTimeSeriesQuery, PrometheusLabelValuesVariable, DatasourceVariable,
- perses/perses-operator: PersesDashboard perses.dev/v1alpha2 (`spec.config` is the spec).

It is stricter than Perses where Perses is lenient (every object is closed; Perses closes
the plugin specs and ignores unknown keys elsewhere), so a generator typo cannot pass.
`problems()` adds the cross-field checks Perses' Go model makes on unmarshal and the
API makes on save (panel ids, variable names, $refs to panels, defaults, grid bounds).
"""

from __future__ import annotations

import re
from typing import Any

import jsonschema

Obj = dict[str, Any]

PANEL_PLUGINS = ("TimeSeriesChart", "StatChart", "BarChart")
VARIABLE_PLUGINS = ("PrometheusLabelValuesVariable", "DatasourceVariable")
BUILTIN_VARIABLES = frozenset({"__dashboard", "__project", "__from", "__to", "__range", "__range_s",
                               "__range_ms", "__rate_interval", "__interval", "__interval_ms"})
GRID_COLUMNS = 24


def _closed(required: tuple[str, ...] = (), **properties: Any) -> Obj:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


STRING, BOOL, NUMBER, INT = {"type": "string"}, {"type": "boolean"}, {"type": "number"}, {"type": "integer"}
ID = {"type": "string", "minLength": 1, "maxLength": 75, "pattern": r"^[a-zA-Z0-9_.-]+$"}
DURATION = {"type": "string", "minLength": 1,
            "pattern": r"^(\d+y)?(\d+w)?(\d+d)?(\d+h)?(\d+m)?(\d+s)?(\d+ms)?$"}
VARIABLE_REF = {"type": "string", "pattern": r"^\$\w+$"}
CALCULATION = {"enum": ["first", "last", "first-number", "last-number", "mean", "sum", "min", "max"]}

# cue/common/format.cue: three closed shapes by unit family.
_TIME = ["nanoseconds", "microseconds", "milliseconds", "seconds", "minutes", "hours", "days", "weeks",
         "months", "years"]
_FLOAT_UNITS = [*_TIME, "percent", "percent-decimal", "aud", "cad", "chf", "cny", "eur", "gbp", "hkd",
                "inr", "jpy", "krw", "nok", "nzd", "sek", "sgd", "usd", "celsius", "fahrenheit"]
_SHORT_UNITS = ["decimal", "bits", "decbits", "bytes", "decbytes", "bits/sec", "decbits/sec", "bytes/sec",
                "decbytes/sec", "counts/sec", "events/sec", "messages/sec", "ops/sec", "packets/sec",
                "reads/sec", "records/sec", "requests/sec", "rows/sec", "writes/sec"]
_DATE_UNITS = ["datetime-iso", "datetime-us", "datetime-local", "date-iso", "date-us", "date-local",
               "time-local", "time-iso", "time-us", "relative-time", "unix-timestamp", "unix-timestamp-ms"]
FORMAT = {"anyOf": [
    _closed(unit={"enum": _DATE_UNITS}),
    _closed(unit={"enum": _FLOAT_UNITS}, decimalPlaces=NUMBER),
    _closed(unit={"enum": _SHORT_UNITS}, decimalPlaces=NUMBER, shortValues=BOOL),
]}
THRESHOLDS = _closed(mode={"enum": ["percent", "absolute"]}, defaultColor=STRING,
                     steps={"type": "array", "items": _closed(("value",), value=NUMBER, color=STRING,
                                                              name=STRING)})
LEGEND = _closed(("position",), position={"enum": ["bottom", "right"]}, mode={"enum": ["list", "table"]},
                 size={"enum": ["small", "medium"]}, values={"type": "array", "items": CALCULATION})
LINE_STYLE = {"enum": ["solid", "dashed", "dotted"]}
OPACITY = {"type": "number", "minimum": 0, "maximum": 1}
PROMETHEUS_DATASOURCE = {"anyOf": [VARIABLE_REF, _closed(("kind",), kind={"const": "PrometheusDatasource"},
                                                         name=STRING)]}

PLUGIN_SPECS: dict[str, Obj] = {
    "TimeSeriesChart": _closed(
        legend=LEGEND, tooltip=_closed(enablePinning=BOOL),
        yAxis=_closed(show=BOOL, label=STRING, format=FORMAT, min=NUMBER, max=NUMBER,
                      logBase={"enum": [2, 10]}),
        thresholds=THRESHOLDS,
        visual=_closed(display={"enum": ["line", "bar"]},
                       lineWidth={"type": "number", "minimum": 0.25, "maximum": 3}, lineStyle=LINE_STYLE,
                       areaOpacity=OPACITY, showPoints={"enum": ["auto", "always"]},
                       palette=_closed(("mode",), mode={"enum": ["auto", "categorical"]}),
                       pointRadius={"type": "number", "minimum": 0, "maximum": 6},
                       stack={"enum": ["all", "percent"]}, connectNulls=BOOL),
        querySettings={"type": "array"}),
    "StatChart": _closed(
        ("calculation",), calculation=CALCULATION, metricLabel=STRING, format=FORMAT, thresholds=THRESHOLDS,
        sparkline=_closed(color=STRING, width=NUMBER), valueFontSize=NUMBER,
        colorMode={"enum": ["value", "background_solid", "none"]}, legendMode={"enum": ["auto", "on", "off"]},
        mappings={"type": "array"}),
    "BarChart": _closed(
        ("calculation",), calculation=CALCULATION, format=FORMAT, sort={"enum": ["asc", "desc"]},
        mode={"enum": ["value", "percentage"]}, orientation={"enum": ["horizontal", "vertical"]},
        groupBy={"type": "array", "items": STRING}, isStacked=BOOL, visual={"type": "object"}),
    "PrometheusTimeSeriesQuery": _closed(
        ("query",), datasource=PROMETHEUS_DATASOURCE, query={"type": "string", "minLength": 1},
        seriesNameFormat=STRING, minStep={"anyOf": [DURATION, VARIABLE_REF]}, resolution=NUMBER,
        instant=BOOL),
    "PrometheusLabelValuesVariable": _closed(
        ("labelName",), datasource=PROMETHEUS_DATASOURCE, labelName={"type": "string", "minLength": 1},
        matchers={"type": "array", "items": STRING}),
    "DatasourceVariable": _closed(("datasourcePluginKind",), datasourcePluginKind={"type": "string",
                                                                                  "minLength": 1}),
}


def _plugin(kinds: tuple[str, ...]) -> Obj:
    """{kind, spec} whose spec must satisfy the schema of its kind (one of `kinds`)."""
    return {**_closed(("kind", "spec"), kind={"enum": list(kinds)}, spec={"type": "object"}),
            "allOf": [{"if": {"properties": {"kind": {"const": k}}},
                       "then": {"properties": {"spec": PLUGIN_SPECS[k]}}} for k in kinds]}


QUERY = _closed(("kind", "spec"), kind={"const": "TimeSeriesQuery"},
                spec=_closed(("plugin",), name=STRING, plugin=_plugin(("PrometheusTimeSeriesQuery",))))
PANEL = _closed(("kind", "spec"), kind={"const": "Panel"}, spec=_closed(
    ("plugin",), display=_closed(name=STRING, description=STRING, hideHeader=BOOL),
    plugin=_plugin(PANEL_PLUGINS), queries={"type": "array", "items": QUERY},
    links={"type": "array", "items": _closed(("url",), name=STRING, url=STRING, tooltip=STRING,
                                             renderVariables=BOOL, targetBlank=BOOL)}))
LIST_VARIABLE = _closed(("kind", "spec"), kind={"const": "ListVariable"}, spec=_closed(
    ("name", "allowAllValue", "allowMultiple", "plugin"), name=ID,
    display=_closed(name=STRING, description=STRING, hidden=BOOL),
    defaultValue={"anyOf": [STRING, {"type": "array", "items": STRING}]},
    allowAllValue=BOOL, allowMultiple=BOOL, customAllValue=STRING, capturingRegexp=STRING,
    sort={"enum": ["none", "alphabetical-asc", "alphabetical-desc", "numerical-asc", "numerical-desc",
                   "alphabetical-ci-asc", "alphabetical-ci-desc"]},
    plugin=_plugin(VARIABLE_PLUGINS)))
GRID = _closed(("kind", "spec"), kind={"const": "Grid"}, spec=_closed(
    ("items",), display=_closed(("title",), title=STRING, collapse=_closed(("open",), open=BOOL)),
    items={"type": "array", "items": _closed(
        ("x", "y", "width", "height"), x={**INT, "minimum": 0}, y={**INT, "minimum": 0},
        width={**INT, "minimum": 1}, height={**INT, "minimum": 1},
        content=_closed(("$ref",), **{"$ref": {"type": "string", "pattern": r"^#/spec/panels/"}}))},
    repeatVariable=STRING))
SPEC = _closed(("panels", "layouts", "duration"), display=_closed(name=STRING, description=STRING),
               variables={"type": "array", "items": LIST_VARIABLE},
               panels={"type": "object", "additionalProperties": PANEL},
               layouts={"type": "array", "items": GRID},
               duration=DURATION, refreshInterval=DURATION, timezone=STRING)
DASHBOARD = _closed(("kind", "metadata", "spec"), kind={"const": "Dashboard"},
                    metadata=_closed(("name", "project"), name=ID, project=ID), spec=SPEC)
PERSES_DASHBOARD = _closed(("apiVersion", "kind", "metadata", "spec"),
                           apiVersion={"const": "perses.dev/v1alpha2"}, kind={"const": "PersesDashboard"},
                           metadata=_closed(("name",), name=ID, namespace=STRING,
                                            labels={"type": "object", "additionalProperties": STRING}),
                           spec=_closed(("config",), config=SPEC, instanceSelector={"type": "object"}))
SCHEMAS = {"Dashboard": DASHBOARD, "PersesDashboard": PERSES_DASHBOARD}


def _id_problems(key: str) -> list[str]:
    """go/common ValidateID beyond the pattern: no '..', no leading or trailing '.'."""
    return [f"panel id {key!r}: no '..' and no '.' at either end"] \
        if ".." in key or key.startswith(".") or key.endswith(".") else []


def _spec_problems(spec: Obj) -> list[str]:
    problems: list[str] = []
    names: set[str] = set()
    for var in spec.get("variables", []):
        v = var["spec"]
        name = v["name"]
        if name in names:
            problems.append(f"variable {name!r} already exists")
        names.add(name)
        if not re.fullmatch(r"\w*?[^0-9]\w*", name) or name.startswith("__"):
            problems.append(f"variable name {name!r} is not valid (or has the builtin prefix __)")
        if v.get("customAllValue") and not v["allowAllValue"]:
            problems.append(f"variable {name!r}: customAllValue needs allowAllValue")
        if isinstance(v.get("defaultValue"), list) and len(v["defaultValue"]) > 1 and not v["allowMultiple"]:
            problems.append(f"variable {name!r}: a list of default values needs allowMultiple")
    defined = names | BUILTIN_VARIABLES
    panels = spec["panels"]
    for key in panels:
        problems += _id_problems(key)
    referenced: list[str] = []
    for layout in spec["layouts"]:
        cells: set[tuple[int, int]] = set()
        title = layout["spec"].get("display", {}).get("title", "?")
        for item in layout["spec"]["items"]:
            ref = item.get("content", {}).get("$ref", "")
            key = ref.removeprefix("#/spec/panels/")
            if key not in panels:
                problems.append(f"layout {title!r}: {ref!r} names no panel")
            referenced.append(key)
            if item["x"] + item["width"] > GRID_COLUMNS:
                problems.append(f"layout {title!r}: {key} is wider than the {GRID_COLUMNS}-column grid")
            mine = {(x, y) for x in range(item["x"], item["x"] + item["width"])
                    for y in range(item["y"], item["y"] + item["height"])}
            if cells & mine:
                problems.append(f"layout {title!r}: {key} overlaps another panel")
            cells |= mine
    problems += [f"panel {key!r} is in no layout" for key in panels if key not in referenced]
    problems += [f"panel {key!r} is in {referenced.count(key)} layouts" for key in set(referenced)
                 if referenced.count(key) > 1]
    for key, panel in panels.items():
        for query in panel["spec"].get("queries", []):
            used = set(re.findall(r"\$\{?(\w+)", query["spec"]["plugin"]["spec"].get("query", "")))
            problems += [f"panel {key!r}: query uses undefined variable ${v}" for v in sorted(used - defined)]
    return problems


def problems(resource: Obj) -> list[str]:
    """Everything wrong with one generated resource (a Dashboard or a PersesDashboard)."""
    schema = SCHEMAS.get(resource.get("kind", ""))
    if schema is None:
        return [f"kind {resource.get('kind')!r} is neither Dashboard nor PersesDashboard"]
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(resource), key=lambda e: list(e.absolute_path))
    out = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors]
    if out:
        return out
    spec = resource["spec"] if resource["kind"] == "Dashboard" else resource["spec"]["config"]
    return _spec_problems(spec)
