"""What `python -m dashboards.generate --check` verifies.

Every query may only select series, labels and exact label values the vocabulary
defines; every vocabulary metric is on a panel; every panel has a unit, the
$datasource variable and a description naming its metrics; rates use
`$__rate_interval`; range panels take the exact change (`offset $__range`), never
`increase()`, which extrapolates; latency histograms show exemplars linked to Jaeger;
and every generated file on disk equals what the generator renders.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import re
from pathlib import Path
from typing import Any

import yaml

from connector import vocabulary as V
from dashboards import panels, promql
from dashboards.queries import (
    BASE_LABELS,
    LITERAL_ALTERNATIVES,
    RANGE,
    RATE,
    all_specs,
    base_labels,
    scope_of,
    series_index,
)
from dashboards.rules import RULES_FILE

VOCAB_LABELS = frozenset(V.LABEL_VALUES)
# NIXL's exporter's labels and the agent info's (open values: never matched by value).
JOIN_LABELS = frozenset({V.AgentLabel.AGENT_NAME, V.AgentLabel.TP_RANK, V.NixlLabel.HOSTNAME,
                         V.NixlLabel.STATUS})


def _value_errors(where: str, metric: str, label: str, op: str, value: str,
                  spec: V.MetricSpec | None) -> list[str]:
    """Exact values (and literal `a|b` alternatives) of vocabulary labels must be allowed."""
    allowed = (V.METRIC_LABEL_VALUES.get((spec.name, label)) if spec else None) or V.LABEL_VALUES[label]
    if op in ("=~", "!~"):
        if not LITERAL_ALTERNATIVES.fullmatch(value):
            return [f"{where}: {label}{op}{value!r}: a regex on a vocabulary label must list "
                    "literal values (a|b), so each can be checked"]
        values = value.split("|")
    else:
        values = [value]
    return [f"{where}: {label}={v!r} is not a value the vocabulary allows for "
            f"{metric or label} {sorted(allowed)}" for v in values if v not in allowed]


def check_expr(expr: str, where: str, *, allow_variables: bool,
               recorded: frozenset[str] = frozenset()) -> list[str]:
    """Names in one query: metrics (or series `recorded` by our rules), labels and label
    values from the vocabulary; windows."""
    index = series_index()
    try:
        names = promql.metric_names(expr)
        calls = promql.range_calls(expr)
    except promql.PromQLError as exc:
        return [f"{where}: {exc}"]
    errors = [f"{where}: metric {name!r} is not defined in connector.vocabulary "
              "(ALL_METRICS or STOCK_METRICS)" for name in sorted(names - index.keys() - recorded)]
    all_labels = BASE_LABELS | VOCAB_LABELS | JOIN_LABELS | {"le"}
    for m in promql.matchers(expr):
        spec = index.get(m.metric)
        if spec is not None:
            allowed = (base_labels(spec) | set(spec.labels)
                       | ({"le"} if m.metric.endswith("_bucket") else set()))
        else:
            allowed = all_labels
        if m.label not in allowed:
            errors.append(f"{where}: label {m.label!r} is not a label of {m.metric or 'the selector'}")
        elif m.label in VOCAB_LABELS:
            errors += _value_errors(where, m.metric, m.label, m.op, m.value, spec)
    errors += [f"{where}: grouping label {label!r} is not a known label"
               for label in sorted(promql.grouping_labels(expr) - all_labels)]
    used = promql.variables(expr)
    if allow_variables:
        for func, window in calls:
            if func == "increase" and window == RANGE:
                errors.append(f"{where}: increase() over [{RANGE}] extrapolates to the range edges; "
                              "take the exact change (queries.range_change)")
            elif window != RATE:
                errors.append(f"{where}: {func}() must use [{RATE}], not [{window}]")
        errors += [f"{where}: offset must be {RANGE}, not {offset}"
                   for offset in promql.offsets(expr) if offset != RANGE]
        errors += [f"{where}: undefined variable ${v}"
                   for v in sorted(used - set(panels.VARIABLES) - panels.BUILTIN_VARIABLES)]
    elif used:
        errors.append(f"{where}: rules cannot use Grafana variables {sorted(used)}")
    return errors


def _check_panel(panel: dict[str, Any], headline: bool) -> tuple[list[str], set[str]]:
    """One panel's problems and the metrics it shows."""
    index = series_index()
    where = f"panel {panel.get('title')!r}"
    errors: list[str] = []
    if panel.get("datasource") != panels.DS:
        errors.append(f"{where}: datasource must be the $datasource variable")
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    if not defaults.get("unit"):
        errors.append(f"{where}: no unit")
    targets = panel.get("targets") or []
    if not targets:
        errors.append(f"{where}: no queries")
    shown: set[str] = set()
    wants_exemplars = False
    for t in targets:
        expr, query = t.get("expr", ""), f"{where} query {t.get('refId')}"
        errors += check_expr(expr, query, allow_variables=True)
        if headline and (not t.get("instant") or RANGE not in promql.offsets(expr)):
            errors.append(f"{query}: a headline panel shows the exact change over the range "
                          f"(an instant query with offset {RANGE})")
        with contextlib.suppress(promql.PromQLError):  # already reported by check_expr
            names = promql.metric_names(expr)
            shown |= {index[n].name for n in names if n in index}
            if names & panels.EXEMPLAR_BUCKETS and not t.get("instant"):
                # (an instant stat has no points to hang an exemplar on: only series do)
                wants_exemplars = True
                if not t.get("exemplar"):
                    errors.append(f"{query}: latency histogram without exemplars")
    links = defaults.get("links") or []
    if wants_exemplars and not any("${" + panels.JAEGER_VARIABLE + "}" in link.get("url", "")
                                   for link in links):
        errors.append(f"{where}: exemplars without a data link to the ${panels.JAEGER_VARIABLE} "
                      "data source")
    description = panel.get("description") or ""
    errors += [f"{where}: description does not name its metric {metric}"
               for metric in sorted(shown) if metric not in description]
    return errors, shown


def check_dashboard(dashboard: dict[str, Any],
                    headlines: frozenset[str] | None = None) -> list[str]:
    """Everything `--check` verifies about one dashboard dict (`headlines`: titles of the
    panels that must show exact range changes; default: the generator's)."""
    headlines = panels.headline_titles() if headlines is None else headlines
    errors: list[str] = []
    if dashboard.get("schemaVersion") != panels.SCHEMA_VERSION:
        errors.append(f"schemaVersion must be {panels.SCHEMA_VERSION}")
    names = [v.get("name") for v in dashboard.get("templating", {}).get("list", [])]
    errors += [f"missing dashboard variable ${v}" for v in panels.VARIABLES if v not in names]
    seen: set[str] = set()
    ids: set[int] = set()
    titles: set[str] = set()
    for panel in panels.iter_panels(dashboard):
        if panel.get("id") in ids:
            errors.append(f"panel {panel.get('title')!r}: duplicate id {panel.get('id')}")
        ids.add(panel.get("id"))
        titles.add(panel.get("title"))
        panel_errors, shown = _check_panel(panel, panel.get("title") in headlines)
        errors += panel_errors
        seen |= shown
    errors += [f"headline panel {title!r} is not on the dashboard" for title in sorted(headlines - titles)]
    errors += [f"metric {spec.name} is defined in connector.vocabulary but on no panel"
               for spec in all_specs() if spec.name not in seen]
    return errors


# ------------------------------------------------------------ vLLM's dashboard conventions
# vLLM's tools/generate_grafana_dashboards.py: ${datasource}, job, model_name, instance and
# engine variables; rates over $__rate_interval (checked above); ratios that drop zero
# denominators; optional sections as collapsed rows titled "(requires ...)"; descriptions
# that end with the metrics they read. dashboards/README.md says where we differ and why.
_SCOPE_MATCHER = re.compile(r'(\w+)(=~|=)"([^"]*)"')


def _parse_matchers(matchers: tuple[str, ...]) -> set[tuple[str, str, str]]:
    return {m.groups() for text in matchers if (m := _SCOPE_MATCHER.fullmatch(text))}


def unguarded_divisions(expr: str) -> list[str]:
    """Right operands of `/` that are neither a number nor a parenthesised `... > 0`."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    text = re.sub(r"\[[^\]]*\]", "[]", text)
    out = []
    for match in re.finditer(r"/", text):
        rest = text[match.end():].lstrip()
        if re.match(r"[0-9.]+(?:e[+-]?\d+)?\b", rest):
            continue
        if not rest.startswith("("):
            out.append(rest[:40])
            continue
        end = _closing(rest)
        if not rest[1:end].rstrip().endswith("> 0"):
            out.append(rest[:end + 1][:60])
    return out


def _closing(text: str) -> int:
    """Index of the parenthesis closing the one `text` starts with."""
    depth = 0
    for index, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return index
    return len(text)


def check_conventions(dashboard: dict[str, Any]) -> list[str]:
    """Where the dashboard departs from vLLM's conventions (each departure is an error)."""
    errors: list[str] = []
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    ds = variables.get("datasource", {})
    if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        errors.append("variable $datasource must be a Prometheus data source variable")
    for name in ("job", "model_name", "instance", "engine"):
        if variables.get(name, {}).get("type") != "query":
            errors.append(f"variable ${name} must be a query variable")
    for row in (p for p in dashboard.get("panels", []) if p.get("type") == "row"):
        optional = bool(panels.REQUIRES.fullmatch(row.get("title", "")))
        if bool(row.get("collapsed")) != optional:
            errors.append(f"row {row.get('title')!r}: a collapsed row is an optional section titled "
                          "'... (requires ...)', and only such a row is collapsed")
    for panel in panels.iter_panels(dashboard):
        where = f"panel {panel.get('title')!r}"
        targets = panel.get("targets") or []
        try:
            line = panels.metrics_line(targets)
        except promql.PromQLError:
            continue  # reported by check_expr
        if not (panel.get("description") or "").endswith(line):
            errors.append(f"{where}: description must end with {line.strip()!r}")
        for t in targets:
            expr, query = t.get("expr", ""), f"{where} query {t.get('refId')}"
            errors += [f"{query}: ratio without a zero-denominator guard: / {d}"
                       for d in unguarded_divisions(expr)]
            by_metric: dict[str, set[tuple[str, str, str]]] = {}
            for m in promql.matchers(expr):
                by_metric.setdefault(m.metric, set()).add((m.label, m.op, m.value))
            for metric, have in by_metric.items():
                if metric in series_index():
                    missing = _parse_matchers(scope_of(metric)) - have
                    errors += [f"{query}: {metric} is not scoped by {label}{op}\"{value}\""
                               for label, op, value in sorted(missing)]
    return errors


# ------------------------------------------------------------------------------ Perses
def check_perses(grafana: dict[str, Any], resources: list[dict[str, Any]]) -> list[str]:
    """Each Perses resource passes our Perses schema (perses_schema.py) and carries every row,
    panel and query of the Grafana dashboard, with a Perses counterpart for each panel type."""
    from dashboards import perses, perses_schema

    errors = [f"Grafana panel {p.get('title')!r}: type {p.get('type')!r} has no Perses counterpart "
              "(dashboards/perses.py PANEL_KINDS)" for p in panels.iter_panels(grafana)
              if p.get("type") not in perses.PANEL_KINDS]
    want_rows = [(row["title"], not row["collapsed"], [p["title"] for p in members])
                 for row, members in perses._rows(grafana)]
    want_queries = {p["title"]: [(t["expr"], bool(t.get("instant"))) for t in p["targets"]]
                    for p in panels.iter_panels(grafana)}
    for resource in resources:
        where = f"Perses {resource.get('kind')}"
        problems = perses_schema.problems(resource)
        errors += [f"{where}: {e}" for e in problems]
        if problems:
            continue
        spec = resource["spec"] if resource["kind"] == "Dashboard" else resource["spec"]["config"]
        by_key = spec["panels"]
        rows = [(layout["spec"]["display"]["title"], layout["spec"]["display"]["collapse"]["open"],
                 [by_key[item["content"]["$ref"].rsplit("/", 1)[1]]["spec"]["display"]["name"]
                  for item in layout["spec"]["items"]]) for layout in spec["layouts"]]
        if rows != want_rows:
            errors.append(f"{where}: rows and panels differ from the Grafana dashboard's")
        for panel in by_key.values():
            title = panel["spec"]["display"]["name"]
            got = [(q["spec"]["plugin"]["spec"]["query"], bool(q["spec"]["plugin"]["spec"].get("instant")))
                   for q in panel["spec"].get("queries", [])]
            if got != want_queries.get(title):
                errors.append(f"{where}: panel {title!r}: queries differ from the Grafana panel's")
    return errors


def check_rules(rules: dict[str, Any]) -> list[str]:
    errors: list[str] = []
    names: set[str] = set()
    every = [rule for group in rules.get("groups", []) for rule in group.get("rules", [])]
    recorded = frozenset(rule["record"] for rule in every if rule.get("record"))
    for rule in every:
        name = rule.get("alert") or rule.get("record")
        if name in names:
            errors.append(f"rule {name}: duplicate name")
        names.add(name)
        errors += check_expr(rule.get("expr", ""), f"rule {name}", allow_variables=False,
                             recorded=recorded)
    return errors


def stale(label: str, path: Path, text: str) -> list[str]:
    """A generated file that is missing or differs from `text`, with a diff excerpt."""
    if not path.exists():
        return [f"{label}: missing; run `make dashboards`"]
    current = path.read_text()
    if current == text:
        return []
    diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(),
                                     f"{label} (on disk)", f"{label} (generated)", lineterm="", n=1))
    return [f"{label}: stale (differs from the generator); run `make dashboards`\n  "
            + "\n  ".join(diff[:12])]


def check_files(root: Path, rendered: dict[str, str]) -> list[str]:
    """Staleness of every generated file under `root`, plus the vocabulary checks of what
    is on disk (a hand-edited file is reported for its names too, not only as stale)."""
    errors = [e for rel, text in rendered.items() for e in stale(rel, root / rel, text)]
    dashboard_path = root / panels.DASHBOARD_FILE
    if dashboard_path.exists():
        try:
            on_disk = json.loads(dashboard_path.read_text())
            errors += [f"{panels.DASHBOARD_FILE}: {e}" for e in
                       check_dashboard(on_disk) + check_conventions(on_disk)]
        except json.JSONDecodeError as exc:
            errors.append(f"{panels.DASHBOARD_FILE}: invalid JSON: {exc}")
    from dashboards import perses

    on_disk_perses = []
    for rel in (perses.DASHBOARD_FILE, perses.OPERATOR_FILE):
        if (root / rel).exists():
            try:
                on_disk_perses.append(yaml.safe_load((root / rel).read_text()) or {})
            except yaml.YAMLError as exc:
                errors.append(f"{rel}: invalid YAML: {exc}")
    if dashboard_path.exists() and on_disk_perses:
        with contextlib.suppress(json.JSONDecodeError):  # (reported above)
            errors += check_perses(json.loads(dashboard_path.read_text()), on_disk_perses)
    rules_path = root / RULES_FILE
    if rules_path.exists():
        errors += [f"{RULES_FILE}: {e}" for e in check_rules(yaml.safe_load(rules_path.read_text()) or {})]
    return errors
